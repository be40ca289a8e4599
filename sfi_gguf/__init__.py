"""Slow-Fast Inference for GGUF models on llama.cpp.

`SFILlama` is the model object; `Llama` is llama-cpp-python's `Llama` decoding with SFI. `SFIConfig` sets SFI's
budgets, trigger policy and Selector, each with its parameter class; `SamplingParams` holds a generation's sampling.
The library lives in `sfi_gguf.core`, the HTTP server and llama-cpp-python's completion API in `sfi_gguf.serve`,
the benchmark and evaluation tooling in `sfi_gguf.tools`.
"""
__version__ = "0.1.0"

from .core.library import NativeLibraryError, native_info  # noqa: E402  (loads the patched library first)
from .core import log as _log  # noqa: E402,F401  (llama.cpp's log: verbose only)
from .core.config import SFIConfig  # noqa: E402
from .core.generate import Completion, GenerationStats  # noqa: E402
from .core.policy import FixedParams, PolicyParams, PunctuationParams  # noqa: E402
from .core.sampling import SamplingParams  # noqa: E402
from .core.selector import SelectorParams, SFISelectorParams, TopKMassParams  # noqa: E402
from .core.stepper import SFIStats, Stepper  # noqa: E402
from .sfi_llama import SFILlama  # noqa: E402
from .llama_compat import Llama  # noqa: E402
from .models import ensure_model  # noqa: E402

__all__ = ["SFILlama", "Llama", "SFIConfig", "PolicyParams", "PunctuationParams", "FixedParams", "SelectorParams",
           "SFISelectorParams", "TopKMassParams", "SamplingParams", "Stepper", "Completion", "GenerationStats",
           "SFIStats", "NativeLibraryError", "ensure_model", "native_info", "__version__"]
