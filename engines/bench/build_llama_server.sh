#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the peer engines/bench/serving.py measures this repo's server against)
# from the llama.cpp source vendored in the llama-cpp-python sdist of the installed version, in a folder
# outside the repo. Nothing of llama.cpp is committed or vendored here.
#
#     bash engines/bench/build_llama_server.sh            # then: python -m engines.bench.serving --llama-server PATH
#
# BUILD_DIR (default ~/.cache/tiny-gpt-llama-server) and JOBS (default 2) may be set. Prints the binary's path last.
set -euo pipefail
BUILD_DIR=${BUILD_DIR:-$HOME/.cache/tiny-gpt-llama-server}
JOBS=${JOBS:-2}
VERSION=$(python -c 'import llama_cpp; print(llama_cpp.__version__)')
mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
    # the sdist only (its build tools may come as wheels: --no-binary :all: would build each of them from source)
    pip download --no-binary llama-cpp-python --no-deps --dest . "llama-cpp-python==$VERSION"
fi
SRC="$BUILD_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
cd "$SRC"
cmake -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
cmake --build build --target llama-server -j"$JOBS"
BIN="$SRC/build/bin/llama-server"
[ -x "$BIN" ] || { echo "no llama-server at $BIN" >&2; exit 1; }
echo "llama-server: $BIN"
