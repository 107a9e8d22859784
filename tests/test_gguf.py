"""GGUF files read natively (models/gguf_file.py): every tensor type the runtime reads gives
transformers' own reading of the file, is converted a slice of rows at a time, keeps verify
rows equal to one-token passes, and a damaged file is said as such."""

import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

import specdecode
from specdecode.models import gguf_file, quant, registry
from specdecode.models.loading import load, resolve_model_path
from specdecode.models.native import Transformer
from tiny_dirs import PROMPT, gguf_source_dir, write_tiny_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
Q4K = quant.q4k_kernel()[0] is not None


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-src")
    return {"llama": gguf_source_dir(root / "llama", "llama", tied=True),
            "qwen2": gguf_source_dir(root / "qwen2", "qwen2", tied=False)}


def transformers_reading(path):
    """transformers' own model of the GGUF file (it dequantizes with the gguf package)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def verify_rows_equal_one_token_passes(lm, seed=0):
    seq = torch.randint(0, lm.vocab_size, (1, 60), generator=torch.Generator().manual_seed(seed))
    lm.allocate(1, 64)
    lm.forward(seq[:, :30], num_logits=0)
    singles = torch.cat([lm.forward(seq[:, i:i + 1])[0] for i in range(30, 45)])
    for k in (2, 5, 9):
        lm.rollback(32)
        assert torch.equal(lm.forward(seq[:, 32:32 + k])[0], singles[2:2 + k]), k


def same_logits_and_lossless(ours, reference, path, qtype):
    """``ours`` (the file's float model) gives ``reference``'s logits; the file's int8 model
    (q4 for Q4_K where a Q4_K kernel runs) has verify rows equal to one-token passes and
    its speculative output equals its plain decoding."""
    ids = torch.randint(0, ours.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(ids).logits
    ours.allocate(1, 32)
    assert (ours(ids) - ref).abs().max() <= 1e-4 * ref.abs().max()
    dtype = "q4" if qtype == "Q4_K" and Q4K else "int8"
    m = load(path, dtype=dtype)
    assert m.lm.weight_format.startswith(dtype)
    verify_rows_equal_one_token_passes(m.lm)
    plain = specdecode.generate(m, PROMPT, method="ar", max_new_tokens=24)
    assert specdecode.generate(m, PROMPT, method="prompt-lookup", max_new_tokens=24).token_ids == plain.token_ids


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_type_reads_as_transformers_reads_it(sources, tmp_path, arch, qtype):
    """Each tensor type, every 2-D weight stored in it (the embedding and an untied output
    too): the float model read natively holds transformers' weights bit for bit and gives
    its logits; the int8 model (q4 for Q4_K) has verify rows equal to one-token passes and
    its speculative output equals its plain decoding."""
    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_tiny_gguf(sources[arch], path, qtype=qtype)
    assert gguf_file.GGUFFile(path).type_counts()[qtype] >= 7 * 2 + 1
    hf = transformers_reading(path)
    meta = resolve_model_path(path)
    ours = Transformer.from_pretrained(meta, pack=False)
    theirs = hf.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    same_logits_and_lossless(ours, hf, path, qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qwen3_from_a_gguf_file_gives_transformers_logits(sources, tmp_path, qtype):
    """Qwen3 (per-head query and key norms, a head size of its own) written as llama.cpp
    writes it: its float model gives the logits of transformers' Qwen3 on the same weights,
    its int8 / q4 model has verify rows equal to one-token passes (on the modules: the fused
    layer kernel has no per-head norms) and speculates losslessly."""
    src = gguf_source_dir(tmp_path / "src", "qwen3", tied=True)
    path = tmp_path / f"qwen3-{qtype}.gguf"
    write_tiny_gguf(src, path, qtype=qtype)
    meta = resolve_model_path(path)
    ours = Transformer.from_pretrained(meta, pack=False)
    assert ours.args.qk_norm and ours.args.head_dim == 32
    reference = transformers.Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # the source's weights as the file stores them
        for name, t in ours.state_dict().items():
            reference.get_parameter(name).copy_(t)
    same_logits_and_lossless(ours, reference, path, qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gemma3_from_a_gguf_file_gives_transformers_logits(sources, tmp_path, qtype):
    """Gemma 3 written as llama.cpp writes it (its 1 + w norms, sliding window and linear
    RoPE scaling in the metadata, five sliding-window layers then a global one): the float
    model gives transformers' Gemma 3 logits on the same weights over more than the window,
    the quantized model's verify rows equal its one-token passes across the window's edge,
    and its speculative output equals its plain decoding."""
    src = gguf_source_dir(tmp_path / "src", "gemma3", tied=True)
    path = tmp_path / f"gemma3-{qtype}.gguf"
    write_tiny_gguf(src, path, qtype=qtype)
    ours = Transformer.from_pretrained(resolve_model_path(path), pack=False)
    a = ours.args
    assert a.sandwich_norms and a.sliding_window == 8 and a.sliding_layers == (0, 1, 2, 3, 4)
    assert dict(a.rope_scaling) == {"factor": 8.0, "rope_type": "linear"} and a.attn_scale == 64 ** -0.5
    reference = transformers.Gemma3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # the file's weights, its norms back to transformers' w
        for name, t in ours.state_dict().items():
            reference.get_parameter(name).copy_(t - 1 if name.endswith("norm.weight") else t)
    same_logits_and_lossless(ours, reference, path, qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_phi3_from_a_gguf_file_gives_transformers_logits(sources, tmp_path, qtype):
    """Phi-4-mini's switches (fused qkv and gate_up, partial rotary, LongRoPE factors stored
    as tensors, tied embeddings) written as llama.cpp writes them: the config gets its rope
    from the file's metadata, the float model gives transformers' Phi-3 logits on the same
    weights, and the quantized model is lossless."""
    src = gguf_source_dir(tmp_path / "src", "phi3", tied=True)
    path = tmp_path / f"phi3-{qtype}.gguf"
    write_tiny_gguf(src, path, qtype=qtype)
    ours = Transformer.from_pretrained(resolve_model_path(path), pack=False)
    rope = dict(ours.args.rope_scaling)
    assert ours.args.fused and ours.args.rotary_dim == 48 and ours.args.max_position_embeddings == 64
    assert rope["rope_type"] == "longrope" and rope["short_factor"][1] == pytest.approx(1.05)
    reference = transformers.Phi3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # the source's weights as the file stores them
        for name, t in ours.state_dict().items():
            reference.get_parameter(name).copy_(t)
    same_logits_and_lossless(ours, reference, path, qtype)


def test_the_native_reading_equals_the_fp32_conversion_bit_for_bit(sources, tmp_path):
    """Where a tensor keeps the format it had when GGUF files were converted to fp32 first
    (Q4_K blocks, int8 from the dequantized rest), the loaded bits are the same: the int8
    and q4 states from the file equal those from transformers' fp32 conversion."""
    path = tmp_path / "mix.gguf"
    write_tiny_gguf(sources["qwen2"], path, qtype="Q6_K")
    converted = registry.converted_dir_for_gguf(path)
    native = load(path, dtype="int8", tokenizer=False).lm.state_dict()
    via_fp32 = load(converted, dtype="int8", tokenizer=False).lm.state_dict()
    assert native.keys() == via_fp32.keys()
    for name in native:
        assert torch.equal(native[name], via_fp32[name]), name


def test_weights_are_converted_a_slice_of_rows_at_a_time(sources, tmp_path, monkeypatch):
    """No weight is read or dequantized whole (the float copy of a 7B embedding alone is
    2 GB): with slices of 16 rows every read and every dequantization covers at most 16 rows,
    and the state is the same bits as with the default slices."""
    path = tmp_path / "k.gguf"
    write_tiny_gguf(sources["qwen2"], path, qtype="Q6_K")
    whole = quant.quantize_state(_weights(path), "kn", False, keep_q4k=True)
    path4 = tmp_path / "k4.gguf"
    write_tiny_gguf(sources["qwen2"], path4, qtype="Q4_K")
    whole4 = quant.quantize_state(_weights(path4), "kn", False, keep_q4k=True)
    seen = []
    real_raw, real_dequantize = gguf_file.GGUFTensor.raw, gguf_file.GGUFTensor.dequantize

    def raw(self, start=0, stop=None, out=None):
        rows = real_raw(self, start, stop, out)
        seen.append(rows.shape[0])
        return rows

    def dequantize(self, raw, out=None):
        seen.append(raw.shape[0])
        return real_dequantize(self, raw, out)

    monkeypatch.setattr(gguf_file.GGUFTensor, "raw", raw)
    monkeypatch.setattr(gguf_file.GGUFTensor, "dequantize", dequantize)
    monkeypatch.setattr(quant, "SLICE_VALUES", 1)  # slices of 16 rows
    for p, full in ((path, whole), (path4, whole4)):
        seen.clear()
        sliced = quant.quantize_state(_weights(p), "kn", False, keep_q4k=True)
        assert max(seen) == 16 and len(seen) > 20
        assert sliced.keys() == full.keys()
        for name in full:
            assert torch.equal(sliced[name], full[name]), name
    assert any(k.endswith(".dmin") for k in whole4)  # the Q4_K blocks were kept, by slices too


def _weights(path):
    meta = resolve_model_path(path)
    config = transformers.AutoConfig.from_pretrained(meta)
    with torch.device("meta"):
        names = list(transformers.AutoModelForCausalLM.from_config(config).state_dict())
    return gguf_file.GGUFFile(path).weights(names, config.num_hidden_layers,
                                            config.num_attention_heads, config.num_key_value_heads)


def test_damaged_files_are_said_as_such(sources, tmp_path):
    """A truncated download, a file that is not GGUF, and a tensor type the runtime does not
    read: one error naming the file and what to do, never a traceback from numpy."""
    good = tmp_path / "good.gguf"
    write_tiny_gguf(sources["llama"], good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 3 // 4])
    with pytest.raises(gguf_file.GGUFError, match=f"{cut} is not a readable GGUF file: truncated or "
                       "damaged .* download it again"):
        load(cut)
    tail = tmp_path / "tail.gguf"  # the header whole, the last tensor's bytes cut
    tail.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(gguf_file.GGUFError, match=f"{tail} is (not a readable GGUF file: truncated|"
                       "truncated: tensor)"):
        load(tail)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"ggml" + bytes(range(256)) * 4)
    with pytest.raises(gguf_file.GGUFError, match=f"{junk} is not a readable GGUF file: not a GGUF file"):
        load(junk)
    q2 = tmp_path / "q2.gguf"
    write_tiny_gguf(sources["llama"], q2, qtype="Q2_K")
    with pytest.raises(gguf_file.GGUFError,
                       match=r"tensor token_embd.weight is Q2_K, a type this runtime does not read .*--backend llama.cpp"):
        load(q2)


def test_a_template_reaching_for_python_objects_is_refused(sources, tmp_path):
    """A GGUF chat template is untrusted: rendered in transformers' sandboxed Jinja, a
    template that reaches for Python internals fails with a clear error, never runs."""
    path = tmp_path / "evil.gguf"
    write_tiny_gguf(sources["llama"], path, chat_template=(
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"))
    m = load(path)
    with pytest.raises(ValueError, match="the chat template of .* failed .*unsafe"):
        specdecode.generate(m, "hi", chat=True, max_new_tokens=2)


def test_a_known_models_metadata_moves_with_its_cache(sources, tmp_path):
    """A known model's metadata directory names its GGUF file by the path from itself: a
    cache that is moved (or linked from elsewhere, as the tests link it) still finds it."""
    cache = tmp_path / "old"
    (cache / "gguf").mkdir(parents=True)
    write_tiny_gguf(sources["llama"], cache / "gguf" / "m.gguf")
    gguf_file.write_metadata_dir(cache / "gguf" / "m.gguf", cache / "models" / "m", relative=True)
    moved = tmp_path / "new"
    cache.rename(moved)
    assert gguf_file.source_of(moved / "models" / "m") == moved / "gguf" / "m.gguf"
    assert load(moved / "models" / "m", tokenizer=False).lm.vocab_size > 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_torch_dequantization_is_the_gguf_packages_bit_for_bit(qtype):
    """Q4_K and Q6_K rows dequantized in torch equal the gguf package's numpy arithmetic
    bit for bit (random blocks with finite fp16 scales)."""
    kind = gguf.GGMLQuantizationType[qtype]
    size = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (48, 3 * size), dtype=np.uint8)
    blocks = raw.reshape(48, 3, size)
    for at in ((0, 2) if qtype == "Q4_K" else (size - 2,)):  # d (and dmin): finite fp16
        blocks[..., at:at + 2] = rng.normal(0, 0.05, (48, 3)).astype(np.float16)[..., None].view(np.uint8)
    fn = gguf_file.dequantize_q4k if qtype == "Q4_K" else gguf_file.dequantize_q6k
    got = fn(torch.from_numpy(raw), torch.empty(48, 3 * 256))
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert torch.equal(got, want)


def test_the_header_is_parsed_once_and_its_table_kept_for_later_loads(sources, tmp_path, monkeypatch):
    """Writing a GGUF file's metadata parses its header once (transformers' config and
    tokenizer readers get that parse), and keeps its tensor table and short fields in the
    directory: a later process loads the model without parsing the header again; a file
    changed since (another size or mtime) is parsed again; a directory written before
    tables were gets one."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(sources["qwen2"], path)
    real, parses = gguf.GGUFReader, []

    def counting(p, *args, **kwargs):
        parses.append(p)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    meta = tmp_path / "meta"
    gguf_file.write_metadata_dir(path, meta)
    assert len(parses) == 1
    assert gguf.GGUFReader is counting  # (the swap for transformers is undone)
    parsed = gguf_file.open_file(path)
    table = json.loads((meta / gguf_file.TABLE_FILE).read_text())
    assert table["size"] == path.stat().st_size

    monkeypatch.setattr(gguf_file, "_FILES", {})  # a later process
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("parsed the header again"))
    again = gguf_file.of_directory(meta)
    assert again.tensors == parsed.tensors and again.fields == parsed.fields and again.arch == parsed.arch
    assert Transformer.from_pretrained(meta, dtype="int8").weight_format.startswith("int8")
    monkeypatch.setattr(gguf, "GGUFReader", counting)
    assert len(parses) == 1  # (the model's weights were read with the table alone)

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed
    monkeypatch.setattr(gguf_file, "_FILES", {})
    gguf_file.of_directory(meta)
    assert len(parses) == 2
    monkeypatch.setattr(gguf_file, "_FILES", {})
    gguf_file.of_directory(meta)  # the table was written anew for the changed file
    assert len(parses) == 2
    (meta / gguf_file.TABLE_FILE).unlink()  # a directory of an earlier version
    monkeypatch.setattr(gguf_file, "_FILES", {})
    assert gguf_file.of_directory(meta).tensors == parsed.tensors
    assert json.loads((meta / gguf_file.TABLE_FILE).read_text())["mtime_ns"] == path.stat().st_mtime_ns


def test_prefetch_reads_the_file_in_a_thread_unless_memory_is_short(tmp_path, monkeypatch):
    """While a first load parses the header, a thread reads the file (into the page cache);
    a file larger than half the memory available is left alone."""
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(40 << 20))
    started, read = [], []
    real_open = open

    class Recorded:
        def __init__(self, target, name, daemon):
            started.append((name, daemon))
            self.target = target

        def start(self):
            self.target()

    class Counted:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def fileno(self):
            return self.fh.fileno()

        def readinto(self, b):
            read.append(self.fh.readinto(b))
            return read[-1]

    def recording_open(p, *args, **kwargs):
        fh = real_open(p, *args, **kwargs)
        return Counted(fh) if str(p) == str(path) else fh

    monkeypatch.setattr(gguf_file.threading, "Thread", Recorded)
    monkeypatch.setattr("builtins.open", recording_open)
    gguf_file.prefetch(path)
    assert started == [("gguf-prefetch", True)] and sum(read) == 40 << 20
    monkeypatch.setattr(gguf_file.Path, "read_text", lambda self, *a, **k: "MemAvailable: 60000 kB\n")
    gguf_file.prefetch(path)
    assert len(started) == 1  # 40 MiB > half of ~58 MiB: not read
