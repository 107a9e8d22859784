"""Draft heads (docs/methods/heads.md): Medusa heads on the target's last hidden state and an
EAGLE-3 head on three of its hidden states draft a chain or a draft tree; a head is trained
with ``specdecode train`` or given as a directory in the format vLLM and SGLang load.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import MAX_K, KSchedule
from ..heads import DEFAULT_HEAD_TIME, Eagle3Head, MedusaHeads, aux_layers, default_head_dir
from ..models.base import module_device
from ..models.loading import LoadedModel
from ..models.native import auto_draft_vocab
from ..models.quant import best_layout
from ..profile import verify_profile
from ..proposers import Eagle3Proposer, MedusaProposer
from ..tree import MAX_NODES
from ..verify import LossyTypical
from .draft import TREE
from .spec import PRECISION, Export, Key, MethodSpec, Option, is_int, native_lm, path_value, positive


def _choices_file(path: str) -> list:
    """A Medusa tree's node list from a JSON file (Medusa's ``medusa_choices``: a list of node
    paths of candidate ranks, e.g. ``[[0], [1], [0, 0]]``). Raises ValueError naming the file
    when it cannot be read or is not JSON (the nodes are checked when the config is made)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"choices={path}: cannot read a Medusa tree from it ({e}); give a JSON file "
                         "of node paths such as [[0], [1], [0, 0]]") from None


def _check_nodes(config) -> dict:
    n = config.tree_nodes
    if n is not None and n != "auto" and (not is_int(n) or not 1 <= n <= MAX_NODES):
        raise ValueError(f"tree_nodes = {n!r} is invalid; allowed: an integer in 1..{MAX_NODES}, "
                         "'auto', or None (no dynamic tree)")
    return {}


def _check_choices(config) -> dict:
    c = config.medusa_choices
    if c is None:
        return {}
    try:
        c = tuple(tuple(int(r) if is_int(r) else None for r in node) for node in c)
    except TypeError:
        c = ((None,),)
    if not c or any(not node or None in node or min(node) < 0 for node in c):
        raise ValueError(f"medusa_choices = {config.medusa_choices!r} is invalid; allowed: a "
                         "non-empty list of node paths, each a non-empty list of candidate ranks "
                         "(integers >= 0), e.g. [[0], [1], [0, 0]] (Medusa's medusa_choices)")
    if config.draft_tree_width != 1:
        raise ValueError("give a Medusa tree's width (tree=W) or its node list (choices=FILE), not both")
    MedusaProposer.check_shape(list(c))  # (the heads' depth is checked when they load)
    return {"medusa_choices": c}


def _check_lossy(config) -> dict:
    t = config.lossy_typical
    if t is None or isinstance(t, LossyTypical):
        return {}
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ValueError(f"lossy_typical = {t!r} is invalid; allowed: None (lossless), EPS (a "
                         "number in (0, 1), e.g. 0.09) or a LossyTypical")
    return {"lossy_typical": LossyTypical(t)}


TREE_NODES = Option(
    "tree_nodes", "a dynamic draft tree's size (tree_nodes=; nodes=) applies",
    (("tree_nodes", "int | str | None", None),),
    "``tree_nodes`` (``nodes``): an EAGLE-3 head's dynamic tree of that many nodes, or \"auto\": "
    "as many as verify at the cost of the chain's pass; None: none",
    {"nodes": Key("N|auto", lambda v: {"tree_nodes": v if v == "auto" else positive("nodes", v, MAX_NODES, " or auto")})},
    check=_check_nodes)
HEAD = Option(
    "head", "a draft head's directory (head_dir=; head=) applies", (("head_dir", "str | None", None),),
    "``head_dir`` (``head``): the directory of the ``medusa`` or ``eagle3`` method's head",
    {"head": Key("DIR", lambda v: {"head_dir": path_value(v)})})
MEDUSA_CHOICES = Option(
    "medusa_choices", "a Medusa tree's node list (medusa_choices=; choices=) applies",
    (("medusa_choices", "tuple[tuple[int, ...], ...] | None", None),),
    "``medusa_choices`` (``choices=FILE``, a JSON file): Medusa's static tree as node paths of "
    "candidate ranks, e.g. ((0,), (1,), (0, 0)), Medusa's ``medusa_choices``; not with tree=W",
    {"choices": Key("FILE", lambda v: {"medusa_choices": _choices_file(path_value(v))})},
    check=_check_choices)
LOSSY_TYPICAL = Option(
    "lossy_typical", "Medusa's typical acceptance, which changes the output (lossy_typical=; "
                     "lossy-typical=), applies", (("lossy_typical", "LossyTypical | float | None", None),),
    "``lossy_typical`` (``lossy-typical=EPS[/DELTA]``, medusa only): a "
    ":class:`~specdecode.verify.LossyTypical`, or its EPS as a number; None, the default: "
    "lossless. Sampled requests are then verified by Medusa's typical acceptance, which CHANGES "
    "THE OUTPUT",
    {"lossy-typical": Key("EPS[/DELTA]", lambda v: {"lossy_typical": LossyTypical.parse(v)})},
    check=_check_lossy)


def tree_size(times: list[float], k: int) -> int:
    """The most draft-tree nodes whose verify pass costs no more than a chain of K's (within
    5 %), from the target's measured forward times T(1..n) (``times[i]`` = T(i+1), seconds):
    on a CPU a pass of a few more rows is nearly free up to a kernel's block of rows, then
    costs more (docs/EXPERIMENTS.md, the draft heads). At least K."""
    limit = times[min(k, len(times) - 1)] * 1.05
    return max([k] + [i for i in range(1, min(len(times), MAX_NODES + 1)) if times[i] <= limit])


def head_directory(config, target: str) -> str:
    """The head directory ``config``'s head method reads for the target named ``target`` (a
    registry name or directory): ``config.head_dir``, or the target's default head. Callable
    before the target is loaded, so that a missing head is said at once. Raises ValueError,
    saying how to make or give one, when the default head does not exist."""
    kind = config.method.value
    if config.head_dir is not None:
        return config.head_dir
    path = default_head_dir(target, kind)
    if not (path / "config.json").exists():
        raise ValueError(f"method {kind!r} has no head for {target} yet: `specdecode train {kind} "
                         f"--target {target}` trains its default one into {path} ({DEFAULT_HEAD_TIME} "
                         f"for the 1.5B default target on 2 cores; `specdecode bench` does it when a run "
                         f"asks for {kind}), or give {kind}:head=DIR (Python: head_dir=DIR)")
    return str(path)


def loaded_head(config, target: LoadedModel):
    """The head ``config`` names, loaded once per loaded target and kept on it
    (``LoadedModel.heads``; a head rewritten on disk is read again): checked against the
    target, on its device, with int8 linears where the target is quantized on a CPU."""
    kind = config.method.value
    path = Path(head_directory(config, target.name))
    lm = native_lm(target, kind)
    try:
        stamp = (path / "model.safetensors").stat().st_mtime_ns
    except OSError:
        stamp = None  # the loader says what is missing
    key = (kind, str(path.resolve()), stamp)
    if key in target.heads:
        return target.heads[key]
    device = module_device(lm)
    # the target's own tables (output layer, embedding), not copies: read in place, in its
    # dtype; Medusa's output layer over the first ids only, as a self-draft's (FR-Spec)
    if kind == "medusa":
        vocab = auto_draft_vocab(lm.args.vocab_size)
        head = MedusaHeads.load(path, lm.lm_head if vocab is None else lm.draft_head(vocab))
        if (head.dim, head.vocab_size) != (lm.args.dim, lm.vocab_size):
            raise ValueError(f"the Medusa heads in {path} are for hidden size {head.dim} and "
                             f"{head.vocab_size} tokens; this target has {lm.args.dim} and "
                             f"{lm.vocab_size}: give heads made for this target")
    else:
        if not aux_layers(lm.args.n_layers):
            raise ValueError(f"EAGLE-3 fuses three target layers; this target has {lm.args.n_layers} "
                             "(at least 7 needed)")
        head = Eagle3Head.load(path, lm.args, lm.model.embed_tokens)
    head.to(device)
    if PRECISION.get(lm.weight_format.split("-")[0], 0) <= PRECISION["int8"] and device.type == "cpu":
        head.quantize_(best_layout("draft"))  # a quantized target's head drafts in int8 too
    target.heads[key] = head.eval()
    return head


def _medusa(config, target: LoadedModel, draft=None) -> MedusaProposer:
    """The Medusa heads of ``config.head_dir`` (default: the target's default heads) as a
    chain, with ``tree=W`` a tree (:meth:`MedusaProposer.siblings_tree`), or the static tree
    of ``config.medusa_choices``. Raises ValueError for a tree the heads cannot draft."""
    heads = loaded_head(config, target)
    w, nodes = config.draft_tree_width, config.medusa_choices
    if nodes is None and w > 1:
        nodes = MedusaProposer.siblings_tree(heads.num_heads, w)
    return MedusaProposer(heads, nodes, lossy_typical=config.lossy_typical)


def _eagle3(config, target: LoadedModel, draft=None) -> Eagle3Proposer:
    """The EAGLE-3 head of ``config.head_dir`` (default: the target's default head), on the
    target's embedding; with ``tree=W`` the chain and its siblings as a tree, with
    ``nodes=N`` EAGLE-2's dynamic tree of N nodes (expanding ``tree`` nodes a depth, at
    least 2; ``nodes=auto``: :func:`tree_size` from the target's measured forward times)."""
    head = loaded_head(config, target)
    nodes = config.tree_nodes
    if nodes == "auto":
        nodes = tree_size(verify_profile(target, MAX_K), config.num_speculative_tokens)
    return Eagle3Proposer(head, aux_layers(target.lm.args.n_layers), config.draft_tree_width, nodes)


def _prepare(config, target: LoadedModel, draft=None) -> None:
    loaded_head(config, target)  # a bad head is said at once


# a head trained on a CPU's budget is weak, and the papers' fixed K of 3-4 then verifies rows
# it rarely gets right, slower than plain decoding (docs/EXPERIMENTS.md, the draft heads):
# their K schedule is auto
_COMMON = dict(schedule=KSchedule.AUTO, native_only=True, cpu_only="its draft heads use the CPU kernels", prepare=_prepare,
               head_dir=head_directory,
               export=Export(refusal="{name} drafts with a trained head: export it with export_head "
                                     "(specdecode export {name} HEAD --format {engine} OUT)"))

METHODS = (
    MethodSpec("medusa", "Medusa heads on the target's own last hidden state (head=DIR: vLLM's "
               "Medusa format; default: the target's own, from specdecode train medusa)", MedusaProposer,
               _medusa, options=(TREE, HEAD, MEDUSA_CHOICES, LOSSY_TYPICAL), k=3,
               options_help="medusa:head=DIR:tree=W (or :choices=FILE, Medusa's node list as JSON; "
                            ":lossy-typical=EPS[/DELTA] is LOSSY: Medusa's typical acceptance "
                            "(arXiv:2401.10774) changes the output of sampled requests, --temperature > 0)",
               **_COMMON),
    MethodSpec("eagle3", "an EAGLE-3 head on three of the target's own hidden states (head=DIR: the "
               "LlamaForCausalLMEagle3 format vLLM and SGLang load; default: the target's own, from "
               "specdecode train eagle3)", Eagle3Proposer,
               _eagle3, options=(TREE, TREE_NODES, HEAD), k=4,
               options_help="eagle3:head=DIR:tree=W:nodes=N|auto", **_COMMON),
)
