#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server (the online-benchmark peer) from the sources vendored in the
# llama-cpp-python sdist on PyPI. Cached by version under ~/.cache; nothing built is committed.
# Also builds llama-quantize (bench/quant.py makes Q8_0/Q4_0 GGUFs with it) in the same tree.
# Prints the path of the llama-server binary on its last line.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${KILN_CACHE:-$HOME/.cache/kiln}/llama-cpp-$VERSION"
BIN="$CACHE/build/bin/llama-server"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
if [[ -x "$BIN" && -x "$CACHE/build/bin/llama-quantize" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
if [[ ! -d "$CACHE/src" ]]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/dl"
  mkdir -p "$CACHE/src" && tar xf "$CACHE"/dl/llama_cpp_python-*.tar.gz -C "$CACHE/src" --strip-components=1
fi
V="$CACHE/src/vendor/llama.cpp"
cmake -S "$V" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
# The machine is shared: build at low priority.
nice -n 15 cmake --build "$CACHE/build" -j"${JOBS:-2}" --target llama-server llama-quantize >&2
echo "$BIN"
