"""Devices: ``load(device=)`` and ``--device``, the model as the device boundary, and the
row-exactness probe that guards speculation off the CPU. They run on the CPU (no accelerator
is needed: a model on another device is stood for by one that says so); a lent GPU runs
``benchmarks/device_check.py``."""

from __future__ import annotations

import pytest
import torch

import specdecode
from helpers import MockLM, hashed_logits, tiny_model
from specdecode import cli
from specdecode.methods import build_proposer, speculative_config
from specdecode.models import loading
from specdecode.models.base import lm_device, rows_exact
from specdecode.models.loading import LoadedModel, parse_device
from tiny_dirs import tiny_dirs_in


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs_in(tmp_path_factory)


class WidthDependent(MockLM):
    """Logits that move with the number of tokens in the pass, as an accelerator GEMM whose
    kernel changes with the row count may make them."""

    def forward(self, input_ids, num_logits=None):
        return super().forward(input_ids, num_logits) + input_ids.shape[1] * 1e-6


def test_rows_exact_holds_on_the_integer_kernels_and_catches_rows_that_move():
    assert rows_exact(tiny_model(0, int8="kn")) and rows_exact(tiny_model(0, int8="nk"))
    assert rows_exact(MockLM(32, hashed_logits(32)))
    # fp32 through PyTorch's GEMM: not row-exact even on the CPU (the README says float
    # targets' speculative output equals their plain decoding up to rounding)
    assert not rows_exact(tiny_model(0))
    assert not rows_exact(WidthDependent(32, hashed_logits(32)))
    with pytest.raises(ValueError, match="needs 17 positions"):
        rows_exact(MockLM(32, hashed_logits(32), max_context=10))


def test_off_the_cpu_the_heads_and_the_quantized_self_draft_are_refused():
    lm = MockLM(32, hashed_logits(32))
    lm.device = torch.device("meta")  # stands for an accelerator
    assert lm_device(lm).type == "meta" and lm_device(MockLM(32, hashed_logits(32))).type == "cpu"
    target = LoadedModel(lm=lm, name="t", rows_exact=False)
    assert build_proposer(speculative_config("ar", False), target, None) is None
    assert build_proposer(speculative_config("prompt-lookup", False), target, None) is not None
    for method in ("eagle3", "medusa", "self-draft"):
        with pytest.raises(ValueError, match=f"method '{method}' runs on the CPU only"):
            build_proposer(speculative_config(method, False), target, None)


def test_a_device_this_machine_lacks_is_one_clear_error(dirs, capsys):
    for bad, words in (("cuda:99", "no cuda device|has 1 cuda|has [0-9]+ cuda"), ("gpu", "invalid.*e.g. cpu, cuda"),
                       ("cpu:1", "one CPU device")):
        with pytest.raises(ValueError, match=words):
            parse_device(bad)
        with pytest.raises(ValueError, match=words):  # before anything loads
            specdecode.generate(dirs["target"], "hi", device=bad, max_new_tokens=2)
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--target", str(dirs["target"]), "--prompt", "hi", "--device", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --device" in err and bad in err and "Traceback" not in err
    with pytest.raises(ValueError, match="device=1.5 is invalid: give a string"):
        parse_device(1.5)
    assert parse_device(None) == parse_device("cpu") == torch.device("cpu")
    # a loaded model stays where it is: another device= is an error, not ignored
    loaded = specdecode.load(dirs["target"])
    for bad in ("cuda", "bogus", 1.5):
        with pytest.raises(ValueError, match="device"):
            specdecode.generate(loaded, "hi", device=bad, max_new_tokens=2)
    assert specdecode.generate(loaded, "hi", device="cpu", max_new_tokens=2).token_ids
    on_cpu = specdecode.load(dirs["target"], device="cpu")
    assert lm_device(on_cpu.lm).type == "cpu" and on_cpu.rows_exact is None  # the kernels' tests prove it


def test_off_the_cpu_the_cpu_formats_are_refused_and_auto_is_float32(dirs, monkeypatch):
    monkeypatch.setattr(loading, "parse_device", lambda device: torch.device("meta"))
    for kw, words in ((dict(dtype="int8"), "dtype int8 runs on the CPU only"),
                      (dict(dtype="q4"), "dtype q4 runs on the CPU only"),
                      (dict(backend="llama.cpp"), "the llama.cpp backend runs on the CPU only")):
        with pytest.raises(ValueError, match=f"{words}.*float32, bfloat16 or float16"):
            specdecode.load(dirs["target"], device="meta", **kw)
    # auto: float32, the weights moved there (meta holds no values: the row probe, which
    # needs real numbers, is stood for), and rows that move are said once, at load
    probed = []
    monkeypatch.setattr(loading, "rows_exact", lambda lm: probed.append(lm.weight_format) or False)
    with pytest.warns(UserWarning, match="on meta, .*verify passes do not give each row .*up to that rounding"):
        loaded = specdecode.load(dirs["target"], device="meta")
    assert probed == ["float32"] and loaded.rows_exact is False and lm_device(loaded.lm).type == "meta"
