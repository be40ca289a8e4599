#!/usr/bin/env bash
# Set up sfi-gguf on this machine (idempotent; a re-run with nothing changed takes seconds):
#  1. llama-cpp-python's Python bindings, without its own llama.cpp build (LLAMA_BUILD=OFF);
#  2. sfi-gguf, which builds the pinned, patched llama.cpp once, in a build directory cached under
#     ~/.cache/sfi-gguf keyed by everything that changes the binary (patches, our sources, CMake args, CPU).
# CMAKE_ARGS works as for llama-cpp-python, e.g. CMAKE_ARGS="-DGGML_CUDA=ON" scripts/setup.sh
# SFI_LLAMA_CPP_SOURCE=/path/to/llama.cpp uses a local unpatched tree instead of the PyPI sdist.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${SFI_GGUF_CACHE:-$HOME/.cache/sfi-gguf}
LCP_VERSION=0.3.36

have_version() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

# build and runtime dependencies, installed only where missing (a GPU machine may have no package index)
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"scikit_build_core": "scikit-build-core>=0.10", "numpy": "numpy>=1.24", "typing_extensions": "typing-extensions>=4.5.0",
        "diskcache": "diskcache>=5.6.1", "jinja2": "jinja2>=2.11.3",
        "anyio": "anyio>=4.0", "starlette": "starlette>=0.37", "uvicorn": "uvicorn>=0.29"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then "$PY" -m pip install -q $missing; fi

if ! have_version llama_cpp_python "$LCP_VERSION"; then
    if [ -n "${SFI_LLAMA_CPP_PYTHON_WHEEL:-}" ]; then
        "$PY" -m pip install -q --no-deps "$SFI_LLAMA_CPP_PYTHON_WHEEL"
    else
        SDIST=$("$PY" native/prepare_llama_cpp.py --dest unused --fetch-only)
        CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip install -q --no-build-isolation --no-deps "$SDIST"
    fi
fi

CPU_ID=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m)
KEY=$( { cat CMakeLists.txt pyproject.toml native/prepare_llama_cpp.py native/patches/*.patch native/bench/*.c native/tests/*.cpp;
         find native/src native/include native/ggml -type f | LC_ALL=C sort | xargs cat;
         echo "${CMAKE_ARGS:-}" "${SFI_LLAMA_CPP_SOURCE:-}" "$CPU_ID"; } | sha256sum | cut -c1-16)
BUILD_DIR="$CACHE/build/$KEY"
echo "sfi-gguf: building in $BUILD_DIR"
"$PY" -m pip install --no-build-isolation --no-deps \
    --config-settings=build-dir="$BUILD_DIR" \
    --config-settings=cmake.define.SFI_LLAMA_CPP_SOURCE="${SFI_LLAMA_CPP_SOURCE:-}" \
    ${SFI_PIP_QUIET:--q} .
"$PY" -c "import sfi_gguf; print('sfi-gguf', sfi_gguf.__version__, 'with', sfi_gguf.native_info())"
