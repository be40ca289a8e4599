"""Which code produced a result: the git commit recorded next to every benchmark and evaluation row."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def git_commit(length: int = 7, mark_dirty: bool = False) -> str:
    """HEAD's abbreviated hash (+ "+dirty" with uncommitted tracked changes if asked); "unknown" outside
    a checkout (an installed package) or without git."""
    if os.environ.get("SFI_GIT_COMMIT"):  # a copied tree without its git history (the GPU machine)
        return os.environ["SFI_GIT_COMMIT"][:length]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", f"--short={length}", "HEAD")
        if commit and mark_dirty and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
        return commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
