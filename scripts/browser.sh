#!/usr/bin/env bash
# Make sure Debian's Chromium is installed for the dashboard's browser tests (Playwright drives
# /usr/bin/chromium; it never downloads a browser of its own). Used by `make test`.
# Set FTQ_SKIP_BROWSER_INSTALL=1 to skip (the browser tests then skip, or fail under CI).
set -euo pipefail

CHROMIUM=${FTQ_TEST_CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ] || [ "${FTQ_SKIP_BROWSER_INSTALL:-0}" = 1 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "browser.sh: $CHROMIUM is missing; install Debian's chromium (apt-get install chromium)" >&2
  exit 0
fi
echo "browser.sh: installing Debian's chromium for the browser tests"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
