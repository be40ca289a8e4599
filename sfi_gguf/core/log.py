"""llama.cpp's log on stderr: errors always, information and warnings too with verbose=True, debug lines never
(llama.cpp logs some at every decode: thousands for a short generation).

llama-cpp-python 0.3.36's log callback reads ggml's log levels as an older ggml numbered them (INFO 1,
WARN 2, ERROR 3); this ggml has DEBUG 1, INFO 2, WARN 3, ERROR 4, so with verbose=False that callback
prints every warning as an error (e.g. a vocabulary's "control-looking token" lines at each model
load). This one keeps its switch, the level of llama-cpp-python's logger (`llama_cpp._logger.set_verbose`,
called by `llama_cpp.Llama` and `LlamaContext`), and reads this ggml's levels. With verbose it prints llama.cpp's
information, as llama.cpp's tools do by default; their debug level (`llama-cli -v`) is never printed.
"""
from __future__ import annotations

import ctypes
import logging
import sys

from .library import lib, llama_cpp

# enum ggml_log_level; NONE is llama.cpp's plain LLAMA_LOG / GGML_LOG output (performance reports ...)
GGML_LOG_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_LOG_LEVEL_CONT = 5  # continues the previous line, at its level

_last_level = logging.INFO


@llama_cpp.llama_log_callback
def log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level != GGML_LOG_LEVEL_CONT:
        _last_level = GGML_LOG_LEVELS.get(level, logging.ERROR)
    if _last_level >= _threshold():
        print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)


_sfi_log_set = lib.llama_sfi_log_set
_sfi_log_set.argtypes = [llama_cpp.llama_log_callback, ctypes.c_void_p, ctypes.c_int]
_sfi_log_set.restype = None
GGML_LOG_LEVEL_INFO = 2


def _threshold() -> int:
    """The least level printed: INFO with verbose (llama-cpp-python's logger at DEBUG), else ERROR (also before
    anything set it)."""
    return max(llama_cpp._logger.logger.level or logging.ERROR, logging.INFO)


def install() -> None:
    """Make `log_callback` llama.cpp's (and ggml's) log callback for the process, behind the library's filter: debug
    lines never enter Python (INFO and WARN do, and are printed with verbose; they are few)."""
    _sfi_log_set(log_callback, ctypes.c_void_p(0), GGML_LOG_LEVEL_INFO)


install()
