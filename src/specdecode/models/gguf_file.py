"""GGUF files read natively: the header and tensor table checked once, each tensor read from
the file on its own (its rows dequantized a slice at a time), and the metadata a model needs
besides its weights (config, generation config, tokenizer, chat template) written once into a
small directory. No float copy of the model is ever held. Format: ggml's GGUF specification
(the ``gguf`` package reads the header; llama.cpp's block layouts)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
# the tensor types read here; each either kept as its blocks by a kernel (Q4_K: quant.Q4KLinear)
# or dequantized a slice of rows at a time by the gguf package into one of our formats
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K,
                   T.Q6_K)
SOURCE_FILE = "gguf_source.json"  # names the GGUF file a metadata directory was written from
TABLE_FILE = "gguf_table.json"  # its header's tensor table and short fields (GGUFFile.table)


class GGUFError(ValueError):
    """A GGUF file that cannot be read here: damaged, truncated, or holding a tensor type this
    runtime does not read. The message names the file and what to do."""


class TensorInfo(NamedTuple):
    """A tensor's entry in a GGUF file's table: ``shape`` in torch order (rows, columns),
    ``offset`` and ``nbytes`` of its data in the file (bytes)."""

    name: str
    type: gguf.GGMLQuantizationType
    shape: torch.Size
    offset: int
    nbytes: int


class GGUFTensor:
    """One weight of a GGUF file, read only when asked.

    ``shape``: torch order (rows, columns), e.g. [out_features, in_features]; ``type``: its
    ``GGMLQuantizationType``. ``row_heads``: heads whose rotary halves llama.cpp's converter
    interleaved (llama's q and k): the row order is undone on the raw blocks, as transformers
    undoes it on the dequantized rows.
    """

    def __init__(self, file: "GGUFFile", name: str, row_heads: int | None = None):
        t = file.tensors[name]
        self.file, self.name, self.type, self.shape = file, name, t.type, t.shape
        self.row_heads = row_heads
        self._offset, self._bytes = t.offset, t.nbytes

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """The size of the tensor's data in the file, in bytes."""
        return self._bytes

    def raw(self, start: int = 0, stop: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop of the tensor's bytes, uint8 [rows, bytes per row] (1-D tensors:
        one row), read from the file (not mapped: no page of it is held once this array is
        dropped). Only those rows are read, except for llama's q and k (small), read whole to
        undo their row order.

        Args:
            start: the first row.
            stop: the row after the last (None: to the end).
            out: a flat uint8 array of at least that many bytes to read into (a buffer kept
                for the slices of a tensor: no new memory a slice); the result is a view of it.

        Returns:
            uint8 [stop - start, bytes per row].

        Raises:
            GGUFError: the file is cut short within these rows.
        """
        rows = self.shape[0] if self.dim() == 2 else 1
        stop = rows if stop is None else stop
        whole = bool(self.row_heads)
        per_row = self._bytes // rows
        first, count = (0, rows) if whole else (start, stop - start)
        data = np.empty(count * per_row, np.uint8) if out is None or whole else out[:count * per_row]
        with open(self.file.path, "rb") as fh:
            fh.seek(self._offset + first * per_row)
            got = fh.readinto(memoryview(data))
        if got != count * per_row:
            raise GGUFError(f"{self.file.path}: tensor {self.name} is cut short: the file is "
                            "truncated; download it again")
        data = data.reshape(count, per_row)
        if whole:
            h = self.row_heads
            data = data.reshape(h, rows // h // 2, 2, -1).swapaxes(2, 1).reshape(rows, -1)[start:stop]
        return data

    def dequantize(self, raw: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of :meth:`raw` dequantized with the gguf package's arithmetic (as transformers
        reads GGUF files), bit for bit: Q4_K and Q6_K by :func:`dequantize_q4k` and
        :func:`dequantize_q6k` (the same float steps in torch, on every thread), the other
        types by the gguf package itself.

        Args:
            raw: uint8 [rows, bytes per row] of this tensor.
            out: fp32 of at least rows x columns values to write into (a buffer kept for the
                slices of a tensor); the result is a view of it. None: a new tensor.

        Returns:
            fp32 [rows, columns].
        """
        n, cols = raw.shape[0], raw.shape[1] // gguf.GGML_QUANT_SIZES[self.type][1] * \
            gguf.GGML_QUANT_SIZES[self.type][0]
        w = torch.empty(n * cols) if out is None else out.view(-1)[:n * cols]
        w = w.view(n, cols)
        if self.type == T.Q4_K:
            return dequantize_q4k(torch.from_numpy(raw), w)
        if self.type == T.Q6_K:
            return dequantize_q6k(torch.from_numpy(raw), w)
        return w.copy_(torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(raw, self.type), dtype=np.float32)).view(n, cols))

    def float(self) -> torch.Tensor:
        """The whole tensor dequantized, fp32 in ``shape`` (a float copy: 4 bytes a value)."""
        return self.dequantize(self.raw()).reshape(self.shape)


def q4k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of Q4_K blocks (llama.cpp's ``get_scale_min_k4``, the gguf
    package's ``Q4_K.get_scale_min``), four bytes at a time as int32 (each byte's bits stay
    in that byte).

    Args:
        scales: uint8 [..., 12], the blocks' packed scales (rows of bytes at offsets and
            strides that are multiples of 4, as in a block's bytes 4..15).

    Returns:
        (sc, mn) uint8 [..., 8], the eight 32-input groups' scales and mins.
    """
    d, m, md = scales.view(torch.int32).unbind(-1)
    sc = torch.stack((d & 0x3F3F3F3F, (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)), -1)
    mn = torch.stack((m & 0x3F3F3F3F, ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)), -1)
    return sc.view(torch.uint8), mn.view(torch.uint8)


def dequantize_q4k(raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Q4_K rows dequantized into ``out``, the gguf package's float steps bit for bit:
    (d * sc) * q - dmin * m.

    Args:
        raw: uint8 [rows, blocks * 144] (llama.cpp's ``block_q4_K``).
        out: fp32 [rows, blocks * 256], written.

    Returns:
        ``out``.
    """
    n, nb = raw.shape[0], raw.shape[1] // 144
    b = raw.view(n, nb, 144)
    sc, mn = q4k_scale_min(b[..., 4:16])
    a = b[..., 0:2].view(torch.float16).float() * sc.float()  # [n, nb, 8]
    c = b[..., 2:4].view(torch.float16).float() * mn.float()
    qs = b[..., 16:].view(n, nb, 4, 32)
    w = out.view(n, nb, 4, 2, 32)  # per 64 inputs: the low nibbles, then the high ones
    w[..., 0, :] = qs & 0x0F
    w[..., 1, :] = qs >> 4
    w = w.view(n, nb, 8, 32)
    w.mul_(a[..., None]).sub_(c[..., None])
    return out


def dequantize_q6k(raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Q6_K rows dequantized into ``out``, the gguf package's float steps bit for bit:
    (d * scale) * (q - 32).

    Args:
        raw: uint8 [rows, blocks * 210] (llama.cpp's ``block_q6_K``).
        out: fp32 [rows, blocks * 256], written.

    Returns:
        ``out``.
    """
    n, nb = raw.shape[0], raw.shape[1] // 210
    b = raw.view(n, nb, 210)
    scale = b[..., 208:210].view(torch.float16).float() * b[..., 192:208].view(torch.int8).float()
    ql = b[..., :128].view(n, nb, 2, 1, 64)
    qh = b[..., 128:192].view(n, nb, 2, 1, 32)
    q = torch.empty((n, nb, 2, 2, 64), dtype=torch.uint8)  # per 128 inputs: ql's low, high nibbles
    q[..., 0:1, :] = ql & 0x0F
    q[..., 1:2, :] = ql >> 4
    q = q.view(n, nb, 2, 4, 32)
    for i in range(4):  # qh's four 2-bit fields: the high bits
        q[..., i:i + 1, :] |= ((qh >> 2 * i) & 0x03) << 4
    w = out.view(n, nb, 16, 16)
    w.copy_(q.view(n, nb, 16, 16)).sub_(32).mul_(scale[..., None])
    return out


class GGUFFile:
    """A GGUF file's header and tensor table, checked.

    ``tensors``: the table, by GGUF name; ``fields``: the metadata values but the long
    arrays (the tokenizer's lists: transformers reads those). Read from ``reader`` (the gguf
    package's, already parsed), else from ``table`` (:meth:`table`'s copy of this file's
    header), else parsed here; the reader is dropped once read (it holds about 0.5 GB of
    objects for a 152k-token vocabulary).
    Raises GGUFError naming the file and what is wrong: not a GGUF file, a damaged header, a
    tensor that lies past the end of the file (a truncated download), or (when a tensor is
    asked for) a tensor type that is not read here, naming the type, the tensor and what to
    do.
    """

    def __init__(self, path: str | os.PathLike, reader: gguf.GGUFReader | None = None,
                 table: dict | None = None):
        self.path = Path(path).expanduser().resolve()
        size = self.path.stat().st_size
        if table is not None:  # a copy of this header (TABLE_FILE), checked when written
            self.tensors = {name: TensorInfo(name, T(kind), torch.Size(shape), offset, nbytes)
                            for name, kind, shape, offset, nbytes in table["tensors"]}
            self.fields = table["fields"]
        else:
            reader = reader or read_header(self.path)
            self.tensors = {t.name: TensorInfo(t.name, t.tensor_type, torch.Size([int(x) for x in reversed(
                t.shape.tolist())]), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
            self.fields = {k: f.contents() for k, f in reader.fields.items()
                           if not (f.types and f.types[0] == gguf.GGUFValueType.ARRAY and len(f.data) > 1024)}
            del reader
        for t in self.tensors.values():
            if t.offset + t.nbytes > size:
                raise GGUFError(f"{self.path} is truncated: tensor {t.name} ends at byte "
                                f"{t.offset + t.nbytes}, the file has {size}; download it again")
        self.arch = self.field("general.architecture")
        if not isinstance(self.arch, str):
            raise GGUFError(f"{self.path} has no general.architecture: not a model file")

    def table(self) -> dict:
        """This header as JSON values (the tensor table and the short fields) with the file's
        size and mtime, for :data:`TABLE_FILE`."""
        st = self.path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "fields": self.fields,
                "tensors": [[t.name, int(t.type), list(t.shape), t.offset, t.nbytes]
                            for t in self.tensors.values()]}

    def field(self, key: str, default=None):
        """A metadata value (str, int, float, short list), or ``default`` when absent."""
        return self.fields.get(key, default)

    def tensor(self, name: str, row_heads: int | None = None) -> GGUFTensor:
        """The tensor ``name`` (``blk.0.attn_q.weight``). Raises KeyError when absent,
        GGUFError for a type not read here."""
        t = self.tensors[name]
        if t.type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{self.path}: tensor {name} is {t.type.name}, a type this runtime does not "
                f"read (it reads {', '.join(x.name for x in SUPPORTED_TYPES)}); use --backend "
                "llama.cpp for this file, or a file quantized to one of those types")
        return GGUFTensor(self, name, row_heads)

    def name_map(self, n_layers: int):
        """gguf's map from transformers tensor names to this architecture's GGUF names."""
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch), None)
        if arch is None:
            raise GGUFError(f"{self.path}: architecture {self.arch!r} is unknown to the gguf "
                             f"package {gguf.__version__ if hasattr(gguf, '__version__') else ''}")
        return gguf.get_tensor_name_map(arch, n_layers)

    def weights(self, names, n_layers: int, n_heads: int, n_kv_heads: int):
        """(transformers name, :class:`GGUFTensor`) for each of ``names`` the file holds (a
        tied lm_head is absent from it). Llama's q and k rows come in transformers' order."""
        names_map = self.name_map(n_layers)
        for name in names:
            base, _, suffix = name.rpartition(".")
            g = names_map.get_name(base)
            if g is None or f"{g}.{suffix}" not in self.tensors:
                continue
            g = f"{g}.{suffix}"
            heads = None
            if self.arch == "llama" and suffix == "weight" and (".attn_q." in g or ".attn_k." in g):
                heads = n_heads if ".attn_q." in g else n_kv_heads
            yield name, self.tensor(g, heads)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type the file holds."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
        return counts


def read_header(path: Path) -> gguf.GGUFReader:
    """The gguf package's reader of ``path`` (its header parsed: seconds for a large
    vocabulary), or GGUFError saying that the file is not a GGUF file or is damaged."""
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure of untrusted input is said as one
        with open(path, "rb") as fh:
            what = "truncated or damaged" if fh.read(4) == b"GGUF" else "not a GGUF file"
        raise GGUFError(f"{path} is not a readable GGUF file: {what} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else 'bad header'}); "
                         "download it again, or check that it is a GGUF model file") from None


_FILES: dict[tuple, GGUFFile] = {}  # open_file's, by _version(path)


def _version(path: Path) -> tuple:
    """(path, size, mtime_ns) of a resolved path: a GGUFFile is kept per file version."""
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def _remember(f: GGUFFile) -> None:
    """Keep ``f`` for :func:`open_file` (at most 8 files, the oldest dropped)."""
    if len(_FILES) >= 8:
        _FILES.pop(next(iter(_FILES)))
    _FILES[_version(f.path)] = f


def _save_table(f: GGUFFile, table: Path) -> None:
    """Write ``f``'s :data:`TABLE_FILE` at ``table`` (a temp file renamed into place), if it
    can be: a field JSON cannot hold, or a directory that cannot be written, leaves none."""
    with contextlib.suppress(OSError, TypeError, ValueError):
        tmp = table.with_name(f".{table.name}.{os.getpid()}")
        tmp.write_text(json.dumps(f.table()))
        os.replace(tmp, table)


def open_file(path: str | os.PathLike, table: Path | None = None) -> GGUFFile:
    """:class:`GGUFFile` of ``path``, read once per process and file version (path, size,
    mtime): the header takes seconds to parse for a large vocabulary. ``table``: a
    :data:`TABLE_FILE` (a metadata directory's), read instead of the header when it is of
    this version of the file; else the header is parsed and the table (re)written there, if
    it can be (a directory written by an earlier version, or a file changed since). Raises
    as :class:`GGUFFile` does."""
    key = _version(Path(path).expanduser().resolve())
    if key not in _FILES:
        copy = None
        try:
            copy = json.loads(table.read_text()) if table is not None else None
            if (copy["size"], copy["mtime_ns"]) != key[1:]:
                copy = None
        except (OSError, ValueError, KeyError, TypeError):
            copy = None
        f = GGUFFile(key[0], table=copy)
        _remember(f)
        if table is not None and copy is None:  # none yet, or of another version of the file
            _save_table(f, table)
    return _FILES[key]


def of_directory(directory: Path) -> GGUFFile | None:
    """The :class:`GGUFFile` a metadata directory (:func:`write_metadata_dir`) stands for,
    read from its :data:`TABLE_FILE` (no header parse) where it has one; None for a
    directory of another kind."""
    source = source_of(directory)
    return None if source is None else open_file(source, Path(directory) / TABLE_FILE)


def prefetch(path: Path) -> None:
    """Read the file ``path`` into the page cache in a background thread, 16 MiB at a time
    into one buffer, so that the disk works while this process parses the header (the
    kernel's WILLNEED hint alone read a tenth of a 4.7 GB file in that time). Skipped where
    the file would take more than half the memory available, or where the platform has no
    ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        size = path.stat().st_size
        available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if size > available // 2:
        return

    def read_ahead():
        buf = bytearray(16 << 20)
        with contextlib.suppress(OSError), open(path, "rb", buffering=0) as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while fh.readinto(buf):
                pass

    threading.Thread(target=read_ahead, name="gguf-prefetch", daemon=True).start()


_READER_SWAP = threading.Lock()


@contextlib.contextmanager
def _one_parse(path: Path, reader: gguf.GGUFReader):
    """Within this block the gguf package's reader of ``path`` is ``reader``: transformers'
    GGUF loader, which builds its own reader for the config and again for the tokenizer,
    reads the header parsed once (each parse takes seconds for a large vocabulary)."""
    with _READER_SWAP:
        real = gguf.GGUFReader

        def reader_of(p, *args, **kwargs):
            if not args and not kwargs and Path(p).expanduser().resolve() == path:
                return reader
            return real(p, *args, **kwargs)

        gguf.GGUFReader = reader_of
        try:
            yield
        finally:
            gguf.GGUFReader = real


def file_key(path: Path) -> str:
    """A short key of the file's absolute path, size and mtime: a changed file gets a new one."""
    st = path.stat()
    return hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]


def write_metadata_dir(path: Path, out: Path, relative: bool = False) -> None:
    """Write the transformers files of the GGUF file ``path`` (config.json,
    generation_config.json, tokenizer files and chat template, from its metadata by
    transformers' own GGUF reader; no tensor is read) and ``gguf_source.json`` naming the
    file (``relative``: by its path from ``out``, for a file that moves with the directory's
    cache) into a new directory ``out``, atomically (a temp directory renamed; a concurrent
    writer's finished directory is kept). Raises GGUFError for a damaged or truncated file
    (:class:`GGUFFile`), ValueError when transformers cannot read the file's metadata (an
    architecture or tokenizer it does not know)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(path).expanduser().resolve()
    prefetch(path)  # the weights are read next: from the disk meanwhile
    reader = read_header(path)  # a damaged file is said as such, before transformers reads it
    f = GGUFFile(path, reader)
    _remember(f)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        try:
            with _one_parse(path, reader):
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            del reader
        except Exception as e:  # noqa: BLE001 - re-raised with the file and what to do
            raise ValueError(f"{path}: transformers cannot read this GGUF file's metadata "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); try --backend "
                             "llama.cpp") from None
        config.dtype = torch.float32
        _rope_from_metadata(f, config)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        where = os.path.relpath(path, out) if relative else str(path)
        _save_table(f, tmp / TABLE_FILE)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": where}))
        for p in (tmp, *tmp.iterdir()):  # mkdtemp creates owner-only directories
            p.chmod(0o755 if p.is_dir() else 0o644)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rope_from_metadata(f: GGUFFile, config) -> None:
    """What transformers' GGUF config mapping leaves out, from the file (llama.cpp's keys):
    the head size (qwen3's ``attention.key_length``), partial rotary (``rope.dimension_count``
    below the head size: Phi-4-mini), Phi-3's LongRoPE (``rope_factors_long`` /
    ``rope_factors_short`` tensors, ``rope.scaling.original_context_length``), and Gemma 3's
    linear scaling of its global layers (``rope.scaling.type`` / ``factor``) and score scale
    (``query_pre_attn_scalar``, as llama.cpp derives it)."""
    head_dim = f.field(f"{f.arch}.attention.key_length")
    if head_dim and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    text = getattr(config, "get_text_config", lambda: config)()
    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    params = dict(getattr(text, "rope_parameters", None) or {})
    rotary = f.field(f"{f.arch}.rope.dimension_count")
    if rotary and int(rotary) < hd:
        params["partial_rotary_factor"] = int(rotary) / hd
    if "rope_factors_long.weight" in f.tensors and "rope_factors_short.weight" in f.tensors:
        original = int(f.field(f"{f.arch}.rope.scaling.original_context_length") or text.max_position_embeddings)
        params.update(rope_type="longrope", original_max_position_embeddings=original,
                      long_factor=f.tensor("rope_factors_long.weight").float().tolist(),
                      short_factor=f.tensor("rope_factors_short.weight").float().tolist())
        text.original_max_position_embeddings = original
    if f.arch == "gemma3":  # transformers' mapping reads neither: llama.cpp's rules
        if f.field("gemma3.rope.scaling.type") == "linear":  # the global layers of 4B and up
            params["full_attention"] = {**params.get("full_attention", {}), "rope_type": "linear",
                                        "factor": float(f.field("gemma3.rope.scaling.factor"))}
        # the scores' scale: 1 / sqrt(head size), but 27B's (62 layers) 1 / sqrt(width / heads)
        text.query_pre_attn_scalar = (text.hidden_size // text.num_attention_heads
                                      if text.num_hidden_layers == 62 else hd)
    if params:
        text.rope_parameters = params


def source_of(directory: Path) -> Path | None:
    """The GGUF file a metadata directory (:func:`write_metadata_dir`) stands for, or None for
    a directory of another kind (or an unreadable ``gguf_source.json``)."""
    f = Path(directory) / SOURCE_FILE
    if not f.is_file():
        return None
    try:
        where = json.loads(f.read_text())["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(os.path.normpath(Path(directory) / where))  # (an absolute ``where`` stays)
