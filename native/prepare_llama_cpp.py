#!/usr/bin/env python3
"""Produce the llama.cpp tree that CMake builds: the pinned tree, patched, with our sources in it.

The pinned source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (fetched with
pip, sha256 checked, cached outside the repo). The patches in native/patches (the hooks that call our
code, and ggml changes) are applied in order, and native/src, native/include and native/ggml are copied
into the tree's src/, include/ and ggml/. A local unpatched tree can be given instead (--source), for machines
without a package index.

The output tree is rewritten only when the sdist or a patch changed (stamp file), and our sources are
copied only when their bytes changed, so a persistent build directory rebuilds incrementally. Standard
library only: this runs before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# Parts of the vendored tree the build never reads (large, or backends we do not build).
SKIP_DIRS = ("models/", "docs/", "media/", "benches/", ".github/", "tools/server/public", "tools/ui")

NATIVE_DIR = Path(__file__).resolve().parent
PATCH_DIR = NATIVE_DIR / "patches"
# our sources, and where they go in the tree (sub-folders kept)
SOURCE_DIRS = {NATIVE_DIR / "src": "src", NATIVE_DIR / "include": "include", NATIVE_DIR / "ggml": "ggml"}


def cache_dir() -> Path:
    return Path(os.environ.get("SFI_GGUF_CACHE", Path.home() / ".cache" / "sfi-gguf"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist() -> Path:
    """The pinned sdist from the cache, downloaded with pip on first use."""
    target = cache_dir() / "sdist" / SDIST_NAME
    if target.exists() and sha256_of(target) == SDIST_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"sfi-gguf: downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps",
             "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
             "-d", tmp],
            check=False, stdout=sys.stderr,
        )
        got = Path(tmp) / SDIST_NAME
        if not got.exists():  # metadata preparation may fail without build deps; the file is there first
            raise SystemExit(f"sfi-gguf: pip did not fetch {SDIST_NAME}")
        actual = sha256_of(got)
        if actual != SDIST_SHA256:
            raise SystemExit(f"sfi-gguf: {SDIST_NAME} sha256 {actual} != pinned {SDIST_SHA256}")
        os.replace(got, target)
    return target


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def stamp_for(source_id: str) -> str:
    digest = hashlib.sha256(source_id.encode())
    digest.update(Path(__file__).read_bytes())  # a change of this recipe re-prepares the tree
    for patch in patches():
        digest.update(patch.name.encode())
        digest.update(patch.read_bytes())
    return digest.hexdigest()


def extract_sdist(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if not member.name.startswith(VENDOR_PREFIX):
                continue
            rel = member.name[len(VENDOR_PREFIX):]
            if not rel or rel.startswith(SKIP_DIRS) or rel == ".git":
                continue
            member.name = rel
            tar.extract(member, dest, filter="data") if sys.version_info >= (3, 12) else tar.extract(member, dest)


def copy_tree(source: Path, dest: Path) -> None:
    top_level_skip = {d.rstrip("/") for d in SKIP_DIRS if d.count("/") == 1} | {".git"}

    def ignore(directory: str, names: list[str]) -> set[str]:
        # only top-level folders (src/models/ holds the model graphs and must stay)
        return top_level_skip & set(names) if Path(directory) == source else set()

    shutil.copytree(source, dest, ignore=ignore, dirs_exist_ok=True)


def apply_patches(tree: Path) -> None:
    for patch in patches():
        cmd = ["git", "apply", "-p1", "--whitespace=nowarn", str(patch)] if shutil.which("git") \
            else ["patch", "-p1", "-s", "-i", str(patch)]
        # inside another git work tree (e.g. a build dir under a checkout) `git apply` would resolve paths
        # against that repository and silently skip them: stop git's repository discovery at the tree
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
        result = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise SystemExit(f"sfi-gguf: patch {patch.name} does not apply:\n{result.stderr}")
    if patches() and "llama-sfi" not in (tree / "src" / "CMakeLists.txt").read_text():
        raise SystemExit("sfi-gguf: the patches did not take effect (src/CMakeLists.txt does not list llama-sfi*.cpp)")


SOURCES_MANIFEST = ".sfi-sources"  # the tree's files copied from our sources, one per line


def copy_sources(tree: Path) -> None:
    """native/src, native/include and native/ggml into the tree (only the files whose bytes changed); a file copied
    before whose source is gone is removed (ggml-cuda builds every .cu in its folder)."""
    copied = set()
    for src_dir, rel in SOURCE_DIRS.items():
        for path in sorted(src_dir.rglob("*")):
            if not path.is_file():
                continue
            out = tree / rel / path.relative_to(src_dir)
            copied.add(out.relative_to(tree).as_posix())
            if not out.exists() or out.read_bytes() != path.read_bytes():
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, out)  # (not copy2: a changed file must look newer than what was built from it)
    manifest = tree / SOURCES_MANIFEST
    before = set(manifest.read_text().split()) if manifest.exists() else set()
    for gone in sorted(before - copied):
        (tree / gone).unlink(missing_ok=True)
    manifest.write_text("".join(f"{name}\n" for name in sorted(copied)))


def prepare(dest: Path, source: Path | None) -> None:
    if source is not None:
        if not (source / "include" / "llama.h").exists():
            raise SystemExit(f"sfi-gguf: {source} is not a llama.cpp tree (no include/llama.h)")
        source_id = f"tree:{source.resolve()}:{(source / 'include' / 'llama.h').stat().st_mtime_ns}"
    else:
        source_id = f"sdist:{SDIST_SHA256}"
    stamp = stamp_for(source_id)
    stamp_file = dest / ".sfi-stamp"
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        copy_sources(dest)
        return
    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if source is not None:
        copy_tree(source, staging)
    else:
        extract_sdist(fetch_sdist(), staging)
    apply_patches(staging)
    copy_sources(staging)
    sync_tree(staging, dest)
    shutil.rmtree(staging)
    stamp_file.write_text(stamp)
    print(f"sfi-gguf: patched llama.cpp tree ready at {dest} ({len(patches())} patches)", file=sys.stderr)


def sync_tree(src: Path, dest: Path) -> None:
    """Copy src over dest touching only files whose bytes changed (keeps incremental builds)."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        out = dest / rel
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif not out.exists() or out.read_bytes() != path.read_bytes():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out)
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest)
        if rel not in wanted and rel.name != ".sfi-stamp":
            path.unlink() if not path.is_dir() else shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, required=True, help="where the patched tree goes")
    parser.add_argument("--source", type=Path, default=None,
                        help="an unpatched llama.cpp tree to use instead of the pinned sdist")
    parser.add_argument("--fetch-only", action="store_true", help="only download and verify the sdist")
    args = parser.parse_args()
    if args.fetch_only:
        print(fetch_sdist())
        return
    prepare(args.dest, args.source)


if __name__ == "__main__":
    main()
