"""Models: the interface the engine uses (:mod:`.base`), our native Llama-family decoder
(:mod:`.native`), the transformers adapter (:mod:`.hf`), loading and pairing (:mod:`.loading`)
and the known models fetched from PyPI (:mod:`.registry`)."""

from .base import CausalLM, busy_lock
from .hf import HFCausalLM
from .loading import (IncompatibleDraftError, LoadedModel, check_compatible, load, load_pair,
                      resolve_model_path)
from .native import ModelArgs, Transformer

__all__ = ["CausalLM", "HFCausalLM", "IncompatibleDraftError", "LoadedModel", "ModelArgs",
           "Transformer", "busy_lock", "check_compatible", "load", "load_pair", "resolve_model_path"]
