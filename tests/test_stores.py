"""Models where users keep them (models/stores.py): ollama's store by ``ollama:NAME[:TAG]``
and the Hugging Face hub cache, read in place and listed by `specdecode models list`."""

import hashlib
import json

import pytest

import specdecode
from specdecode.cli import main
from specdecode.models import llamacpp, stores
from specdecode.models.loading import check_model_name
from tiny_dirs import PROMPT, tiny_dirs_in, write_tiny_gguf


@pytest.fixture
def ollama(tmp_path, tmp_path_factory, monkeypatch):
    """An ollama store in tmp_path holding the tiny target as library/tiny:q8 and
    me/tiny (tag latest), as ollama lays it out."""
    root = tmp_path / "ollama"
    gguf = tmp_path / "t.gguf"
    write_tiny_gguf(tiny_dirs_in(tmp_path_factory)["target"], gguf)
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256-00", "size": 1},
        {"mediaType": stores.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}", "size": len(data)}]}
    for parts, tag in ((("registry.ollama.ai", "library", "tiny"), "q8"), (("registry.ollama.ai", "me", "tiny"), "latest")):
        d = root.joinpath("manifests", *parts)
        d.mkdir(parents=True)
        (d / tag).write_text(json.dumps(manifest))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return root, digest


def test_an_ollama_model_loads_in_place_and_decodes(ollama, tmp_path_factory):
    root, digest = ollama
    blob = root / "blobs" / f"sha256-{digest}"
    assert stores.ollama_blob("ollama:tiny:q8") == blob == stores.ollama_blob("ollama:me/tiny")
    assert check_model_name("ollama:tiny:q8") == "ollama"
    assert llamacpp.gguf_file("ollama:tiny:q8") == blob  # the llama.cpp backend reads the same blob
    m = specdecode.load("ollama:tiny:q8")
    target = specdecode.load(tiny_dirs_in(tmp_path_factory)["target"])
    assert specdecode.generate(m, PROMPT, max_new_tokens=16).token_ids == \
        specdecode.generate(target, PROMPT, max_new_tokens=16).token_ids
    assert sorted(p.name for p in root.rglob("*")) == sorted(  # nothing written into the store
        [f"sha256-{digest}", "blobs", "manifests", "registry.ollama.ai", "library", "me", "tiny", "tiny", "q8",
         "latest"])


def test_ollama_names_that_do_not_resolve_say_why(ollama, tmp_path):
    root, _ = ollama
    with pytest.raises(ValueError, match="not in the ollama store .*models there: ollama:tiny:q8, "
                                         "ollama:me/tiny:latest"):
        specdecode.load("ollama:tiny:7b")
    for bad in ("ollama:", "ollama:../x", "ollama:tiny:../../x", "ollama:a//b"):
        with pytest.raises(ValueError, match="not an ollama model name"):
            check_model_name(bad)
    (root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8").write_text('{"layers": []}')
    with pytest.raises(ValueError, match="names no model layer"):
        specdecode.load("ollama:tiny:q8")


def test_models_list_shows_what_it_finds(ollama, tmp_path, monkeypatch, capsys):
    """`models list` names the ollama models and the hub cache's GGUF files and model
    directories by what --target takes."""
    hub = tmp_path / "hub" / "models--org--m"
    blob = hub / "blobs" / "abc"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"GGUF" + b"\0" * 60)
    snap = hub / "snapshots" / "1234"
    snap.mkdir(parents=True)
    (snap / "m-Q4_K_M.gguf").symlink_to(blob)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("1234")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    found = out.split("found on this machine")[1]
    assert "ollama:tiny:q8 " in found and "ollama:me/tiny:latest " in found and " ollama" in found
    assert str(snap / "m-Q4_K_M.gguf") in found and "hugging face" in found


def _store_model(root, name, src_dir, tmp_path):
    """Put the tiny model directory ``src_dir`` into the ollama store ``root`` as NAME:latest."""
    gguf = tmp_path / f"{name}.gguf"
    write_tiny_gguf(src_dir, gguf)
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    d = root / "manifests" / "registry.ollama.ai" / "library" / name
    d.mkdir(parents=True)
    (d / "latest").write_text(json.dumps({"layers": [
        {"mediaType": stores.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}"}]}))
    return data


def test_draft_auto_picks_the_smallest_draft_that_pays(ollama, tmp_path, tmp_path_factory, capsys):
    """The smallest model here with the target's tokenizer; failing that one of another
    tokenizer; failing that none (--method self, said), and never the target itself or a
    model over half its size."""
    from specdecode.models.auto_draft import pick_draft

    root, _ = ollama
    dirs = tiny_dirs_in(tmp_path_factory)
    target = specdecode.load(dirs["target"])
    small = len(_store_model(root, "foreign", dirs["foreign"], tmp_path))
    same = len((root / "blobs" / f"sha256-{ollama[1]}").read_bytes())  # tiny:q8, me/tiny: the target's tokenizer
    pick = pick_draft(target, target_bytes=2 * same)
    assert pick.mode == "same" and pick.name in ("ollama:tiny:q8", "ollama:me/tiny:latest"), pick
    assert "smallest model here with the target's tokenizer" in pick.why
    pick = pick_draft(target, target_bytes=2 * small + 1)  # only the foreign one is small enough
    assert (pick.name, pick.mode) == ("ollama:foreign:latest", "cross") and "through text" in pick.why
    pick = pick_draft(target, target_bytes=small)
    assert pick.name is None and "--method self" in pick.why


def test_draft_auto_finds_a_draft_beside_the_target_file(tmp_path, tmp_path_factory, monkeypatch):
    """A user's folder of GGUF files: the draft beside the target's file is found (it is in
    no store), the target itself never."""
    from specdecode.models.auto_draft import pick_draft

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))  # empty stores
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    dirs = tiny_dirs_in(tmp_path_factory)
    folder = tmp_path / "my-models"
    folder.mkdir()
    write_tiny_gguf(dirs["target"], folder / "big.gguf")
    write_tiny_gguf(dirs["target"], folder / "small.gguf")
    target = specdecode.load(folder / "big.gguf")
    size = (folder / "small.gguf").stat().st_size
    pick = pick_draft(target, target_bytes=2 * size)
    assert (pick.name, pick.mode) == (str(folder / "small.gguf"), "same"), pick
    pick = pick_draft(target, target_bytes=2 * size - 1)  # nothing at most half the target's size
    assert pick.name is None and "the target file's folder" in pick.why


def test_generate_with_draft_auto_and_no_draft_here_speculates_with_self(ollama, tmp_path_factory, capsys):
    target = tiny_dirs_in(tmp_path_factory)["target"]
    code = main(["generate", "--target", str(target), "--draft", "auto", "--prompt", PROMPT,
                 "--max-new-tokens", "12", "--json", "--compare"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "draft auto: no model found (known models, ollama's store, the Hugging Face cache, the " \
        "target file's folder) is a draft for this target" in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical"] is True and result["weights"]["draft"] is None
    assert "[self] 12 tokens" in err
