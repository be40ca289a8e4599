"""Load the patched llama.cpp through llama-cpp-python's own bindings.

llama-cpp-python reads LLAMA_CPP_LIB_PATH once, when `llama_cpp` is first imported, and keeps one
`ctypes.CDLL` for the process. We point it at our library before that import, so the `llama_cpp`
API and our `llama_sfi_*` functions share one library instance (one KV cache implementation, one
ggml). If `llama_cpp` was imported earlier with another library, we refuse: mixing two libllama
copies in one process gives undefined behaviour.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

EXPECTED_SFI_API_VERSION = 20
_LIB_NAMES = {"linux": "libllama.so", "darwin": "libllama.dylib", "win32": "llama.dll"}


class NativeLibraryError(ImportError):
    """The patched llama.cpp library is missing, or another libllama is already loaded."""


def _lib_file_name() -> str:
    for prefix, name in _LIB_NAMES.items():
        if sys.platform.startswith(prefix):
            return name
    return "libllama.so"


def find_lib_dir() -> Path:
    """Directory holding our libllama: sfi_gguf/lib (next to the package), else where pip installed sfi-gguf.

    The second case covers running from a source checkout (tests, examples) after `scripts/setup.sh`.
    """
    override = os.environ.get("SFI_GGUF_LIB_DIR")
    candidates = [Path(override)] if override else []
    candidates.append(Path(__file__).resolve().parents[1] / "lib")
    try:
        for f in importlib.metadata.files("sfi-gguf") or []:
            if f.name == _lib_file_name() and f.parent.name == "lib":
                candidates.append(Path(f.locate()).resolve().parent)
                break
    except importlib.metadata.PackageNotFoundError:
        pass
    for directory in candidates:
        if (directory / _lib_file_name()).exists():
            return directory
    raise NativeLibraryError(
        "sfi-gguf: the patched llama.cpp library was not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "). Run scripts/setup.sh, or `pip install .` in the sfi-gguf checkout."
    )


def _preload_libstdcxx() -> None:
    """Put the system libstdc++ first in the process's global symbol scope (Linux).

    Some CUDA toolchains (seen with CUDA 13 + GCC 13) leave copies of libstdc++ internals exported
    from libggml*.so; libllama's std::ostream calls then bind to those copies, whose locale facet ids
    are not libstdc++'s, and crash at model load (upstream llama.cpp PR #22434 hit the same). With
    libstdc++ loaded RTLD_GLOBAL first, every library binds to the real one.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass  # no shared libstdc++ (static build): nothing to interpose


def _load_llama_cpp():
    lib_dir = find_lib_dir()
    if "llama_cpp" not in sys.modules:
        _preload_libstdcxx()
        previous = os.environ.get("LLAMA_CPP_LIB_PATH")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
        try:
            import llama_cpp  # noqa: F401  (loads the library named by LLAMA_CPP_LIB_PATH)
        finally:
            if previous is None:
                os.environ.pop("LLAMA_CPP_LIB_PATH", None)
            else:
                os.environ["LLAMA_CPP_LIB_PATH"] = previous
    import llama_cpp

    loaded = Path(llama_cpp.llama_cpp._lib._name).resolve()
    if loaded.parent != lib_dir.resolve():
        raise NativeLibraryError(
            f"sfi-gguf: llama_cpp was already imported with another libllama ({loaded}); sfi-gguf needs "
            f"its patched library ({lib_dir / _lib_file_name()}). Import sfi_gguf before llama_cpp, or "
            f"set LLAMA_CPP_LIB_PATH={lib_dir} before starting Python."
        )
    lib = llama_cpp.llama_cpp._lib
    if not hasattr(lib, "llama_sfi_version"):
        raise NativeLibraryError(f"sfi-gguf: {loaded} is not patched for SFI (no llama_sfi_version)")
    lib.llama_sfi_version.argtypes = []
    lib.llama_sfi_version.restype = __import__("ctypes").c_int32
    version = lib.llama_sfi_version()
    if version != EXPECTED_SFI_API_VERSION:
        raise NativeLibraryError(
            f"sfi-gguf: {loaded} has SFI API version {version}, this package needs "
            f"{EXPECTED_SFI_API_VERSION}; rebuild with scripts/setup.sh"
        )
    return llama_cpp, lib, loaded


llama_cpp, lib, LIB_PATH = _load_llama_cpp()
SFI_API_VERSION = EXPECTED_SFI_API_VERSION


def native_info() -> dict:
    """Which library is loaded and what it was built with (for bug reports and the CLI)."""
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return {"library": str(LIB_PATH), "sfi_api_version": lib.llama_sfi_version(), "system_info": system_info}
