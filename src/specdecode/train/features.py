"""Self-distillation data: the target answers the training prompts itself, and one more pass
over each prompt + answer records what a draft head learns from.

The answers are the target's greedy output, generated on its fastest runtime and dtype, as
many prompts at a time as ``batch`` (:func:`specdecode.generate` with a list): a head
trained on them learns the distribution it will be asked to match, in the same numerics
(Medusa and EAGLE train on the target's own answers for this reason; EAGLE-3's paper,
arXiv:2503.01840, calls it the training-time data of the target). The feature pass over
prompt + answer is one prefill whose rows equal one-token passes on the int8/int4 kernels,
so the states recorded are those the engine hands a head while decoding.

A features directory holds ``features.json`` (the manifest: target, layers, shards, and
the keys of the prompts done) and shards ``shard-NNNNN.safetensors`` of up to ``batch``
sequences, each with:

- ``tokens`` int32 [N]: prompt + answer ids of every sequence, concatenated;
- ``offsets`` int64 [S+1] and ``starts`` int64 [S]: sequence s is tokens[offsets[s]:
  offsets[s+1]], its answer begins at offsets[s] + starts[s];
- ``final`` bf16 [N, dim]: the final norm's output (the lm_head input; ``FINAL``);
- ``aux`` bf16 [N, 3*dim]: the residual stream after the layers ``aux_layers`` (EAGLE-3's
  fused features), concatenated in that order ([N, 0] for a target of under 7 layers);
- ``topk_ids`` int32 [N, TOPK], ``topk_logp`` fp32 [N, TOPK]: the TOPK most likely next
  tokens at each position and their log-probabilities under the target's full softmax.

A shard is written (to a temporary name, then renamed) after each batch, so an interrupted
run loses at most one batch and resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..api import generate
from ..models.base import RowsLM
from ..models.loading import LoadedModel
from ..heads import aux_layers
from ..models.native import FINAL
from .data import Prompt, is_held_out

TOPK = 16
FORMAT = 1


@dataclass
class Sequence:
    """One recorded sequence, sliced out of a shard (see the module docstring for the fields;
    here ``tokens`` [T], ``final`` [T, dim], ``aux`` [T, 3*dim], ``topk_*`` [T, TOPK])."""

    tokens: torch.Tensor
    start: int
    final: torch.Tensor
    aux: torch.Tensor
    topk_ids: torch.Tensor
    topk_logp: torch.Tensor


def _manifest_path(out: Path) -> Path:
    return out / "features.json"


def read_manifest(out: str | Path) -> dict | None:
    """The manifest of a features directory, or None when it has none. Raises ValueError for
    an unreadable one."""
    path = _manifest_path(Path(out))
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e}); delete the directory to record the features again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not a features manifest of format {FORMAT}; delete the directory "
                         "to record the features again")
    return m


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def record(target: LoadedModel, prompts: list[Prompt], out: str | Path, *, max_new_tokens: int = 256,
           batch: int = 8, progress: bool = True) -> dict:
    """Generate the target's greedy answers to ``prompts`` and record their features into the
    directory ``out`` (see the module docstring); prompts already recorded there are
    skipped, so a second call resumes. Returns the manifest.

    target: a native-runtime model (its hidden states are read). max_new_tokens: the answer
    length cap (tokens). batch: prompts generated together (rows of the batched engine).
    Raises ValueError for a target of another runtime, a directory recorded for another
    target, dtype or answer length, or bad sizes.
    """
    lm = target.lm
    if not isinstance(lm, RowsLM):
        raise ValueError(f"recording features reads the target's hidden states, which the native "
                         f"runtime gives; this target is {type(lm).__name__} (load it with backend='native')")
    if not (isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= 4096):
        raise ValueError(f"max_new_tokens must be an integer 1..4096, got {max_new_tokens!r}")
    if not (isinstance(batch, int) and batch >= 1):
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = aux_layers(lm.args.n_layers)
    identity = {"target": target.name, "weights": lm.weight_format, "n_layers": lm.args.n_layers, "dim": lm.args.dim,
                "vocab_size": lm.vocab_size, "aux_layers": layers, "max_new_tokens": max_new_tokens}
    manifest = read_manifest(out) or {"format": FORMAT, **identity, "shards": [], "done": []}
    diff = {k: (manifest.get(k), v) for k, v in identity.items() if manifest.get(k) != v}
    if diff:
        raise ValueError(f"{out} holds features recorded with other settings "
                         f"({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in diff.items())}); "
                         "use another directory or delete it")
    done = set(manifest["done"])
    todo = [p for p in prompts if p.key not in done]
    # batches of one kind (chat or completion) and one split, so shards are split-pure
    groups: dict[tuple[bool, bool], list[Prompt]] = {}
    for p in todo:
        groups.setdefault((p.chat, is_held_out(p)), []).append(p)
    batches = [(held, g[i:i + batch]) for (chat, held), g in sorted(groups.items())
               for i in range(0, len(g), batch)]
    bar = tqdm(total=len(todo), desc=f"self-distillation ({target.name} answers)", unit="prompt",
               disable=not progress, initial=0)
    t0 = time.perf_counter()
    try:
        for held, group in batches:
            texts = [p.text for p in group]
            results = generate(target, texts, chat=group[0].chat, max_new_tokens=max_new_tokens,
                               max_batch=batch)
            seqs = [r.prompt_token_ids + r.token_ids for r in results]
            starts = [len(r.prompt_token_ids) for r in results]
            tensors = _feature_pass(lm, seqs, starts, layers)
            name = f"shard-{len(manifest['shards']):05d}.safetensors"
            tmp = out / (name + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, out / name)
            seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            manifest["shards"].append({"file": name, "held_out": held, "sequences": len(group),
                                       "tokens": int(tensors["tokens"].numel()),
                                       "answer_tokens": sum(len(s) - st for s, st in zip(seqs, starts)),
                                       "seconds": round(seconds, 3)})
            manifest["done"].extend(p.key for p in group)
            # the recording's own time, over every call that added to it (resumed or reused runs)
            manifest["recording_seconds"] = round(manifest.get("recording_seconds", 0.0) + seconds, 1)
            _write_json(_manifest_path(out), manifest)
            bar.update(len(group))
    finally:
        bar.close()
    return manifest


def _feature_pass(lm, seqs: list[list[int]], starts: list[int], layers: list[int]) -> dict[str, torch.Tensor]:
    """One prefill per sequence with the hidden states and top-k log-probabilities kept."""
    finals, auxes, ids, logps = [], [], [], []
    for seq in seqs:
        lm.allocate(1, len(seq))
        with torch.no_grad():
            o = lm.forward_rows(torch.tensor([seq]), output_hidden=(FINAL, *layers))
            logp = torch.log_softmax(o.logits[0].float(), dim=-1)
            top = logp.topk(TOPK, dim=-1)
        finals.append(o.hidden[FINAL][0].to(torch.bfloat16))
        auxes.append(torch.cat([o.hidden[i][0] for i in layers], dim=-1).to(torch.bfloat16)
                     if layers else torch.zeros(len(seq), 0, dtype=torch.bfloat16))
        ids.append(top.indices.to(torch.int32))
        logps.append(top.values)
        del o, logp
    lens = torch.tensor([len(s) for s in seqs])
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "starts": torch.tensor(starts, dtype=torch.int64),
            "final": torch.cat(finals), "aux": torch.cat(auxes),
            "topk_ids": torch.cat(ids), "topk_logp": torch.cat(logps)}


def recording_seconds(manifest: dict, keys: set[str]) -> float:
    """The seconds the target spent recording the answers of the prompts ``keys`` (a run's
    own, where the directory holds a larger run's too): each shard's time times the share of
    its sequences among them (directories recorded before shards kept their time: the
    directory's time times the share of all its prompts)."""
    done = manifest["done"]
    if not all("seconds" in shard for shard in manifest["shards"]):
        return round(manifest.get("recording_seconds", 0.0) * len(keys.intersection(done)) / max(1, len(done)), 3)
    return round(sum(shard["seconds"] * sum(k in keys for k in shard_keys) / max(1, shard["sequences"])
                     for shard, shard_keys in _shards_with_keys(manifest)), 3)


def _shards_with_keys(manifest: dict) -> list[tuple[dict, list[str | None]]]:
    """Each shard of ``manifest`` with its sequences' prompt keys (``done`` lists them shard
    after shard, as :func:`record` adds them)."""
    done, out = iter(manifest["done"]), []
    for shard in manifest["shards"]:
        out.append((shard, [next(done, None) for _ in range(shard["sequences"])]))
    return out


def load_sequences(out: str | Path, held_out: bool, keys: set[str] | None = None) -> list[Sequence]:
    """The recorded sequences of one split (training: held_out False); with ``keys``, only
    those of these prompts (``Prompt.key``: a run's own prompts, where the directory holds a
    larger run's too). Raises ValueError for a directory without features or a damaged shard."""
    out = Path(out)
    manifest = read_manifest(out)
    if manifest is None:
        raise ValueError(f"{out} holds no recorded features (features.json is missing)")
    seqs = []
    for shard, shard_keys in _shards_with_keys(manifest):
        if shard["held_out"] != held_out or (keys is not None and not keys.intersection(shard_keys)):
            continue
        try:
            t = load_file(str(out / shard["file"]))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{out / shard['file']} is damaged ({e}); delete it and its entry, or "
                             "the directory, and record again") from None
        off = t["offsets"].tolist()
        for s in range(len(off) - 1):
            if keys is not None and shard_keys[s] not in keys:
                continue
            a, b = off[s], off[s + 1]
            seqs.append(Sequence(t["tokens"][a:b].long(), int(t["starts"][s]), t["final"][a:b],
                                 t["aux"][a:b], t["topk_ids"][a:b].long(), t["topk_logp"][a:b]))
    return seqs

