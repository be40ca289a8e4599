#!/usr/bin/env bash
# Run llama-cpp-python 0.3.36's own test suite (the tests/ of its sdist, unmodified) against
# sfi-gguf's patched llama.cpp: proof that the patches do not break llama.cpp for its existing users.
#
#   bash scripts/test_llama_cpp_python.sh [extra pytest args, e.g. -k cache]
#
# Needs sfi-gguf installed (scripts/setup.sh). The sdist's tests/ and pytest config are extracted to a
# temporary folder and run from there; tests_upstream/sfi_upstream_plugin.py points the bindings at
# our library (and checks it is the patched one), stands in local models for the hub downloads, and
# deselects with the reason the tests that cannot run here. docs/llama-cpp-python-tests.md lists all.
# SFI_UPSTREAM_DROPIN=1 runs the same tests with sfi_gguf.Llama in place of llama_cpp.Llama (their token loop
# through SFI); SFI_UPSTREAM_SFI='{"n_sink": 2, "k_head": 4, "n_recent": 4}' (SFIConfig fields) then makes SFI
# sparse at the tests' 32- and 64-cell contexts.
# Exit status: pytest's (non-zero if anything that runs fails, or if nothing ran).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
LCP_VERSION=0.3.36
START=$(date +%s)

# What the tests import, beyond llama-cpp-python's own dependencies (numpy, jinja2): pytest, scipy
# (test_llama.py imports scipy.special) and huggingface_hub (imported by test_llama.py; its download
# function is replaced). The versions are the floors of the sdist's [test] extra.
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"pytest": "pytest>=7.4.0", "scipy": "scipy>=1.10", "huggingface_hub": "huggingface-hub>=0.23.0",
        "numpy": "numpy>=1.20.0", "jinja2": "jinja2>=2.11.3"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$MISSING" ]; then
    echo "test_llama_cpp_python: installing $MISSING"
    "$PY" -m pip install -q $MISSING
fi

LIB_DIR=$("$PY" -c "from sfi_gguf.core.library import find_lib_dir; print(find_lib_dir())")
DEFAULT_MODEL=$("$PY" -c "import sfi_gguf; print(sfi_gguf.ensure_model())" | tail -n 1)
SDIST=$("$PY" native/prepare_llama_cpp.py --dest unused --fetch-only | tail -n 1)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/sfi-lcp-tests.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
TOP=llama_cpp_python-$LCP_VERSION
# tests/ and the pytest config (pyproject.toml), the vocab-only GGUFs the tests and the random-weight
# stand-ins use, and the vendored gguf-py that writes the stand-ins.
tar -xzf "$SDIST" -C "$WORK" "$TOP/pyproject.toml" "$TOP/tests" "$TOP/vendor/llama.cpp/models" \
    "$TOP/vendor/llama.cpp/gguf-py"

export LLAMA_CPP_LIB_PATH="$LIB_DIR"
export SFI_UPSTREAM_SDIST="$WORK/$TOP"
export SFI_UPSTREAM_DEFAULT_MODEL="$DEFAULT_MODEL"
export SFI_UPSTREAM_MODEL_CACHE="${SFI_GGUF_CACHE:-$HOME/.cache/sfi-gguf}/upstream-test-models"
export SFI_UPSTREAM_REPORT="$WORK/report.json"
export PYTHONPATH="$REPO/tests_upstream${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1                 # any download that escaped the stand-ins fails at once
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 # only our plugin, whatever else is installed

set +e
(cd "$WORK/$TOP" && "$PY" -m pytest -p sfi_upstream_plugin -p no:cacheprovider -v -rfEs --durations=5 "$@")
RC=$?
set -e

"$PY" - "$SFI_UPSTREAM_REPORT" "$RC" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
path, rc, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    report = json.load(open(path))
except OSError:
    print(f"test_llama_cpp_python: no report (pytest exit {rc})"); sys.exit(0)
results = report["results"]
counts = {}
for r in results.values():
    counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
print(f"\n== llama-cpp-python {report['library']['llama_cpp_python']} tests against "
      f"{report['library']['library']} (llama_sfi_version {report['library']['llama_sfi_version']})")
for nodeid, r in sorted(results.items()):
    extra = r.get("reason") or ", ".join(f"stand-in: {s}" for s in r.get("stand_ins", []))
    print(f"  {r['outcome']:<10} {nodeid}" + (f"  [{extra}]" if extra else ""))
print("== " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
      + f" in {secs}s (pytest exit {rc}; 'deselected' = cannot run here, reasons above)")
EOF
exit $RC
