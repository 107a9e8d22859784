"""``specdecode export vllm|sglang DIR`` and ``specdecode export eagle3|medusa HEAD --format
vllm|sglang OUT``: what a user who outgrows one machine loads in vLLM or SGLang to run the
same speculation at scale (a draft model or lookup method; a trained draft head, see
:func:`export_head`).

DIR gets: ``draft/`` (the draft model as a Hugging Face directory: bf16 safetensors, config,
tokenizer and chat template), with ``target/`` too on request; ``speculative_config.json``
(vLLM's ``--speculative-config``) or the SGLang flags; ``launch.sh``; ``NOTES.md`` (what was
exported, the vocabulary check, and where the engine has no equivalent of our method).

Vocabulary sizes: vLLM refuses a draft whose vocabulary size differs from the target's
(Qwen2.5's 0.5B/1.5B checkpoints have 151,936 rows, its 7B and larger 152,064). A draft with
fewer rows is padded with zero rows (those ids score 0 in the draft, and no token of the
tokenizer has one); a draft with more rows is cut to the target's when its tokenizer has no
id beyond them; otherwise the export is refused.

A parallel draft (PARD, arXiv:2504.18583: a ``pard_token`` in its config.json, as
``specdecode train pard`` writes it) is exported with vLLM's ``"parallel_drafting": true``
beside ``"method": "draft_model"`` (vLLM reads the mask token from the draft's config);
SGLang has no parallel drafting, so there it drafts one token a step.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .heads import HEAD_ARCHS, read_head_dir
from .methods import METHODS, Method
from .models.loading import save_tensors

ENGINES = ("vllm", "sglang")
HEAD_KINDS = ("eagle3", "medusa")  # exported by export_head, from a trained head's directory
ROW_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # one row per token id
# what a model directory holds besides its weights and config (tokenizer, chat template, ...)
SKIP = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


@dataclass
class ExportResult:
    """What :func:`export` wrote: ``out``, the engine's method (``method``, None when it has
    no equivalent), the ``config`` (vLLM's JSON) or ``flags`` (SGLang's), the vocabulary
    action (``vocab``: "same", "padded", "cut") and the ``notes``."""

    out: Path
    engine: str
    method: str | None
    config: dict | None
    flags: list[str]
    vocab: str
    notes: list[str] = field(default_factory=list)


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read config.json ({e})") from None


def _tokenizer_size(path: Path) -> int | None:
    """The number of ids the tokenizer in ``path`` can produce, or None without one."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def _check_same_tokenizer(target: Path, draft: Path) -> None:
    from transformers import AutoTokenizer

    a, b = (AutoTokenizer.from_pretrained(p) for p in (target, draft))
    if a.get_vocab() != b.get_vocab():
        raise ValueError(f"the draft's tokenizer ({draft}) differs from the target's ({target}): "
                         "vLLM's and SGLang's draft models need the target's tokenizer")


def write_hf_dir(src: Path, dst: Path, vocab_size: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> str:
    """Copy the model directory ``src`` to ``dst`` with its weights cast to ``dtype`` (one
    ``model.safetensors``) and, when ``vocab_size`` is given, its token rows padded with zeros
    or cut to that many. Returns "same", "padded" or "cut". Raises ValueError when rows would
    be cut that the tokenizer can produce, or the weights are not safetensors."""
    config = _config(src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors weights to export")
    rows = config.get("vocab_size")
    action = "same"
    if vocab_size is not None and rows != vocab_size:
        if rows > vocab_size:
            used = _tokenizer_size(src)
            if used is None or used > vocab_size:
                raise ValueError(
                    f"the draft has {rows} vocabulary rows and its tokenizer {used} ids, more "
                    f"than the target's {vocab_size}: vLLM needs equal sizes, and rows its "
                    "tokenizer can produce cannot be cut; use a draft of the target's family")
            action = "cut"
        else:
            action = "padded"
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    handles = [safe_open(f, "pt") for f in files]  # each file opened once
    names = [(h, n) for h in handles for n in h.keys()]
    for h, name in tqdm(names, desc=f"export {src.name} ({str(dtype).removeprefix('torch.')})",
                        unit="tensor", disable=not progress):
        t = h.get_tensor(name)
        if t.is_floating_point():
            t = t.to(dtype)
        if action != "same" and name in ROW_TENSORS:
            t = t[:vocab_size] if action == "cut" else torch.cat(
                [t, t.new_zeros(vocab_size - t.shape[0], *t.shape[1:])])
        tensors[name] = t.contiguous()
    del handles, names
    save_tensors(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        # transformers 4 (what many vLLM / SGLang releases pin) reads it at the top level;
        # without it, it would fall back to 10000 and the draft would be another model
        config["rope_theta"] = rope["rope_theta"]
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(SKIP) \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return action


def engine_settings(engine: str, method: Method, k: int | str | None, draft_dir: Path | None,
                    max_ngram: int, min_ngram: int) -> tuple[str | None, dict | None, list[str], list[str]]:
    """(the engine's method, vLLM's speculative config or None, SGLang's flags, notes) that
    reproduce ``method`` with speculation length ``k`` (the method's ``export`` settings).
    Raises ValueError where the engine has no equivalent."""
    notes = []
    if isinstance(k, str):  # heuristic / auto: chosen each round here; neither engine does
        notes.append(f"`k={k}` chooses K each round from measured costs; {engine} takes a fixed "
                     "K: the method's default K is exported instead.")
        k = None
    how = method.spec.export
    if how.settings is None:
        raise ValueError(how.refusal.format(name=method.value, engine=engine))
    name, config, flags, own = how.settings(engine, k, draft_dir, max_ngram, min_ngram)
    return name, config, flags, notes + own


def export(engine: str, out: str | Path, target: Path, draft: Path | None, method: Method,
           k: int | str | None = None, max_ngram: int = 5, min_ngram: int = 2,
           with_target: bool = False, target_name: str = "", progress: bool = True) -> ExportResult:
    """Write DIR for ``engine`` ("vllm" or "sglang"); see the module docstring.

    target / draft: model directories in transformers layout (draft None for the lookup
    methods). with_target: also write the target as ``target/`` (bf16), so that the launch
    script serves the very pair measured here. Raises ValueError for an unknown engine, an
    exported method that needs a draft without one, vocabulary sizes that cannot match, or a
    parallel draft's mask token beyond the target's rows.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; allowed: {', '.join(ENGINES)}")
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new directory")
    uses_draft = method.needs_draft_model
    if uses_draft and draft is None:
        raise ValueError(f"method {method.value} needs a draft model to export (--draft)")
    if uses_draft:
        _check_same_tokenizer(target, draft)
    draft_dir = out / "draft" if uses_draft else None
    name, config, flags, notes = engine_settings(engine, method, k, draft_dir, max_ngram, min_ngram)
    target_vocab = _config(target).get("vocab_size")
    mask = _config(draft).get("pard_token") if uses_draft else None
    if mask is not None:
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < (target_vocab or mask + 1):
            raise ValueError(f"the draft's pard_token {mask!r} is not a row of the target's vocabulary "
                             f"(0..{target_vocab - 1}): vLLM's draft must have the target's rows")
        if config is not None:
            config["parallel_drafting"] = True
        else:
            notes.append(f"the draft is a parallel draft (mask token {mask}); SGLang has no parallel "
                         "drafting, so it drafts one token a step there (what it proposes changes, "
                         "not the output's distribution).")
    out.mkdir(parents=True, exist_ok=True)
    vocab = "same"
    if uses_draft:
        vocab = write_hf_dir(draft, draft_dir, target_vocab, progress=progress)
        if vocab != "same":
            rows = _config(draft).get("vocab_size")
            notes.append(f"vocabulary: the draft's {rows} rows were {vocab} to the target's "
                         f"{target_vocab} (vLLM refuses a pair of different sizes); "
                         + ("the extra rows are zeros: no token of the tokenizer has those ids."
                            if vocab == "padded" else "no token of its tokenizer had the cut ids."))
    if with_target:
        write_hf_dir(target, out / "target", progress=progress)
    result = ExportResult(out, engine, name, config, flags, vocab, notes)
    if config is not None:
        (out / "speculative_config.json").write_text(json.dumps(config, indent=2) + "\n")
    served = "$HERE/target" if with_target else str(target)
    (out / "launch.sh").write_text(_launch_script(result, served))
    (out / "launch.sh").chmod(0o755)
    (out / "NOTES.md").write_text(_notes(result, method.value, target_name or str(target), with_target))
    return result


def _launch_script(r: ExportResult, served: str) -> str:
    head = ["#!/usr/bin/env bash",
            f"# Serves the target with {r.method or 'no'} speculation in {r.engine} (written by "
            "specdecode export; NOTES.md says what maps to what). Set TARGET to serve another "
            "copy of the target (e.g. its hub id); extra arguments go to the server.",
            "set -euo pipefail", 'HERE="$(cd "$(dirname "$0")" && pwd)"',
            f'TARGET="${{TARGET:-{served}}}"']
    if r.engine == "vllm":
        # the draft's path as it is now, wherever DIR was moved to (set by python, which vLLM
        # has: a path may hold any character sed or a shell would read)
        spec = ""
        if r.config and "model" in r.config:
            spec = (""" --speculative-config "$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1]));"""
                    """ c["model"] = sys.argv[2]; print(json.dumps(c))' "$HERE/speculative_config.json" """
                    '"$HERE/draft")"')
        elif r.config:
            spec = ' --speculative-config "$(cat "$HERE/speculative_config.json")"'
        cmd = f'exec vllm serve "$TARGET"{spec} "$@"'
    else:
        flags = " ".join(shlex.quote(f) for f in r.flags).replace(
            shlex.quote(str(r.out / "draft")), '"$HERE/draft"')
        cmd = f'exec python -m sglang.launch_server --model-path "$TARGET" {flags} "$@"'.replace("  ", " ")
    return "\n".join(head + [cmd, ""])


def _notes(r: ExportResult, method: str, target_name: str, with_target: bool,
           head: str | None = None) -> str:
    """NOTES.md of an export of specdecode's ``method``; ``head`` describes an exported draft head."""
    draft = (f"- draft: `draft/`: {head}" if head else
             "- draft: `draft/` (bf16 safetensors, config, tokenizer)" if (r.out / "draft").exists()
             else "- draft: none (a lookup method)")
    lines = [f"# {r.engine} export of specdecode's `{method}` method", "",
             f"- target: {target_name}" + (" (also written here as `target/`, bf16)" if with_target else
                                          " (not copied: `launch.sh` serves this machine's copy unless "
                                          "TARGET names another, e.g. the target's hub id)"),
             draft, f"- {r.engine} method: " + (f"`{r.method}`" if r.method else "none (no equivalent)")]
    if r.config is not None:
        lines += ["- `speculative_config.json`: vLLM's `--speculative-config`"]
    if r.flags:
        lines += ["- SGLang flags: `" + " ".join(r.flags).replace(str(r.out), "DIR") + "`"]
    lines += ["- `launch.sh`: starts the server (`TARGET=... ./launch.sh --port 8000`); DIR may be "
              "moved: it finds `draft/` beside itself", ""]
    if head:
        lines += ["The head reads the target's own hidden states and embedding (not stored here: "
                  "the engine takes them from the target it serves, which must be the target the "
                  "head was trained on). The engine verifies with its own kernels: its output is "
                  "its target's, not token for token specdecode's (whose default target runs quantized).", ""]
    else:
        lines += ["The draft is specdecode's copy of it (a model fetched as GGUF is the dequantized "
                  "GGUF), so it drafts as it does here. The engine verifies with its own target and "
                  "kernels: its output is its target's, not token for token specdecode's (whose default target runs quantized). "
                  "`config.json` carries `rope_theta` at the top level too, for transformers 4.", ""]
    if r.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in r.notes] + [""]
    return "\n".join(lines)


# --- draft heads: ``specdecode export eagle3|medusa HEAD --format vllm|sglang OUT`` ---------


def head_tensor_table(kind: str, config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors (name -> (shape, dtype)) that vLLM (and, for ``eagle3``, SGLang) load for
    a head of this config.json: the table of docs/methods/heads.md, weights in bf16, EAGLE-3's d2t int64 and
    t2d bool. Raises ValueError for an unknown kind or a config without the sizes it needs."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"head kind {kind!r} is unknown; allowed: {', '.join(HEAD_KINDS)}")
    bf16 = torch.bfloat16
    try:
        d, v = int(config["hidden_size"]), int(config["vocab_size"])
        if kind == "medusa":
            heads, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
            table = {f"blocks.{i}.layers.{j}.{p}": ((d, d) if p == "weight" else (d,), bf16)
                     for i in range(heads) for j in range(layers) for p in ("weight", "bias")}
            lm = range(1) if config.get("original_lm_head") else range(heads)
            table.update({f"lm_heads.{i}.weight": ((v, d), bf16) for i in lm})
            t = int(config.get("truncated_vocab_size") or v)
            if t < v:  # vLLM drafts over the ids token_map lists (it slices the table itself)
                table["token_map"] = ((t,), torch.int64)
            return table
        i, n = int(config["intermediate_size"]), int(config["draft_vocab_size"])
        hd = int(config.get("head_dim") or d // int(config["num_attention_heads"]))
        q, kv = int(config["num_attention_heads"]) * hd, int(config["num_key_value_heads"]) * hd
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the {kind} head's config.json lacks or has a bad {e}") from None
    m = "midlayer."
    return {"fc.weight": ((d, 3 * d), bf16), m + "input_layernorm.weight": ((d,), bf16),
            m + "hidden_norm.weight": ((d,), bf16), m + "self_attn.q_proj.weight": ((q, 2 * d), bf16),
            m + "self_attn.k_proj.weight": ((kv, 2 * d), bf16), m + "self_attn.v_proj.weight": ((kv, 2 * d), bf16),
            m + "self_attn.o_proj.weight": ((d, q), bf16), m + "post_attention_layernorm.weight": ((d,), bf16),
            m + "mlp.gate_proj.weight": ((i, d), bf16), m + "mlp.up_proj.weight": ((i, d), bf16),
            m + "mlp.down_proj.weight": ((d, i), bf16), "norm.weight": ((d,), bf16),
            "lm_head.weight": ((n, d), bf16), "d2t": ((n,), torch.int64), "t2d": ((v,), torch.bool)}


def check_head_tensors(kind: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors`` are exactly :func:`head_tensor_table`'s names,
    shapes and dtypes and, for ``eagle3``, d2t maps the draft vocabulary to ascending target
    ids below vocab_size and t2d marks exactly those ids (what the engines index with)."""
    want = head_tensor_table(kind, config)
    problems = [f"missing {k}" for k in sorted(set(want) - set(tensors))]
    problems += [f"unexpected {k}" for k in sorted(set(tensors) - set(want))]
    problems += [f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, expected "
                 f"{want[k][0]} {str(want[k][1]).removeprefix('torch.')}"
                 for k, t in sorted(tensors.items()) if k in want and (tuple(t.shape), t.dtype) != want[k]]
    if not problems and kind == "eagle3":
        ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0 or int(ids.max()) >= len(tensors["t2d"]):
            problems.append("d2t + arange(N) is not strictly increasing target ids below vocab_size")
        elif int(tensors["t2d"].sum()) != len(ids) or not bool(tensors["t2d"][ids].all()):
            problems.append("t2d does not mark exactly the draft vocabulary's target ids")
    if problems:
        raise ValueError(f"the {kind} head does not have the tensors vLLM/SGLang load: "
                         + "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else ""))


def head_settings(kind: str, engine: str, k: int, head_dir: Path) -> tuple[str, dict | None, list[str], list[str]]:
    """(the engine's method, vLLM's speculative config or None, SGLang's flags, notes) that
    serve a ``kind`` head as a chain of ``k`` draft tokens, as specdecode's proposers draft.
    Raises ValueError where the engine has no such head (Medusa in SGLang)."""
    if engine == "vllm":
        name = "eagle3" if kind == "eagle3" else "medusa"
        notes = ["vLLM's Medusa proposer verifies a top-1 chain, as specdecode's `medusa` does "
                 "without `tree=`."] if kind == "medusa" else []
        return name, {"method": name, "model": str(head_dir), "num_speculative_tokens": k}, [], notes
    if kind == "medusa":
        raise ValueError("SGLang has no Medusa heads: export with --format vllm, or train an "
                         "EAGLE-3 head (specdecode train eagle3), which both engines serve")
    return "EAGLE3", None, ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                            str(head_dir), "--speculative-num-steps", str(k), "--speculative-eagle-topk",
                            "1", "--speculative-num-draft-tokens", str(k + 1)], \
        ["a chain of K draft tokens (topk 1), as specdecode drafts; on a GPU a tree pays more "
         "(e.g. --speculative-eagle-topk 4 --speculative-num-draft-tokens 16)."]


def export_head(kind: str, head: str | Path, engine: str, out: str | Path, target: Path,
                k: int | None = None, target_name: str = "") -> ExportResult:
    """Write OUT for serving the trained ``kind`` head (``eagle3`` or ``medusa``) in
    ``engine`` ("vllm" or "sglang"): ``draft/`` (config.json and model.safetensors in bf16,
    checked against :func:`head_tensor_table`), the speculative config or flags for a chain
    of ``k`` tokens (default: the method's K, for Medusa its number of heads), launch.sh and
    NOTES.md. ``target`` is the target's model directory: its hidden and vocabulary sizes
    must be the head's. Medusa heads trained over the target's first ids (``first_ids`` in
    their config's ``training``) get vLLM's ``truncated_vocab_size`` and a ``token_map`` of
    those ids, so that vLLM drafts over them as specdecode does. Raises ValueError naming
    what is wrong (another head kind, tensors the engines would not load, a head of another
    target, k out of range, OUT not empty, Medusa for SGLang)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; allowed: {', '.join(ENGINES)}")
    head, out = Path(head).expanduser(), Path(out).expanduser().resolve()
    if kind not in HEAD_KINDS:
        raise ValueError(f"head kind {kind!r} is unknown; allowed: {', '.join(HEAD_KINDS)}")
    config, tensors = read_head_dir(head, kind)
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}
    check_head_tensors(kind, config, tensors)
    training = config.get("training") if isinstance(config.get("training"), dict) else {}
    first = training.get("first_ids")
    if kind == "medusa" and isinstance(first, int) and 0 < first < int(config["vocab_size"]):
        # heads trained over the first ids (as specdecode serves them) draft over those in vLLM
        # too: its truncated vocabulary, token_map listing the ids
        config = {**config, "truncated_vocab_size": first}
        tensors["token_map"] = torch.arange(first)
        check_head_tensors(kind, config, tensors)
    tc = _config(target)
    tc = tc.get("text_config", tc)
    bad = [f"{key} {config.get(key)} vs the target's {tc.get(key)}" for key in ("hidden_size", "vocab_size")
           if config.get(key) != tc.get(key)]
    if bad:
        raise ValueError(f"the head in {head} was made for another target ({'; '.join(bad)}): "
                         "give the target it was trained on (--target)")
    most = int(config["num_heads"]) if kind == "medusa" else 16
    k = k or (most if kind == "medusa" else METHODS[kind].default_k)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
        raise ValueError(f"k={k!r} is invalid for a {kind} head; allowed: 1..{most}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new directory")
    name, spec, flags, notes = head_settings(kind, engine, k, out / "draft")
    (out / "draft").mkdir(parents=True)
    save_tensors(tensors, out / "draft" / "model.safetensors", metadata={"format": "pt"})
    (out / "draft" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    result = ExportResult(out, engine, name, spec, flags, "same", notes)
    if spec is not None:
        (out / "speculative_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    (out / "launch.sh").write_text(_launch_script(result, str(target)))
    (out / "launch.sh").chmod(0o755)
    trained = config.get("training", {}).get("data", {}).get("sources") if isinstance(config.get("training"), dict) else None
    (out / "NOTES.md").write_text(_notes(result, kind, target_name or str(target), False,
                                         f"the {kind} head ({HEAD_ARCHS[kind]}, bf16; checked against "
                                         "the tensor names, shapes and dtypes the engines load)"
                                         + (f", trained on {', '.join(trained)}" if trained else "")))
    return result
