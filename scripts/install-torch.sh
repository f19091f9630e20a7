#!/usr/bin/env bash
# Installs torch into a venv, unless one is already there (a GPU box may bring its own build).
#
#   scripts/install-torch.sh PYTHON VERSION [LOCK]
#
# VERSION "newest" takes the newest release pyproject.toml's range allows (make test-latest), and
# upgrades a torch already there.
# Which build:
#   TORCH_INDEX_URL set      -> that index (e.g. https://download.pytorch.org/whl/cu130), PyPI beside it
#   an NVIDIA driver present -> PyPI's default build (CUDA, with its nvidia-* wheels: several GB)
#   no NVIDIA driver         -> the CPU build from PyTorch's CPU index (about 200 MB instead of several GB);
#                               when that index cannot be reached, pip's configured indexes
# TORCH_INDEX_URL=default forces PyPI's default build. torch's own dependencies follow LOCK.
set -euo pipefail
py=$1 version=$2 lock=${3:-}
cpu_index=${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}

constraint=()
[ -n "$lock" ] && constraint=(-c "$lock")
if [ "$version" = newest ]; then
  range=$("$py" -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch")))')
  spec=$range cpu_spec=$range upgrade=(--upgrade)
else
  if "$py" -c "import torch" 2>/dev/null; then
    exit 0
  fi
  spec="torch==$version" cpu_spec="torch==$version+cpu" upgrade=()
fi

has_driver() { [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1; }
reachable() { "$py" - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
except Exception as exc:
    print(f"  ({type(exc).__name__}: {exc})", file=sys.stderr)
    sys.exit(1)
PY
}

index=${TORCH_INDEX_URL:-}
if [ -z "$index" ]; then
  if has_driver; then index=default; else index=$cpu_index; fi
fi
if [ "$index" = default ]; then
  echo "$spec: PyPI's default build (CUDA)$(has_driver && echo ': an NVIDIA driver is present')"
  exec "$py" -m pip install "${upgrade[@]}" "${constraint[@]}" "$spec"
fi
if reachable "$index"; then
  echo "$spec from $index$([ "$index" = "$cpu_index" ] && echo ' (no NVIDIA driver here: the CPU build)')"
  [ "$index" = "$cpu_index" ] && spec=$cpu_spec
  exec "$py" -m pip install "${upgrade[@]}" "${constraint[@]}" --extra-index-url "$index" "$spec"
fi
echo "$spec: $index cannot be reached; asking pip's configured indexes instead" \
     "(on a stock index that is the CUDA build, several GB; set TORCH_INDEX_URL to a reachable mirror)"
exec "$py" -m pip install "${upgrade[@]}" "${constraint[@]}" "$spec"
