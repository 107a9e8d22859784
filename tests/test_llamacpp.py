"""The llama.cpp backend (:class:`specdecode.models.llamacpp.LlamaCppLM`): its wrapper logic on a
fake C API whose toy logits we choose (always run), and on llama.cpp itself with the real
GGUF files (marker ``llamacpp``: `make test-llamacpp`, which installs the extra)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fake_llama_cpp as fake
from helpers import reference
from specdecode import cli
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.models import llamacpp
from specdecode.models.loading import load
from specdecode.proposers.draft_model import DraftModelProposer


@pytest.fixture
def lc(monkeypatch, tmp_path):
    """The fake C API in place of llama_cpp, and a file it loads."""
    m = fake.module()
    monkeypatch.setitem(sys.modules, "llama_cpp", m)
    monkeypatch.setattr(llamacpp, "_QUIET", [])
    m.gguf = tmp_path / "toy.gguf"
    m.gguf.write_bytes(b"GGUF toy")
    return m


def expected(prefix: list[int], rows: int) -> torch.Tensor:
    """The toy model's logits [1,rows,V] of the last ``rows`` positions of ``prefix``."""
    return torch.from_numpy(np.stack([fake.toy_logits(prefix[:i + 1])
                                      for i in range(len(prefix) - rows, len(prefix))]))[None]


def test_forward_returns_the_logits_of_the_last_rows_at_their_positions(lc):
    lm = llamacpp.LlamaCppLM(lc.gguf, threads=2)
    assert (lm.vocab_size, lm.max_context) == (fake.VOCAB, fake.N_CTX_TRAIN)
    assert lm.weight_format == "llama.cpp toy 1M Q4_K - Medium" and lm.weight_bytes == 123456
    lm.allocate(1, 64)
    ids = list(range(3, 13))
    assert lm.forward(torch.tensor([ids[:6]]), num_logits=0).shape == (1, 0, fake.VOCAB)
    out = lm.forward(torch.tensor([ids[6:]]))  # all rows
    assert lm.seq_len == 10
    assert torch.equal(out, expected(ids, 4))
    assert torch.equal(lm.forward(torch.tensor([[40, 41, 42]]), num_logits=2), expected(ids + [40, 41, 42], 2))


def test_prefill_longer_than_a_batch_is_chunked_with_the_same_logits(lc, monkeypatch):
    monkeypatch.setattr(llamacpp, "N_BATCH", 4)
    lm = llamacpp.LlamaCppLM(lc.gguf, threads=1)
    lm.allocate(1, 64)
    ids = [(7 * i) % fake.VOCAB for i in range(11)]
    assert torch.equal(lm.forward(torch.tensor([ids]), num_logits=6), expected(ids, 6))
    assert lc.decode_calls == [4, 4, 3]


def test_rollback_forgets_the_rejected_tail(lc):
    lm = llamacpp.LlamaCppLM(lc.gguf, threads=2)
    lm.allocate(1, 64)
    lm.forward(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    lm.rollback(3)
    assert lm.seq_len == 3
    assert torch.equal(lm.forward(torch.tensor([[9, 8]])), expected([1, 2, 3, 9, 8], 2))
    with pytest.raises(ValueError, match="cannot roll back to 6: cache holds 5"):
        lm.rollback(6)
    lm.allocate(1, 64)  # a new request starts from an empty cache
    assert lm.seq_len == 0 and torch.equal(lm.forward(torch.tensor([[9]])), expected([9], 1))


def test_a_longer_request_gets_a_larger_context_and_bad_sizes_are_refused(lc):
    lm = llamacpp.LlamaCppLM(lc.gguf, threads=2, n_ctx=32)
    lm.allocate(1, 300)
    assert lc.contexts[-1].n_ctx == 512 and lc.contexts[0].freed  # rounded up; old one freed
    with pytest.raises(ValueError, match="one sequence; got batch=2"):
        lm.allocate(2, 10)
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        lm.allocate(1, 2000)
    with pytest.raises(ValueError, match="one sequence; got 2 rows"):
        lm.forward(torch.zeros(2, 1, dtype=torch.long))
    lm.forward(torch.zeros(1, 500, dtype=torch.long), num_logits=0)
    with pytest.raises(ValueError, match="513 positions exceed the KV cache of 512"):
        lm.forward(torch.zeros(1, 13, dtype=torch.long))


def test_a_fork_has_its_own_cache_on_the_same_weights(lc):
    lm = llamacpp.LlamaCppLM(lc.gguf, threads=2)
    lm.allocate(1, 16)
    lm.forward(torch.tensor([[1, 2]]))
    f = lm.fork()
    f.allocate(1, 16)
    assert torch.equal(f.forward(torch.tensor([[5]])), expected([5], 1))
    assert lm.seq_len == 2 and f._model is lm._model
    assert torch.equal(lm.forward(torch.tensor([[3]])), expected([1, 2, 3], 1))


def test_a_file_llama_cpp_cannot_load_is_named_with_its_error(lc, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match=r"could not load .*bad\.gguf.*invalid magic"):
        llamacpp.LlamaCppLM(bad, threads=1)
    llamacpp._LOG.clear()
    lc.log_cb = lambda *a: None  # a failure llama.cpp logs nothing about
    with pytest.raises(ValueError, match=r"truncated\): llama.cpp gave no reason"):
        llamacpp.LlamaCppLM(bad, threads=1)


@pytest.mark.parametrize("k", [1, 4])
def test_engine_on_the_backend_draft_and_target_greedy_equals_plain_decoding(lc, k):
    """The chain through the backend: a draft of it proposing for a target of it (the toy
    model is row-independent, so speculative output must equal plain decoding)."""
    target = llamacpp.LlamaCppLM(lc.gguf, threads=2)
    params = SamplingParams(max_new_tokens=24)
    plain = reference(target, [1, 2, 3], params).token_ids
    gen = Engine(target, DraftModelProposer(target.fork()), k, debug=True).generate([1, 2, 3], params)
    gen.run()
    assert gen.token_ids == plain and len(plain) == 24
    assert gen.stats.num_accepted_tokens == gen.stats.num_draft_tokens > 0  # the same model drafts


def test_load_refuses_a_dtype_on_llama_cpp_and_a_missing_extra_says_how_to_install(lc, monkeypatch, capsys):
    with pytest.raises(ValueError, match="own quantization; dtype 'int8' cannot be chosen"):
        load(lc.gguf, dtype="int8", backend="llama.cpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the extra is not installed
    code = cli.main(["generate", "--prompt", "hi", "--method", "ar", "--backend", "llama.cpp",
                     "--target", str(lc.gguf), "--threads", "1"])
    assert code == 1 and "make llamacpp" in capsys.readouterr().err
    code = cli.main(["generate", "--prompt", "hi", "--draft-backend", "llama.cpp",
                     "--target", str(lc.gguf), "--draft", str(lc.gguf), "--threads", "1"])
    assert code == 1 and "draft" in capsys.readouterr().err


# --- llama.cpp itself (the extra), real GGUF files -----------------------------------------


@pytest.fixture(scope="module")
def real_draft():
    from specdecode.models import registry

    return load(registry.DEFAULT_DRAFT, backend="llama.cpp", role="draft", tokenizer=False)


@pytest.mark.llamacpp
@pytest.mark.real
def test_real_llama_cpp_draft_changes_nothing_in_the_q4_targets_output(real_draft):
    from specdecode.models import registry

    target = load(registry.DEFAULT_TARGET, tokenizer=False)
    prompt = [151644, 872, 198, 7985, 264, 13027, 729, 429, 12341, 369, 49433, 13, 151645, 198,
              151644, 77091, 198]  # a ChatML user turn asking for code, then the assistant's
    params = SamplingParams(max_new_tokens=40)
    plain = reference(target.lm, prompt, params, target.eos_token_ids).token_ids
    gen = Engine(target.lm, DraftModelProposer(real_draft.lm), 5, debug=True).generate(
        prompt, params, target.eos_token_ids)
    gen.run()
    assert gen.token_ids == plain
    assert gen.stats.acceptance_rate > 0.5  # the draft really drafts (same family, code)


@pytest.mark.llamacpp
@pytest.mark.real
def test_real_llama_cpp_one_token_passes_after_a_rollback_repeat_bit_for_bit(real_draft):
    lm = real_draft.lm.fork()
    lm.allocate(1, 64)
    ids = torch.arange(1000, 1020)[None]
    lm.forward(ids[:, :10], num_logits=0)
    first = torch.cat([lm.forward(ids[:, i:i + 1]) for i in range(10, 20)], 1)
    lm.rollback(10)
    again = torch.cat([lm.forward(ids[:, i:i + 1]) for i in range(10, 20)], 1)
    assert torch.equal(first, again)
    assert lm.weight_format.startswith("llama.cpp qwen2") and lm.vocab_size == 151936


@pytest.mark.llamacpp
@pytest.mark.real
def test_real_llama_cpp_decodes_a_json_task_under_its_own_grammar():
    """The bench's llama.cpp row on the json workload: llama.cpp's grammar of the schema
    (its JSON-schema converter) keeps its greedy answer valid against the schema."""
    import json

    import jsonschema

    from specdecode.bench import workloads
    from specdecode.bench.runners import BenchModels, build_runners, parse_methods
    from specdecode.models import registry

    models = BenchModels(registry.DEFAULT_TARGET, None, "auto", "auto", torch.device("cpu"))
    [(_, (run, _))] = build_runners(models, parse_methods("llamacpp-ar"), 0.0).items()
    task = workloads.load_json(1)[0]
    ids = workloads.prompt_ids(models.target().tokenizer, task, 0, [])
    out = run(ids, 200, task.request(0))
    text = models.target().tokenizer.decode(out.token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), workloads.FUNCTION_SCHEMA)
