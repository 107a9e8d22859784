"""A stand-in for llama-cpp-python's C API (the part :class:`specdecode.models.llamacpp.LlamaCppLM`
calls), over a toy model whose logits at a position are a fixed random function of every
token up to it, read from its own KV cache. So a wrong position, a stale cache entry after a
rollback or a row taken from the wrong output changes the logits a test compares."""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np

VOCAB = 48
N_CTX_TRAIN = 1024


def toy_logits(prefix: list[int]) -> np.ndarray:
    """The toy model's logits [VOCAB] after ``prefix`` (float32)."""
    seed = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
    return (np.random.default_rng(seed).standard_normal(VOCAB) * 3).astype(np.float32)


class Context:
    def __init__(self, n_ctx: int):
        self.n_ctx, self.kv, self.out, self.freed = n_ctx, [], np.zeros(0, np.float32), False


def module() -> ModuleType:
    """A fresh fake ``llama_cpp`` module; ``.log`` holds the contexts made and what was freed."""
    m = ModuleType("llama_cpp")
    m.contexts, m.freed, m.decode_calls = [], [], []

    def load(path: bytes, params):
        p = Path(path.decode())
        if not p.is_file() or not p.read_bytes().startswith(b"GGUF"):
            m.log_cb(3, b"llama_model_load: error loading model: invalid magic\n", None)
            return None
        return SimpleNamespace(path=p)

    def init_ctx(model, params):
        ctx = Context(params.n_ctx)
        m.contexts.append(ctx)
        return ctx

    def batch_init(n, embd, n_seq):  # ctypes arrays, as llama_batch's fields are C arrays
        return SimpleNamespace(n_tokens=0, token=(ctypes.c_int32 * n)(), pos=(ctypes.c_int32 * n)(),
                               n_seq_id=(ctypes.c_int32 * n)(),
                               seq_id=[(ctypes.c_int32 * 1)(-1) for _ in range(n)],
                               logits=(ctypes.c_int8 * n)())

    def decode(ctx, b):
        m.decode_calls.append(b.n_tokens)
        rows = []
        for i in range(b.n_tokens):
            if b.pos[i] != len(ctx.kv) or b.seq_id[i][0] != 0 or len(ctx.kv) >= ctx.n_ctx:
                return 1  # llama.cpp refuses a batch it cannot place in the cache
            ctx.kv.append(b.token[i])
            if b.logits[i]:
                rows.append(toy_logits(ctx.kv))
        ctx.out = np.ascontiguousarray(np.stack(rows) if rows else np.zeros((0, VOCAB), np.float32))
        return 0

    def seq_rm(mem, seq, p0, p1):
        assert seq == 0 and p1 == -1
        del mem.kv[p0:]
        return True

    def desc(model, buf, size):
        buf.value = b"toy 1M Q4_K - Medium"

    m.llama_model_default_params = lambda: SimpleNamespace(use_mmap=False)
    m.llama_model_load_from_file = load
    m.llama_model_get_vocab = lambda model: model
    m.llama_vocab_n_tokens = lambda vocab: VOCAB
    m.llama_model_n_ctx_train = lambda model: N_CTX_TRAIN
    m.llama_model_desc = desc
    m.llama_model_size = lambda model: 123456
    m.llama_context_default_params = lambda: SimpleNamespace(
        n_ctx=0, n_batch=0, n_ubatch=0, n_threads=0, n_threads_batch=0, no_perf=False)
    m.llama_init_from_model = init_ctx
    m.llama_get_memory = lambda ctx: ctx
    m.llama_batch_init = batch_init
    m.llama_batch_free = lambda b: m.freed.append("batch")
    m.llama_decode = decode
    m.llama_get_logits = lambda ctx: ctx.out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    m.llama_memory_seq_rm = seq_rm
    m.llama_memory_clear = lambda mem, data: mem.kv.clear()
    m.llama_free = lambda ctx: (setattr(ctx, "freed", True), m.freed.append("context"))
    m.llama_model_free = lambda model: m.freed.append("model")
    m.llama_log_callback = lambda f: f
    m.llama_log_set = lambda cb, user_data: setattr(m, "log_cb", cb)
    m.llama_backend_init = lambda: None
    return m
