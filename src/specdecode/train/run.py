"""One training run of a draft head, from prompts to a head directory: the steps that
``specdecode train`` and the bench (which trains the default head when it is missing) share.

1. prompts (:func:`specdecode.train.data.training_prompts`);
2. the target's answers and states (:func:`specdecode.train.features.record`);
3. the head's task (:func:`specdecode.train.medusa.medusa_task`,
   :func:`specdecode.train.eagle3.eagle3_task`) trained by :func:`specdecode.train.loop.train`.

The defaults of :class:`HeadRecipe` are the default head's recipe, sized so that the
default target's EAGLE-3 head, answers included, trains in under two hours on a 2-core CPU
(docs/EXPERIMENTS.md, the draft heads).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import generate
from ..bench.workloads import load_spec_bench
from ..heads import DEFAULT_HEAD_TIME, HEAD_ARCHS, HEAD_NAMES, Eagle3Head, MedusaHeads, aux_layers, cache_name, default_head_dir, draft_vocabulary
from ..models import registry
from ..models.loading import LoadedModel, checkpoint_tensor, float_model_path
from ..models.native import auto_draft_vocab
from ..tokenmap import pair_mode
from .data import DEFAULT_SOURCES, evaluation_runs, parse_sources, training_prompts
from .draft import DISTILL_FILE, PARD_FILE, WEIGHT_FILES, draft_task, source_files, trainable_layers
from .eagle3 import eagle3_task
from .features import load_sequences, read_manifest, record, recording_seconds
from .loop import PRECISIONS, STATE_FILE, Task, resolve_precision, train
from .medusa import medusa_task
from .pard import PARD_K, PARD_KEEP, PARD_KEEP_MIN, mask_token_id, pard_task

KINDS = tuple(HEAD_ARCHS)  # medusa, eagle3
# what a training run writes into its output directory (a directory holding only these is resumed)
OWN_FILES = ("checkpoint", "features", "config.json", "model.safetensors")


@dataclass(frozen=True)
class HeadRecipe:
    """The settings of a head's training run (the ``specdecode train`` options of the same
    names). data: prompt sources (:data:`specdecode.train.data.SOURCES`). max_prompts:
    prompts the target answers (None: 1,000 for a head, 400 for a distilled draft, whose
    steps are dearer: each default run within two hours on 2 cores). max_new_tokens: the answers' length cap (tokens). epochs:
    passes over the data. heads: Medusa heads (the longest chain). steps: EAGLE-3's
    training-time test steps. draft_vocab: EAGLE-3's draft vocabulary (tokens).
    intermediate_size: the EAGLE-3 layer's MLP width (None: the target's). batch_size:
    examples per step (None: 64 positions for Medusa, one sequence for EAGLE-3, whose
    batches pad to their longest sequence; 4 sequences for a distilled draft; docs/EXPERIMENTS.md,
    the draft heads). lr: AdamW's learning rate (None: 1e-3 for Medusa, 3e-4 for EAGLE-3,
    3e-5 for a draft). layers: a distilled draft's decoder layers trained, from the top.
    seed: the data order's seed. precision: the training steps' arithmetic, "auto", "bf16"
    or "fp32" (:func:`specdecode.train.loop.resolve_precision`). dataset: the Spec-Bench
    question.jsonl that no prompt may share an 8-word run with (None: the copy shipped
    inside specdecode)."""

    data: tuple[str, ...] = DEFAULT_SOURCES
    max_prompts: int | None = None
    max_new_tokens: int = 192
    epochs: int = 3
    heads: int = 3
    steps: int = 3
    draft_vocab: int = 8192
    intermediate_size: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    layers: int = 8
    seed: int = 0
    precision: str = "auto"
    dataset: str | None = None

    def prompts_for(self, kind: str) -> int:
        return self.max_prompts if self.max_prompts is not None else (400 if kind in ("draft", "pard") else 1000)

    def batch_for(self, kind: str) -> int:
        return self.batch_size if self.batch_size is not None else {"medusa": 64, "eagle3": 1, "draft": 4, "pard": 4}[kind]

    def lr_for(self, kind: str) -> float:
        return self.lr if self.lr is not None else {"medusa": 1e-3, "eagle3": 3e-4, "draft": 3e-5, "pard": 1e-4}[kind]

    def check(self) -> None:
        """Raises ValueError naming the first setting out of range (as its command-line option)."""
        parse_sources(",".join(self.data))  # (raises naming an unknown or repeated source)
        if self.dataset is not None:
            try:
                load_spec_bench(self.dataset)  # (raises naming the file and what it must hold)
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None
        for name, v, low, high in (("max-prompts", self.prompts_for("eagle3"), 2, 10**6),
                                   ("max-new-tokens", self.max_new_tokens, 2, 4096),
                                   ("epochs", self.epochs, 1, 1000), ("heads", self.heads, 1, 8),
                                   ("steps", self.steps, 1, 8), ("draft-vocab", self.draft_vocab, 1, 10**7),
                                   ("intermediate-size", 1 if self.intermediate_size is None
                                    else self.intermediate_size, 1, 10**6),
                                   ("batch-size", self.batch_for("eagle3"), 1, 65536),
                                   ("layers", self.layers, 1, 1000)):
            if not (isinstance(v, int) and low <= v <= high):
                raise ValueError(f"--{name} must be an integer {low}..{high}, got {v!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        lr = self.lr_for("eagle3")
        if not 0 < lr < 1:
            raise ValueError(f"--lr must be between 0 and 1, got {lr}")


# the default head's recipe (what the bench trains when a default head is missing)
DEFAULT_RECIPE = HeadRecipe()


def check_out(out: str | Path, kind: str, own: tuple[str, ...] = OWN_FILES) -> None:
    """Raises ValueError when the directory ``out`` holds files a ``kind`` ("medusa",
    "eagle3" or "draft") training run did not write (``own``: the names it writes; an earlier
    run's directory is resumed; anything else is the user's, never mixed in), or another
    kind's model (a run of another kind would resume its checkpoint)."""
    out = Path(out)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in own) if out.is_dir() else []
    if foreign:
        raise ValueError(f"--out {out} holds files of something else ({', '.join(foreign[:3])}): "
                         "give a new directory, or the --out of an earlier training run to resume it")
    config = out / "config.json"
    if not config.is_file():
        return  # no model there yet
    try:
        archs = json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"--out {out} holds a config.json that is not a model's: give a new "
                         "directory") from None
    holds = next((k for k, a in HEAD_ARCHS.items() if archs == [a]), "draft")
    if holds != kind:
        what = {**HEAD_NAMES, "draft": "a draft model"}
        raise ValueError(f"--out {out} holds {what[holds]} from an earlier run, not {what[kind]}: "
                         "give a new directory")


def is_trained(out: str | Path) -> bool:
    """Whether ``out`` holds a head whose run finished all its epochs (an interrupted run
    leaves a usable head of the epochs done, and a checkpoint to resume)."""
    state = Path(out) / "checkpoint" / STATE_FILE
    try:
        s = json.loads(state.read_text())
        return s["epoch"] >= s["epochs"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_default_head(kind: str, target: LoadedModel, log=None) -> Path:
    """The directory of ``target``'s default ``kind`` head
    (:func:`specdecode.heads.default_head_dir`), trained first with :data:`DEFAULT_RECIPE`
    when it is missing or its run unfinished (which resumes). Raises as :func:`train_head`."""
    out = default_head_dir(target.name, kind)
    if is_trained(out):
        return out
    with run_lock(out):  # (another process may have trained it meanwhile)
        if is_trained(out):
            return out
        print(f"{target.name} has no default {kind} head yet: training it now into {out} "
              f"(once; what `specdecode train {kind} --target {target.name}` does; {DEFAULT_HEAD_TIME} for "
              "the 1.5B default target on 2 cores; Ctrl-C stops it and the same command resumes)",
              file=log or sys.stderr)
        train_head(kind, target, out, DEFAULT_RECIPE, log=log)
    return out


_HELD_RUNS: set[str] = set()


@contextlib.contextmanager
def run_lock(out: Path):
    """Hold the lock of the training run writing into ``out`` (its checkpoint, recorded
    answers and model files): a second process training into the same directory waits,
    saying so, then resumes or finds the run done. Re-entrant within a process; not taken by
    the processes of a distributed launch (torchrun, accelerate: WORLD_SIZE > 1), which share
    one run by design."""
    key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]
    if key in _HELD_RUNS or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        yield
        return
    with registry.cache_lock(f"train-{key}", waiting=f"another process is training into {out}: "
                             "waiting for it to end (Ctrl-C stops waiting)"):
        _HELD_RUNS.add(key)
        try:
            yield
        finally:
            _HELD_RUNS.discard(key)


def train_head(kind: str, target: LoadedModel, out: str | Path, recipe: HeadRecipe | None = None,
               features: str | Path | None = None, log=None) -> dict:
    """Train a ``kind`` head ("medusa" or "eagle3") for ``target`` (native runtime) into the
    directory ``out``, resuming a run there; the target's answers and states go to
    ``features`` (default out/features; share it between runs of the same target and answer
    length). Prints its steps to ``log`` (default stderr) with progress bars. Returns the
    summary: ``history`` (per epoch: loss, held-out ``acceptance_length``), ``examples``,
    ``prompts``, ``held_out`` (sequences), ``recording_seconds`` (the answers' recording,
    by this run or an earlier one), ``prompts_recorded_now`` (by this run), ``training_seconds``.

    Raises ValueError for a bad kind or recipe, an ``out`` holding other files, or a target
    that cannot carry the head; KeyboardInterrupt on Ctrl-C after saving what was done (the
    same call resumes).
    """
    log = log or sys.stderr
    if kind not in KINDS:
        raise ValueError(f"head kind {kind!r} is not one of {list(KINDS)}")
    recipe = recipe or DEFAULT_RECIPE
    recipe.check()
    recipe = replace(recipe, max_prompts=recipe.prompts_for(kind))
    out = Path(out)
    with run_lock(out):
        check_out(out, kind)
        lm = target.lm
        if kind == "eagle3" and not aux_layers(getattr(getattr(lm, "args", None), "n_layers", 0)):
            raise ValueError(f"EAGLE-3 fuses three target layers; {target.name} has "
                             f"{getattr(getattr(lm, 'args', None), 'n_layers', '?')} (at least 7 needed)")
        train_seqs, held, info = _recorded(target, recipe, Path(features) if features else out / "features", log)
        task = (_medusa(target, recipe, train_seqs, held, info) if kind == "medusa"
                else _eagle3(target, recipe, train_seqs, held, info))
        return _train(task, out, recipe, kind, info, len(held))


def _recorded(target: LoadedModel, recipe: HeadRecipe, features: Path, log) -> tuple[list, list, dict]:
    """Steps 1 and 2: the prompts, and the target's answers and states recorded into
    ``features`` (resumed there). Returns (training sequences, held-out sequences, the
    run's info for the saved config)."""
    lm = target.lm
    t0 = time.perf_counter()
    # under `accelerate launch` (or torchrun with ACCELERATE_USE_CPU=true: several CPU
    # processes) one process records the answers and the others read them
    from accelerate import PartialState  # here: importing accelerate costs every CLI command
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # (Accelerator() reads it itself)

    def prompts_of_the_run():
        to_german = _german_writer(target, features) if "translation" in recipe.data else None
        return training_prompts(recipe.data, recipe.max_prompts, exclude=evaluation_runs(recipe.dataset),
                                to_german=to_german)

    if state.is_main_process:
        prompts, summary = prompts_of_the_run()
        counts = {s: v for s, v in summary.items() if isinstance(v, dict)}
        kept = ", ".join(f"{s}: {v['kept']}" for s, v in counts.items())
        dropped = sum(v["dropped_overlap"] for v in counts.values())
        print(f"{len(prompts)} prompts ({kept}; {dropped} dropped for an 8-word overlap with "
              "Spec-Bench or HumanEval)", file=log)
        known = set((read_manifest(features) or {}).get("done", []))
        record(target, prompts, features, max_new_tokens=recipe.max_new_tokens)
    state.wait_for_everyone()
    if not state.is_main_process:  # the same prompts; any German is read from what the first process wrote
        prompts, summary = prompts_of_the_run()
        known = {p.key for p in prompts}
    manifest = read_manifest(features)
    # this run's prompts only: a features directory may hold a larger run's too (--features)
    keys = {p.key for p in prompts}
    train_seqs, held = load_sequences(features, False, keys), load_sequences(features, True, keys)
    info = {"target": target.name, "target_weights": lm.weight_format,
            "data": {"sources": list(recipe.data), "prompts": summary,
                     "sequences": {"train": len(train_seqs), "held_out": len(held)},
                     "answer_tokens": sum(len(s.tokens) - s.start for s in train_seqs + held),
                     "max_new_tokens": recipe.max_new_tokens},
            "recipe": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(recipe).items()},
            "precision": resolve_precision(recipe.precision, state.device),
            "recording_seconds": recording_seconds(manifest, keys) if manifest else round(time.perf_counter() - t0, 1),
            "prompts_recorded_now": len(keys - known)}  # (0: all read from an earlier run's features)
    return train_seqs, held, info


GERMAN_FILE = "german.json"  # in a features directory: the target's German of each English sentence
ASK_GERMAN = "Translate English to German: "


def _german_writer(target: LoadedModel, features: Path):
    """The ``to_german`` of the translation source (:func:`specdecode.train.data.
    translation_prompts`): the target translates English sentences into German (greedy, a
    batch at a time, up to 96 tokens each; a reply cut there counts as none). Kept in
    ``features``/GERMAN_FILE, so that a resumed run (or another process of the run) asks the
    same prompts without writing them again."""
    path = features / GERMAN_FILE
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        known = {}
    if not (isinstance(known, dict) and all(isinstance(v, str) for v in known.values())):
        known = {}  # not a file this wrote: written again
    bar = tqdm(desc=f"German for the translation prompts ({target.name} writes it)", unit="sentence")

    def to_german(sentences: list[str]) -> list[str]:
        todo = [s for s in sentences if s not in known]
        if todo:
            results = generate(target, [ASK_GERMAN + s for s in todo], chat=True, max_new_tokens=96,
                               max_batch=len(todo))
            # a reply cut at the cap is a loop or a ramble, not a sentence's translation
            known.update({s: r.text if r.finish_reason != "length" else "" for s, r in zip(todo, results)})
            features.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(known, ensure_ascii=False, indent=0))
            os.replace(tmp, path)
        bar.update(len(sentences))
        return [known[s] for s in sentences]

    return to_german


def _train(task: Task, out: Path, recipe: HeadRecipe, kind: str, info: dict, held: int) -> dict:
    """Step 3, with the summary :func:`train_head` and :func:`train_draft` return."""
    t1 = time.perf_counter()
    result = train(task, out, epochs=recipe.epochs, batch_size=recipe.batch_for(kind),
                   lr=recipe.lr_for(kind), seed=recipe.seed, precision=recipe.precision)
    return {**result, "prompts": sum(v["kept"] for v in info["data"]["prompts"].values() if isinstance(v, dict)),
            "held_out": held,
            "recording_seconds": info["recording_seconds"], "prompts_recorded_now": info["prompts_recorded_now"],
            "training_seconds": round(time.perf_counter() - t1, 1)}


def default_draft_dir(target: str, draft: str, parallel: bool = False) -> Path:
    """Where ``specdecode train draft`` (``pard``: ``parallel``) writes without ``--out``:
    <specdecode cache>/drafts/DRAFT-for-TARGET (-pard-for- for a parallel draft; a directory's
    base name and a hash of its path for either)."""
    join = "-pard-for-" if parallel else "-for-"
    return registry.cache_dir() / "drafts" / f"{cache_name(str(draft))}{join}{cache_name(str(target))}"


def draft_out_files(source: Path) -> tuple[str, ...]:
    """The names a distillation or parallel-draft run writes into its output directory (for
    :func:`check_out`), for a draft in the model directory ``source``."""
    return OWN_FILES + WEIGHT_FILES + tuple(source_files(source))


def train_draft(target: LoadedModel, draft: str | Path, out: str | Path, recipe: HeadRecipe | None = None,
                features: str | Path | None = None, log=None, parallel: bool = False) -> dict:
    """Distil the draft model ``draft`` (a known name or model directory, loaded in fp32 by
    transformers) toward ``target`` (native runtime) on the target's answers
    (:mod:`specdecode.train.draft`), or with ``parallel`` adapt it into a parallel draft
    (:mod:`specdecode.train.pard`: a mask token, chains of 8 from one pass), into ``out``: a
    model directory, resuming a run there. ``recipe.layers`` top decoder layers are trained.
    Returns the summary of :func:`train_head`, with ``before``: the held-out measures of the
    draft as it was.

    Raises ValueError for a bad recipe, an ``out`` holding other files, a draft whose
    tokenizer is not the target's (both compare the two distributions token by token), or
    (parallel) one without a spare embedding row for the mask token; KeyboardInterrupt on
    Ctrl-C after saving what was done (the same call resumes).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or sys.stderr
    kind = "pard" if parallel else "draft"
    recipe = recipe or DEFAULT_RECIPE
    recipe.check()
    recipe = replace(recipe, max_prompts=recipe.prompts_for(kind))
    out = Path(out)
    source = float_model_path(draft)
    with run_lock(out):
        check_out(out, "draft", draft_out_files(source))
        tokenizer = AutoTokenizer.from_pretrained(source)
        if target.tokenizer is not None and pair_mode(target.tokenizer, tokenizer) != "same":
            raise ValueError(f"draft {draft!r} has another tokenizer than target {target.name!r}: training "
                             "matches the two distributions token by token, so it needs a draft of the "
                             f"target's own vocabulary (`specdecode check-pair {target.name} {draft}` shows the pair)")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        mask_id = mask_token_id(tokenizer, model.config.vocab_size) if parallel else None
        trained = trainable_layers(model, recipe.layers)
        train_seqs, held, info = _recorded(target, recipe, Path(features) if features else out / "features", log)
        saved = out / (PARD_FILE if parallel else DISTILL_FILE)  # a resumed run keeps the measures before
        before = json.loads(saved.read_text()).get("before", {}) if saved.exists() else {}
        info.update(draft=str(draft), layers_trained=recipe.layers,
                    parameters_trained=trained + (model.config.hidden_size if parallel else 0))
        if parallel:
            info.update(mask_token=mask_id, k=PARD_K, method="PARD (arXiv:2504.18583): conditional drop-token "
                        f"(keep max({PARD_KEEP}^s, {PARD_KEEP_MIN})), forward KL over the target's top-16")
            task = pard_task(model, source, mask_id, train_seqs, held, info, seed=recipe.seed)
        else:
            info["method"] = "DistillSpec (arXiv:2310.08461), forward KL over the target's top-16"
            task = draft_task(model, source, train_seqs, held, info)
        if held and not before:  # (the model is the source's here: a checkpoint loads in train())
            model.eval()
            before = task.evaluate(task.module)
            print("before: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()), file=log)
        info["before"] = before
        return {**_train(task, out, recipe, kind, info, len(held)), "before": before}


def _medusa(target, recipe: HeadRecipe, train_seqs, held, info) -> Task:
    lm = target.lm
    heads = MedusaHeads(lm.args.dim, lm.vocab_size, recipe.heads, 1,
                        lm_head=checkpoint_tensor(target, "lm_head.weight")[:lm.vocab_size])
    # over the ids the heads draft when served (methods.heads.loaded_head)
    first_ids = auto_draft_vocab(lm.args.vocab_size)
    return medusa_task(heads, train_seqs, held, {**info, "first_ids": first_ids}, first_ids)


def _eagle3(target, recipe: HeadRecipe, train_seqs, held, info) -> Task:
    """An EAGLE-3 head over the answers' most frequent tokens, its output layer and final
    norm started from the target's (the EAGLE-3 recipe's warm start), and its layer from
    the identity on the last captured state (fc selects it; o_proj and down_proj start at
    zero, as LoRA's B does), so that its first guesses are the target's own early exit."""
    lm = target.lm
    answers = [s.tokens[s.start:].long() for s in train_seqs]
    counts = torch.bincount(torch.cat(answers), minlength=lm.vocab_size) if answers else torch.zeros(lm.vocab_size)
    ids = draft_vocabulary(counts, min(recipe.draft_vocab, lm.vocab_size))
    head = Eagle3Head(lm.args, ids, checkpoint_tensor(target, "model.embed_tokens.weight")[:lm.vocab_size],
                      recipe.intermediate_size)
    with torch.no_grad():  # at the start the head's state is the last captured layer's
        head.lm_head.weight.copy_(checkpoint_tensor(target, "lm_head.weight")[ids])
        head.norm.weight.copy_(checkpoint_tensor(target, "model.norm.weight"))
        d = lm.args.dim
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * d:].copy_(torch.eye(d))
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    return eagle3_task(head, train_seqs, held, {**info, "draft_vocab_size": len(ids)}, steps=recipe.steps)
