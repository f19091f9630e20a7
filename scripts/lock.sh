#!/usr/bin/env bash
# Writes requirements/lock.txt: the exact version of every dependency of ftq and of its extras
# (dev, tracking, qlora), resolved by uv from pyproject.toml's ranges for every platform and
# Python >= 3.11. `make up`, `make test` and .ci/run install with it as pip's constraints file,
# so a new release upstream changes nothing until this script is run again (`make lock`) and
# the suite passes on the result. torch and the CUDA wheels it brings are left out: torch is
# installed first, per machine, by scripts/install-torch.sh (the CPU or the CUDA build), and a
# GPU box may bring its own; the lock is resolved against torch==TORCH_VERSION so everything
# else agrees with it.
#
#   scripts/lock.sh UV TORCH_VERSION
set -euo pipefail
cd "$(dirname "$0")/.."
uv=$1 torch_version=$2
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$torch_version" >"$pin"
UV_CUSTOM_COMPILE_COMMAND="make lock" "$uv" pip compile pyproject.toml \
  --extra dev --extra tracking --extra qlora \
  --universal --python-version 3.11 \
  --constraint "$pin" \
  --no-emit-package torch \
  --quiet -o requirements/lock.txt.new
# the CUDA runtime wheels come with a CUDA torch and follow its pins, not ours: drop each such
# line with the "# via" lines under it
awk '/^[a-z0-9]/ { skip = ($0 ~ /^(nvidia-|cuda-)/) } !skip' requirements/lock.txt.new >requirements/lock.txt
rm requirements/lock.txt.new
echo "requirements/lock.txt: $(grep -c '==' requirements/lock.txt) pinned packages"
