#!/usr/bin/env bash
# Builds the llama.cpp tools that `serve-check --engine llamacpp` and `export --format gguf`
# run, from the llama.cpp that PyPI's pinned llama-cpp-python sdist vendors (the Python
# bindings are not built: only `llama-server`, CPU backend). Resumable: the sdist and the
# unpacked tree are kept, and cmake/ninja rebuild only what is missing, so an interrupted
# build continues where it stopped. Output: $LLAMACPP_DIR (default .llamacpp/ in the repo,
# ignored by git) with src/ (the vendored llama.cpp, its convert_hf_to_gguf.py included) and
# build/bin/llama-server.
#   JOBS (default: every core) parallel compile jobs
#   PY   (default python3) the Python whose pip downloads the sdist
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=${LLAMACPP_DIR:-.llamacpp}
JOBS=${JOBS:-$(nproc)}
PY=${PY:-python3}
TARGETS=${TARGETS:-llama-server}
# This CPU's instruction sets, named one by one instead of -march=native: native builds
# also compile ggml's AMX kernels (quantised weights: Q4_0/Q4_1/Q8_0), and a virtual machine
# whose kernel does not grant AMX tile state kills llama-server with SIGILL on a Q4 GGUF.
isa_flags() {
    local flags; flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    local pair has
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
            avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
            avx512_bf16:AVX512_BF16; do
        has=OFF; [[ " $flags " == *" ${pair%%:*} "* ]] && has=ON
        echo "-DGGML_${pair##*:}=$has"
    done
    echo "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}
start=$(date +%s)
mkdir -p "$DIR/sdist"
SDIST="$DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    echo "[llamacpp] downloading the llama-cpp-python==$VERSION sdist (75 MB) ..."
    # pip reads the sdist's metadata in an isolated build environment (it installs
    # scikit-build-core there for a moment); nothing is built or installed here
    "$PY" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$DIR/sdist"
fi
if [ ! -f "$DIR/src/.unpacked" ]; then
    echo "[llamacpp] unpacking its vendored llama.cpp ..."
    rm -rf "$DIR/src" "$DIR/unpack"
    mkdir -p "$DIR/unpack"
    tar xzf "$SDIST" -C "$DIR/unpack" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$DIR/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
    rm -rf "$DIR/unpack"
    touch "$DIR/src/.unpacked"
fi
if [ ! -f "$DIR/build/build.ninja" ]; then
    echo "[llamacpp] configuring (cmake, CPU backend, Release) ..."
    cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=OFF $(isa_flags) >"$DIR/cmake.log" 2>&1 \
        || { tail -20 "$DIR/cmake.log"; exit 1; }
fi
echo "[llamacpp] building $TARGETS with $JOBS jobs (ninja prints [done/total]) ..."
# shellcheck disable=SC2086
cmake --build "$DIR/build" --target $TARGETS -j "$JOBS"
end=$(date +%s)
echo "[llamacpp] done in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s: $DIR/build/bin/"
ls "$DIR/build/bin"
