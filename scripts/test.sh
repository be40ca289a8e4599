#!/usr/bin/env bash
# Set up (scripts/setup.sh, idempotent) and run the whole test suite on the CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k native -x
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m pip install -q "pytest>=7" "gguf>=0.10" "openai>=1.0" "jsonschema>=4" "langchain-openai>=0.2" \
    "openai-agents>=0.24" "anthropic>=2.17" "pydantic-ai-slim[anthropic]>=2.78"
# fetch + verify the real models the tests use once, before the timed tests (the 1.5B model is the evals' own)
for m in qwen2.5-coder-0.5b-instruct gemma3-270m; do "$PY" -m sfi_gguf.cli model "$m" > /dev/null; done
# our suite, then llama-cpp-python 0.3.36's own suite against our patched library (proof we broke nothing),
# then SFI over llama.cpp's RPC backend (a second, RPC-enabled build, cached: ~3-4 min the first time)
status=0
"$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ $# -eq 0 ]; then
    bash scripts/test_llama_cpp_python.sh -q || status=$?
    [ "${SFI_SKIP_RPC:-0}" = 1 ] || bash scripts/rpc_check.sh -q || status=$?
fi
exit $status
