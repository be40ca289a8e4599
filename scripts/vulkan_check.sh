#!/usr/bin/env bash
# SFI over llama.cpp's Vulkan backend, on whatever Vulkan device this machine has (on a machine without a GPU,
# Mesa's lavapipe: software Vulkan on the CPU). Vulkan has none of our fused ops, so the slow, fast and mixed
# steps run the composite graph there: the nearest this machine gets to Metal's path.
#
# Builds our llama.cpp tree with GGML_VULKAN (separate build, ~/.cache/sfi-gguf/vulkan-build, configured once;
# later runs rebuild only what changed; only libllama and libggml* are built), then runs with that library and
# every layer on the Vulkan device (SFI_TEST_NGL=99):
#   - test_native's exactness tests: every cell selected = dense, a fast step over a window = dense over the same
#     cells, slow-fast cycles;
#   - the device Selector's tests (the Selector in the slow step's graph against the numpy reference);
#   - tests/test_vulkan.py: KV cache and view on the device, an SFI generation equal to the same on the CPU, and
#     the device's own supports_op against its source's (native/backend_audit.py) on every node of SFI's graphs.
#
#   bash scripts/vulkan_check.sh               # build if needed, then run the tests
#   bash scripts/vulkan_check.sh --build-only
#   bash scripts/vulkan_check.sh -x            # extra arguments go to pytest
#
# Needs the Vulkan loader and headers, glslc and SPIR-V headers, and a Vulkan driver (Debian/Ubuntu:
# libvulkan-dev glslc spirv-headers mesa-vulkan-drivers). Env: SFI_DEV_TREE (a prepared llama.cpp tree to build
# instead; default: ours in ~/.cache/sfi-gguf/vulkan-src, by native/prepare_llama_cpp.py), SFI_VULKAN_BUILD
# (default ~/.cache/sfi-gguf/vulkan-build), SFI_BUILD_JOBS (default 2), GGML_VK_VISIBLE_DEVICES (default 0:
# llama.cpp skips CPU-type devices such as lavapipe unless named).
# Cost: the first build ~11 CPU-minutes (hundreds of shader variants through glslc), a change of native/src ~3.
# On lavapipe every test process first spends a minute or more compiling the shaders it uses, and Debian 12's
# Mesa 22.3 lavapipe crashes in its own queue thread after a few tests (dense decoding too): see docs/backends.md.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${SFI_GGUF_CACHE:-$HOME/.cache/sfi-gguf}
BUILD=${SFI_VULKAN_BUILD:-$CACHE/vulkan-build}
PY=${PYTHON:-python3}
SRC=${SFI_DEV_TREE:-$CACHE/vulkan-src}
JOBS=${SFI_BUILD_JOBS:-2}
if [ -z "${SFI_DEV_TREE:-}" ]; then  # kept up to date with this checkout (copies only what changed)
    "$PY" native/prepare_llama_cpp.py --dest "$SRC"
fi

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi

# AMX off: the compiler knows AMX but this machine's assembler/CPU may not (same as the main build).
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    mkdir -p "$(dirname "$BUILD")"
    nice -n 10 cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
        -DBUILD_SHARED_LIBS=ON -DGGML_VULKAN=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$BUILD.cmake.log" 2>&1 \
        || { rm -f "$BUILD/CMakeCache.txt"; tail -30 "$BUILD.cmake.log"; exit 1; }
fi
nice -n 10 cmake --build "$BUILD" -j"$JOBS" --target llama > "$BUILD.build.log" 2>&1 \
    || { tail -40 "$BUILD.build.log"; exit 1; }
LIB_DIR="$BUILD/bin"
for f in libllama.so libggml-vulkan.so; do
    test -e "$LIB_DIR/$f" || { echo "no $LIB_DIR/$f" >&2; exit 1; }
done
echo "vulkan build: $LIB_DIR ($(git -C "$SRC" log -1 --format='%h %s' 2>/dev/null || echo "$SRC"))"
[ $build_only = 1 ] && exit 0

export SFI_GGUF_LIB_DIR=$LIB_DIR
export SFI_TEST_NGL=99
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
status=0
# exactness: every cell selected = dense (in order, permuted, Q8_0, gemma3's global layers), a window = dense over
# the same cells, slow-fast cycles
nice -n 10 "$PY" -m pytest -q -p no:cacheprovider tests/test_native.py -m "not real_model" \
    -k "all_cells or window_matches or slow_then_fast or q8_0_cache or gemma3" "$@" || status=$?
nice -n 10 "$PY" -m pytest -q -p no:cacheprovider tests/test_device_selector.py tests/test_vulkan.py "$@" || status=$?
exit $status
