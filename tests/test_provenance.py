"""The commit recorded beside results: this repository's, or "unknown" for a copy inside another repository."""
import importlib.util
import shutil
import subprocess
from pathlib import Path

import sfi_gguf.tools.provenance as provenance


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _copy_in(repo: Path):
    """provenance.py at sfi_gguf/tools/ of repo, imported from there."""
    dst = repo / "sfi_gguf" / "tools" / "provenance.py"
    dst.parent.mkdir(parents=True)
    shutil.copy(provenance.__file__, dst)
    spec = importlib.util.spec_from_file_location("provenance_copy", dst)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_copy_inside_another_repository_is_unknown(tmp_path, monkeypatch):
    # e.g. pip's site-packages inside pyenv's own git checkout
    monkeypatch.delenv("SFI_GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("another project\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-q", "-m", "another project")
    assert _copy_in(tmp_path).git_commit(mark_dirty=True) == "unknown"


def test_dirty_means_the_code_changed(tmp_path, monkeypatch):
    monkeypatch.delenv("SFI_GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    module = _copy_in(tmp_path)
    (tmp_path / "BENCHMARKS.md").write_text("numbers\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "code and docs")
    head = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    assert module.git_commit(mark_dirty=True) == head

    (tmp_path / "BENCHMARKS.md").write_text("numbers being written\n")
    assert module.git_commit(mark_dirty=True) == head
    with open(module.__file__, "a") as f:
        f.write("# changed\n")
    assert module.git_commit(mark_dirty=True) == head + "+dirty"
    assert module.git_commit() == head
