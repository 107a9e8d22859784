"""Real models (fetched by `make models` / `specdecode models fetch`): SmolLM2-135M as its own
draft, and the default Qwen2.5-Coder pair, against plain greedy decoding."""

import random

import pytest
import torch
import transformers

from gguf import GGUFReader, dequantize

import specdecode
from specdecode.models import quant, registry
from specdecode.models.loading import float_model_path
from specdecode.text import IncrementalDetokenizer

pytestmark = pytest.mark.real
Q4K = quant.q4k_kernel()[0] is not None  # the AVX512-VNNI or the AVX2 kernel: q4 / int4


@pytest.fixture(scope="module")
def smollm2():
    return specdecode.load("smollm2-135m-instruct")


def test_smollm2_plain_decoding_equals_transformers_generate():
    fp32 = specdecode.load("smollm2-135m-instruct", dtype="float32")
    prompt_ids = fp32.tokenizer.encode("The three primary colours are")
    ours = specdecode.generate(fp32, input_ids=prompt_ids, method="ar", max_new_tokens=40,
                               eos_token_id=[])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        float_model_path("smollm2-135m-instruct"), dtype=torch.float32)  # transformers' GGUF reading
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt_ids):].tolist()


def test_gemma3_past_its_sliding_window():
    """Gemma 3 (the native runtime) past its 512-token window: plain decoding in fp32 equals
    transformers' own generate on the file's fp32 conversion, and the lookup methods, whose
    rollbacks cross the window, equal plain decoding on the quantized model."""
    text = "".join(f"Item {i}: the {'red' if i % 3 else 'blue'} box holds {i * 7 % 13} apples.\n"
                   for i in range(90))
    fp32 = specdecode.load("gemma3-270m", dtype="float32")
    ids = fp32.tokenizer.encode(text)
    assert len(ids) > 700
    ours = specdecode.generate(fp32, input_ids=ids, method="ar", max_new_tokens=24, eos_token_id=[])
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_model_path("gemma3-270m"),
                                                           dtype=torch.float32)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    assert ours.token_ids == out[0, len(ids):].tolist()
    q = specdecode.load("gemma3-270m")
    ar = specdecode.generate(q, input_ids=ids, method="ar", max_new_tokens=32, eos_token_id=[])
    for method in ("prompt-lookup", "suffix"):
        spec = specdecode.generate(q, input_ids=ids, method=method, max_new_tokens=32, eos_token_id=[])
        assert spec.token_ids == ar.token_ids, method
        stats = spec.stats  # tokens accepted, and rejected ones rolled back past the window
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, method


@pytest.mark.parametrize("k", [3, 8])
def test_smollm2_as_its_own_draft(smollm2, k):
    prompt = "Write a short story about a robot who learns to paint."
    ar = specdecode.generate(smollm2, prompt, chat=True, method="ar", max_new_tokens=96)
    spec = specdecode.generate(smollm2, prompt, chat=True, method="draft", draft=smollm2, max_new_tokens=96,
                               num_speculative_tokens=k, debug=True)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.num_draft_tokens > 0
    # every full round emits K+1 tokens
    assert spec.stats.num_verify_passes == -(-len(spec.token_ids) // (k + 1))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", registry.DEFAULT_TARGET])
def test_streamed_text_of_real_tokenizers_equals_one_decode(name):
    """The incremental detokenizer on the real tokenizers (byte-level BPE of SmolLM2 and
    Qwen2.5): random ids, many of them lone bytes of multi-byte characters, and a
    multilingual text, fed one id and several at a time, give the text of one decode."""
    tok = transformers.AutoTokenizer.from_pretrained(registry.fetch(name, progress=False))
    rng = random.Random(0)
    text = "Xin chào thế giới 🌍🚀 你好世界 naïve café 👩‍👩‍👧 def f(x):\n    return x  # ổ ữ ặ"
    for ids in ([rng.randrange(len(tok)) for _ in range(400)], tok.encode(text)):
        for block in (1, 5):
            detok = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=True))
            pieces = [detok.add(ids[i:i + block]) for i in range(0, len(ids), block)]
            full = tok.decode(ids, skip_special_tokens=True)
            assert "".join(pieces) == full.rstrip("\ufffd") and full.startswith("".join(pieces))


@pytest.fixture(scope="module")
def qwen_pair():
    return specdecode.load_pair(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT)


@pytest.mark.parametrize("prompt", [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
])
def test_default_qwen_pair_equals_greedy(qwen_pair, prompt):
    target, draft = qwen_pair
    assert target.lm.vocab_size == 151936 and draft.lm.vocab_size == 151936
    ar = specdecode.generate(target, prompt, chat=True, method="ar", max_new_tokens=32)
    spec = specdecode.generate(target, prompt, chat=True, method="draft", draft=draft, max_new_tokens=32,
                               debug=True)
    assert spec.token_ids == ar.token_ids
    assert len(spec.token_ids) == 32 or spec.finish_reason == "stop"
    assert spec.stats.acceptance_rate > 0.3  # a real draft of the same family, not noise
    # no method named: the default method (the hybrid), its draft judged by the clock
    default = specdecode.generate(target, prompt, chat=True, draft=draft, max_new_tokens=32, debug=True)
    assert default.token_ids == ar.token_ids


def test_the_default_target_fills_a_middle_and_stops_at_the_gap(qwen_pair):
    """The default (instruct) target's GGUF names only <|im_end|> as EOS; it ends a middle
    with <|endoftext|>, one of the FIM stops (llama.cpp's end of generation): the request
    ends there with the middle as its text, the same with the hybrid."""
    target, draft = qwen_pair
    prefix = "def is_even(n):\n    "
    suffix = "\n\nprint(is_even(4))\n"
    plain = specdecode.generate(target, prefix, suffix=suffix, method="ar", max_new_tokens=48)
    assert plain.finish_reason == "stop" and "return" in plain.text and "<|" not in plain.text
    assert target.tokenizer.convert_ids_to_tokens(plain.token_ids[-1]) in ("<|endoftext|>", "<|fim_pad|>",
                                                                          "<|file_sep|>")
    hybrid = specdecode.generate(target, prefix, suffix=suffix, draft=draft, max_new_tokens=48)
    assert hybrid.token_ids == plain.token_ids


@pytest.mark.parametrize("role", ["target", "draft"])
def test_default_models_verify_rows_equal_one_token_passes_bit_for_bit(qwen_pair, role):
    """The lossless property on the real kernels at the real shapes (Qwen2.5-Coder 1.5B and
    0.5B, in the dtypes and layouts load() picks: q4 and int4, whose linears of 896 inputs
    are padded to 1024): after a 600-token prompt (a chunked prefill), each row of a verify
    pass of 2, 5, 9 and 17 tokens equals the one-token pass at its position."""
    lm = qwen_pair[0 if role == "target" else 1].lm
    if Q4K:
        kind = "q4" if role == "target" else "int4"
        assert lm.weight_format == f"{kind}-{quant.best_layout(role)}"
    else:  # int8 on torch._int_mm (a CPU without AVX2)
        assert lm.weight_format == "int8-kn"
    seq = torch.randint(0, 151000, (1, 640), generator=torch.Generator().manual_seed(0))
    lm.allocate(1, 700)
    lm.forward(seq[:, :600], num_logits=0)
    singles = torch.cat([lm.forward(seq[:, i:i + 1])[0] for i in range(600, 617)])
    for n in (17, 9, 5, 2):
        lm.rollback(600)
        assert torch.equal(lm.forward(seq[:, 600:600 + n])[0], singles[:n]), n


def test_default_target_keeps_the_gguf_q4k_blocks(qwen_pair):
    """q4: the Q4_K linears of the default target dequantize exactly to the GGUF file's
    tensors as the gguf package dequantizes them (what transformers converts; layer 0 and
    the last layer), the rest is int8, and nothing was converted to float on the way."""
    if not Q4K:  # q4 runs on the AVX512-VNNI or the AVX2 kernel only: refused, saying so
        with pytest.raises(ValueError, match="VNNI"):
            specdecode.load(registry.DEFAULT_TARGET, dtype="q4")
        return
    lm = qwen_pair[0].lm
    q4 = {n: m for n, m in lm.named_modules() if isinstance(m, quant.Q4KLinear)}
    assert len(q4) > 100 and isinstance(lm.lm_head, quant.Int8Linear)  # output.weight is Q6_K
    assert not list(qwen_pair[0].path.glob("*.safetensors"))
    assert not registry.converted_path_for_gguf(registry.gguf_path(registry.DEFAULT_TARGET)).exists()
    names = {"attn_q": "self_attn.q_proj", "attn_v": "self_attn.v_proj", "ffn_up": "mlp.up_proj"}
    checked = 0
    for t in GGUFReader(registry.gguf_path(registry.DEFAULT_TARGET)).tensors:
        _, layer, kind, _ = (t.name.split(".") + ["", "", "", ""])[:4]
        if layer in ("0", "27") and kind in names and t.tensor_type.name == "Q4_K":
            expected = torch.from_numpy(dequantize(t.data, t.tensor_type))
            assert torch.equal(q4[f"model.layers.{layer}.{names[kind]}"].weight(), expected), t.name
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_smollm2_seeded_sampling_is_the_same_whatever_speculates(smollm2, temperature):
    """Seeded output that no proposer can change (docs/testing.md), on a real model: a
    seeded sampled request gives plain sampling's token ids with every method, K schedule
    and session state; the draft is the same model quantized to int4 (other logits: it
    agrees often, not always)."""
    # int4 needs a Q4_K kernel; elsewhere the float model drafts for the int8 one
    draft = specdecode.load("smollm2-135m-instruct", dtype="int4" if Q4K else "float32", role="draft")
    prompt = "List five fruits and say one thing about each."
    common = dict(chat=True, max_new_tokens=64, temperature=temperature, seed=11)
    plain = specdecode.generate(smollm2, prompt, method="ar", **common)
    runs = {
        "draft K=4": dict(method="draft", draft=draft, num_speculative_tokens=4),
        "draft auto": dict(method="draft", draft=draft, num_speculative_tokens="auto"),
        "prompt-lookup": dict(method="prompt-lookup"),
        "suffix session": dict(method="suffix", suffix_cache="session"),
        "hybrid": dict(method="hybrid", draft=draft),
    }
    accepted = {}
    for label, kw in runs.items():
        r = specdecode.generate(smollm2, prompt, **common, **kw)
        assert r.token_ids == plain.token_ids and r.text == plain.text, label
        accepted[label] = r.stats.num_accepted_tokens
    again = specdecode.generate(smollm2, prompt, **common, **runs["suffix session"])  # a fuller cache
    assert again.token_ids == plain.token_ids
    assert accepted["draft K=4"] > 10


def test_default_pair_behind_the_server_equals_solo_runs(qwen_pair):
    """The server test with the default pair: four concurrent streamed chat
    requests (hybrid, draft, prompt lookup, plain) through the OpenAI client each equal the
    request run alone in-process; usage counts what was delivered."""
    import asyncio

    import openai

    from specdecode.server import Metrics, Worker, create_app, serve_in_thread

    target, draft = qwen_pair
    cases = [("hybrid", "Write a Python function that reverses a list."),
             ("draft", "What is a closure in Python? Two sentences."),
             ("prompt-lookup", "Repeat after me: the quick brown fox jumps over the lazy dog."),
             ("ar", "Name three sorting algorithms.")]
    want = [specdecode.generate(target, [{"role": "user", "content": p}], method=m,
                                draft=draft if m in ("draft", "hybrid") else None, max_new_tokens=24)
            for m, p in cases]
    worker = Worker(lambda: qwen_pair, Metrics("qwen"), 8, 4, 1024)
    uv, port = serve_in_thread(create_app(worker, "qwen", "hybrid"))
    worker.start()
    try:
        assert worker.ready.wait(300), worker.error
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                    timeout=300)

        async def one(method, prompt):
            stream = await client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"method": method})
            chunks = [c async for c in stream]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

        async def main():
            return await asyncio.gather(*(one(m, p) for m, p in cases))

        got = asyncio.run(main())
    finally:
        worker.stop()
        uv.should_exit = True
        worker._thread.join(60)  # its batch released the target for the other tests
    for (method, _), w, (text, usage) in zip(cases, want, got):
        assert text == w.text, method
        eos = w.finish_reason == "stop" and w.token_ids[-1] in target.eos_token_ids
        assert usage.completion_tokens == len(w.token_ids) - eos, method


@pytest.mark.parametrize("draft_name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_drafts_of_another_tokenizer_equal_greedy(qwen_pair, draft_name):
    """Drafts of another tokenizer on the real tokenizers: SmolLM2 (49,152 tokens, ChatML) and Gemma 3 (262,144,
    SentencePiece with byte fallback, a BOS; the transformers adapter runs its architecture)
    draft for the default target through text: greedy output equal to plain decoding, on a
    chat prompt and on code; and the drafts are accepted (they are real models)."""
    target = qwen_pair[0]
    draft = specdecode.load(draft_name, role="draft")
    assert specdecode.check_compatible(target, draft) == "cross"
    accepted = 0
    for prompt, chat in (("Write a Python function that returns the n-th Fibonacci number.", True),
                         ("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", False)):
        ar = specdecode.generate(target, prompt, chat=chat, method="ar", max_new_tokens=40)
        spec = specdecode.generate(target, prompt, chat=chat, method="draft", draft=draft, max_new_tokens=40,
                                   debug=True)
        assert spec.token_ids == ar.token_ids and spec.text == ar.text
        accepted += spec.stats.num_accepted_tokens
    assert accepted > 10
