#!/usr/bin/env bash
# Prepare .gpu/ (git-ignored, < 64 MiB) for a GPU machine that reaches no package index:
#   .gpu/llama.cpp   the pinned llama.cpp tree, unpatched, trimmed to what a CUDA build reads
#   .gpu/wheels      wheels the GPU image lacks (llama-cpp-python bindings-only, diskcache, gguf, starlette,
#                    uvicorn; py-spy for gpu_run.sh's host-profile stage)
#   .gpu/wheels-openai  the openai client and its dependencies, for gpu_run.sh's serve-load stage
#   .gpu/vocab.gguf  the default model's tokenizer alone (random-weight benchmark models carry it)
#   .gpu/cupti       libcupti (PyPI) and benchmarks/cupti_trace.c built against it, for gpu_run.sh's trace stage
# Then scripts/gpu_run.sh runs there (build with CUDA, tests, benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .gpu && mkdir -p .gpu/wheels
SDIST=$("$PY" native/prepare_llama_cpp.py --dest unused --fetch-only)
tmp=$(mktemp -d)
tar xzf "$SDIST" -C "$tmp" llama_cpp_python-0.3.36/vendor/llama.cpp
src="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
rm -rf "$src"/{models,docs,media,benches,tests,tools,examples,pocs,app,gguf-py,scripts,.github,skills,conversion,common,grammars,ci}
for b in cann openvino webgpu et hexagon sycl opencl metal virtgpu musa hip zdnn kompute zendnn blas; do
    rm -rf "$src/ggml/src/ggml-$b"
done
mv "$src" .gpu/llama.cpp
rm -rf "$tmp"
# llama-cpp-python: Python bindings only (our package provides the library)
CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip wheel -q --no-deps --no-build-isolation "$SDIST" -w .gpu/wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels diskcache==5.6.3 gguf==0.19.0 \
    starlette==1.10.0 uvicorn==0.54.0 \
    py-spy==0.4.3   # the server's (its other needs, anyio, h11, click, are in the GPU image); the host profiler
# the openai client for gpu_run.sh's serve-load stage, with its dependencies for the Pythons a GPU image may have
# (pydantic-core and jiter are built per Python version); installed there from this folder, what is missing only
OPENAI_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('openai'))")
for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --only-binary=:all: --python-version $v -d .gpu/wheels-openai "openai==$OPENAI_VERSION"
done
"$PY" -m sfi_gguf.tools.random_model --write-vocab-only .gpu/vocab.gguf
# the kernel tracer: CUPTI and the CUDA driver API's header from PyPI (skipped where they cannot be had)
if "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp.cupti" "nvidia-cuda-cupti==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"; then
    mkdir -p .gpu/cupti "$tmp.cupti/x"
    for w in "$tmp.cupti"/*.whl; do (cd "$tmp.cupti/x" && unzip -q -o "$w"); done
    cp "$tmp.cupti/x/nvidia/cu13/lib/libcupti.so.13" .gpu/cupti/
    gcc -shared -fPIC -O2 -I"$tmp.cupti/x/nvidia/cu13/include" benchmarks/cupti_trace.c -o .gpu/cupti/libsfi_cupti_trace.so \
        -L.gpu/cupti -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
fi
rm -rf "$tmp.cupti"
git rev-parse HEAD > .gpu/COMMIT  # refresh before each run: git rev-parse HEAD > .gpu/COMMIT
du -sh .gpu .gpu/*
