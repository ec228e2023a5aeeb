#!/usr/bin/env bash
# Builds the benchmarks' anchors: llama.cpp's own C binaries (llama-bench, llama-server,
# llama-quantize, llama-perplexity), from the llama.cpp source that the pinned llama-cpp-python
# sdist vendors, with -DGGML_NATIVE=ON (CPU repacking is on by default where it applies).
#
#   bench/build_anchors.sh [DEST]        DEST defaults to bench/.anchors (ignored by git)
#   AVX2=1 bench/build_anchors.sh [DEST] the same source for an AVX2-only CPU (-DGGML_NATIVE=OFF, AVX/AVX2/
#                                        FMA/F16C on, AVX-512 off) into DEST/bin-avx2: the AVX2 runs of
#                                        the benchmarks on an AVX-512 machine (bench/blocks.py --avx2)
#   NOAMX=1 bench/build_anchors.sh [DEST] the same source with every AVX-512 extension this CPU has but AMX
#                                        (-DGGML_NATIVE=OFF), into DEST/bin-noamx: on a VM whose CPU runs AMX,
#                                        llama.cpp's AMX matmul faults (a #GP in ldtilecfg) and llama-bench
#                                        dies with repacking on; this build keeps its CPU repacking (Q4_Kx8,
#                                        Q4_0x8...), which bench/blocks.py then uses before turning repacking off
#
# Leaves DEST/llama.cpp (the source: tools/hf_to_gguf.py and the GGUF tests read its converter)
# and DEST/bin (the binaries; LLAMA_BIN). About 6 minutes on 2 cores; a second run rebuilds nothing.
set -euo pipefail
VERSION=0.3.36
DEST=${1:-"$(dirname "$0")/.anchors"}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
cd "$DEST"
if [ ! -d llama.cpp ]; then
    python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d sdist
    tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz" -C sdist
    mv "sdist/llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
    rm -rf sdist
fi
if [ "${AVX2:-0}" = 1 ]; then
    BUILD=build-avx2 BIN=bin-avx2
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
elif [ "${NOAMX:-0}" = 1 ]; then
    BUILD=build-noamx BIN=bin-noamx
    has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=ON -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
               -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)"
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
    BUILD=build BIN=bin CPU_FLAGS=(-DGGML_NATIVE=ON)
fi
cmake -S llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$BUILD" -j"${JOBS:-2}" --target llama-bench llama-server llama-quantize llama-perplexity
ln -sfn "$BUILD/bin" "$BIN"
echo "llama.cpp anchors in $DEST/$BIN"
