"""Drafts of another tokenizer (docs/testing.md, vocabularies and tokenizers): token bytes, the text bridge between two
vocabularies, greedy equality with mock drafts whose proposals we choose, BOS and special
tokens, multi-byte text, and the sampling distribution on toy tokenizers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import ASCII_TEXT, PROMPT, UNICODE_TEXT, MockLM, hashed_logits, local_tokenizer
from lossless import N_RUNS, assert_lossless, probs_of
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import CrossTokenizerProposer
from specdecode.proposers.base import RequestState
from specdecode.proposers.cross_tokenizer import LOOKBEHIND
from specdecode.tokenmap import TokenBytes, UnsupportedTokenizerError, VocabMap, utf8_prefix
from tiny_dirs import _foreign_tokenizer


def _fast(model, pre=None, decoder=None, post=None, bos=None, eos=None, unk=None, special=()):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(model)
    if pre is not None:
        t.pre_tokenizer = pre
    if decoder is not None:
        t.decoder = decoder
    if post is not None:
        t.post_processor = post
    t.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token=bos, eos_token=eos, unk_token=unk)


def spm_tokenizer(bos: bool = True):
    """A SentencePiece-style tokenizer (Metaspace ▁ for space, <0xNN> byte fallback, BOS added
    in front of every text), like Llama 2's and Gemma's: another split of the same texts."""
    from tokenizers import decoders, models, normalizers, processors

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = sorted({w for w in (PROMPT + " " + ASCII_TEXT).replace(".", " ").replace(",", " ").split()})
    pieces += ["\u2581" + w for w in words] + list("abcdefghijklmnopqrstuvwxyzTHP?.,!") + ["\u2581"]
    vocab = [(p, -float(len(p))) for p in dict.fromkeys(pieces)]
    tok = _fast(models.Unigram(vocab, unk_id=0, byte_fallback=True),
                decoder=decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()]),
                post=processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]) if bos else None,
                bos="<s>", eos="</s>", unk="<unk>", special=["<unk>", "<s>", "</s>"])
    tok.backend_tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    return tok


# -- token bytes


@pytest.mark.parametrize("make", [local_tokenizer, _foreign_tokenizer, spm_tokenizer])
def test_token_bytes_concatenate_to_the_text(make):
    tb = TokenBytes.of(make())
    for text in (PROMPT, ASCII_TEXT, UNICODE_TEXT, " leading space", "tab\tand\nnewline  "):
        ids = tb.encode(text)
        assert tb.bytes_of(ids) == text.encode(), text
        # a multi-byte character split at the end waits; bytes that are not UTF-8 stop the text
        data = text.encode()
        enc = tb.encode_bytes(data + "🌍".encode()[:2])
        assert enc is not None and enc[1:] == (len(data), True)
    assert tb.encode_bytes(b"ab\xffcd")[1:] == (2, False)


def test_bos_stands_for_no_text_and_is_known():
    tb = TokenBytes.of(spm_tokenizer())
    assert tb.bos == 1 and tb.table[1] == b"" and 1 not in tb.encode("Hello there")
    assert TokenBytes.of(spm_tokenizer(bos=False)).bos is None
    assert TokenBytes.of(local_tokenizer()).bos is None  # ChatML: nothing added in front


def test_utf8_prefix():
    assert utf8_prefix("naïve 🌍".encode()) == (len("naïve 🌍".encode()), True)
    assert utf8_prefix("a🌍".encode()[:3]) == (1, True)
    assert utf8_prefix(b"a\x80b") == (1, False)


def test_unsupported_tokenizer_is_named():
    from tokenizers import decoders, models, pre_tokenizers

    wp = _fast(models.WordPiece({"[UNK]": 0, "hello": 1, "##lo": 2}, unk_token="[UNK]"),
               pre=pre_tokenizers.Whitespace(), decoder=decoders.WordPiece(), unk="[UNK]")
    with pytest.raises(UnsupportedTokenizerError, match="WordPiece"):
        TokenBytes.of(wp)


def test_vocab_map_is_exact_and_maps_shared_special_tokens():
    t, d = TokenBytes.of(local_tokenizer()), TokenBytes.of(_foreign_tokenizer())
    vm = VocabMap.of(t, d)
    assert VocabMap.of(t, d) is vm
    mapped = (vm.to_target >= 0).nonzero().flatten().tolist()
    assert 100 < vm.overlap == len(mapped) < len(d)
    for i in mapped:
        assert t.table[vm.to_target[i]] == d.table[i] != b""
    # the draft's specials (<unk> <s> </s>) are none of the target's (ChatML)
    assert all(vm.to_target[s] < 0 for s in d.special)
    same = VocabMap.of(t, t)
    assert same.to_target[2] == 2  # <|im_end|> to <|im_end|>
    assert same.overlap == len(t) and t.table[1] == b"<|im_start|>"


# -- greedy: mocks whose text we know

TGT = local_tokenizer()


def script_target(prompt: list[int], script: list[int], vocab: int, salt: str = "t"):
    """A target whose greedy continuation of ``prompt`` is ``script`` (any other context:
    fixed pseudo-random logits, so that a wrong token accepted would show)."""
    full = prompt + script
    noise = hashed_logits(vocab, salt)

    def fn(tokens):
        out = noise(tokens)
        if tokens == full[:len(tokens)] and len(tokens) < len(full):
            out = out.clone()
            out[full[len(tokens)]] += 100.0
        return out
    return MockLM(vocab, fn)


def oracle_draft(dtok, text: bytes, vocab: int, wrong_every: int = 0):
    """A draft (in ``dtok``'s tokens) that knows the target's text: after a context of its
    own tokens that spells a prefix of ``text``, it proposes the next token of its tokenizer's
    encoding of the whole text where the context ends at one of its token boundaries, else
    of the rest of the text (a byte token where the context ends inside a character); every
    ``wrong_every``-th proposal a wrong one."""
    db = TokenBytes.of(dtok)
    full = db.encode(text[:utf8_prefix(text)[0]].decode())
    ends = torch.tensor([len(db.table[t]) for t in full]).cumsum(0).tolist()
    byte_token = {db.table[t][0]: t for t in range(len(db)) if len(db.table[t]) == 1}
    calls = [0]

    def fn(tokens):
        calls[0] += 1
        out = torch.zeros(vocab)
        have = db.bytes_of(tokens)
        tok = db.tokenizer.eos_token_id or 0
        if text.startswith(have) and len(have) < len(text):
            rest = text[len(have):]
            if len(have) in ends[:-1]:
                tok = full[ends.index(len(have)) + 1]
            elif len(have) == 0:
                tok = full[0]
            elif (n := utf8_prefix(rest)[0]) and db.encode(rest[:n].decode()):
                tok = db.encode(rest[:n].decode())[0]
            elif rest[0] in byte_token:
                tok = byte_token[rest[0]]
        if wrong_every and calls[0] % wrong_every == 0:
            tok = (tok + 7) % vocab
        out[tok] = 50.0
        return out
    return MockLM(vocab, fn)


def _run(target, proposer, prompt, k, n=128, eos=(), params=None):
    params = params or SamplingParams(max_new_tokens=n)
    gen = Engine(target, proposer, k, debug=True).generate(prompt, params, eos)
    for _ in gen:
        pass
    return gen


SCRIPT = ASCII_TEXT + " " + UNICODE_TEXT + " def add(a, b):\n    return a + b\n" + ASCII_TEXT


@pytest.mark.parametrize("k", [1, 2, 5, 8])
@pytest.mark.parametrize("direction", ["bpe->bpe", "spm->bpe", "bpe->spm"])
@pytest.mark.parametrize("prompt_text", ["H", PROMPT, (PROMPT + " ") * 30])
def test_greedy_equality_and_an_oracle_draft_is_accepted(k, direction, prompt_text):
    """Different tokenizers both ways (other split counts of the same text): the output is
    the target's greedy text, and a draft that knows the text is accepted almost always."""
    dname, tname = direction.split("->")
    make = {"bpe": local_tokenizer, "spm": spm_tokenizer}
    ttok = make[tname]() if tname == "spm" else TGT
    dtok = _foreign_tokenizer() if dname == "bpe" else spm_tokenizer()
    tb = TokenBytes.of(ttok)
    prompt = tb.encode(prompt_text) if tb.bos is None else [tb.bos] + tb.encode(prompt_text)
    script = tb.encode(SCRIPT)
    target = script_target(prompt, script, len(tb))
    text = tb.bytes_of(prompt + script)
    gen = _run(target, CrossTokenizerProposer(oracle_draft(dtok, text, len(TokenBytes.of(dtok))), ttok, dtok),
               prompt, k, n=160)
    assert gen.token_ids == script[:160]
    s = gen.stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens / s.num_draft_tokens > 0.9, s


@pytest.mark.parametrize("k", [2, 5])
def test_a_draft_that_is_sometimes_wrong_realigns(k):
    prompt, script = TGT.encode(PROMPT), TGT.encode(SCRIPT)
    ftok = _foreign_tokenizer()
    vocab = len(TokenBytes.of(ftok))
    p = CrossTokenizerProposer(oracle_draft(ftok, TokenBytes.of(TGT).bytes_of(prompt + script), vocab, 4),
                               TGT, ftok)
    target = script_target(prompt, script, len(TGT))
    gen = _run(target, p, prompt, k, n=200)
    assert gen.token_ids == script[:200]
    s = gen.stats
    assert p.active and s.num_accepted_tokens > 0.2 * len(gen.token_ids)
    assert s.num_accepted_tokens < s.num_draft_tokens  # wrong drafts were proposed and rejected
    # the draft's cache was re-aligned, not refilled: each round fed at most its drafts and
    # the look-behind window beyond the new text (a refill would feed the whole context)
    fed = sum(p.draft.forward_sizes)
    assert fed <= len(p.ctx) + gen.stats.num_verify_passes * (k + 2 + LOOKBEHIND)
    assert len(p.ctx) * gen.stats.num_verify_passes > 20 * fed


def test_bos_once_and_the_prompt_seen_alike():
    """The draft's context is its own encoding of the target's prompt text, with its BOS once
    at position 0, after many rounds too (a BOS re-added on every re-encoding is a known bug)."""
    dtok = spm_tokenizer()
    db = TokenBytes.of(dtok)
    prompt, script = TGT.encode(PROMPT), TGT.encode(ASCII_TEXT)
    draft = oracle_draft(dtok, TokenBytes.of(TGT).bytes_of(prompt + script), len(db), wrong_every=3)
    p = CrossTokenizerProposer(draft, TGT, dtok)
    gen = _run(script_target(prompt, script, len(TGT)), p, prompt, 4, n=len(script))
    assert gen.token_ids == script and gen.stats.num_drafts > 3
    assert p.ctx[0] == db.bos and db.bos not in p.ctx[1:]
    assert p.ctx[:1 + len(dtok.encode(PROMPT, add_special_tokens=False))] == dtok.encode(PROMPT)
    assert draft.tokens.count(db.bos) == 1
    assert db.bytes_of(p.ctx) == TokenBytes.of(TGT).bytes_of(prompt + gen.token_ids)[:len(db.bytes_of(p.ctx))]


def test_the_draft_may_read_its_own_rendering_of_the_prompt():
    """draft_prompt_ids (e.g. the draft's own chat template): the draft's context starts with
    them, unchanged, and the generated text is aligned after them; for that request only."""
    ftok = _foreign_tokenizer()
    db = TokenBytes.of(ftok)
    prompt, script = TGT.encode(PROMPT), TGT.encode(ASCII_TEXT)
    own = ftok.encode("<s>User: " + PROMPT + "\nAssistant:", add_special_tokens=False)
    text = TokenBytes.of(TGT).bytes_of(prompt + script)
    p = CrossTokenizerProposer(oracle_draft(ftok, text, len(db)), TGT, ftok)
    p.draft_prompt_ids = own
    gen = _run(script_target(prompt, script, len(TGT)), p, prompt, 4, n=len(script))
    assert gen.token_ids == script and p.ctx[:len(own)] == own and p.draft_prompt_ids is None
    assert db.bytes_of(p.ctx[len(own):]) == TokenBytes.of(TGT).bytes_of(script)[:len(db.bytes_of(p.ctx[len(own):]))]
    _run(script_target(prompt, script, len(TGT)), p, prompt, 4, n=10)
    assert p.ctx[:len(prompt)] != own  # the next request reads the target's text again


def test_chat_special_tokens_and_eos_inside_a_block():
    """ChatML on both sides: the prompt's <|im_start|> reaches the draft as its own special
    id; the draft's end token is proposed as the target's, and the answer stops there."""
    ftok = _foreign_tokenizer()
    ftok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    db = TokenBytes.of(ftok)
    prompt = TGT.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    answer = TGT.encode("Fine, thanks.") + [2]
    target = script_target(prompt, answer, len(TGT))
    text = TokenBytes.of(TGT).bytes_of(prompt + answer)
    im_end = ftok.convert_tokens_to_ids("<|im_end|>")
    p = CrossTokenizerProposer(oracle_draft(ftok, text, len(db)), TGT, ftok, draft_eos_token_ids=(im_end,))
    assert VocabMap.of(TokenBytes.of(TGT), db).special_to_target[im_end] == 2
    gen = _run(target, p, prompt, 8, n=50, eos=(2,))
    assert gen.token_ids == answer and gen.finish_reason == "stop"
    assert ftok.convert_tokens_to_ids("<|im_start|>") in p.ctx
    # one round: the draft drafts on until its text spans K + 1 target tokens or it ends, so
    # the whole answer, EOS included, is proposed and accepted
    assert gen.stats.num_drafts == 1 and gen.stats.num_accepted_tokens == len(answer)


def test_draft_context_limit_turns_speculation_off():
    prompt, script = TGT.encode(PROMPT), TGT.encode(SCRIPT)
    ftok = _foreign_tokenizer()
    db = TokenBytes.of(ftok)
    draft = oracle_draft(ftok, TokenBytes.of(TGT).bytes_of(prompt + script), len(db))
    draft.max_context = 40
    p = CrossTokenizerProposer(draft, TGT, ftok)
    gen = _run(script_target(prompt, script, len(TGT)), p, prompt, 5, n=120)
    assert gen.token_ids == script[:120]
    assert not p.active and max(draft.forward_sizes) <= 40 and len(draft.tokens) <= 40


def test_text_that_is_not_utf8_turns_speculation_off():
    """A target that emits a lone continuation byte: no text to carry over, no crash."""
    prompt = TGT.encode(PROMPT)
    lone = next(i for i, b in enumerate(TokenBytes.of(TGT).table) if b == b"\x80")
    script = TGT.encode(" ok") + [lone] + TGT.encode(ASCII_TEXT)
    ftok = _foreign_tokenizer()
    draft = oracle_draft(ftok, TokenBytes.of(TGT).bytes_of(prompt + script), len(TokenBytes.of(ftok)))
    p = CrossTokenizerProposer(draft, TGT, ftok)
    gen = _run(script_target(prompt, script, len(TGT)), p, prompt, 4, n=len(script))
    assert gen.token_ids == script and not p.active


# -- sampling: toy tokenizers whose vocabularies overlap in part


def _toy(pieces: list[str], merges: list[tuple[str, str]]):
    from tokenizers import models

    vocab = {p: i for i, p in enumerate(pieces)}
    return _fast(models.BPE(vocab, merges), eos="<e>", special=["<e>"])


def toy_pair():
    """Target tokens a b c ab bc <e>; draft tokens a b c ca abc <e> (in another order): a, b,
    c and <e> map exactly, ca and abc only through text."""
    target = _toy(["a", "b", "c", "ab", "bc", "<e>"], [("a", "b"), ("b", "c")])
    draft = _toy(["<e>", "c", "b", "a", "ca", "ab", "abc"], [("c", "a"), ("a", "b"), ("ab", "c")])
    return target, draft


def _toy_lm(vocab: int, seed: int):
    table = torch.randn(8, 8, vocab, generator=torch.Generator().manual_seed(seed)) * 1.2
    return MockLM(vocab, lambda t: table[t[-2] % 8 if len(t) > 1 else 0, t[-1] % 8])


def _joint(target, params, prompt):
    fn, v = target.logits_fn, target.vocab_size
    p1 = probs_of(fn(prompt)[None, None], params, torch.tensor([prompt]), None)[0, 0]
    rows = [probs_of(fn(prompt + [a])[None, None], params, torch.tensor([prompt + [a]]), None)[0, 0]
            for a in range(v)]
    return p1[:, None] * torch.stack(rows)


def test_toy_pair_maps_as_documented():
    t, d = toy_pair()
    vm = VocabMap.of(TokenBytes.of(t), TokenBytes.of(d))
    assert vm.to_target.tolist() == [5, 2, 1, 0, -1, 3, -1]
    assert vm.special_to_target == {0: 5}


@pytest.mark.parametrize("guess,proposed", [("c", ["a"]), ("<e>", ["a"]), ("b", [])])
def test_a_draft_that_stops_unsure_proposes_its_last_token_where_it_is_settled(guess, proposed):
    """Greedy with p_min: the draft drafts "a" (sure), then is unsure (top probability below
    p_min) with ``guess`` as its best next token. The target's tokens for "a" + "c" are a | c:
    "a" is settled and proposed; "<e>" ends the text: proposed; "a" + "b" is the one target
    token ab, so "a" may not stand and is not proposed (the draft step that would settle it
    is not paid)."""
    t, d = toy_pair()
    tb, db = TokenBytes.of(t), TokenBytes.of(d)
    did = {db.table[i].decode(): i for i in range(len(db)) if db.table[i]}
    did["<e>"] = 0

    def fn(tokens):  # the prompt is one draft token; then "a", then unsure
        out = torch.zeros(len(db))
        out[did["a"] if len(tokens) == 1 else did[guess]] = 50.0 if len(tokens) == 1 else 0.5
        return out
    p = CrossTokenizerProposer(MockLM(len(db), fn), t, d, draft_eos_token_ids=(0,), p_min=0.4)
    state = RequestState(tb.encode("c"), 0, SamplingParams(), (5,), None, len(tb))
    p.reset(state, 64)
    out = p.propose(state, 6)
    assert [tb.table[i].decode() for i in out.token_ids[0].tolist()] == proposed


@pytest.mark.slow
@pytest.mark.parametrize("rule,temperature,top_k", [("rejection", 1.0, 0), ("rejection", 0.5, 0),
                                                    ("rejection", 2.0, 3), ("gumbel", 1.0, 0)])
def test_sampling_is_the_targets_distribution(rule, temperature, top_k):
    """20,000 requests of three tokens each: the joint distribution of the first two emitted
    tokens is the target's (chi-square), with draft tokens that map exactly (their
    distribution restricted and carried over) and ones that map only through text."""
    ttok, dtok = toy_pair()
    target, draft = _toy_lm(6, 1), _toy_lm(7, 2)
    prompt = [0, 2]
    params = SamplingParams(max_new_tokens=3, temperature=temperature, top_k=top_k)
    p = CrossTokenizerProposer(draft, ttok, dtok, draft_eos_token_ids=(0,))
    engine = Engine(target, p, 3, debug=True)
    counts = torch.zeros(6, 6)
    proposed = exact = 0
    for seed in range(N_RUNS):
        gen = engine.generate(prompt, dataclasses.replace(params, seed=seed, acceptance_rule=rule)).run()
        ids = gen.token_ids
        counts[ids[0], ids[1]] += 1
        proposed += gen.stats.num_draft_tokens
        exact += gen.stats.num_accepted_tokens
    assert proposed > N_RUNS and exact > N_RUNS / 4  # the draft drafted, and was accepted often
    assert_lossless(counts, _joint(target, params, prompt))


def test_padding_tokens_past_the_last_id_keep_a_pair_the_same():
    """A tokenizer whose list llama.cpp padded further ([PAD<id>] up to its embedding rows, as
    a Qwen2.5-7B GGUF beside a 0.5B one) pairs as "same" either way round; another extra
    token, or a pad name at another id, makes it "cross"."""
    import copy

    from specdecode.tokenmap import pair_mode

    base = local_tokenizer()
    n = len(base)
    padded = copy.deepcopy(base)  # (local_tokenizer() is one shared object)
    padded.add_tokens([f"[PAD{i}]" for i in range(n, n + 5)])
    assert len(padded) == n + 5 and padded.convert_tokens_to_ids(f"[PAD{n + 4}]") == n + 4
    assert pair_mode(padded, base) == pair_mode(base, padded) == "same"
    other = copy.deepcopy(base)
    other.add_tokens(["[PAD0]"])  # a pad name, at an id that is not its own
    assert pair_mode(other, base) == "cross"
    extra = copy.deepcopy(base)
    extra.add_tokens(["hello_world_token"])
    assert pair_mode(extra, base) == "cross"
