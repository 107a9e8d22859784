"""specdecode: lossless speculative decoding for LLM text generation.

Public API: :func:`load`, :func:`generate`, :func:`stream`, :class:`SamplingParams`,
:class:`SpeculativeConfig`, :class:`Method`, :class:`Engine`.
"""

from .api import (GenerationResult, IncompatibleDraftError, StreamChunk, check_compatible, generate,
                  load_pair, stream)
from .backends import LoadedModel, load
from .config import Method, SamplingParams, SpeculativeConfig
from .engine import Engine, SpecDecodingStats
from .sampling import rejection_sample

__all__ = ["Engine", "GenerationResult", "IncompatibleDraftError", "LoadedModel", "Method",
           "SamplingParams", "SpecDecodingStats", "SpeculativeConfig", "StreamChunk",
           "check_compatible", "generate", "load", "load_pair", "rejection_sample", "stream"]
__version__ = "0.1.0"
