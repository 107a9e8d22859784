"""Tests of the Python API (specdecode.generate / stream / load / load_pair) with a real
tokenizer (a byte-level BPE trained here with ChatML special tokens and a chat template, the
shape of SmolLM2's and Qwen2.5's: :func:`helpers.local_tokenizer`; no download).

Models: tiny random Llama decoders saved as Hugging Face directories with that tokenizer
(built once per session, a few MB each), and ``MockLM`` models whose logits force an exact
token script, so that the output is exactly the tokens of a chosen text (multi-byte UTF-8,
stop strings, EOS at chosen positions). No real model weights are loaded.
The fault kinds covered here (docs/testing.md): events inside an accepted block (stop
strings, EOS, length), vocabularies and tokenizers, streaming; plus argument validation and
model loading.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import sys

import pytest
import torch

import specdecode
from specdecode import IncompatibleDraftError, LoadedModel, check_compatible
from specdecode.methods import DEFAULT_METHOD, Method, SpeculativeConfig, build_proposer, build_schedule, speculative_config
from specdecode.proposers import CrossTokenizerProposer, DraftModelProposer
from specdecode.models import registry
from specdecode.api import GenerationResult, StreamChunk
from specdecode.models import HFCausalLM, resolve_model_path
from specdecode.stats import SpecDecodingStats

from helpers import MockLM, local_tokenizer
from tiny_dirs import (ASCII_TEXT, EOS, PROMPT, UNICODE_TEXT, VOCAB, WIDE_VOCAB, tiny_dirs_in,
                       write_tiny_gguf)


def _fewer_page_faults() -> None:
    """Keep freed memory in the heap instead of returning it to the OS after every step.

    Each decode step allocates a few [1, V] fp32 tensors; with glibc's default mmap
    threshold every one of them is a fresh mmap, and on some VMs page faults are so slow that
    this alone makes a 40-token generation of a 2-layer toy model take seconds. Speed only."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        except (OSError, AttributeError):
            pass


_fewer_page_faults()

# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def tok():
    return local_tokenizer()


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    return tiny_dirs_in(tmp_path_factory)


@pytest.fixture(scope="module")
def target(dirs):
    return specdecode.load(dirs["target"])


@pytest.fixture(scope="module")
def draft(dirs):
    return specdecode.load(dirs["draft"])


def scripted(tok, script: list[int], prompt_len: int, wrong=lambda i: False, after: int = EOS,
             name: str = "mock", eos=(EOS,)) -> LoadedModel:
    """A LoadedModel whose greedy continuation of any ``prompt_len``-token prompt is
    ``script`` and then ``after`` forever. ``wrong(i)``: position i gets a wrong token
    instead (for drafts: rejected there)."""
    def logits_fn(tokens):
        i = len(tokens) - prompt_len  # index of the token these logits predict
        nxt = script[i] if 0 <= i < len(script) else after
        if wrong(i):
            nxt = (nxt + 7) % VOCAB
        out = torch.zeros(VOCAB)
        out[nxt] = 10.0
        return out

    return LoadedModel(lm=MockLM(VOCAB, logits_fn), tokenizer=tok, name=name, eos_token_ids=eos)


def every(n: int, offset: int = 0):
    return lambda i: i % n == offset


def collect(chunks) -> tuple[list[StreamChunk], GenerationResult]:
    chunks = list(chunks)
    assert [c.result is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    return chunks, chunks[-1].result


def check_stream(chunks: list[StreamChunk], result: GenerationResult) -> None:
    """The stream's text and token ids concatenate to the result's."""
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert all(isinstance(c.text, str) for c in chunks)


class Recorder:
    """Wraps a CausalLM, keeping what its KV cache holds (``cache``) and every forward's input."""

    def __init__(self, lm):
        self.lm = lm
        self.cache: list[int] = []
        self.forwards: list[list[int]] = []

    vocab_size = property(lambda self: self.lm.vocab_size)
    max_context = property(lambda self: self.lm.max_context)
    seq_len = property(lambda self: self.lm.seq_len)

    def allocate(self, batch, max_len):
        self.lm.allocate(batch, max_len)
        self.cache, self.forwards = [], []

    def forward(self, input_ids, num_logits=None):
        self.cache += input_ids[0].tolist()
        self.forwards.append(input_ids[0].tolist())
        return self.lm.forward(input_ids, num_logits)

    def rollback(self, length):
        self.lm.rollback(length)
        del self.cache[length:]

    def fork(self):
        return Recorder(self.lm.fork())


# --------------------------------------------------------------------------- prompts, results

def test_text_prompt_result_fields(target, tok):
    r = specdecode.generate(target, PROMPT, max_new_tokens=12)
    assert isinstance(r, GenerationResult)
    assert r.prompt_token_ids == tok.encode(PROMPT)
    assert len(r.token_ids) == 12 and all(isinstance(t, int) and 0 <= t < VOCAB for t in r.token_ids)
    assert r.finish_reason == "length"
    # cut by max_new_tokens: a character whose last bytes were not generated is dropped
    assert r.text == tok.decode(r.token_ids, skip_special_tokens=True).rstrip("\ufffd") and r.text
    assert isinstance(r.stats, SpecDecodingStats)
    assert r.stats.num_generated_tokens == 12 and r.stats.num_draft_tokens == 0  # no draft: plain decoding
    d = r.to_dict()
    assert d["text"] == r.text and d["token_ids"] == r.token_ids and d["finish_reason"] == "length"
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
            "mean_acceptance_length", "tokens_per_second"} <= set(d["stats"])
    json.dumps(d)  # serializable


def test_chat_prompt_ids_follow_the_chat_template(target, tok):
    messages = [{"role": "user", "content": PROMPT}]
    expected = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n") and expected == tok.encode(rendered)

    chat_text = specdecode.generate(target, PROMPT, chat=True, max_new_tokens=8)
    assert chat_text.prompt_token_ids == expected
    chat_list = specdecode.generate(target, messages, max_new_tokens=8)
    assert chat_list.prompt_token_ids == expected and chat_list.token_ids == chat_text.token_ids
    by_ids = specdecode.generate(target, input_ids=expected, max_new_tokens=8)
    assert by_ids.token_ids == chat_text.token_ids and by_ids.prompt_token_ids == expected
    plain = specdecode.generate(target, PROMPT, max_new_tokens=8)
    assert plain.prompt_token_ids == tok.encode(PROMPT) != expected

    system = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    r = specdecode.generate(target, system, max_new_tokens=4)
    assert r.prompt_token_ids == list(tok.apply_chat_template(system, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))
    assert "You are terse." in tok.decode(r.prompt_token_ids)


def test_input_ids_accepts_lists_and_tensors(target, tok):
    ids = tok.encode(PROMPT)
    ref = specdecode.generate(target, input_ids=ids, max_new_tokens=6).token_ids
    assert specdecode.generate(target, input_ids=torch.tensor(ids), max_new_tokens=6).token_ids == ref
    assert specdecode.generate(target, input_ids=torch.tensor([ids]), max_new_tokens=6).token_ids == ref
    assert specdecode.generate(target, PROMPT, max_new_tokens=6).token_ids == ref
    with pytest.raises(ValueError, match="2 prompts"):
        specdecode.generate(target, input_ids=torch.tensor([ids, ids]), max_new_tokens=6)


# --------------------------------------------------------------------------- aliases, greedy equality

def test_speculative_greedy_equals_plain_decoding_with_transformers_aliases(target, draft):
    ar = specdecode.generate(target, PROMPT, method="ar", max_new_tokens=40)
    assert ar.stats.num_draft_tokens == 0 and len(ar.token_ids) == 40
    variants = {
        "draft": dict(method="draft", draft=draft),
        "assistant_model": dict(method="draft", assistant_model=draft),
        "draft+K3": dict(method="draft", draft=draft, num_speculative_tokens=3),
        "assistant+num_assistant_tokens3": dict(method="draft", assistant_model=draft, num_assistant_tokens=3),
        "do_sample=False beats temperature": dict(method="draft", draft=draft, do_sample=False, temperature=0.7, seed=5),
        "path strings": dict(draft=str(draft.path), method="draft"),
    }
    results = {}
    for name, kwargs in variants.items():
        r = specdecode.generate(target, PROMPT, max_new_tokens=40, **kwargs)
        assert r.token_ids == ar.token_ids and r.text == ar.text, name
        assert r.stats.num_draft_tokens > 0, name  # really speculated
        assert 0 < r.stats.num_accepted_tokens < r.stats.num_draft_tokens, name  # accepts and rejects
        results[name] = r
    for name in ("draft+K3", "assistant+num_assistant_tokens3"):
        s = results[name].stats
        assert len(s.accepted_per_position) == 3 and s.num_draft_tokens <= 3 * s.num_drafts
    assert len(results["draft"].stats.accepted_per_position) == specdecode.METHODS['draft'].default_k
    a, b = results["draft+K3"].stats, results["assistant+num_assistant_tokens3"].stats
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == \
        (b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens)
    # a draft and no method named: the default method (the hybrid), the same output
    assert speculative_config(None, True).method is DEFAULT_METHOD is Method.HYBRID
    default = specdecode.generate(target, PROMPT, assistant_model=draft, max_new_tokens=40)
    assert default.token_ids == ar.token_ids
    # method="ar" with a draft is refused, not ignored (it was ignored)
    with pytest.raises(ValueError, match="not 'ar'"):
        specdecode.generate(target, PROMPT, draft=draft, method="ar", max_new_tokens=40)
    # do_sample=False alone is greedy too
    assert specdecode.generate(target, PROMPT, do_sample=False, max_new_tokens=40).token_ids == ar.token_ids


@pytest.mark.parametrize("kwargs", [
    dict(method="prompt-lookup"),
    dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2),
    dict(method="suffix", num_speculative_tokens="heuristic"),
    dict(method="hybrid", draft_p_min=0.2),
    dict(method="draft", num_speculative_tokens="heuristic", max_speculative_tokens=5),
    dict(method="draft", assistant_confidence_threshold=0.3),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_every_method_and_k_option_equals_plain_decoding(target, draft, kwargs):
    prompt = "one two three one two three one two three one two"
    ar = specdecode.generate(target, prompt, method="ar", max_new_tokens=40)
    with_draft = {"draft": draft} if kwargs.get("method") in ("draft", "hybrid") else {}
    r = specdecode.generate(target, prompt, max_new_tokens=40, debug=True, **with_draft, **kwargs)
    assert r.token_ids == ar.token_ids and r.text == ar.text
    if kwargs.get("method") != "hybrid":
        assert r.stats.num_draft_tokens > 0
    if "max_speculative_tokens" in kwargs:
        assert max(r.stats.speculation_lengths) <= 5
    if "prompt_lookup_num_tokens" in kwargs:
        assert set(r.stats.by_proposer) == {"prompt-lookup"} and max(r.stats.speculation_lengths) <= 3


def test_auto_k_profiles_once_and_caches_on_disk(dirs, tok, monkeypatch, tmp_path):
    import specdecode.profile as schedule

    monkeypatch.setattr(schedule, "PROFILE_DIR", None)  # the default place: <cache>/profiles
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target = specdecode.load(dirs["target"])
    ar = specdecode.generate(target, PROMPT, method="ar", max_new_tokens=30)
    r = specdecode.generate(target, PROMPT, method="prompt-lookup", num_speculative_tokens="auto",
                            max_new_tokens=30, debug=True)
    assert r.token_ids == ar.token_ids
    profiles = list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert len(profiles) == 1
    times = json.loads(profiles[0].read_text())["forward_seconds"]
    assert len(times) == 17 and all(t > 0 for t in times)
    # a fresh load of the same model reads the profile instead of measuring again
    again = specdecode.load(dirs["target"])
    monkeypatch.setattr(schedule, "measure_forward_times", lambda *a, **k: pytest.fail("measured twice"))
    assert schedule.verify_profile(again) == times
    assert again.forward_seconds == times  # declared state of the loaded model, kept in memory


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_suffix_session_cache_lives_with_the_loaded_target(dirs, draft, method):
    target = specdecode.load(dirs["target"])  # a fresh session
    ids = list(range(40, 60))
    kw = dict(input_ids=ids, method=method, suffix_cache="session", max_new_tokens=40,
              **({"draft": draft} if method == "hybrid" else {}))
    one = specdecode.generate(target, **kw)
    two = specdecode.generate(target, **kw)
    assert one.token_ids == two.token_ids == specdecode.generate(target, input_ids=ids, max_new_tokens=40).token_ids
    by_suffix = [r.stats.by_proposer.get("suffix", {}).get("num_accepted_tokens", 0) for r in (one, two)]
    assert by_suffix[1] > by_suffix[0] + 20
    assert list(target.session_proposers) == ["suffix"]  # declared state of the loaded model


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_a_seeded_request_is_the_same_after_other_requests_filled_the_session_cache(dirs, draft, method):
    """A fixed fault: with the session suffix cache, T = 1 and seed 7, the same prompt
    gave another text after three other requests ran (the cache changed the proposals, and
    the proposals moved the draws). Under the gumbel rule (the default with a seed) the
    text is plain sampling's with that seed, whatever the cache holds."""
    target = specdecode.load(dirs["target"])  # a fresh session
    kw = dict(method=method, suffix_cache="session", max_new_tokens=40, temperature=1.0,
              **({"draft": draft} if method == "hybrid" else {}))
    plain = specdecode.generate(target, PROMPT, method="ar", max_new_tokens=40, temperature=1.0, seed=7)
    first = specdecode.generate(target, PROMPT, seed=7, **kw)
    for other in ("one two three", PROMPT, ASCII_TEXT):
        specdecode.generate(target, other, seed=3, **kw)
    again = specdecode.generate(target, PROMPT, seed=7, **kw)
    assert first.text == again.text == plain.text and first.token_ids == again.token_ids
    assert again.stats.num_draft_tokens > 0
    # the rejection rule, chosen explicitly, is lossless in distribution only: its text moves
    rejection = {specdecode.generate(target, PROMPT, seed=7, acceptance_rule="rejection", **kw).text
                 for _ in range(3)}
    assert rejection != {plain.text}


def test_a_pair_is_checked_once(dirs, monkeypatch):
    """The tokenizer check compares whole vocabularies: it runs when a draft first meets a
    target, not on every request."""
    target, draft = specdecode.load(dirs["target"]), specdecode.load(dirs["draft"])
    calls = []
    real = type(target.tokenizer).get_vocab
    monkeypatch.setattr(type(target.tokenizer), "get_vocab", lambda self: calls.append(1) or real(self))
    for _ in range(3):
        specdecode.generate(target, PROMPT, draft=draft, max_new_tokens=3)
    assert len(calls) == 2  # target's and draft's vocabularies, once
    other = specdecode.load(dirs["draft"])
    specdecode.generate(target, PROMPT, draft=other, max_new_tokens=3)
    assert len(calls) == 4  # a new draft is checked
    foreign = specdecode.load(dirs["foreign"])
    specdecode.generate(target, PROMPT, draft=foreign, max_new_tokens=3)
    specdecode.generate(target, PROMPT, draft=foreign, max_new_tokens=3)
    assert len(calls) == 8  # another tokenizer: compared once, each one's token bytes read once


def test_do_sample_true_samples_like_temperature(target, draft):
    greedy = specdecode.generate(target, PROMPT, max_new_tokens=30).token_ids
    t1 = specdecode.generate(target, PROMPT, temperature=1.0, seed=11, max_new_tokens=30).token_ids
    assert specdecode.generate(target, PROMPT, do_sample=True, seed=11, max_new_tokens=30).token_ids == t1
    assert t1 != greedy
    t07 = specdecode.generate(target, PROMPT, temperature=0.7, seed=11, max_new_tokens=30).token_ids
    assert specdecode.generate(target, PROMPT, do_sample=True, temperature=0.7, seed=11,
                               max_new_tokens=30).token_ids == t07
    spec = [specdecode.generate(target, PROMPT, method="draft", assistant_model=draft, do_sample=True, seed=4,
                                max_new_tokens=30) for _ in range(2)]
    assert spec[0].token_ids == spec[1].token_ids and spec[0].token_ids != greedy
    assert spec[0].stats.num_draft_tokens > 0


def test_self_draft_accepts_everything(target):
    """Draft == target (a forked cache): every round emits K+1 tokens, exactly as many as asked."""
    ar = specdecode.generate(target, PROMPT, max_new_tokens=41)
    r = specdecode.generate(target, PROMPT, method="draft", draft=target, num_speculative_tokens=4, max_new_tokens=41)
    assert r.token_ids == ar.token_ids and len(r.token_ids) == 41
    s = r.stats
    assert s.num_accepted_tokens == s.num_draft_tokens and s.acceptance_rate == 1.0
    assert s.num_verify_passes == 9  # 8 rounds of 5 tokens, then 1 token (no room to draft)


# --------------------------------------------------------------------------- streaming

def _splits_a_character(tok, chunks) -> bool:
    """Some chunk boundary (not the last) falls inside a multi-byte character."""
    ids: list[int] = []
    for c in chunks[:-1]:
        ids += c.token_ids
        if c.token_ids and tok.decode(ids, skip_special_tokens=True).endswith("\ufffd"):
            return True
    return False


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_stream_multibyte_utf8_across_tokens_and_blocks(tok, k):
    script = tok.encode(UNICODE_TEXT)
    assert tok.decode(script) == UNICODE_TEXT
    assert sum("\ufffd" in tok.decode([t]) for t in script) >= 10  # many characters span tokens
    n = len(tok.encode(PROMPT))
    tgt = scripted(tok, script, n, name="target")
    plain = specdecode.generate(tgt, PROMPT, max_new_tokens=200)
    assert plain.text == UNICODE_TEXT and plain.token_ids == script + [EOS]
    assert plain.finish_reason == "stop"
    # drafts that are right everywhere, wrong every 3rd token, wrong every 2nd token
    for wrong in (lambda i: False, every(3, 1), every(2)):
        drf = scripted(tok, script, n, wrong=wrong, name="draft")
        chunks, result = collect(specdecode.stream(tgt, PROMPT, draft=drf, num_speculative_tokens=k,
                                                   max_new_tokens=200))
        assert result.token_ids == plain.token_ids and result.text == UNICODE_TEXT
        assert result.finish_reason == "stop"
        check_stream(chunks, result)
        assert not any("\ufffd" in c.text for c in chunks)
        assert _splits_a_character(tok, chunks)  # the case under test really happened
        assert result.stats.num_accepted_tokens > 0  # multi-token blocks happened
        # every prefix of the stream is a prefix of the final text (nothing taken back)
        sent = ""
        for c in chunks:
            sent += c.text
            assert UNICODE_TEXT.startswith(sent)
        non_streamed = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=k,
                                           max_new_tokens=200)
        assert non_streamed.text == result.text and non_streamed.token_ids == result.token_ids


def test_stream_cut_inside_a_character_by_max_new_tokens(tok):
    """Output that ends mid-character: the partial bytes are dropped (no U+FFFD), and the
    stream still equals the final text."""
    script = tok.encode(UNICODE_TEXT)
    first_split = next(i for i, t in enumerate(script) if "\ufffd" in tok.decode([t]))
    n = len(tok.encode(PROMPT))
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    chunks, result = collect(specdecode.stream(tgt, PROMPT, draft=drf, num_speculative_tokens=3,
                                               max_new_tokens=first_split + 1))
    assert result.token_ids == script[:first_split + 1] and result.finish_reason == "length"
    lossy = tok.decode(script[:first_split + 1])
    assert lossy.endswith("\ufffd") and result.text == lossy.rstrip("\ufffd")
    assert "\ufffd" not in result.text
    check_stream(chunks, result)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_stream_real_models_equals_non_streamed_and_plain(target, draft, k):
    plain = specdecode.generate(target, PROMPT, max_new_tokens=32)
    for drf in (draft, target):
        chunks, result = collect(specdecode.stream(target, PROMPT, draft=drf, num_speculative_tokens=k,
                                                   max_new_tokens=32))
        assert result.token_ids == plain.token_ids and result.text == plain.text
        check_stream(chunks, result)
        assert len(chunks) - 1 == result.stats.num_verify_passes  # one chunk per verify pass


# --------------------------------------------------------------------------- stop strings, EOS, length

def _first_token_completing(tok, script, stop: str) -> int:
    return next(j for j in range(len(script)) if stop in tok.decode(script[:j + 1]))


@pytest.mark.parametrize("others", [(), ("never appears",)], ids=["one_stop", "two_stops"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_stop_string_inside_blocks(tok, k, others):
    """Stop strings that end inside a block, span two tokens ("x ju", "dog. Pa") or two
    blocks (drafts wrong every 3rd token): cut before the stop string, finish "stop", no
    token after the one that completed it, and the stream never shows any of it."""
    script = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    tgt = scripted(tok, script, n)
    for stop in ("lazy", "x ju", "dog. Pa", "k my box"):
        j = _first_token_completing(tok, script, stop)
        expected_text = ASCII_TEXT[:ASCII_TEXT.index(stop)]
        for wrong in (lambda i: False, every(3, 2)):
            drf = scripted(tok, script, n, wrong=wrong)
            chunks, r = collect(specdecode.stream(tgt, PROMPT, draft=drf, num_speculative_tokens=k,
                                                  stop=[stop, *others], max_new_tokens=100))
            assert r.finish_reason == "stop", stop
            assert r.text == expected_text, stop
            assert r.token_ids == script[:j + 1], stop  # nothing after the token that completed it
            assert r.stats.num_generated_tokens == j + 1
            sent = ""
            for c in chunks:
                sent += c.text
                assert stop not in sent and expected_text.startswith(sent), (stop, sent)
            check_stream(chunks, r)
        plain = specdecode.generate(tgt, PROMPT, stop=stop, max_new_tokens=100)
        assert plain.text == expected_text and plain.token_ids == script[:j + 1]


def test_stop_string_early_in_a_long_accepted_block(tok):
    """The stop string is completed by the 2nd token of a 9-token accepted block."""
    script = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    stop = tok.decode(script[1:3])  # " quick brown"
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    r = specdecode.generate(tgt, PROMPT, method="draft", draft=drf, num_speculative_tokens=8, stop=stop, max_new_tokens=100)
    assert r.token_ids == script[:3] and r.text == tok.decode(script[:1])
    assert r.finish_reason == "stop"
    assert r.stats.num_verify_passes == 1 and r.stats.num_accepted_tokens == 3


def test_stop_string_in_multibyte_text(tok):
    script = tok.encode(UNICODE_TEXT)
    n = len(tok.encode(PROMPT))
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n, wrong=every(2))
    for stop in ("世界", "🚀", "ữ ặ"):
        chunks, r = collect(specdecode.stream(tgt, PROMPT, draft=drf, num_speculative_tokens=3,
                                              stop=stop, max_new_tokens=200))
        assert r.text == UNICODE_TEXT[:UNICODE_TEXT.index(stop)] and r.finish_reason == "stop"
        check_stream(chunks, r)
        assert not any("\ufffd" in c.text for c in chunks)


def test_stop_string_also_at_max_new_tokens_is_stop(tok):
    script = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    j = _first_token_completing(tok, script, "lazy")
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    r = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=5, stop="lazy",
                            max_new_tokens=j + 1)
    assert r.finish_reason == "stop" and r.token_ids == script[:j + 1]
    r = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=5, stop="lazy",
                            max_new_tokens=j)
    assert r.finish_reason == "length" and r.token_ids == script[:j] and "lazy" not in r.text


@pytest.mark.parametrize("k", [2, 5])
def test_eos_inside_a_block(tok, k):
    text_ids = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    for j in range(0, 12):
        script = text_ids[:j] + [EOS] + text_ids[j:]
        tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
        chunks, r = collect(specdecode.stream(tgt, PROMPT, method="draft", draft=drf, num_speculative_tokens=k,
                                              max_new_tokens=60))
        assert r.token_ids == script[:j + 1] and r.token_ids[-1] == EOS, j
        assert r.text == tok.decode(text_ids[:j]) and "<|im_end|>" not in r.text
        assert r.finish_reason == "stop"
        assert r.stats.num_generated_tokens == j + 1
        # every draft was right: full rounds of K accepted + bonus, then the cut round
        full, rest = divmod(j + 1, k + 1)
        assert r.stats.num_accepted_tokens == full * k + rest
        check_stream(chunks, r)
        assert chunks[-1].token_ids == [] and chunks[-2].token_ids[-1] == EOS  # nothing after EOS


def test_several_eos_ids_and_no_eos(tok):
    text_ids = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    a, b = text_ids[7], text_ids[4]  # first occurrences at 7 and 4
    assert a not in text_ids[:7] and b not in text_ids[:4]
    script = text_ids[:10] + [EOS] + text_ids[10:]
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    r = specdecode.generate(tgt, PROMPT, draft=drf, eos_token_id=[a, b], max_new_tokens=60)
    assert r.token_ids == script[:5] and r.finish_reason == "stop"
    r = specdecode.generate(tgt, PROMPT, draft=drf, eos_token_id=EOS, max_new_tokens=60)
    assert r.token_ids == script[:11] and r.finish_reason == "stop"
    # no EOS at all: <|im_end|> is an ordinary token, generation runs to max_new_tokens
    r = specdecode.generate(tgt, PROMPT, draft=drf, eos_token_id=[], max_new_tokens=14)
    assert r.token_ids == script[:14] and r.finish_reason == "length"
    assert r.text == tok.decode(script[:14], skip_special_tokens=True)


def test_custom_eos_text_is_excluded(tok):
    """An ordinary token declared as EOS ends generation; like the default EOS, its text is
    not part of the completion (token_ids end with it)."""
    text_ids = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    (period,) = tok.encode(".")
    j = text_ids.index(period)
    tgt, drf = scripted(tok, text_ids, n), scripted(tok, text_ids, n)
    chunks, r = collect(specdecode.stream(tgt, PROMPT, draft=drf, eos_token_id=period,
                                          max_new_tokens=60))
    assert r.token_ids == text_ids[:j + 1] and r.finish_reason == "stop"
    assert r.text == tok.decode(text_ids[:j]) == "The quick brown fox jumps over the lazy dog"
    check_stream(chunks, r)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_min_new_tokens_masks_eos_for_exactly_m_tokens(tok, k):
    """EOS where the script has it at 2 and 6; with min_new_tokens=m it cannot end before m
    generated tokens, counted in tokens, not rounds."""
    text_ids = tok.encode(ASCII_TEXT)
    script = text_ids[:2] + [EOS] + text_ids[2:5] + [EOS] + text_ids[5:]
    n = len(tok.encode(PROMPT))
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    for m, end in ((0, 3), (2, 3), (3, 7), (6, 7), (7, len(script) + 1)):
        r = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=k, min_new_tokens=m,
                                max_new_tokens=40)
        assert len(r.token_ids) == end and r.token_ids[-1] == EOS and r.finish_reason == "stop", m
        assert EOS not in r.token_ids[:-1]
    r = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=k, min_new_tokens=8,
                            max_new_tokens=12)
    assert EOS not in r.token_ids and len(r.token_ids) == 12 and r.finish_reason == "length"


@pytest.mark.parametrize("k", [1, 3])
def test_max_new_tokens_exact(tok, target, k):
    script = tok.encode(ASCII_TEXT)
    n = len(tok.encode(PROMPT))
    tgt, drf = scripted(tok, script, n), scripted(tok, script, n)
    for m in range(1, 3 * k + 2):
        r = specdecode.generate(tgt, PROMPT, draft=drf, num_speculative_tokens=k, max_new_tokens=m)
        assert r.token_ids == script[:m] and r.finish_reason == "length"
        assert r.stats.num_generated_tokens == m
        assert r.stats.num_draft_tokens <= m - 1  # never drafts past the limit
    ar = specdecode.generate(target, PROMPT, max_new_tokens=3 * k + 1).token_ids
    for m in range(1, 3 * k + 2):
        r = specdecode.generate(target, PROMPT, draft=target, num_speculative_tokens=k, max_new_tokens=m)
        assert r.token_ids == ar[:m] and r.stats.num_generated_tokens == m


# --------------------------------------------------------------------------- vocabularies, tokenizers

def test_draft_with_more_embedding_rows(dirs, target):
    wide = specdecode.load(dirs["wide_draft"])
    assert wide.lm.vocab_size == WIDE_VOCAB and target.lm.vocab_size == VOCAB
    wide.lm.allocate(1, 64)
    raw = wide.lm.forward(torch.tensor([target.tokenizer.encode(PROMPT)]))
    assert (raw.argmax(-1) >= VOCAB).all()  # rows the target lacks would win if not cut off
    ar = specdecode.generate(target, PROMPT, max_new_tokens=40)
    r = specdecode.generate(target, PROMPT, method="draft", draft=wide, num_speculative_tokens=4, max_new_tokens=40)
    assert r.token_ids == ar.token_ids
    # on the target's rows the wide draft has the target's weights: all drafts accepted
    assert r.stats.acceptance_rate == 1.0 and r.stats.num_draft_tokens > 0
    # sampling: the draft's distribution over the target's VOCAB rows
    s1 = specdecode.generate(target, PROMPT, method="draft", draft=wide, temperature=0.8, seed=2, max_new_tokens=30)
    s2 = specdecode.generate(target, PROMPT, method="draft", draft=wide, temperature=0.8, seed=2, max_new_tokens=30)
    assert s1.token_ids == s2.token_ids and len(s1.token_ids) == 30
    assert s1.stats.num_accepted_tokens > 0.5 * s1.stats.num_draft_tokens
    t, d = specdecode.load_pair(dirs["target"], dirs["wide_draft"])
    assert d.lm.vocab_size == WIDE_VOCAB


def test_target_with_more_embedding_rows_than_draft(dirs, target):
    wide = specdecode.load(dirs["wide"])
    ar = specdecode.generate(wide, PROMPT, max_new_tokens=40)
    assert ar.token_ids == specdecode.generate(target, PROMPT, max_new_tokens=40).token_ids
    r = specdecode.generate(wide, PROMPT, method="draft", draft=target, num_speculative_tokens=4, max_new_tokens=40)
    assert r.token_ids == ar.token_ids and r.stats.acceptance_rate == 1.0
    # sampling: draft distributions of VOCAB rows against target ones of WIDE_VOCAB (padded with 0)
    s1 = specdecode.generate(wide, PROMPT, method="draft", draft=target, temperature=0.8, seed=2, max_new_tokens=30)
    s2 = specdecode.generate(wide, PROMPT, method="draft", draft=target, temperature=0.8, seed=2, max_new_tokens=30)
    assert s1.token_ids == s2.token_ids and s1.stats.num_accepted_tokens > 0
    assert all(t < VOCAB for t in s1.token_ids)  # the zero rows are never likely


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_draft_of_another_tokenizer_goes_through_text(dirs, target, method):
    """Vocabularies and tokenizers: a genuinely different tokenizer is routed through the cross-tokenizer
    path (the output is plain decoding's), both ways; the proposer reads its own tokenizer."""
    foreign = specdecode.load(dirs["foreign"])
    assert len(foreign.tokenizer) < 1000 and check_compatible(target, foreign) == "cross"
    plain = specdecode.generate(target, PROMPT, max_new_tokens=40)
    for kwargs in (dict(draft=foreign), dict(assistant_model=foreign), dict(draft=str(dirs["foreign"]))):
        out = specdecode.generate(target, PROMPT, max_new_tokens=40, method=method, **kwargs)
        assert out.token_ids == plain.token_ids and out.text == plain.text
    proposer = build_proposer(speculative_config("draft", True), target, foreign)
    assert isinstance(proposer, CrossTokenizerProposer)
    # such a draft stops below its own p_min unless one is given (0: never), the hybrid's below
    # the hybrid's; a draft of the target's tokenizer never stops unless told
    assert proposer.p_min == CrossTokenizerProposer.default_p_min == 0.5
    assert build_proposer(SpeculativeConfig("draft", draft_p_min=0), target, foreign).p_min == 0
    assert build_proposer(SpeculativeConfig("hybrid"), target, foreign).drafter.p_min == 0.5
    assert build_proposer(SpeculativeConfig("draft"), target, target).p_min is None
    # the draft method's default K is the cross-tokenizer proposer's for such a pair, the
    # same-tokenizer draft's for a same pair; a K given is kept
    assert build_schedule(SpeculativeConfig("draft"), target, foreign).k == CrossTokenizerProposer.default_k
    assert build_schedule(SpeculativeConfig("draft"), target, target).k == DraftModelProposer.default_k
    assert build_schedule(SpeculativeConfig("draft", num_speculative_tokens=2), target, foreign).k == 2
    assert build_schedule(SpeculativeConfig("draft", schedule="auto"), target, foreign).lookahead == 1
    assert build_schedule(SpeculativeConfig("draft", schedule="auto"), target, target).lookahead == 0
    tgt, drf = specdecode.load_pair(dirs["foreign"], dirs["target"])
    back = specdecode.generate(tgt, PROMPT, max_new_tokens=30)
    assert specdecode.generate(tgt, PROMPT, draft=drf, max_new_tokens=30).token_ids == back.token_ids


@pytest.mark.parametrize("k", [2, 5])
def test_a_draft_of_another_tokenizer_streams_and_batches_like_plain_decoding(dirs, target, k):
    """Tokenizers and streaming: with a draft of another tokenizer, the stream of a multilingual
    prompt concatenates to the non-streamed text, which is plain decoding's; a batch of
    prompts (the batched engine: the drafts' passes on rows of one draft cache) gives each
    its solo run."""
    foreign = specdecode.load(dirs["foreign"])
    for prompt in (UNICODE_TEXT, PROMPT):
        plain = specdecode.generate(target, prompt, max_new_tokens=40)
        chunks, result = collect(specdecode.stream(target, prompt, draft=foreign, num_speculative_tokens=k,
                                                   max_new_tokens=40))
        assert result.token_ids == plain.token_ids and result.text == plain.text
        check_stream(chunks, result)
    prompts = [PROMPT, ASCII_TEXT, UNICODE_TEXT[:30]]
    solo = [specdecode.generate(target, p, max_new_tokens=30).token_ids for p in prompts]
    batch = specdecode.generate(target, prompts, draft=foreign, max_new_tokens=30, num_speculative_tokens=k)
    assert [r.token_ids for r in batch] == solo


def test_a_chat_reaches_a_draft_of_another_tokenizer_in_its_own_template(dirs, tmp_path, target, monkeypatch):
    """Chat requests: the draft reads the conversation in its own chat template where it has
    one (measured to be accepted more than the target's rendered text), else the target's
    text; plain prompts are the target's text either way. The output is plain decoding's."""
    d = tmp_path / "permuted"  # the test tokenizer with two ids swapped: another tokenizer
    shutil.copytree(dirs["draft"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    other = specdecode.load(d)
    seen = []
    real = CrossTokenizerProposer.reset
    monkeypatch.setattr(CrossTokenizerProposer, "reset",
                        lambda self, state, n: (seen.append(self.draft_prompt_ids), real(self, state, n))[1])
    msgs = [{"role": "user", "content": PROMPT}]
    plain = specdecode.generate(target, msgs, max_new_tokens=20)
    assert specdecode.generate(target, msgs, draft=other, max_new_tokens=20).token_ids == plain.token_ids
    assert seen[-1] == other.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    specdecode.generate(target, PROMPT, draft=other, max_new_tokens=5)
    assert seen[-1] is None
    specdecode.generate(target, PROMPT, chat=True, draft=specdecode.load(dirs["foreign"]), max_new_tokens=5)
    assert seen[-1] is None  # no chat template of its own: the target's rendered text
    # a batch of prompts: each chat in the draft's own template, as alone
    seen.clear()
    batch = specdecode.generate(target, [msgs, PROMPT], draft=other, max_new_tokens=20)
    assert batch[0].token_ids == plain.token_ids
    own = other.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    assert len(seen) == 2 and own in seen and None in seen


def test_a_tokenizer_that_cannot_be_bridged_is_refused_at_pairing(dirs, tmp_path, target):
    """A WordPiece tokenizer's tokens are not byte strings: refused before anything runs,
    with a message that names check-pair and the way out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path / "wordpiece"
    shutil.copytree(dirs["foreign"], d)
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *sorted(set(PROMPT.lower().split()))])}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    t.save(str(d / "tokenizer.json"))
    wordpiece = specdecode.load(d)
    rec = Recorder(target.lm)
    with pytest.raises(IncompatibleDraftError) as err:
        specdecode.generate(LoadedModel(rec, target.tokenizer, "t", target.eos_token_ids), PROMPT,
                            draft=wordpiece)
    msg = str(err.value)
    assert "tokenizer" in msg and "check-pair" in msg and "'ar'" in msg and "\n" not in msg
    assert rec.forwards == []
    with pytest.raises(IncompatibleDraftError):
        specdecode.load_pair(dirs["target"], d)


def test_same_size_but_permuted_vocabulary_goes_through_text(dirs, tmp_path, target):
    """Same number of tokens and same special tokens, but two ids swapped: not the same
    tokenizer, so the proposals go through text, and the output is plain decoding's."""
    d = tmp_path / "permuted"
    shutil.copytree(dirs["draft"], d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "Ġthe", "Ġand"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    perm = specdecode.load(d)
    assert len(perm.tokenizer) == len(target.tokenizer)
    assert check_compatible(target, perm) == "cross"
    plain = specdecode.generate(target, PROMPT, max_new_tokens=30).token_ids
    assert specdecode.generate(target, PROMPT, draft=perm, max_new_tokens=30).token_ids == plain


def test_draft_and_target_see_the_same_prompt_ids(target, draft, tok):
    t, d = Recorder(target.lm), Recorder(draft.lm)
    tgt = LoadedModel(t, target.tokenizer, "t", target.eos_token_ids)
    drf = LoadedModel(d, draft.tokenizer, "d", draft.eos_token_ids)
    for prompt, chat in ((PROMPT, True), (PROMPT, False), ([{"role": "user", "content": "2+2?"}], False)):
        r = specdecode.generate(tgt, prompt, method="draft", draft=drf, chat=chat, max_new_tokens=20)
        ids = r.prompt_token_ids
        if chat or isinstance(prompt, list):
            assert ids[:1] == tok.encode("<|im_start|>") and tok.decode(ids).endswith("<|im_start|>assistant\n")
        assert t.forwards[0] == ids[:-1] == d.forwards[0]  # both prefill the same ids
        committed = ids + r.token_ids
        assert t.cache == committed[:len(t.cache)] and len(t.cache) == len(committed) - 1
        assert d.cache == committed[:len(d.cache)]  # the draft's cache: a prefix of the committed
        assert r.stats.num_draft_tokens > 0


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-1), ["temperature", "-1"]),
    (dict(temperature=float("nan")), ["temperature"]),
    (dict(top_p=0), ["top_p", "0"]),
    (dict(top_p=1.5), ["top_p", "1.5"]),
    (dict(top_k=-2), ["top_k", "-2"]),
    (dict(seed=2**63, temperature=1.0), ["seed", "-2**63"]),
    (dict(max_new_tokens=0), ["max_new_tokens", "0"]),
    (dict(min_new_tokens=-1), ["min_new_tokens", "-1"]),
    (dict(repetition_penalty=0), ["repetition_penalty", "0"]),
    (dict(num_speculative_tokens=0), ["num_speculative_tokens", "0"]),
    (dict(num_assistant_tokens=0), ["num_speculative_tokens", "0"]),
    (dict(num_speculative_tokens=65), ["num_speculative_tokens", "65"]),
    (dict(method="bogus"), ["method", "bogus"]),
    (dict(stop=[""]), ["stop"]),
    (dict(eos_token_id=-3), ["eos_token_ids", "-3"]),
    (dict(num_speculative_tokens="heuristics"), ["num_speculative_tokens", "heuristics", "auto"]),
    (dict(num_speculative_tokens="auto", max_speculative_tokens=0), ["max_speculative_tokens", "0"]),
    (dict(draft_p_min=1.5), ["draft_p_min", "1.5"]),
    (dict(method="prompt-lookup", draft_p_min=0.5), ["draft_p_min", "prompt-lookup"]),
    (dict(prompt_lookup_num_tokens=4, method="draft"), ["prompt_lookup_num_tokens", "draft"]),
    (dict(method="prompt-lookup", max_matching_ngram_size=0), ["max_ngram=0"]),
    (dict(method="prompt-lookup", max_matching_ngram_size=True), ["max_ngram=True", "1..32"]),
    (dict(method="prompt-lookup", max_matching_ngram_size=-1), ["max_ngram=-1", "1..32"]),
    (dict(method="draft", max_matching_ngram_size=5), ["n-gram", "'draft'", "max_ngram=5"]),
    (dict(method="suffix", suffix_cache="forever"), ["suffix_cache", "forever"]),
    (dict(draft_p_min=0.5, assistant_confidence_threshold=0.5), ["draft_p_min", "alias"]),
    # a positive temperature too small to divide by (was: nan in multinomial)
    (dict(temperature=1e-40), ["temperature=1e-40", "1e-20"]),
    (dict(temperature=True), ["temperature=True"]),
    (dict(temperature=1e39, top_k=3), ["temperature=1e+39", "1e+30"]),  # top_k was ignored
    (dict(stop=["\udcff"]), ["stop", "UTF-8"]),  # could never match
    (dict(stop=5), ["stop=5"]),  # fault 7: was a bare TypeError
    (dict(stop=["ok", 5]), ["stop", "strings"]),
    (dict(acceptance_rule="coupled", temperature=1.0), ["acceptance_rule", "'coupled'", "gumbel"]),
])
def test_bad_arguments_raise_value_error_naming_the_value(target, draft, kwargs, words):
    with_draft = {} if kwargs.get("method") in ("prompt-lookup", "suffix", "ar") else {"draft": draft}
    with pytest.raises(ValueError) as err:
        specdecode.generate(target, PROMPT, **with_draft, **kwargs)
    msg = str(err.value)
    assert all(w in msg for w in words), msg
    assert not isinstance(err.value, IncompatibleDraftError)


def test_bad_prompts(target, tok):
    with pytest.raises(ValueError, match="empty"):
        specdecode.generate(target, "")
    with pytest.raises(ValueError, match="empty"):
        specdecode.generate(target, input_ids=[])
    with pytest.raises(ValueError, match=f"{VOCAB}"):
        specdecode.generate(target, input_ids=[5, VOCAB])
    with pytest.raises(ValueError, match="-1"):
        specdecode.generate(target, input_ids=[-1, 5])
    with pytest.raises(ValueError, match="exactly one"):
        specdecode.generate(target, PROMPT, input_ids=tok.encode(PROMPT))
    with pytest.raises(ValueError, match="exactly one"):
        specdecode.generate(target)
    with pytest.raises(ValueError, match="int"):
        specdecode.generate(target, 123)
    with pytest.raises(ValueError, match="needs a draft"):
        specdecode.generate(target, PROMPT, method="draft")
    with pytest.raises(ValueError, match="needs a draft"):
        specdecode.stream(target, PROMPT, method="draft").__next__()
    # a list of prompts: the error names the bad entry (was: the first prompt, or no index)
    for prompts, words in [([PROMPT, 5], r"prompt\[1\] is of type int"),
                           ([PROMPT, ""], r"prompt\[1\] is empty"),
                           ([PROMPT, [{"role": "user"}]], r"prompt\[1\]: chat message"),
                           ([{"role": "user", "content": "x"}, PROMPT], r"prompt\[0\] is of type dict")]:
        with pytest.raises(ValueError, match=words):
            specdecode.generate(target, prompts, max_new_tokens=3)


def test_text_that_is_not_utf8_is_refused_naming_the_character(target, tok):
    """A fixed fault: a lone surrogate (what Python makes of a byte that is not UTF-8)
    crashed inside the tokenizers library with a TypeError."""
    for prompt, words in (("abc \ud800 def", ["prompt", "U+D800", "character 4", "lone surrogate"]),
                          (b"abc \xff def".decode("utf-8", "surrogateescape"), ["U+DCFF", "0xFF"])):
        with pytest.raises(ValueError) as err:
            specdecode.generate(target, prompt, max_new_tokens=3)
        assert all(w in str(err.value) for w in words), err.value
        with pytest.raises(ValueError, match="'user' message is not valid UTF-8"):
            specdecode.generate(target, [{"role": "user", "content": prompt}], max_new_tokens=3)
        with pytest.raises(ValueError, match="role is not valid UTF-8"):
            specdecode.generate(target, [{"role": "us" + prompt, "content": "x"}], max_new_tokens=3)


@pytest.mark.parametrize("method", ["ar", "prompt-lookup", "suffix"])
def test_a_draft_given_to_a_method_without_one_is_refused(target, draft, method):
    """One rule for every option: a draft model given to a method that
    does not use one is an error, like draft_p_min to prompt lookup (it was dropped)."""
    for kwargs in (dict(draft=draft), dict(assistant_model=draft)):
        with pytest.raises(ValueError) as err:
            specdecode.generate(target, PROMPT, method=method, max_new_tokens=3, **kwargs)
        assert all(w in str(err.value) for w in ("draft model", "'draft'", "'hybrid'", repr(method)))
    with pytest.raises(ValueError, match="does not apply"):
        specdecode.generate(target, PROMPT, method="ar", num_speculative_tokens=5, max_new_tokens=3)


def test_smallest_allowed_temperature_samples_the_argmax(target):
    greedy = specdecode.generate(target, PROMPT, max_new_tokens=12)
    for rule in ("gumbel", "rejection"):
        tiny = specdecode.generate(target, PROMPT, max_new_tokens=12, temperature=1e-20, seed=3,
                                   acceptance_rule=rule)
        assert tiny.token_ids == greedy.token_ids


def test_chat_without_a_chat_template(dirs):
    foreign = specdecode.load(dirs["foreign"])
    assert not getattr(foreign.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        specdecode.generate(foreign, PROMPT, chat=True, max_new_tokens=3)
    assert len(specdecode.generate(foreign, PROMPT, max_new_tokens=3).token_ids) == 3


def test_bad_prompts_tokenizer_free(target, tok):
    ids_only = LoadedModel(target.lm, None, "no-tokenizer", target.eos_token_ids)
    with pytest.raises(ValueError, match="input_ids"):
        specdecode.generate(ids_only, PROMPT)
    r = specdecode.generate(ids_only, input_ids=tok.encode(PROMPT), max_new_tokens=4)
    assert len(r.token_ids) == 4
    with pytest.raises(ValueError, match="tokenizer"):
        specdecode.generate(ids_only, input_ids=tok.encode(PROMPT), stop="x", max_new_tokens=4)


def test_bad_model_references(tmp_path, dirs):
    with pytest.raises(ValueError) as err:
        specdecode.load("no-such-model")
    assert "no-such-model" in str(err.value)
    assert all(name in str(err.value) for name in registry.KNOWN_MODELS)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError) as err:
        specdecode.load(not_gguf)
    assert str(not_gguf) in str(err.value) and ".gguf" in str(err.value)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError) as err:
        specdecode.load(empty)
    assert str(empty) in str(err.value) and "config.json" in str(err.value)
    with pytest.raises(ValueError, match="dtype 'float8'"):
        specdecode.load(dirs["target"], dtype="float8")
    with pytest.raises(ValueError, match="backend 'onnx'"):
        specdecode.load(dirs["target"], backend="onnx")
    broken = tmp_path / "broken_config"
    shutil.copytree(dirs["target"], broken)
    for text in ("{bad json", "[1, 2]"):  # was: a bare JSONDecodeError
        (broken / "config.json").write_text(text)
        with pytest.raises(ValueError) as err:
            specdecode.load(broken)
        assert str(broken / "config.json") in str(err.value) and "JSON" in str(err.value)
    with pytest.raises(ValueError) as err:
        specdecode.load_pair(dirs["target"], "no-such-draft")
    assert "no-such-draft" in str(err.value)
    with pytest.raises(ValueError) as err:
        specdecode.generate(dirs["target"], PROMPT, draft="no-such-draft", max_new_tokens=3)
    assert "no-such-draft" in str(err.value)


# --------------------------------------------------------------------------- loading paths, backends

def test_load_local_dir(dirs, tok):
    m = specdecode.load(dirs["target"])
    assert m.path == dirs["target"] and m.name == str(dirs["target"])
    assert m.lm.vocab_size == VOCAB and m.lm.max_context == 2048
    assert m.eos_token_ids == (EOS,)
    assert m.tokenizer.get_vocab() == tok.get_vocab() and m.tokenizer.chat_template
    no_tok = specdecode.load(dirs["target"], tokenizer=False)
    assert no_tok.tokenizer is None
    # a path string, and a directory passed straight to generate
    r1 = specdecode.generate(str(dirs["target"]), PROMPT, max_new_tokens=8)
    r2 = specdecode.generate(m, PROMPT, max_new_tokens=8)
    assert r1.token_ids == r2.token_ids


def test_transformers_backend_matches_native(dirs, target, draft):
    hf_target = specdecode.load(dirs["target"], backend="transformers")
    hf_draft = specdecode.load(dirs["draft"], backend="transformers")
    assert isinstance(hf_target.lm, HFCausalLM) and not isinstance(target.lm, HFCausalLM)
    ar = specdecode.generate(target, PROMPT, max_new_tokens=30)
    assert specdecode.generate(hf_target, PROMPT, max_new_tokens=30).token_ids == ar.token_ids
    for tgt, drf in ((target, hf_draft), (hf_target, draft), (hf_target, hf_draft), (hf_target, hf_target)):
        r = specdecode.generate(tgt, PROMPT, method="draft", draft=drf, num_speculative_tokens=4, max_new_tokens=30,
                                debug=True)
        assert r.token_ids == ar.token_ids
        assert r.stats.num_draft_tokens > 0
        if drf is not hf_target:  # rejections happened, so both caches were rolled back
            assert r.stats.num_accepted_tokens < r.stats.num_draft_tokens


@pytest.mark.parametrize("name, backend", [("draft", "native"), ("draft", "transformers"), ("gpt2", "auto")])
def test_int8_draft_keeps_the_output(dirs, target, name, backend):
    """The CLI's default draft dtype: only speed and acceptance change, never the output."""
    q = specdecode.load(dirs[name], backend=backend, dtype="int8")
    assert q.lm.vocab_size == VOCAB
    ar = specdecode.generate(target, PROMPT, max_new_tokens=30)
    r = specdecode.generate(target, PROMPT, method="draft", draft=q, max_new_tokens=30)
    assert r.token_ids == ar.token_ids and r.stats.num_draft_tokens > 0


def test_other_architecture_goes_through_transformers(dirs, target, tok):
    """GPT-2 is not a native architecture: backend "auto" uses the transformers adapter; it
    pairs with a Llama target of the same tokenizer."""
    g = specdecode.load(dirs["gpt2"])
    assert isinstance(g.lm, HFCausalLM) and g.lm.vocab_size == VOCAB
    with pytest.raises(ValueError, match="backend='transformers'"):
        specdecode.load(dirs["gpt2"], backend="native")
    own = specdecode.generate(g, PROMPT, max_new_tokens=12)
    assert len(own.token_ids) == 12 and own.prompt_token_ids == tok.encode(PROMPT)
    ar = specdecode.generate(target, PROMPT, max_new_tokens=24)
    assert specdecode.generate(target, PROMPT, draft=g, max_new_tokens=24, debug=True).token_ids == ar.token_ids
    assert specdecode.generate(g, PROMPT, draft=target, max_new_tokens=12).token_ids == own.token_ids


def test_gguf_file_is_read_natively_and_matches(dirs, target, tmp_path, monkeypatch):
    """A .gguf file loads without any float conversion: its metadata directory (config,
    tokenizer, chat template; no weights) is written once, the weights come from the file,
    and it decodes as the directory it was written from."""
    from specdecode.models import registry

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_convert_into", lambda *a: pytest.fail("converted to fp32"))
    gguf_file = tmp_path / "tiny model.gguf"
    write_tiny_gguf(dirs["target"], gguf_file)
    meta = resolve_model_path(gguf_file)
    assert meta.parent == tmp_path / "cache" / "meta" and meta.name.startswith("tiny model-")
    assert (meta / "config.json").is_file() and not list(meta.glob("*.safetensors"))
    monkeypatch.setattr(registry, "_write_metadata", lambda *a: pytest.fail("written twice"))
    assert resolve_model_path(str(gguf_file)) == meta
    m = specdecode.load(gguf_file)
    assert m.path == meta and m.lm.vocab_size == VOCAB and EOS in m.eos_token_ids
    assert m.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    ar = specdecode.generate(target, PROMPT, max_new_tokens=20)
    r = specdecode.generate(m, PROMPT, max_new_tokens=20)
    assert r.prompt_token_ids == ar.prompt_token_ids and r.token_ids == ar.token_ids
    # the GGUF model and the directory pair as target and draft (same tokenizer)
    r = specdecode.generate(target, PROMPT, method="draft", draft=m, max_new_tokens=20)
    assert r.token_ids == ar.token_ids and r.stats.acceptance_rate == 1.0


def test_max_matching_ngram_size_sets_the_longest_n_gram_and_keeps_the_shortest_below_it():
    from specdecode.methods import speculative_config
    assert (speculative_config("prompt-lookup", False).min_ngram,
            speculative_config("prompt-lookup", False).max_ngram) == (2, 5)
    for given, expected in [(1, (1, 1)), (2, (2, 2)), (8, (2, 8))]:
        c = speculative_config("prompt-lookup", False, max_ngram=given)
        assert (c.min_ngram, c.max_ngram) == expected


def test_a_stream_closed_or_abandoned_early_frees_its_models_at_once(target, draft):
    """``close()`` on a stream, or a ``break`` out of a loop over it, releases the models
    then and there (not when the cyclic garbage collector runs): the next request works,
    every time. A stream paused but still held keeps them."""
    import gc

    gc.disable()  # only reference counting may free anything here
    try:
        for _ in range(5):
            s = specdecode.stream(target, PROMPT, draft=draft, max_new_tokens=30)
            next(s), next(s)
            with pytest.raises(RuntimeError, match="already generating"):
                specdecode.generate(target, PROMPT, max_new_tokens=4)
            s.close()
            assert len(specdecode.generate(target, PROMPT, draft=draft, max_new_tokens=4).token_ids) >= 1
            for i, _ in enumerate(specdecode.stream(target, PROMPT, draft=draft, max_new_tokens=30)):
                if i == 1:
                    break
            assert len(specdecode.generate(target, PROMPT, draft=draft, max_new_tokens=4).token_ids) >= 1
    finally:
        gc.enable()
