"""specdecode: lossless speculative decoding for LLM text generation.

Public API: :func:`load`, :func:`generate`, :func:`stream`, :class:`SamplingParams`,
:class:`SpeculativeConfig`, :class:`Method`, :class:`Engine`.

The names are imported on first use (PEP 562), so that ``import specdecode`` and the command
line's first moments do not wait for PyTorch: a Ctrl-C while the command line starts ends it
with one line (``specdecode.__main__``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_HOMES = {
    "GenerationResult": "api", "StreamChunk": "api", "generate": "api", "stream": "api",
    "SamplingParams": "config",
    "Engine": "engine", "TokenInfo": "engine",
    "METHODS": "methods", "Method": "methods", "SpeculativeConfig": "methods",
    "IncompatibleDraftError": "models.loading", "LoadedModel": "models.loading",
    "check_compatible": "models.loading", "load": "models.loading", "load_pair": "models.loading",
    "SpecDecodingStats": "stats",
    "rejection_sample": "verify",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
