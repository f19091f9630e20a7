#!/usr/bin/env bash
# Writes requirements/lock.txt: the exact version of every dependency of ftq and of its extras
# (dev, tracking, qlora, lm_eval), resolved by uv from pyproject.toml's ranges for every platform and
# Python >= 3.11. `make up`, `make test` and .ci/run install with it as pip's constraints file,
# so a new release upstream changes nothing until this script is run again (`make lock`) and
# the suite passes on the result. torch and the CUDA wheels it brings are left out: torch is
# installed first, per machine, by scripts/install-torch.sh (the CPU or the CUDA build), and a
# GPU box may bring its own; the lock is resolved against torch==TORCH_VERSION so everything
# else agrees with it.
#
#   scripts/lock.sh UV TORCH_VERSION [--keep]
#
# --keep (`make lock KEEP=1`): the current lock's pins are uv's preferences (an existing output
# file's pins are kept unless they no longer fit), so adding a dependency adds it and what it
# pulls and moves nothing else. Without it every version is re-resolved to the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=$1 torch_version=$2 keep=${3:-}
pin=$(mktemp)
trap 'rm -f "$pin" requirements/lock.txt.new' EXIT
echo "torch==$torch_version" >"$pin"
rm -f requirements/lock.txt.new
if [ "$keep" = --keep ]; then
  cp requirements/lock.txt requirements/lock.txt.new
elif [ -n "$keep" ]; then
  echo "usage: scripts/lock.sh UV TORCH_VERSION [--keep]" >&2
  exit 2
fi
UV_CUSTOM_COMPILE_COMMAND="make lock" "$uv" pip compile pyproject.toml \
  --extra dev --extra tracking --extra qlora --extra lm_eval \
  --universal --python-version 3.11 \
  --constraint "$pin" \
  --no-emit-package torch \
  --quiet -o requirements/lock.txt.new
# the CUDA runtime wheels come with a CUDA torch and follow its pins, not ours: drop each such
# line with the "# via" lines under it
awk '/^[a-z0-9]/ { skip = ($0 ~ /^(nvidia-|cuda-)/) } !skip' requirements/lock.txt.new >requirements/lock.txt
echo "requirements/lock.txt: $(grep -c '==' requirements/lock.txt) pinned packages"
