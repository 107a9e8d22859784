"""specdecode: lossless speculative decoding for LLM text generation.

Public API: :func:`load`, :func:`generate`, :func:`stream`, :class:`SamplingParams`,
:class:`SpeculativeConfig`, :class:`Method`, :class:`Engine`.
"""

__version__ = "0.1.0"

from .api import GenerationResult, StreamChunk, generate, stream  # noqa: E402
from .config import SamplingParams  # noqa: E402
from .engine import Engine, TokenInfo  # noqa: E402
from .methods import METHODS, Method, SpeculativeConfig  # noqa: E402
from .models.loading import (IncompatibleDraftError, LoadedModel, check_compatible, load,  # noqa: E402
                             load_pair)
from .stats import SpecDecodingStats  # noqa: E402
from .verify import rejection_sample  # noqa: E402

__all__ = ["Engine", "GenerationResult", "IncompatibleDraftError", "LoadedModel", "METHODS", "Method",
           "SamplingParams", "SpecDecodingStats", "SpeculativeConfig", "StreamChunk",
           "TokenInfo", "check_compatible", "generate", "load", "load_pair", "rejection_sample", "stream"]
