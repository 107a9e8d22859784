"""Loading models: names, directories, GGUF files and hub ids to a :class:`LoadedModel`, and
the one check that a draft can serve a target.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import gguf_file, llamacpp, registry, stores
from .base import CausalLM, rows_exact
from .hf import HFCausalLM
from .native import SUPPORTED_MODEL_TYPES, Transformer, read_json
from .quant import best_layout, has_q4k, q4k_kernel, quantize_linears, require_q4k
from ..tokenmap import UnsupportedTokenizerError, pair_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "int8": row-independent W8A8; "q4": a GGUF file's own Q4_K blocks, the rest int8; "int4": every
# linear as Q4_K blocks quantized here (models/quant.py)
DTYPE_NAMES = ("auto", "int8", "q4", "int4", *DTYPES)
DEFAULT_DTYPE = "auto"  # q4 for a target from a GGUF file with Q4_K weights, else int8: BENCHMARKS.md
# "llama.cpp": llama.cpp's own forward passes of the GGUF file (optional extra; models/llamacpp.py)
BACKENDS = ("auto", "native", "transformers", "llama.cpp")
ROLES = ("target", "draft")


@dataclass(eq=False)
class LoadedModel:
    """A model ready for the engine plus what only the text layer needs.

    ``tokenizer`` is a transformers tokenizer or None (token-id-only use);
    ``eos_token_ids`` are the ids that end generation by default (generation_config ∪ tokenizer).
    State that lives as long as the loaded model:
    ``forward_seconds``: its measured forward times T(1..n) in seconds, once profiled
    (:func:`specdecode.profile.verify_profile`); ``prefill_seconds``: its measured prefill
    time per token, once profiled (:func:`specdecode.profile.prefill_profile`);
    ``session_proposers``: proposers whose state carries over between this model's requests
    (``suffix_cache="session"``), by method name;
    ``self_drafts``: its weights at lower precisions drafting for it (``--method
    self-draft``), by dtype; ``heads``: draft heads loaded for it (shared by its requests),
    by kind, directory and file time; ``rows_exact``: for a model off the CPU, whether its
    verify rows equal its one-token passes (:func:`~.base.rows_exact`, probed at load; None
    on the CPU, where the integer formats' kernels are proven by tests).
    ``pard_token``: a parallel draft's mask token (PARD, arXiv:2504.18583; the ``pard_token``
    of its config.json, as vLLM reads it): as a draft it proposes K tokens in one pass
    (:class:`~specdecode.proposers.DraftModelProposer`); None for an ordinary model.
    Compared by identity (two loads of the same files are two models, with two KV caches).
    """

    lm: CausalLM
    tokenizer: object | None = None
    name: str = "model"
    eos_token_ids: tuple[int, ...] = ()
    path: Path | None = field(default=None, repr=False)
    forward_seconds: list[float] | None = field(default=None, repr=False)
    prefill_seconds: float | None = field(default=None, repr=False)
    session_proposers: dict[str, object] = field(default_factory=dict, repr=False)
    self_drafts: dict[str, object] = field(default_factory=dict, repr=False)
    heads: dict[tuple, object] = field(default_factory=dict, repr=False)
    rows_exact: bool | None = field(default=None, repr=False)
    pard_token: int | None = None


def resolve_model_path(name_or_path: str | Path) -> Path:
    """Turn a specdecode model name, a local directory, a GGUF file or a hub id into a local
    directory holding config.json and the tokenizer files.

    Known names are fetched on first use; a GGUF file gets its metadata directory (written
    once into the cache, seconds; the weights stay in the file: :mod:`.gguf_file`); a hub id
    goes through ``huggingface_hub.snapshot_download`` (the standard ``from_pretrained``
    resolution, honouring HF_HOME and HF_HUB_OFFLINE). For float weights in transformers'
    layout use :func:`float_model_path`. Raises ValueError when nothing matches,
    ModelFetchError when a hub id or a known model cannot be fetched.
    """
    s = str(name_or_path)
    kind = check_model_name(s)
    if kind == "known":
        return registry.fetch(s)
    p = Path(s).expanduser()
    if kind == "directory":
        return p
    if kind == "gguf":
        return registry.metadata_dir_for_gguf(p)
    if kind == "ollama":
        return registry.metadata_dir_for_gguf(stores.ollama_blob(s))
    from huggingface_hub import snapshot_download  # a hub id

    try:
        return Path(snapshot_download(s, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]))
    except Exception as e:  # noqa: BLE001 - re-raised with what to do
        raise registry.ModelFetchError(f"could not fetch hub model {s!r} ({type(e).__name__}: {e}); use a "
                                       "local directory, a GGUF file, or one of "
                                       + ", ".join(registry.KNOWN_MODELS)) from e


def float_model_path(name_or_path: str | Path) -> Path:
    """:func:`resolve_model_path`, with float weights in transformers' layout: a GGUF file (a
    known model's too) is converted once into an fp32 safetensors directory (about 8x the
    file in RAM while converting, 4 bytes a parameter on disk, said on stderr first). For
    what runs through transformers: the transformers backend, training, export. Raises as
    :func:`resolve_model_path`."""
    path = resolve_model_path(name_or_path)
    source = gguf_file.source_of(path)
    return path if source is None else registry.converted_dir_for_gguf(source)


def check_model_name(name_or_path: str | Path) -> str:
    """Which form of model ``name_or_path`` is, without fetching, converting or loading
    anything: "known" (a registry name), "directory", "gguf", "ollama" (``ollama:NAME[:TAG]``,
    :mod:`.stores`) or "hub" (a hub id's form; whether the hub has it is known only when
    fetched). Raises ValueError saying what is wrong with it (empty, a directory without
    config.json, another kind of file, an ollama name the store lacks, none of the forms)."""
    s = str(name_or_path)
    if not s.strip():
        raise ValueError("the model name/path is empty; give one of " + ", ".join(registry.KNOWN_MODELS)
                         + ", a model directory, a .gguf file, ollama:NAME or a hub id")
    if s in registry.KNOWN_MODELS:
        return "known"
    if s.startswith(stores.OLLAMA_PREFIX):
        stores.ollama_blob(s)
        return "ollama"
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} is a directory without config.json; expected a Hugging Face "
                             "model directory (config.json, *.safetensors, tokenizer files)")
        return "directory"
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf file; pass a GGUF file, a model "
                             "directory, a hub id, or one of " + ", ".join(registry.KNOWN_MODELS))
        return "gguf"
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        return "hub"
    raise ValueError(f"model {s!r} not found: not a known name ({', '.join(registry.KNOWN_MODELS)}), "
                     "not an existing directory or .gguf file, and not a hub id of the form org/name")


def parse_device(device: str | torch.device | None) -> torch.device:
    """``device`` ("cpu", "cuda", "cuda:1", "mps", a torch.device; None: the CPU) as a
    torch.device that this machine has. Raises ValueError naming the value otherwise."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} is invalid: give a string such as 'cpu' or 'cuda:0', or a "
                         "torch.device")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is invalid ({str(e).splitlines()[0][:120]}); e.g. cpu, "
                         "cuda, cuda:1") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):  # torch takes "cpu:1" as the one CPU: say so instead
            raise ValueError(f"device {device!r}: there is one CPU device (cpu, or cpu:0)")
        return dev
    backend = getattr(torch, dev.type, None)
    count = backend.device_count() if backend is not None and hasattr(backend, "device_count") else 0
    if not count or (dev.index or 0) >= count:
        raise ValueError(f"device {device!r}: this machine has {count or 'no'} {dev.type} device(s) "
                         f"visible to torch {torch.__version__}; use device cpu")
    return dev


def load(name_or_path: str | Path, *, dtype: str | torch.dtype = DEFAULT_DTYPE,
         backend: str = "auto", tokenizer: bool = True, role: str = "target",
         device: str | torch.device | None = None) -> LoadedModel:
    """Load a model for use as target or draft.

    ``backend``: "native" (our decoder; llama/qwen2/mistral), "transformers" (any causal LM),
    "llama.cpp" (llama.cpp's forward passes of a known model's or a ``.gguf`` file in its own
    quantization, ``dtype`` auto; its verify rows are not row-independent, so as a target its
    speculative output equals its plain decoding only up to its batched-kernel rounding; as a
    draft it changes nothing: :class:`specdecode.models.llamacpp.LlamaCppLM`) or "auto"
    (native when the architecture allows). ``dtype``: auto (default: q4 for a
    target from a GGUF file with Q4_K weights on an x86 CPU with the AVX512-VNNI or the AVX2
    kernel, the fastest there; int4 for a draft on such a CPU; else int8), int8 (int8
    weights and per-row int8 activations, whose verify-pass rows equal one-token passes bit
    for bit; quantized once from the float files and cached), int4 (the native backend on a
    CPU with either kernel: every linear in Q4_K blocks quantized here, per-row int8
    activations, rows independent as with int8), float32 (the reference), bfloat16 or
    float16. ``role``: "target" or "draft"; with int8 it picks the weight layout that is
    fastest for verify passes (target) or one-token steps (draft), which changes no output
    (:func:`specdecode.models.quant.best_layout`). ``q4`` (native backend, x86 CPUs with
    either kernel, a known model or a ``.gguf`` file): the file's Q4_K weights as they are,
    with the same per-row int8 activations, the same bits on both kernels; the others int8.
    Speculative decoding reproduces the plain decoding of the target in the dtype it was
    loaded with. ``device``: where the weights and KV cache live (default the CPU; see
    :func:`parse_device`). Off the CPU, ``dtype`` auto is float32 and the int8, q4 and int4
    formats (CPU kernels) and the llama.cpp backend are refused; the forward passes are
    PyTorch's there, whose verify rows may differ from one-token passes in the last bits:
    :func:`specdecode.models.base.rows_exact` probes it at load (``rows_exact``) and a
    warning says so. Raises ValueError naming the bad value, MissingExtraError for the
    llama.cpp backend without its extra.
    """
    dev = parse_device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_NAMES)}")
        dtype = DTYPES.get(dtype, dtype)
    elif dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_NAMES)} (or the torch "
                         f"dtypes {', '.join(str(d) for d in DTYPES.values())})")
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    if dev.type != "cpu":
        if backend == "llama.cpp" or dtype in ("int8", "q4", "int4"):
            what = "the llama.cpp backend" if backend == "llama.cpp" else f"dtype {dtype}"
            raise ValueError(f"{what} runs on the CPU only (CPU kernels); on device {dev} use dtype "
                             "float32, bfloat16 or float16 with backend native or transformers")
        if dtype == "auto":
            dtype = torch.float32
    if backend == "llama.cpp":
        return _load_llamacpp(name_or_path, dtype, tokenizer)
    layout = best_layout(role)
    path = resolve_model_path(name_or_path)
    config = read_json(path / "config.json")
    source = gguf_file.source_of(path)
    native_ok = config.get("model_type") in SUPPORTED_MODEL_TYPES and (
        source is not None or any(path.glob("*.safetensors")))
    if backend == "native" and not native_ok:
        raise ValueError(f"{name_or_path}: model_type {config.get('model_type')!r} with these weights "
                         f"is not supported natively ({SUPPORTED_MODEL_TYPES}); use backend='transformers'")
    native = native_ok and backend != "transformers"
    if dtype == "auto":
        q4k = native and q4k_kernel()[0] is not None
        if role == "target" and q4k and source is not None and has_q4k(source):
            dtype = "q4"
        elif role == "draft" and q4k:
            dtype = "int4"  # 0.78x the int8 draft's step, at 2 points less acceptance: BENCHMARKS.md
        else:
            dtype = "int8"
    elif dtype == "q4":
        if not native:
            raise ValueError(f"dtype q4 runs on the native backend only (model types "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}); use dtype int8, or backend native")
        check_q4(name_or_path, source)
    elif dtype == "int4":
        if not native:
            raise ValueError(f"dtype int4 runs on the native backend only (model types "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}); use dtype int8, or backend native")
        require_q4k("dtype int4")
    try:
        if backend == "transformers" or not native_ok:
            from transformers import AutoModelForCausalLM

            path = float_model_path(name_or_path)  # transformers reads float safetensors
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if dtype == "int8" else dtype)
            lm = HFCausalLM(quantize_linears(hf, layout) if dtype == "int8" else hf.to(dev),
                            weight_format=f"int8-{layout}" if dtype == "int8" else None)
        else:
            # oneDNN's packed weights are CPU ones
            lm = Transformer.from_pretrained(path, dtype=dtype, layout=layout,
                                             pack=None if dev.type == "cpu" else False).to(dev)
        tok = None
        if tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
    except gguf_file.GGUFError:
        raise  # names the file and what to do
    except (ValueError, OSError, RuntimeError, KeyError, SafetensorError) as e:
        raise ValueError(
            f"could not load the model in {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}. "
            "The files may be missing, truncated or corrupt: re-copy them (for a known model, "
            "delete that directory and run `specdecode models fetch NAME`)") from e
    loaded = LoadedModel(lm=lm, tokenizer=tok, name=str(name_or_path),
                         eos_token_ids=_default_eos(path, tok), path=path,
                         pard_token=_pard_token(config, lm.vocab_size, path))
    if dev.type != "cpu":
        loaded.rows_exact = rows_exact(lm)
        if not loaded.rows_exact:
            warnings.warn(f"on {dev}, {name_or_path}'s verify passes do not give each row the logits "
                          "of its one-token pass bit for bit (PyTorch's kernels there change with the "
                          "row count): speculative output equals its plain decoding up to that "
                          "rounding, as with float weights on the CPU; the int8, q4 and int4 "
                          "formats on the CPU are exact", stacklevel=2)
    return loaded


def _pard_token(config: dict, rows: int, path: Path) -> int | None:
    """config.json's ``pard_token`` (None without one). Raises ValueError when it is not an
    embedding row of the model (0 .. rows - 1)."""
    token = config.get("pard_token")
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < rows:
        raise ValueError(f"{path / 'config.json'}: pard_token = {token!r} is invalid; allowed: an "
                         f"embedding row of the model, 0..{rows - 1} (the parallel draft's mask token)")
    return token


def _load_llamacpp(name_or_path, dtype, tokenizer: bool) -> LoadedModel:
    if dtype != "auto":
        raise ValueError(f"the llama.cpp backend runs the GGUF file's own quantization; dtype "
                         f"{dtype!r} cannot be chosen there (leave it auto, or use backend native)")
    llamacpp.llama_cpp()  # a missing extra is said before anything is fetched
    lm = llamacpp.LlamaCppLM(llamacpp.gguf_file(name_or_path), threads=torch.get_num_threads())
    path = resolve_model_path(name_or_path)  # the tokenizer and generation config of the file
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    return LoadedModel(lm=lm, tokenizer=tok, name=str(name_or_path),
                       eos_token_ids=_default_eos(path, tok), path=path)


def check_q4(name_or_path, source: Path | None = None) -> Path | None:
    """The GGUF file whose Q4_K blocks dtype q4 would use for this model (``source`` when
    known; None for a known model not fetched yet, checked once it is). Raises ValueError
    when q4 cannot load it (no kernel for Q4_K, no GGUF file, no Q4_K weights in it), before
    anything is loaded."""
    require_q4k("dtype q4")
    if source is None and str(name_or_path) in registry.KNOWN_MODELS and not registry.is_present(
            str(name_or_path)):
        return None
    gguf = source or _gguf_source(name_or_path)
    if not has_q4k(gguf):
        raise ValueError(f"{gguf} has no Q4_K weights (dtype q4 keeps those as they are and "
                         "makes the rest int8); use dtype int8")
    return gguf


def _gguf_source(name_or_path) -> Path:
    """The GGUF file of a model (:func:`.stores.gguf_path_of`); ValueError for other models."""
    source = stores.gguf_path_of(name_or_path)
    if source is None:
        raise ValueError(f"dtype q4 reads a GGUF file's Q4_K blocks: {str(name_or_path)!r} is neither a "
                         f"known model ({', '.join(registry.KNOWN_MODELS)}), an ollama model nor a .gguf "
                         "file; use dtype int8")
    return source


def default_eos_token_ids(path: Path) -> tuple[int, ...]:
    """The EOS ids of the model directory ``path`` (generation config ∪ tokenizer), without
    loading its weights."""
    from transformers import AutoTokenizer

    return _default_eos(path, AutoTokenizer.from_pretrained(path))


def _default_eos(path: Path, tok) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.exists():
        e = read_json(gen).get("eos_token_id")
        ids += e if isinstance(e, list) else ([e] if e is not None else [])
    if tok is not None and tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return tuple(dict.fromkeys(ids))


class IncompatibleDraftError(ValueError):
    """The draft cannot propose tokens for this target (a tokenizer that cannot be bridged)."""


# target -> {draft: mode} for pairs already checked: the check compares whole vocabularies
# (tens of milliseconds for 150k tokens), so it runs once per pair, not once per request
_PAIRED: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def check_compatible(target: LoadedModel, draft: LoadedModel) -> str:
    """How the draft speaks to the target, checked once per pair: "same" when they share the
    tokenizer (vocabulary and special tokens; the embedding rows may differ, as Qwen2.5's
    151,936 vs 152,064: draft probability of rows it lacks is 0), or when either was loaded
    without one (token ids only); "cross" when the tokenizers differ and both map tokens to
    bytes, so the draft's proposals reach the target through text
    (:class:`~specdecode.proposers.CrossTokenizerProposer`). A pair that passed is not
    checked again (llama.cpp checks at init, ``common/speculative.cpp``). Raises
    IncompatibleDraftError, saying what to do, for different tokenizers that cannot be
    bridged.
    """
    # keyed on the tokenizers where there are some: a batch gives each request a copy of the
    # draft's LoadedModel (its own KV cache row) with the same tokenizer
    key_t, key_d = target.tokenizer or target, draft.tokenizer or draft
    checked = _PAIRED.setdefault(key_t, weakref.WeakKeyDictionary())
    if key_d in checked:
        return checked[key_d]
    tt, dt = target.tokenizer, draft.tokenizer
    mode = "same"
    if tt is not None and dt is not None:
        try:
            mode = pair_mode(tt, dt)
        except UnsupportedTokenizerError as e:
            raise IncompatibleDraftError(
                f"draft {draft.name!r} uses a different tokenizer than target {target.name!r}, and "
                f"its proposals cannot be carried over as text: {e}. `specdecode check-pair "
                f"{target.name} {draft.name}` shows the details; pick a draft of the target's own "
                "family, or decode without a draft (CLI --method ar, Python method='ar').") from None
    checked[key_d] = mode
    return mode


def load_pair(target: str | Path, draft: str | Path | None, dtype: str = DEFAULT_DTYPE,
              draft_dtype: str = DEFAULT_DTYPE, backend: str = "auto",
              draft_backend: str = "auto", device: str | torch.device | None = None
              ) -> tuple[LoadedModel, LoadedModel | None]:
    """Load a target and (optionally) a draft on ``device`` (default the CPU), checking their
    compatibility once.

    The draft's dtype and backend only change speed and acceptance rate, never the output.
    Raises ValueError (IncompatibleDraftError for a draft of another tokenizer),
    ModelFetchError or MissingExtraError (see :func:`load`)."""
    for name, d, b, role in ((target, dtype, backend, "target"),
                             (draft, draft_dtype, draft_backend, "draft")):
        if name is None:
            continue
        try:  # refused before seconds of loading
            if d == "q4" and b != "llama.cpp":
                check_q4(name)
            if b == "llama.cpp":
                llamacpp.llama_cpp()
                llamacpp.gguf_file(name)
        except (ValueError, llamacpp.MissingExtraError) as e:
            raise type(e)(f"{role} {str(name)!r}: {e}") from None
    tgt = load(target, dtype=dtype, backend=backend, device=device)
    drf = load(draft, dtype=draft_dtype, backend=draft_backend, role="draft",
               device=device) if draft is not None else None
    if drf is not None:
        check_compatible(tgt, drf)
    return tgt, drf


def usual_mode(path: str | Path) -> None:
    """Give the file ``path`` the mode a new file gets under the process's umask (0644 under
    the usual 022): safetensors' writer (``save_file``, and ``save_pretrained`` through it)
    creates owner-only files (0600), which a server running as another user (a vLLM or
    SGLang container reading an export or a trained head) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` with the usual file mode (:func:`usual_mode`)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    usual_mode(path)


def checkpoint_tensor(model: LoadedModel, name: str) -> torch.Tensor:
    """A float tensor of a model's own checkpoint (fp32), e.g. ``"lm_head.weight"`` (the
    tied embedding when the checkpoint has no separate lm_head) or
    ``"model.embed_tokens.weight"``: heads share these with the target, at full precision
    whatever dtype the target runs in; from the GGUF file itself for a model loaded from one
    (dequantized). Raises ValueError when the target has no checkpoint or the tensor is
    missing."""
    wanted = [name] + (["model.embed_tokens.weight"] if name == "lm_head.weight" else [])
    source = gguf_file.source_of(model.path) if model.path else None
    if source is not None:
        config = read_json(Path(model.path) / "config.json")
        for _, t in gguf_file.of_directory(model.path).weights(wanted, config["num_hidden_layers"], 1, 1):
            return t.float()
    files = sorted(Path(model.path).glob("*.safetensors")) if model.path else []
    for want in wanted:
        for f in files:
            with safe_open(str(f), "pt") as s:
                if want in s.keys():
                    return s.get_tensor(want).float()
    raise ValueError(f"{name} not found in the model's weights ({source or model.path or 'no directory'}); "
                     "heads need the target's checkpoint (a model directory or a GGUF file)")
