#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-bench, llama-batched-bench,
# llama-quantize) from the llama-cpp-python sdist pinned in pyproject's `bench` extra,
# so a peer run can be reproduced with the exact llama.cpp commit the Python binding
# vendors. Usage:
#   benchmarks/peers/build_llama_cpp.sh [BUILD_DIR]   (default: ./llama.cpp-build)
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2), PYTHON (default python3).
# Prints KEY=VALUE lines at the end (binaries, commit, gguf-py) and writes them to
# BUILD_DIR/llama.cpp.env for benchmarks/bench_serving.py --llama-env.
set -euo pipefail

BUILD_DIR=$(mkdir -p "${1:-llama.cpp-build}" && cd "${1:-llama.cpp-build}" && pwd)
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}

cd "$BUILD_DIR"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
fi
SRC="$BUILD_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
    tar xzf "$SDIST"
fi

# The sdist has no .git; its CHANGELOG names the llama.cpp commit it vendors.
COMMIT=$(sed -n "/^## \[$VERSION\]/,/^## \[/p" "$BUILD_DIR/llama_cpp_python-$VERSION/CHANGELOG.md" \
    | grep -oE 'llama\.cpp@[0-9a-f]{7,40}' | head -1 | cut -d@ -f2 || true)
COMMIT=${COMMIT:-unknown}

# Native CPU code (AVX-512/VNNI where the CPU has them), no network features, no
# shared libs so the binaries run from anywhere; only the tools a peer run needs.
cmake -S "$SRC" -B "$BUILD_DIR/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_COMMIT="$COMMIT"
nice -n 10 cmake --build "$BUILD_DIR/build" -j "$JOBS" \
    --target llama-server llama-bench llama-batched-bench llama-quantize

BIN="$BUILD_DIR/build/bin"
{
    echo "LLAMA_SERVER=$BIN/llama-server"
    echo "LLAMA_BENCH=$BIN/llama-bench"
    echo "LLAMA_BATCHED_BENCH=$BIN/llama-batched-bench"
    echo "LLAMA_QUANTIZE=$BIN/llama-quantize"
    echo "LLAMA_COMMIT=$COMMIT"
    echo "LLAMA_CPP_PYTHON_VERSION=$VERSION"
    echo "GGUF_PY=$SRC/gguf-py"
    echo "CONVERT_HF_TO_GGUF=$SRC/convert_hf_to_gguf.py"
} | tee "$BUILD_DIR/llama.cpp.env"
