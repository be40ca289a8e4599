"""Quality evaluation of SFI against full KV and the other policies at equal budget.

One module per task (`needle`, `variables`, `longgen`, `cot`), each turning a seed into reproducible
`Case`s and scoring generated text; `runner` runs every policy on every case (one prefill per case,
the KV cache reused across policies), writes resumable JSON, and `report` makes the table and plots.

    from sfi_gguf.tools.evals import run_suite
    rows = run_suite("quick")
"""
from .common import Case
from .runner import SUITES, run_suite

__all__ = ["Case", "SUITES", "run_suite"]
