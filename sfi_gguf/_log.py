"""llama.cpp's log on stderr: errors always, everything else only with verbose=True.

llama-cpp-python 0.3.36's log callback reads ggml's log levels as an older ggml numbered them (INFO 1,
WARN 2, ERROR 3); this ggml has DEBUG 1, INFO 2, WARN 3, ERROR 4, so with verbose=False that callback
prints every warning as an error (e.g. a vocabulary's "control-looking token" lines at each model
load). This one keeps its switch, the level of llama-cpp-python's logger (`llama_cpp._logger.set_verbose`,
called by `llama_cpp.Llama` and `LlamaContext`), and reads this ggml's levels.
"""
from __future__ import annotations

import ctypes
import logging
import sys

from ._native import lib, llama_cpp

# enum ggml_log_level; NONE is llama.cpp's plain LLAMA_LOG / GGML_LOG output (performance reports ...)
GGML_LOG_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_LOG_LEVEL_CONT = 5  # continues the previous line, at its level

_last_level = logging.INFO


@llama_cpp.llama_log_callback
def log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level != GGML_LOG_LEVEL_CONT:
        _last_level = GGML_LOG_LEVELS.get(level, logging.ERROR)
    threshold = llama_cpp._logger.logger.level or logging.ERROR  # not set yet: as verbose=False
    if _last_level >= threshold:
        print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)


_sfi_log_set = lib.llama_sfi_log_set
_sfi_log_set.argtypes = [llama_cpp.llama_log_callback, ctypes.c_void_p, ctypes.c_int]
_sfi_log_set.restype = None
_sfi_log_set_min_level = lib.llama_sfi_log_set_min_level
_sfi_log_set_min_level.argtypes = [ctypes.c_int]
_sfi_log_set_min_level.restype = None


def _min_level() -> int:
    """ggml's level below which nothing `log_callback` receives would be printed: DEBUG when verbose, else INFO
    (INFO and WARN still reach it, NONE lines always; they are few)."""
    threshold = llama_cpp._logger.logger.level or logging.ERROR
    return 1 if threshold <= logging.DEBUG else 2


def install() -> None:
    """Make `log_callback` llama.cpp's (and ggml's) log callback for the process, behind the library's filter:
    debug lines (a GPU backend logs some at every decode) never enter Python unless they would be printed."""
    _sfi_log_set(log_callback, ctypes.c_void_p(0), _min_level())


_set_verbose = llama_cpp._logger.set_verbose


def set_verbose(verbose: bool) -> None:
    """llama-cpp-python's switch (`llama_cpp.Llama` and `LlamaContext` call it), and the filter's level with it."""
    _set_verbose(verbose)
    _sfi_log_set_min_level(_min_level())


install()
# where llama-cpp-python calls it from: its logger module, and the name llama.py imported from it
llama_cpp._logger.set_verbose = set_verbose
if hasattr(llama_cpp, "llama") and getattr(llama_cpp.llama, "set_verbose", None) is _set_verbose:
    llama_cpp.llama.set_verbose = set_verbose
