#!/usr/bin/env bash
# SFI over llama.cpp's RPC backend: build our llama.cpp tree with GGML_RPC (and its rpc-server), then run
# tests/test_rpc.py, which starts two rpc-server processes on loopback (CPU backend), puts the layers on
# them and checks SFI decoding against dense decoding and against the same model run locally.
#
# The build is separate (~/.cache/sfi-gguf/rpc-build), configured once; later runs rebuild only what
# changed (e.g. after an edit of native/src). Only libllama, libggml* and the rpc-server are built.
#
#   bash scripts/rpc_check.sh               # build if needed, then run the tests
#   bash scripts/rpc_check.sh --build-only
#   bash scripts/rpc_check.sh -k exact -x   # extra arguments go to pytest
#
# Env: SFI_DEV_TREE (a prepared llama.cpp tree to build instead; default: the pinned sdist with native/patches
# applied and native/src copied in, by native/prepare_llama_cpp.py, in ~/.cache/sfi-gguf/rpc-src), SFI_RPC_BUILD
# (default ~/.cache/sfi-gguf/rpc-build). Cost: the first build takes ~6 CPU-minutes (~3-4 min on 2 idle cores).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${SFI_GGUF_CACHE:-$HOME/.cache/sfi-gguf}
BUILD=${SFI_RPC_BUILD:-$CACHE/rpc-build}
PY=${PYTHON:-python3}
SRC=${SFI_DEV_TREE:-$CACHE/rpc-src}
if [ -z "${SFI_DEV_TREE:-}" ]; then  # kept up to date with this checkout (copies only what changed)
    "$PY" native/prepare_llama_cpp.py --dest "$SRC"
fi

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi

# AMX off: the compiler knows AMX but this machine's assembler/CPU may not (same as the main build).
# LLAMA_BUILD_TOOLS (with LLAMA_BUILD_COMMON, which it needs) only to get the rpc-server target.
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    nice -n 10 cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
        -DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$BUILD.cmake.log" 2>&1 \
        || { tail -30 "$BUILD.cmake.log"; exit 1; }
fi
nice -n 10 cmake --build "$BUILD" -j2 --target llama ggml-rpc-server > "$BUILD.build.log" 2>&1 \
    || { tail -40 "$BUILD.build.log"; exit 1; }
LIB_DIR="$BUILD/bin"
for f in libllama.so libggml-rpc.so ggml-rpc-server; do
    test -e "$LIB_DIR/$f" || { echo "no $LIB_DIR/$f" >&2; exit 1; }
done
echo "rpc build: $LIB_DIR ($(git -C "$SRC" log -1 --format='%h %s' 2>/dev/null || echo "$SRC"))"
[ $build_only = 1 ] && exit 0

export SFI_GGUF_LIB_DIR=$LIB_DIR
export SFI_RPC_SERVER=$LIB_DIR/ggml-rpc-server
nice -n 10 "$PY" -m pytest -q -p no:cacheprovider tests/test_rpc.py "$@"
