#!/usr/bin/env bash
# Builds the benchmarks' anchors: llama.cpp's own C binaries (llama-bench, llama-server,
# llama-quantize, llama-perplexity), from the llama.cpp source that the pinned llama-cpp-python
# sdist vendors, with -DGGML_NATIVE=ON (CPU repacking is on by default where it applies).
#
#   bench/build_anchors.sh [DEST]        DEST defaults to bench/.anchors (ignored by git)
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
cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build build -j"${JOBS:-2}" --target llama-bench llama-server llama-quantize llama-perplexity
ln -sfn build/bin bin
echo "llama.cpp anchors in $DEST/bin"
