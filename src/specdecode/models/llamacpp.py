"""llama.cpp through llama-cpp-python (an optional extra): the peer a CPU user would
otherwise run, decoding the very GGUF file our target is converted from, and a backend
(:class:`LlamaCppLM`) that runs our engine and every chain proposer on its forward passes.

Install with ``make llamacpp`` (``pip install -e '.[llamacpp]'``; llama.cpp is compiled from
source for this CPU once, 10-20 minutes on 2 cores).
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import numpy as np
import torch

from . import registry, stores

INSTALL = ("make llamacpp  (runs pip install -e '.[llamacpp]': llama-cpp-python==0.3.36, "
           "compiled from source once, 10-20 minutes)")
N_CTX = 8192  # tokens of llama.cpp's KV cache: prompt + new tokens of every bench prompt


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message says the one command to run."""


def llama_cpp():
    """The ``llama_cpp`` module. Raises MissingExtraError naming the install command."""
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingExtraError(f"llama.cpp needs the llama-cpp-python extra, which is not "
                                f"installed ({e}); install it with: {INSTALL}") from None
    return llama_cpp


def gguf_file(name_or_path: str | Path) -> Path:
    """The GGUF file of a known model name (fetched on first use), an ollama model
    (``ollama:NAME[:TAG]``) or a ``.gguf`` path.

    Raises ValueError for anything else (llama.cpp reads GGUF files only), ModelFetchError
    when a known model cannot be fetched."""
    s = str(name_or_path)
    if s in registry.KNOWN_MODELS:
        registry.fetch(s)
    found = stores.gguf_path_of(s)
    if found is not None:
        return found
    if s.lower().endswith(".gguf"):
        raise ValueError(f"GGUF file {s!r} not found")
    raise ValueError(f"llama.cpp runs GGUF files: {s!r} is neither a known model "
                     f"({', '.join(registry.KNOWN_MODELS)}), an ollama model nor a .gguf file")


def load(name_or_path: str | Path, threads: int, prompt_lookup: int = 0):
    """A ``llama_cpp.Llama`` of the model's GGUF file with ``threads`` threads (decode and
    batch), an N_CTX-token context, no output on stderr. ``prompt_lookup`` > 0 attaches its
    prompt-lookup decoding (``LlamaPromptLookupDecoding``, that many draft tokens), which
    needs the logits of every row. Raises MissingExtraError, ValueError (see gguf_file)."""
    lc = llama_cpp()
    path = gguf_file(name_or_path)
    kwargs = {}
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup),
                  "logits_all": True}
    return lc.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                    verbose=False, **kwargs)


def json_grammar(schema: dict):
    """llama.cpp's grammar (GBNF, from its JSON-schema converter) of a JSON schema, for
    :func:`generate_greedy`. Raises MissingExtraError without the extra."""
    import json

    return llama_cpp().LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)


def generate_greedy(llm, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: tuple[int, ...], grammar=None) -> list[int]:
    """Greedy decoding (temperature 0: llama.cpp's greedy sampler) of up to
    ``max_new_tokens`` tokens after ``prompt_ids``, stopping after an EOS id (kept, as our
    engine keeps it); under llama.cpp's ``grammar`` where given (:func:`json_grammar`). The
    KV cache starts empty (no prefix reuse across calls)."""
    llm.reset()
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    for tok in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                            repeat_penalty=1.0, reset=True, grammar=grammar):
        out.append(int(tok))
        if tok in eos_token_ids or len(out) >= max_new_tokens:
            break
    return out


N_BATCH = 512  # tokens per llama_decode call: prefills longer than this go in chunks


class LlamaCppLM:
    """:class:`~.base.CausalLM` over llama.cpp's own forward passes of a GGUF file (its
    quantization as it is: Q4_K_M etc.), through llama-cpp-python's C API: one sequence,
    positions from :attr:`seq_len`, rollback by ``llama_memory_seq_rm``.

    llama.cpp's n-row passes are not row-independent (its matrix kernels round a batch
    differently from one row), so a verify pass can disagree with one-token decoding where
    two logits are close: greedy output through this backend as a target is identical to its
    plain decoding only up to that rounding, and the bench reports the mismatch rate. As a
    draft it changes nothing in the output (only the target decides); its one-token steps are
    llama.cpp's, the fastest this CPU has for a Q4/Q5 GGUF.

    ``threads``: threads for one-token and batched passes. Batch size 1 only. Raises
    MissingExtraError without the extra, ValueError for a file llama.cpp cannot load.
    """

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = N_CTX, _model=None):
        lc = llama_cpp()
        self._lc = lc
        self.path = Path(gguf)
        self.threads = int(threads)
        if _model is None:
            _quiet(lc)
            params = lc.llama_model_default_params()
            params.use_mmap = True
            model = lc.llama_model_load_from_file(str(self.path).encode(), params)
            if not model:
                raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF file it "
                                 f"reads, or truncated): "
                                 f"{' '.join(_LOG[-3:]).strip() or 'llama.cpp gave no reason'}")
            _model = _ModelHandle(lc, model)
        self._model = _model
        m = _model.ptr
        vocab = lc.llama_model_get_vocab(m)
        self.vocab_size = lc.llama_vocab_n_tokens(vocab)
        self.max_context = lc.llama_model_n_ctx_train(m)
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(m, buf, 256)
        self.weight_format = "llama.cpp " + buf.value.decode(errors="replace")
        self.weight_bytes = int(lc.llama_model_size(m))  # every tensor in the file, bytes
        self.seq_len = 0
        self._ctx = None
        self._n_ctx = 0
        self._new_context(n_ctx)
        self._batch = b = lc.llama_batch_init(N_BATCH, 0, 1)
        weakref.finalize(self, lc.llama_batch_free, b)
        for i in range(N_BATCH):  # every token belongs to sequence 0, in every call
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0

    def _new_context(self, n_ctx: int) -> None:
        lc = self._lc
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model.ptr, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}")
        if self._ctx is not None:
            self._free_ctx()
        self._ctx = ctx
        self._n_ctx = n_ctx
        self._free_ctx = weakref.finalize(self, lc.llama_free, ctx)
        self._model.contexts.append(self._free_ctx)
        self._memory = lc.llama_get_memory(ctx)

    def allocate(self, batch: int, max_len: int) -> None:
        """An empty KV cache of at least ``max_len`` positions (a larger context is made when
        needed). Raises ValueError for ``batch`` != 1 or ``max_len`` above the model's context."""
        if batch != 1:
            raise ValueError(f"the llama.cpp backend runs one sequence; got batch={batch}")
        if max_len > self.max_context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {self.max_context} tokens")
        if max_len > self._n_ctx:
            self._new_context(min(self.max_context, -(-max_len // 256) * 256))
        self._lc.llama_memory_clear(self._memory, True)
        self.seq_len = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, num_logits: int | None = None) -> torch.Tensor:
        """Append ``input_ids`` [1,T] at positions seq_len.. seq_len+T-1; fp32 logits
        [1,num_logits,V] of the last ``num_logits`` positions (all T when None)."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"the llama.cpp backend runs one sequence; got {input_ids.shape[0]} rows")
        ids = input_ids[0].tolist()
        t = len(ids)
        n = t if num_logits is None else num_logits
        if self.seq_len + t > self._n_ctx:
            raise ValueError(f"{self.seq_len + t} positions exceed the KV cache of {self._n_ctx}; "
                             "allocate() a longer one")
        lc, b = self._lc, self._batch
        out = np.empty((n, self.vocab_size), dtype=np.float32)
        done = 0
        for start in range(0, t, N_BATCH):
            chunk = np.asarray(ids[start:start + N_BATCH], dtype=np.int32)
            c = len(chunk)
            keep = (np.arange(start, start + c) >= t - n).astype(np.int8)
            pos = np.arange(self.seq_len, self.seq_len + c, dtype=np.int32)
            for field, values in ((b.token, chunk), (b.pos, pos), (b.logits, keep)):
                ctypes.memmove(field, values.ctypes.data, values.nbytes)
            b.n_tokens = c
            rows = int(keep.sum())
            rc = lc.llama_decode(self._ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at position {self.seq_len}")
            self.seq_len += c
            if rows:
                buf = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(rows * self.vocab_size,))
                out[done:done + rows] = buf.reshape(rows, self.vocab_size)
                done += rows
        return torch.from_numpy(out).unsqueeze(0)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.seq_len} positions")
        self._lc.llama_memory_seq_rm(self._memory, 0, length, -1)
        self.seq_len = length

    def fork(self) -> "LlamaCppLM":
        """Another context (KV cache) on the same loaded weights."""
        return LlamaCppLM(self.path, self.threads, self._n_ctx, _model=self._model)


class _ModelHandle:
    """A loaded llama_model, freed after every context made on it."""

    def __init__(self, lc, ptr):
        self.ptr = ptr
        self.contexts: list = []  # finalizers of its contexts
        weakref.finalize(self, _free_model, lc, ptr, self.contexts)


def _free_model(lc, ptr, contexts) -> None:
    for free_ctx in list(contexts):
        free_ctx()
    lc.llama_model_free(ptr)


_QUIET = []
_LOG: list[str] = []  # llama.cpp's last error lines, quoted when a load fails


def _quiet(lc) -> None:
    """Keep llama.cpp's log (a line per tensor at load, warnings about the vocabulary) off
    stderr, once; its last error lines go into our own error messages."""
    if _QUIET:
        return

    @lc.llama_log_callback
    def cb(level, text, user_data):
        if level == 3:  # GGML_LOG_LEVEL_ERROR
            _LOG.append(text.decode(errors="replace"))
            del _LOG[:-5]

    _QUIET.append(cb)  # the callback must outlive every call into llama.cpp
    lc.llama_log_set(cb, ctypes.c_void_p(0))
    lc.llama_backend_init()
