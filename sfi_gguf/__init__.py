"""Slow-Fast Inference for GGUF models on llama.cpp."""
__version__ = "0.1.0"

from .core.library import NativeLibraryError, native_info  # noqa: E402  (loads the patched library first)
from .core import log as _log  # noqa: E402,F401  (llama.cpp's log: verbose only)
from .core.generate import Completion, GenerationStats  # noqa: E402
from .sfi_llama import SFILlama  # noqa: E402
from .llama_compat import Llama  # noqa: E402
from .models import ensure_model  # noqa: E402

__all__ = ["SFILlama", "Llama", "Completion", "GenerationStats", "NativeLibraryError", "ensure_model", "native_info",
           "__version__"]
