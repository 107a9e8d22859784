"""A GGUF file of a real model's shapes and llama.cpp's Q4_K_M tensor-type mix, with random
blocks, to measure loading and forward passes at a size no fetchable model has.

    python benchmarks/synthetic_gguf.py OUT.gguf [--tokenizer-from GGUF] [--layers N] ...

Default shapes: Qwen2.5-7B (28 layers, 3,584 wide, 18,944 FFN, 28 query / 4 key-value heads,
152,064 embedding and output rows, untied output). Types as llama.cpp's Q4_K_M puts them
(``llama-quant.cpp``): the output Q6_K; attn_v and ffn_down Q6_K on the first and last eighth
of the layers and every third layer between, Q4_K elsewhere; every other linear and the
embedding Q4_K; norms and biases F32. Blocks are random bytes whose fp16 scales are set to
normal values in [0.5e-3, 2e-3] (no inf, NaN or denormal, which would distort timings). The
tokenizer metadata is copied from ``--tokenizer-from`` (default: the default target's file),
the token list padded to the embedding rows as llama.cpp's converter pads it (``[PAD<id>]``),
so that the Qwen2.5 drafts pair with it. Tensors are written one at a time (memory: one
tensor). Prints the file's size and type counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from specdecode.models import registry

T = gguf.GGMLQuantizationType
FP16_AT = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of each block's fp16 scales


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(kind, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, cols / block * bytes] of random ``kind`` blocks with normal fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_AT[kind]:
        b[:, :, at:at + 2] = rng.uniform(0.5e-3, 2e-3, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def tensors(a) -> list[tuple[str, tuple[int, int] | tuple[int], object]]:
    """(name, (rows, cols) or (n,), type) of every tensor, in llama.cpp's order."""
    head = a.hidden // a.heads
    out = [("output.weight", (a.vocab, a.hidden), T.Q6_K), ("token_embd.weight", (a.vocab, a.hidden), T.Q4_K)]
    for i in range(a.layers):
        big = T.Q6_K if more_bits(i, a.layers) else T.Q4_K
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (a.hidden,), T.F32),
                (b + "attn_q.bias", (a.hidden,), T.F32), (b + "attn_q.weight", (a.hidden, a.hidden), T.Q4_K),
                (b + "attn_k.bias", (a.kv_heads * head,), T.F32),
                (b + "attn_k.weight", (a.kv_heads * head, a.hidden), T.Q4_K),
                (b + "attn_v.bias", (a.kv_heads * head,), T.F32),
                (b + "attn_v.weight", (a.kv_heads * head, a.hidden), big),
                (b + "attn_output.weight", (a.hidden, a.hidden), T.Q4_K),
                (b + "ffn_norm.weight", (a.hidden,), T.F32),
                (b + "ffn_gate.weight", (a.ffn, a.hidden), T.Q4_K),
                (b + "ffn_up.weight", (a.ffn, a.hidden), T.Q4_K),
                (b + "ffn_down.weight", (a.hidden, a.ffn), big)]
    return out + [("output_norm.weight", (a.hidden,), T.F32)]


def data(name: str, shape, kind, rng) -> np.ndarray:
    if kind == T.F32:  # norms about 1, biases small
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)
    return random_blocks(kind, shape[0], shape[1], rng)


def copy_tokenizer(src: Path, w: gguf.GGUFWriter, vocab: int) -> int:
    """Copy the tokenizer.* metadata of ``src`` into ``w``, the token list (and its types and
    scores) padded to ``vocab`` entries with ``[PAD<id>]`` unused tokens. Returns the
    number of tokens the source lists."""
    reader = gguf.GGUFReader(str(src))
    listed = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, types = field.contents(), field.types
        if key == "tokenizer.ggml.tokens":
            listed = len(value)
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.UNUSED] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        w.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    if listed is None:
        raise SystemExit(f"error: {src} lists no tokenizer.ggml.tokens; give --tokenizer-from a model's GGUF")
    if listed > vocab:
        raise SystemExit(f"error: {src} lists {listed} tokens, more than --vocab {vocab}")
    return listed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="a GGUF file whose tokenizer metadata is copied (default: the default target's)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--ffn", type=int, default=18944)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=152064, help="embedding and output rows")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.hidden % 256 or a.ffn % 256 or a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden {a.hidden} and --ffn {a.ffn} must be multiples of 256 (k-quant blocks), "
                f"--hidden of --heads {a.heads}, --heads of --kv-heads {a.kv_heads}")
    src = a.tokenizer_from
    if src is None:
        registry.fetch(registry.DEFAULT_TARGET)
        src = registry.gguf_path(registry.DEFAULT_TARGET)
    w = gguf.GGUFWriter(str(a.out), "qwen2")
    w.add_name(f"synthetic Qwen2.5 shapes, {a.layers} layers x {a.hidden}")
    w.add_block_count(a.layers)
    w.add_context_length(32768)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    listed = copy_tokenizer(src, w, a.vocab)
    plan = tensors(a)
    rng = np.random.default_rng(a.seed)
    for name, shape, kind in plan:
        if kind == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            nbytes = shape[0] * shape[1] // block * size
            w.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8), nbytes,
                              raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tqdm(plan, desc=f"writing {a.out.name}", unit="tensor", file=sys.stderr):
        w.write_tensor_data(data(name, shape, kind, rng))
    w.close()
    counts: dict[str, int] = {}
    for _, _, kind in plan:
        counts[kind.name] = counts.get(kind.name, 0) + 1
    print(json.dumps({"file": str(a.out), "bytes": a.out.stat().st_size, "types": counts,
                      "tokens_listed": listed, "vocab": a.vocab}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
