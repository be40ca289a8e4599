#!/usr/bin/env bash
# Run the native tests, the llama_sfi_* fuzzer and the Python-level bad-input tests (files, values,
# types, closed objects, threads) against an AddressSanitizer build of our llama.cpp tree.
#
# Why: a use-after-free or an out-of-bounds write in our native code does not always crash a Release build;
# ASan turns it into a report with a stack. The build is separate (~/.cache/sfi-gguf/asan-build) and
# configured once; later runs rebuild only what changed (e.g. after an edit of native/src).
#
#   bash scripts/asan_check.sh               # build if needed, then run the tests
#   bash scripts/asan_check.sh --build-only
#   bash scripts/asan_check.sh -k fuzz -x    # extra arguments go to pytest
#
# Env: SFI_DEV_TREE (a prepared llama.cpp tree to build instead; default: the pinned sdist with native/patches
# applied and our sources copied in, by native/prepare_llama_cpp.py, in ~/.cache/sfi-gguf/asan-src), SFI_ASAN_BUILD
# (default ~/.cache/sfi-gguf/asan-build), SFI_ASAN_TESTS (default: tests/test_native.py tests/test_fuzz_native.py
# tests/test_reliability.py tests/test_server_robust.py).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${SFI_GGUF_CACHE:-$HOME/.cache/sfi-gguf}
BUILD=${SFI_ASAN_BUILD:-$CACHE/asan-build}
PY=${PYTHON:-python3}
SRC=${SFI_DEV_TREE:-$CACHE/asan-src}
if [ -z "${SFI_DEV_TREE:-}" ]; then  # kept up to date with this checkout (copies only what changed)
    "$PY" native/prepare_llama_cpp.py --dest "$SRC"
fi

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi

# AMX off: the compiler knows AMX but this machine's assembler/CPU may not (same as the main build).
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ASAN="-fsanitize=address -fno-omit-frame-pointer"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    nice -n 10 cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_C_FLAGS="$NOAMX $ASAN" -DCMAKE_CXX_FLAGS="$NOAMX $ASAN" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address" \
        -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF > "$BUILD.cmake.log" 2>&1 \
        || { tail -30 "$BUILD.cmake.log"; exit 1; }
fi
nice -n 10 cmake --build "$BUILD" -j2 --target llama > "$BUILD.build.log" 2>&1 \
    || { tail -40 "$BUILD.build.log"; exit 1; }
LIB_DIR="$BUILD/bin"
test -f "$LIB_DIR/libllama.so" || { echo "no $LIB_DIR/libllama.so" >&2; exit 1; }
echo "asan build: $LIB_DIR ($(git -C "$SRC" log -1 --format='%h %s' 2>/dev/null || echo "$SRC"))"
[ $build_only = 1 ] && exit 0

# libasan must be the first library of the process (python itself is not instrumented). libstdc++
# comes right after it: ASan intercepts __cxa_throw, and finds the real one only if libstdc++ is
# loaded when ASan starts (otherwise the first C++ exception, e.g. a refused state load, aborts with
# "CHECK failed: ... real___cxa_throw").
# detect_leaks=0: CPython and numpy keep allocations until exit; leaks are not what we look for.
# allocator_may_return_null=1: a refused huge allocation returns NULL as in a normal build (and the
# library reports LLAMA_SFI_ERR_ALLOC) instead of ASan aborting the process.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:print_summary=1}
export SFI_GGUF_LIB_DIR=$LIB_DIR
# real_model tests are left out unless asked for (SFI_ASAN_MARK=""): the default model is very slow under ASan
# without native CPU flags, and they exercise the same native code as the tiny models
# shellcheck disable=SC2086
nice -n 10 "$PY" -m pytest -q -p no:cacheprovider -m "${SFI_ASAN_MARK-not real_model}" \
    ${SFI_ASAN_TESTS:-tests/test_native.py tests/test_fuzz_native.py tests/test_reliability.py tests/test_server_robust.py} "$@"
