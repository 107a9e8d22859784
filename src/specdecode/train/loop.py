"""The training loop every draft head shares, on Hugging Face ``accelerate``: the same code
runs in one process on this CPU and under ``accelerate launch`` on many GPUs or machines
(each process takes every n-th example of the epoch's permutation; gradients are averaged
by accelerate's data-parallel wrapper).

A :class:`Task` says what is trained (its module, examples, loss, held-out measure and how
it is saved); :func:`train` runs epochs over it and owns the run's state in ``out``:

- ``out/checkpoint/``: accelerate's state (module, optimizer, RNG) and ``trainer.json``
  (epoch, step within it, history), written at the end of every epoch and when the run is
  interrupted; a later call with the same ``out`` resumes from it, skipping the examples
  already seen in the epoch (the epoch's permutation is a function of the seed and epoch).
- after every epoch: the head itself, saved by the task into ``out`` (usable at once).

Ctrl-C (SIGINT) or SIGTERM during training finishes the current step, saves the checkpoint
and raises KeyboardInterrupt: at most one step is lost.
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from ..models import quant

STATE_FILE = "trainer.json"


@dataclass
class Task:
    """What a head's training needs from its kind.

    module: the trainable module. examples: the training examples (a list; ``collate`` turns
    a list of them into a batch: tensors, in dicts and lists, moved to the accelerator's device). loss(module, batch) -> scalar tensor. evaluate(module) ->
    dict of held-out measures (e.g. ``{"acceptance_length": 2.3}``), run on the main process
    after every epoch. save(module, out, info): write the head into ``out``; info is the
    run's summary (epochs, history, data) for its config.
    """

    module: nn.Module
    examples: list
    collate: Callable[[list], object]
    loss: Callable[[nn.Module, object], torch.Tensor]
    evaluate: Callable[[nn.Module], dict]
    save: Callable[[nn.Module, Path, dict], None]
    info: dict = field(default_factory=dict)


class _StopFlag:
    """SIGINT and SIGTERM (a batch system's, `timeout`'s, `kill`'s) set ``raised`` instead of
    interrupting mid-step (restored on exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.raised = False
        self._old = {s: signal.getsignal(s) for s in self.SIGNALS}
        try:
            for s in self.SIGNALS:
                signal.signal(s, self._handle)
        except ValueError:  # not the main thread: the signals cannot reach it anyway
            self._old = {}
        return self

    def _handle(self, signum, frame):
        if self.raised:  # a second one: stop now
            raise KeyboardInterrupt
        self.raised = True

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def _to(batch, device):
    """Tensors of a batch (nested in dicts, lists and tuples) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _check(name: str, value, low, kind=int):
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
            or not value >= low or (kind is float and not math.isfinite(value)):
        raise ValueError(f"{name}={value!r} is invalid; allowed: {'a number' if kind is float else 'an integer'} >= {low}")


PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """"bf16" or "fp32" for ``precision`` (one of PRECISIONS) on ``device``: "auto" is bf16
    on a CUDA device that supports it and on a CPU with bf16 arithmetic (AVX512-BF16 or
    AMX-BF16, where oneDNN's bf16 matrix products run about twice as fast as fp32's), fp32
    elsewhere (a CPU without them would emulate bf16, slower than fp32). Raises ValueError
    for another value."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    kind = torch.device(device).type
    if kind == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if kind == "cpu":
        return "bf16" if {"avx512_bf16", "amx_bf16"} & set(quant.cpu_flags()) else "fp32"
    return "fp32"


def train(task: Task, out: str | Path, *, epochs: int = 1, batch_size: int = 32, lr: float = 1e-3,
          seed: int = 0, precision: str = "fp32", progress: bool = True, accelerator=None) -> dict:
    """Train ``task.module`` for ``epochs`` epochs of ``task.examples`` in batches of
    ``batch_size`` examples (per process), AdamW at learning rate ``lr`` with a linear
    warm-up over the first 5 % of steps and cosine decay; resumes from ``out/checkpoint``
    when it exists (see the module docstring). Returns the summary: per-epoch mean
    training loss and held-out measures (``history``), steps, examples.

    accelerator: an ``accelerate.Accelerator`` (default: a new one: this CPU, or the devices
    ``accelerate launch`` gives). precision: the training steps' arithmetic
    (:func:`resolve_precision`): "bf16" runs the loss under ``torch.autocast`` to bfloat16
    (mixed precision: the weights, their gradients and AdamW's state stay fp32; softmax and
    the loss's reductions are fp32 by autocast's rules), "fp32" all in fp32; the held-out
    measures are always fp32. Raises ValueError for bad sizes, precision or no examples,
    KeyboardInterrupt after saving the checkpoint when interrupted.
    """
    from accelerate import Accelerator

    _check("epochs", epochs, 1)
    _check("batch_size", batch_size, 1)
    _check("lr", lr, 0.0, float)
    if not task.examples:
        raise ValueError("there are no training examples: record more prompts (--max-prompts) or "
                         "longer answers (--max-new-tokens)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    acc = accelerator or Accelerator()
    mixed = resolve_precision(precision, acc.device) == "bf16"
    n = len(task.examples)
    per_epoch = math.ceil(math.ceil(n / acc.num_processes) / batch_size)
    total = per_epoch * epochs
    module = task.module
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    warm = max(1, total // 20)

    def schedule(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    module, opt, sched = acc.prepare(module, opt, sched)
    state = {"epoch": 0, "step": 0, "history": [], "epochs": epochs, "batch_size": batch_size,
             "lr": lr, "seed": seed, "examples": n}
    if (ckpt / STATE_FILE).exists():
        saved = json.loads((ckpt / STATE_FILE).read_text())
        for k in ("batch_size", "seed", "examples"):
            if saved.get(k) != state[k]:
                raise ValueError(f"{ckpt} is from a run with {k}={saved.get(k)!r}, this one has "
                                 f"{state[k]!r}: use the same settings to resume, or another --out")
        acc.load_state(str(ckpt))
        state.update({k: saved[k] for k in ("epoch", "step", "history")})
        if progress and acc.is_main_process:
            print(f"{out} is already trained for {epochs} epochs: nothing to do (another --out, or "
                  "more --epochs in a new --out, trains again)" if state["epoch"] >= epochs else
                  f"resuming from {ckpt}: epoch {state['epoch'] + 1}, step {state['step']}")

    def save_checkpoint():
        acc.wait_for_everyone()
        acc.save_state(str(ckpt))
        if acc.is_main_process:
            tmp = ckpt / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps(state, indent=1) + "\n")
            os.replace(tmp, ckpt / STATE_FILE)

    with _StopFlag() as stop:
        while state["epoch"] < epochs:
            epoch = state["epoch"]
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
            mine = perm[acc.process_index::acc.num_processes]
            bar = tqdm(total=per_epoch, initial=state["step"], desc=f"epoch {epoch + 1}/{epochs}",
                       unit="step", disable=not (progress and acc.is_main_process))
            losses = state.setdefault("epoch_losses", [])
            module.train()
            while state["step"] < per_epoch:
                s = state["step"]
                batch = task.collate([task.examples[i] for i in mine[s * batch_size:(s + 1) * batch_size]])
                batch = _to(batch, acc.device)
                with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=mixed):
                    loss = task.loss(module, batch)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
                state["step"] += 1
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                if stop.raised:
                    bar.close()
                    save_checkpoint()
                    raise KeyboardInterrupt(f"stopped at epoch {epoch + 1}, step {state['step']}: "
                                            "run the same command again to resume")
            bar.close()
            module.eval()
            raw = acc.unwrap_model(module)
            with torch.no_grad():
                measures = task.evaluate(raw) if acc.is_main_process else {}
            state["history"].append({"epoch": epoch + 1, "loss": sum(losses) / len(losses), **measures})
            state.update(epoch=epoch + 1, step=0, epoch_losses=[])
            if progress and acc.is_main_process:
                print("epoch {epoch}: loss {loss:.4f}".format(**state["history"][-1])
                      + "".join(f", {k} {v:.3f}" for k, v in measures.items()))
            if acc.is_main_process:
                task.save(raw, out, {**task.info, "epochs": state["epoch"], "history": state["history"]})
            save_checkpoint()
    return {"history": state["history"], "steps": total, "examples": n}
