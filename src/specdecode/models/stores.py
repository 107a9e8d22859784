"""Where users already keep models: ollama's store and the Hugging Face hub cache, read only.

An ollama model is named ``ollama:NAME[:TAG]`` (``ollama:qwen2.5:7b``, ``ollama:user/name``,
``ollama:host/namespace/name:tag``); its manifest names the GGUF blob of its weights, which is
read in place (ollama's layout: ``$OLLAMA_MODELS``, else ``~/.ollama/models``, else the Linux
service's ``/usr/share/ollama/.ollama/models``; ``manifests/<host>/<namespace>/<name>/<tag>``
JSON, ``blobs/sha256-<hex>``). Nothing here writes to either store.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import registry

OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_DEFAULT_HOST, _DEFAULT_NAMESPACE, _DEFAULT_TAG = "registry.ollama.ai", "library", "latest"


@dataclass(frozen=True)
class FoundModel:
    """A model found where users keep them: ``name`` is what ``--target`` takes, ``kind``
    "gguf" or "directory", ``size`` in bytes, ``where`` the store ("ollama", "hugging face")."""

    name: str
    kind: str
    size: int
    path: Path
    where: str


def ollama_dirs() -> list[Path]:
    """ollama's model stores on this machine that exist ($OLLAMA_MODELS first)."""
    candidates = [os.environ.get("OLLAMA_MODELS"), Path.home() / ".ollama" / "models",
                  "/usr/share/ollama/.ollama/models"]
    seen, out = set(), []
    for c in candidates:
        if c and Path(c).expanduser().is_dir() and Path(c).expanduser().resolve() not in seen:
            seen.add(Path(c).expanduser().resolve())
            out.append(Path(c).expanduser())
    return out


def _manifest_path(root: Path, ref: str) -> Path:
    name, _, tag = ref.partition(":")
    parts = name.split("/")
    if len(parts) == 1:
        parts = [_DEFAULT_HOST, _DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [_DEFAULT_HOST, *parts]
    return root / "manifests" / Path(*parts) / (tag or _DEFAULT_TAG)


def ollama_blob(name: str) -> Path:
    """The GGUF blob of the ollama model ``ollama:NAME[:TAG]`` (the ``ollama:`` prefix
    optional). Raises ValueError naming what is missing: no ollama store, no such model (the
    store's models listed), or a manifest without a model layer."""
    ref = name[len(OLLAMA_PREFIX):] if name.startswith(OLLAMA_PREFIX) else name
    model, _, tag = ref.partition(":")
    if not model or any(p in ("", ".", "..") for p in model.split("/")) or "/" in tag or tag in (".", ".."):
        raise ValueError(f"{name!r} is not an ollama model name: give ollama:NAME[:TAG], e.g. "
                         "ollama:qwen2.5:7b")
    roots = ollama_dirs()
    if not roots:
        raise ValueError(f"{name}: no ollama model store found ($OLLAMA_MODELS, ~/.ollama/models, "
                         "/usr/share/ollama/.ollama/models); set OLLAMA_MODELS to yours")
    for root in roots:
        manifest = _manifest_path(root, ref)
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
            digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
            raise ValueError(f"{name}: the manifest {manifest} names no model layer "
                             f"({OLLAMA_MODEL_LAYER}); pull the model again with ollama") from None
        blob = root / "blobs" / digest.replace(":", "-")
        if not blob.is_file():
            raise ValueError(f"{name}: its blob {blob} is missing; pull the model again with ollama")
        return blob
    known = ", ".join(m.name for m in ollama_models()) or "none"
    raise ValueError(f"{name}: not in the ollama store ({', '.join(map(str, roots))}; models there: "
                     f"{known})")


def ollama_models() -> list[FoundModel]:
    """Every model of the ollama stores, as ``ollama:NAME:TAG`` (library models without their
    host and namespace, as ollama names them)."""
    out = []
    for root in ollama_dirs():
        for manifest in sorted((root / "manifests").glob("*/*/*/*")):
            host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
            short = model if (host, namespace) == (_DEFAULT_HOST, _DEFAULT_NAMESPACE) else (
                f"{namespace}/{model}" if host == _DEFAULT_HOST else f"{host}/{namespace}/{model}")
            try:
                blob = ollama_blob(f"{OLLAMA_PREFIX}{short}:{tag}")
            except ValueError:
                continue
            out.append(FoundModel(f"{OLLAMA_PREFIX}{short}:{tag}", "gguf", blob.stat().st_size, blob,
                                  "ollama"))
    return out


def gguf_path_of(name_or_path: str | Path) -> Path | None:
    """The GGUF file a model name stands for, without fetching: a fetched known model's, an
    ollama model's blob, or a ``.gguf`` file itself; None for anything else (a directory, a
    hub id, a known model not fetched yet). Raises ValueError for an ollama name that does
    not resolve."""
    s = str(name_or_path)
    if s in registry.KNOWN_MODELS:
        return registry.gguf_path(s) if registry.gguf_path(s).is_file() else None
    if s.startswith(OLLAMA_PREFIX):
        return ollama_blob(s)
    p = Path(s).expanduser()
    return p if p.suffix.lower() == ".gguf" and p.is_file() else None


def hub_cache_models() -> list[FoundModel]:
    """Models of the Hugging Face hub cache (``huggingface_hub.scan_cache_dir``): each GGUF
    file, and each snapshot with config.json and safetensors weights, newest revision of each
    repository."""
    from huggingface_hub import scan_cache_dir

    try:  # (huggingface_hub reads $HF_HUB_CACHE once, at import)
        info = scan_cache_dir(os.environ.get("HF_HUB_CACHE") or None)
    except Exception:  # noqa: BLE001 - no cache (or an unreadable one): nothing found there
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        names = {f.file_name: f for f in rev.files}
        for f in sorted(rev.files, key=lambda f: f.file_name):
            if f.file_name.lower().endswith(".gguf"):
                out.append(FoundModel(str(f.file_path), "gguf", f.size_on_disk, f.file_path, "hugging face"))
        if "config.json" in names and any(n.endswith(".safetensors") for n in names):
            out.append(FoundModel(str(rev.snapshot_path), "directory", rev.size_on_disk, rev.snapshot_path,
                                  "hugging face"))
    return out
