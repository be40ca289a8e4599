"""Which code produced a result: the git commit recorded next to every benchmark and evaluation row."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# what "+dirty" looks at: the code, not the docs or results a run may be writing beside it
_CODE_PATHS = (":/sfi_gguf", ":/native", ":/scripts")


def git_commit(length: int = 7, mark_dirty: bool = False) -> str:
    """HEAD's abbreviated hash (+ "+dirty" with uncommitted changes to the tracked code if asked); "unknown" outside
    a checkout of this repository (an installed package, also one inside another git repository such as pyenv's)
    or without git."""
    if os.environ.get("SFI_GIT_COMMIT"):  # a copied tree without its git history (the GPU machine)
        return os.environ["SFI_GIT_COMMIT"][:length]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=_HERE, capture_output=True, text=True, timeout=10)

    try:
        if git("ls-files", "--error-unmatch", Path(__file__).name).returncode != 0:
            return "unknown"  # the repository around us is not the one this file comes from
        commit = git("rev-parse", f"--short={length}", "HEAD").stdout.strip()
        if commit and mark_dirty and git("status", "--porcelain", "--untracked-files=no", "--", *_CODE_PATHS).stdout.strip():
            commit += "+dirty"
        return commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
