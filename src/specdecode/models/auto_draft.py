"""``--draft auto``: the draft for a target, picked from the models on this machine.

The smallest model available locally (a fetched known model, an ollama model, a GGUF file or a
model directory of the Hugging Face hub cache: :mod:`.stores`; a GGUF file beside the
target's) that shares the target's
tokenizer (:func:`~specdecode.tokenmap.pair_mode` "same": the same ids for the same token
texts and the same special tokens; padded embedding rows allowed), else the smallest of
another tokenizer whose proposals can go through text ("cross"), else none (the caller
speculates without a draft model: ``--method self``). Only models at most half the target's
size are drafts worth their steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from . import gguf_file, registry, stores
from .loading import resolve_model_path
from ..tokenmap import UnsupportedTokenizerError, pair_mode

MAX_TRIED = 8  # candidates whose tokenizer is read, smallest first


@dataclass(frozen=True)
class DraftPick:
    """``name``: what ``load`` takes (None: no draft found); ``mode``: "same" or "cross";
    ``why``: one line for the user."""

    name: str | None
    mode: str | None
    why: str


def model_bytes(path: Path) -> int:
    """The size of a model's weights: its GGUF file, or a directory's safetensors files."""
    source = gguf_file.source_of(path) if path.is_dir() else path
    if source is not None and source.is_file():
        return source.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0


def candidates(beside: Path | None = None) -> list[tuple[str, int]]:
    """(name, bytes) of every model on this machine (:mod:`.stores`), and the GGUF files in
    the folder ``beside`` (a target file's: where its user keeps models), smallest first."""
    found = [(name, registry.gguf_path(name).stat().st_size) for name in registry.KNOWN_MODELS
             if registry.is_present(name)]
    found += [(m.name, m.size) for m in stores.ollama_models() + stores.hub_cache_models()]
    if beside is not None:
        found += [(str(f), f.stat().st_size) for f in sorted(beside.glob("*.gguf")) if f.is_file()]
    return sorted(dict(found).items(), key=lambda x: x[1])


def pick_draft(target, target_bytes: int | None = None) -> DraftPick:
    """The draft for the loaded ``target`` (a :class:`~.loading.LoadedModel` with a
    tokenizer) among :func:`candidates`, as the module docstring says. ``target_bytes``:
    the target's size (default: from its path)."""
    size = target_bytes if target_bytes is not None else model_bytes(Path(target.path))
    own = {str(target.path), str(target.name)}
    source = gguf_file.source_of(Path(target.path)) if target.path is not None else None
    cross = None
    tried = 0
    for name, nbytes in candidates(source.parent if source is not None else None):
        if nbytes * 2 > size or tried >= MAX_TRIED:
            break
        try:
            path = resolve_model_path(name)
            if str(path) in own or name in own:
                continue
            tried += 1
            mode = pair_mode(target.tokenizer, AutoTokenizer.from_pretrained(path))
        except (ValueError, OSError, UnsupportedTokenizerError):
            continue  # unreadable, or a tokenizer that cannot pair: the next one
        share = f"{nbytes / 2**20:.0f} MiB, {100 * nbytes / size:.0f} % of the target's"
        if mode == "same":
            return DraftPick(name, mode, f"{name}: the smallest model here with the target's "
                                         f"tokenizer ({share})")
        cross = cross or DraftPick(name, mode, f"{name}: no model here shares the target's "
                                               f"tokenizer; the smallest of another one ({share}), "
                                               "its proposals through text")
    return cross or DraftPick(None, None, "no model found (known models, ollama's store, the Hugging "
                                          "Face cache, the target file's folder) is a draft for this "
                                          "target (at most half its size, a tokenizer that pairs); "
                                          "speculating with the target's own layers (--method self)")
