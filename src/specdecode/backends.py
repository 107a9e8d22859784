"""The engine's view of a model, the two backends behind it, and model loading.

A backend is anything with this small interface (:class:`CausalLM`): ``allocate`` a cache,
``forward`` new tokens (appended after the cached ones) to logits, ``rollback`` to a length.
Backends: our native Llama-family decoder (:class:`specdecode.model.Transformer`, which
implements the interface itself) and
:class:`HFCausalLM`, an adapter over any ``transformers.AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError

from .model import SUPPORTED_MODEL_TYPES, Transformer, quantize_int8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "native", "transformers")


@runtime_checkable
class CausalLM(Protocol):
    """What the engine needs from a model.

    Attributes: ``vocab_size`` (embedding rows = logits width V), ``max_context`` (positions),
    ``seq_len`` (positions now in the KV cache).
    """

    vocab_size: int
    max_context: int
    seq_len: int

    def allocate(self, batch: int, max_len: int) -> None:
        """Prepare an empty KV cache for ``batch`` rows of up to ``max_len`` positions."""

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [B,T] to the cache; return fp32 logits [B,num_logits,V]
        of the last ``num_logits`` positions (all T when None, none when 0)."""

    def rollback(self, length: int) -> None:
        """Forget every cached position from ``length`` on."""

    def fork(self) -> "CausalLM":
        """Another handle on the same weights with its own KV cache."""


class HFCausalLM:
    """Adapter over a ``transformers`` causal LM; rollback uses ``DynamicCache.crop``.

    Serves every architecture the native decoder does not cover (slower, and no draft-tree
    masks or layer skipping, which later methods need).
    """

    def __init__(self, hf_model):
        self.hf = hf_model.eval()
        cfg = hf_model.config
        self.vocab_size = hf_model.get_output_embeddings().out_features  # also when int8-quantized
        self.max_context = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        self.seq_len = 0
        self._cache = None

    def allocate(self, batch: int, max_len: int) -> None:
        from transformers import DynamicCache

        if max_len > self.max_context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {self.max_context} tokens")
        self._cache = DynamicCache(config=self.hf.config)
        self.seq_len = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        n = t if num_logits is None else num_logits
        out = self.hf(input_ids=input_ids, past_key_values=self._cache, use_cache=True,
                      logits_to_keep=max(n, 1))
        self.seq_len += t
        return out.logits[:, out.logits.shape[1] - n:].float()

    def fork(self) -> "HFCausalLM":
        return HFCausalLM(self.hf)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.seq_len} positions")
        self._cache.crop(length - self.seq_len)  # transformers 5: a negative count to remove
        self.seq_len = length


@dataclass
class LoadedModel:
    """A model ready for the engine plus what only the text layer needs.

    ``tokenizer`` is a transformers tokenizer or None (token-id-only use);
    ``eos_token_ids`` are the ids that end generation by default (generation_config ∪ tokenizer).
    """

    lm: CausalLM
    tokenizer: object | None = None
    name: str = "model"
    eos_token_ids: tuple[int, ...] = ()
    path: Path | None = field(default=None, repr=False)


def resolve_model_path(name_or_path: str | Path) -> Path:
    """Turn a specdecode model name, a local directory, a GGUF file or a hub id into a local
    directory in transformers layout (config.json + weights + tokenizer files).

    Known names are fetched on first use; GGUF files are converted once into the cache; a hub
    id goes through ``huggingface_hub.snapshot_download`` (the standard ``from_pretrained``
    resolution, honouring HF_HOME and HF_HUB_OFFLINE). Raises ValueError when nothing matches.
    """
    from . import registry

    s = str(name_or_path)
    if not s.strip():
        raise ValueError("the model name/path is empty; give one of " + ", ".join(registry.KNOWN_MODELS)
                         + ", a model directory, a .gguf file or a hub id")
    if s in registry.KNOWN_MODELS:
        return registry.fetch(s) if not registry.is_present(s) else registry.model_dir(s)
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} is a directory without config.json; expected a Hugging Face "
                             "model directory (config.json, *.safetensors, tokenizer files)")
        return p
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf file; pass a GGUF file, a model "
                             "directory, a hub id, or one of " + ", ".join(registry.KNOWN_MODELS))
        return registry.converted_dir_for_gguf(p)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(s, allow_patterns=[
                "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]))
        except Exception as e:  # noqa: BLE001 - re-raised with what to do
            raise ValueError(f"could not fetch hub model {s!r} ({type(e).__name__}: {e}); use a "
                             "local directory, a GGUF file, or one of "
                             + ", ".join(registry.KNOWN_MODELS)) from e
    raise ValueError(f"model {s!r} not found: not a known name ({', '.join(registry.KNOWN_MODELS)}), "
                     "not an existing directory or .gguf file, and not a hub id of the form org/name")


def load(name_or_path: str | Path, *, dtype: str | torch.dtype = "float32",
         backend: str = "auto", tokenizer: bool = True) -> LoadedModel:
    """Load a model for use as target or draft.

    ``backend``: "native" (our decoder; llama/qwen2/mistral), "transformers" (any causal LM)
    or "auto" (native when the architecture allows). ``dtype``: float32 (default; exactness
    on CPU), bfloat16, float16, or int8 (int8 dynamic quantization of the linear layers: fast
    drafts on CPU). Raises ValueError naming the bad value.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES and dtype != "int8":
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES) + ['int8']}")
        dtype = DTYPES.get(dtype, dtype)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    path = resolve_model_path(name_or_path)
    config = json.loads((path / "config.json").read_text())
    native_ok = config.get("model_type") in SUPPORTED_MODEL_TYPES and any(path.glob("*.safetensors"))
    if backend == "native" and not native_ok:
        raise ValueError(f"{name_or_path}: model_type {config.get('model_type')!r} with these weights "
                         f"is not supported natively ({SUPPORTED_MODEL_TYPES}); use backend='transformers'")
    try:
        if backend == "transformers" or not native_ok:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if dtype == "int8" else dtype)
            lm = HFCausalLM(quantize_int8(hf) if dtype == "int8" else hf)
        else:
            lm = Transformer.from_pretrained(path, dtype=dtype)
        tok = None
        if tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, RuntimeError, KeyError, SafetensorError) as e:
        raise ValueError(
            f"could not load the model in {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}. "
            "The files may be missing, truncated or corrupt: re-copy them (for a known model, "
            "delete that directory and run `specdecode models fetch NAME`)") from e
    return LoadedModel(lm=lm, tokenizer=tok, name=str(name_or_path),
                       eos_token_ids=_default_eos(path, tok), path=path)


def _default_eos(path: Path, tok) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids += e if isinstance(e, list) else ([e] if e is not None else [])
    if tok is not None and tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return tuple(dict.fromkeys(ids))
