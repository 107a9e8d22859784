"""A request's plan, naming no method: what a method measures or loads once, whether it can
run on a target, its proposer and its K schedule, all read from its
:class:`~specdecode.methods.spec.MethodSpec`'s hooks.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import KSchedule
from ..models.base import MeasuredDraft, lm_device
from ..models.loading import LoadedModel, check_compatible
from ..profile import verify_profile
from ..proposers import PredictionProposer, Proposer
from ..schedule import AutoK, FixedK, HeuristicK, Schedule
from .config import SpeculativeConfig
from .registry import OPTIONS
from .spec import native_lm


def read_files(config: SpeculativeConfig) -> SpeculativeConfig:
    """``config`` with its file-valued options read now, once (a Medusa tree's ``choices=``
    is read when the text is parsed; this reads a layer-skip ``profile=``): a server keeps
    what it was started with, whatever happens to the files later. Raises ValueError naming
    a file that cannot be read or is not what it should be (a profile's layers are checked
    against the target when the draft is built)."""
    read = {}
    for option in OPTIONS.values():
        if option.read is not None:
            read.update(option.read(config))
    return replace(config, **read) if read else config


def head_dir_for(config: SpeculativeConfig, target: str) -> str | None:
    """The draft head directory ``config``'s method reads for the target named ``target`` (a
    registry name or directory); None for a method without a head. Callable before the
    target is loaded, so that a missing head is said at once. Raises ValueError, saying how
    to make or give one, when the default head does not exist."""
    return config.method.spec.head_dir(config, target)


def prepare(config: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None = None) -> None:
    """Measure or load now what ``config``'s method reads once from ``target`` (and
    ``draft``): a layer-skip profile, a draft head (kept on the target), a draft's prefill
    cost; before a batched engine holds them, which it then cannot measure. Raises
    ValueError for a head or profile that is missing or not for this target."""
    config.method.spec.prepare(config, target, draft)


def cannot_run(config: SpeculativeConfig, target: LoadedModel) -> str | None:
    """Why ``config``'s method with its options cannot run on ``target`` as it stands (None
    when it can), without measuring or loading anything: for a server, whose requests name a
    method (with the options it was started with, else none), and whose batch holds the
    target so that nothing can be measured on it later (:func:`prepare`). Draft models and
    draft heads are checked elsewhere."""
    spec = config.method.spec
    if spec.native_only:
        try:
            native_lm(target, spec.name)
        except ValueError as e:
            return str(e)
    return spec.cannot_run(config, target)


def build_proposer(config: SpeculativeConfig, target: LoadedModel,
                   draft: LoadedModel | None) -> Proposer | None:
    """The proposer of ``config.method`` for one request on ``target`` (None for plain
    decoding). Raises ValueError when the method needs a draft model and none is given, the
    native runtime and the target runs on another, or the CPU and the target is elsewhere; IncompatibleDraftError when the draft's
    tokenizer differs and cannot be bridged (checked once per pair)."""
    spec = config.method.spec
    device = lm_device(target.lm)
    if spec.cpu_only is not None and device.type != "cpu":
        raise ValueError(f"method {spec.name!r} runs on the CPU only ({spec.cpu_only}); the target is "
                         f"on {device}: load it on the CPU, or use a draft model, a lookup method or layer-skip")
    if spec.native_only:
        native_lm(target, spec.name)
    if spec.needs_draft_model:
        if draft is None:
            raise ValueError(f"method {spec.name!r} needs a draft model (draft= or assistant_model=)")
        check_compatible(target, draft)
    return spec.build(config, target, draft if spec.needs_draft_model else None)


def build_schedule(config: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None = None,
                   proposer: Proposer | None = None) -> Schedule | None:
    """The K schedule of ``config`` (None for plain decoding).

    Fixed K or transformers' heuristic, both from K where given, else from the method's
    ``start_k`` (its default; a draft of another tokenizer's, a layer-skip profile's); or
    auto, which profiles the target's forward times T(1..max_k+1) and, for methods with a
    draft model, the draft's T(1) once (:func:`specdecode.profile.verify_profile`); for a
    self-draft, auto's first estimate of a draft step is its ``cost`` (its share of the
    target's T(1)) from ``proposer``, until the request's own round times replace it.
    Raises ValueError where building the method's draft does (a bad profile).
    """
    spec = config.method.spec
    if not spec.speculates:
        return None
    k, lookahead = spec.start_k(config, target, draft)
    if config.schedule is KSchedule.HEURISTIC:
        return HeuristicK(k, config.max_speculative_tokens)
    if config.schedule is KSchedule.AUTO:
        times = verify_profile(target, config.max_speculative_tokens)
        if spec.needs_draft_model and draft is not None:
            draft_s = verify_profile(draft, 0)[0]
        else:  # a lookup costs nothing; a self-draft its share of the target's pass
            costs = [m.cost for m in (proposer.models() if proposer is not None else ()) if isinstance(m, MeasuredDraft)]
            draft_s = times[0] * costs[0] if costs else 0.0
        return AutoK(times, config.max_speculative_tokens, draft_seconds_per_token=draft_s, lookahead=lookahead)
    return FixedK(k)


def with_prediction(predicted: list[int] | None, proposer: Proposer | None, schedule: Schedule | None,
                    forward_seconds: list[float] | None = None) -> tuple[Proposer | None, Schedule | None]:
    """A request's proposer and K schedule with a predicted output's token ids proposed
    first (:class:`~specdecode.proposers.PredictionProposer`, which sizes its proposals from
    the target's measured T(1..n), ``forward_seconds``, where given; plain decoding, which has
    no schedule, gets K 16 each round, as the lookups); unchanged without a prediction."""
    if predicted is None:
        return proposer, schedule
    cost = [t / forward_seconds[0] for t in forward_seconds] if forward_seconds else None
    return PredictionProposer(predicted, proposer, cost), schedule or FixedK(PredictionProposer.default_k)
