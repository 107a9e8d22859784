"""The draft model method (docs/methods/draft.md): a smaller model drafts K tokens, of the
target's tokenizer (token ids straight through, draft trees possible) or of another one
(through text). Also the options every drafting method shares: the draft model, its p_min,
a draft tree's width.
"""

from __future__ import annotations

from pathlib import Path

from ..models.loading import LoadedModel, check_compatible
from ..proposers import CrossTokenizerProposer, DraftModelProposer, HybridProposer, Proposer
from ..proposers.hybrid import HybridTuning
from ..tree import MAX_TREE_WIDTH
from .spec import Export, Key, MethodSpec, Option, is_int, positive


def _check_p_min(config) -> dict:
    p = config.draft_p_min
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1):
        raise ValueError(f"draft_p_min = {p!r} is invalid; allowed: a number in [0, 1), or None")
    return {}


def _check_tree(config) -> dict:
    w = config.draft_tree_width
    if not is_int(w) or not 1 <= w <= MAX_TREE_WIDTH:
        raise ValueError(f"draft_tree_width = {w!r} is invalid; allowed: an integer in 1..{MAX_TREE_WIDTH} "
                         "(1: no tree)")
    return {}


# a model, not a field: speculative_config refuses it for a method without this option
DRAFT = Option("draft", "a draft model (draft=, assistant_model=, --draft and its --draft-* options) applies")
DRAFT_P_MIN = Option(
    "draft_p_min", "draft_p_min applies", (("draft_p_min", "float | None", None),),
    "``draft_p_min``: stop drafting where the draft's top probability is below it (None = the "
    "method's default)", check=_check_p_min)
TREE = Option(
    "tree", "a draft tree width (draft_tree_width=; tree=) applies", (("draft_tree_width", int, 1),),
    "``draft_tree_width`` (``tree=W``): w > 1 verifies the draft's chain with its next w - 1 "
    "candidates at each depth as a draft tree; 1: no tree",
    {"tree": Key("W", lambda v: {"draft_tree_width": positive("tree", v, MAX_TREE_WIDTH)})},
    check=_check_tree)


def own_draft(target: LoadedModel, draft: LoadedModel):
    """The draft's model, with its own KV cache when it is the target itself (a fork
    sharing the weights)."""
    return draft.lm.fork() if draft.lm is target.lm else draft.lm


def draft_proposer(target: LoadedModel, draft: LoadedModel, p_min: float | None = None,
                   hybrid: bool = False, tree_width: int = 1) -> Proposer:
    """The draft model's proposer for this pair: token ids straight through when the two
    share a tokenizer, through text when they do not (:func:`check_compatible`'s mode). A
    parallel draft (``draft.pard_token``) of the target's tokenizer proposes in one pass; of
    another tokenizer it drafts one token a pass, as any draft.

    Args:
        hybrid: as the hybrid's member (:meth:`HybridProposer.draft_for`'s settings).
        tree_width: > 1 drafts trees (:class:`DraftModelProposer`), same tokenizer only.
    Raises:
        ValueError: draft trees asked of a pair whose tokenizers differ.
    """
    lm = own_draft(target, draft)
    if check_compatible(target, draft) == "same":
        return HybridProposer.draft_for(lm, p_min, draft.pard_token) if hybrid else \
            DraftModelProposer(lm, p_min=p_min, tree_width=tree_width, mask_id=draft.pard_token)
    if tree_width > 1:
        raise ValueError("draft trees need a draft of the target's tokenizer; this pair's "
                         "tokenizers differ (see `specdecode check-pair`): use tree=1")
    if p_min is None:
        p_min = HybridTuning.draft_p_min if hybrid else CrossTokenizerProposer.default_p_min
    return CrossTokenizerProposer(lm, target.tokenizer, draft.tokenizer, draft.eos_token_ids,
                                  p_min=p_min, lazy_prefill=hybrid)


def _start_k(config, target: LoadedModel, draft: LoadedModel | None) -> tuple[int, int]:
    # a draft of another tokenizer: its own default K, and a token of lookahead
    if draft is not None and check_compatible(target, draft) == "cross":
        k = config.num_speculative_tokens if config.k_given else CrossTokenizerProposer.default_k
        return k, CrossTokenizerProposer.lookahead
    return config.num_speculative_tokens, 0


def export_settings(engine: str, k: int | None, draft_dir: Path | None, max_ngram: int,
                    min_ngram: int) -> tuple[str | None, dict | None, list[str], list[str]]:
    """vLLM's draft_model, SGLang's STANDALONE (a chain of K steps, one candidate each)."""
    k = k or DraftModelProposer.default_k
    if engine == "vllm":
        return "draft_model", {"method": "draft_model", "model": str(draft_dir),
                               "num_speculative_tokens": k}, [], []
    return "STANDALONE", None, [
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft_dir),
        "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(k + 1)], []


METHODS = (
    MethodSpec("draft", "a smaller model drafts K tokens (of another tokenizer: through text)",
               DraftModelProposer,
               lambda config, target, draft: draft_proposer(target, draft, config.draft_p_min,
                                                            tree_width=config.draft_tree_width),
               options=(DRAFT, DRAFT_P_MIN, TREE), options_help="draft:tree=W (a draft tree W wide)",
               needs_draft_model=True, start_k=_start_k,
               export=Export(export_settings)),
)
