#!/usr/bin/env bash
# Builds the locked llama-cpp-python into a wheelhouse once per machine, so later installs (a new
# clone, a new venv, an emptied pip cache) take the wheel instead of compiling llama.cpp again.
#
#   scripts/llama-wheel.sh PYTHON LOCK WHEELHOUSE
#
# PyPI has no Linux wheel of llama-cpp-python: pip compiles llama.cpp from its sdist, about 7 minutes
# on 2 cores (CMAKE_ARGS from the Makefile keep the build CPU-only and small). The dev extra needs it
# for the GGUF export tests, which load each export in real llama.cpp.
set -euo pipefail
py=$1 lock=$2 wheelhouse=$3
version=$(sed -n 's/^llama-cpp-python==\([^ ;]*\).*/\1/p' "$lock")
[ -n "$version" ] || { echo "llama-cpp-python is not in $lock" >&2; exit 1; }
mkdir -p "$wheelhouse"
if compgen -G "$wheelhouse/llama_cpp_python-$version-*.whl" >/dev/null; then
  echo "llama-cpp-python $version: built before, in $wheelhouse"
  exit 0
fi
echo "llama-cpp-python $version: compiling llama.cpp from source, once on this machine" \
     "(about 7 minutes on 2 cores; the wheel is kept in $wheelhouse)"
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$py" -m pip wheel --no-deps -c "$lock" -w "$wheelhouse" "llama-cpp-python==$version"
echo "llama-cpp-python $version: built in $(( $(date +%s) - start )) s"
