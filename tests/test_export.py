"""``specdecode export vllm|sglang``: the files vLLM and SGLang load, checked without a GPU:
golden files for the settings and launch scripts, and the exported draft directory loaded
with transformers gives the source model's logits (bf16), its vocabulary padded or cut to
the target's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from specdecode import cli
from specdecode.export import export
from specdecode.methods import Method

from tiny_dirs import VOCAB, WIDE_VOCAB, tiny_dirs_in

GOLDEN = Path(__file__).with_name("golden") / "export"
FILES = ("launch.sh", "speculative_config.json", "NOTES.md")
# (case, engine, target, draft, method, k): every method to both engines, both vocabulary fixes
CASES = [
    ("vllm-draft-padded", "vllm", "wide", "draft", Method.DRAFT, 4),
    ("vllm-prompt-lookup", "vllm", "target", None, Method.PROMPT_LOOKUP, 8),
    ("vllm-suffix", "vllm", "target", None, Method.SUFFIX, None),
    ("vllm-hybrid-auto", "vllm", "target", "draft", Method.HYBRID, "auto"),
    ("sglang-draft-cut", "sglang", "target", "wide_draft", Method.DRAFT, None),
    ("sglang-prompt-lookup", "sglang", "target", None, Method.PROMPT_LOOKUP, None),
    # a parallel draft: vLLM's parallel_drafting; SGLang drafts a token a step (a note)
    ("vllm-pard", "vllm", "wide", "pard", Method.DRAFT, 4),
    ("sglang-pard", "sglang", "wide", "pard", Method.DRAFT, None),
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs_in(tmp_path_factory)


def _normalized(path: Path, out: Path, target: Path) -> str:
    return path.read_text().replace(str(out), "DIR").replace(str(target), "TARGET_DIR")


@pytest.mark.parametrize("case,engine,target,draft,method,k", CASES, ids=[c[0] for c in CASES])
def test_exported_settings_equal_the_golden_files(tmp_path, dirs, case, engine, target, draft, method, k):
    out = tmp_path / "out"
    r = export(engine, out, dirs[target], dirs[draft] if draft else None, method, k, progress=False)
    written = sorted(p.name for p in out.iterdir())
    assert (out / "launch.sh").stat().st_mode & 0o111
    umask = os.umask(0)
    os.umask(umask)  # every file readable as any new file is (safetensors alone writes 0600)
    assert all(f.stat().st_mode & 0o444 == 0o444 & ~umask for f in out.rglob("*") if f.is_file())
    for name in FILES:
        golden = GOLDEN / case / name
        if not (out / name).exists():
            assert not golden.exists(), f"{name} was not written"
            continue
        got = _normalized(out / name, out, dirs[target])
        if os.environ.get("SPECDECODE_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
        assert got == golden.read_text(), f"{case}/{name} differs from the golden file"
    if r.config is not None:
        assert json.loads((out / "speculative_config.json").read_text()) == r.config
    assert ("draft" in written) == (draft is not None)
    if draft is not None:  # a parallel draft's mask token travels in its config (vLLM reads it there)
        mask = json.loads((dirs[draft] / "config.json").read_text()).get("pard_token")
        assert json.loads((out / "draft" / "config.json").read_text()).get("pard_token") == mask
        assert (mask is not None) == (case == "vllm-pard" or case == "sglang-pard")


@pytest.mark.parametrize("draft,rows", [("draft", "padded"), ("wide_draft", "cut")])
def test_exported_draft_loads_with_transformers_and_gives_the_same_logits(tmp_path, dirs, draft, rows):
    target = dirs["wide"] if rows == "padded" else dirs["target"]
    r = export("vllm", tmp_path / "out", target, dirs[draft], Method.DRAFT, progress=False)
    assert r.vocab == rows
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16).eval()  # noqa: E731
    got, src = load(tmp_path / "out" / "draft"), load(dirs[draft])
    want_rows = WIDE_VOCAB if rows == "padded" else VOCAB
    assert got.config.vocab_size == want_rows == json.loads((target / "config.json").read_text())["vocab_size"]
    assert next(got.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 77, 300, 12, 9]])
    with torch.no_grad():
        a, b = got(ids).logits, src(ids).logits
    assert torch.equal(a[..., :VOCAB], b[..., :VOCAB])
    if rows == "padded":
        assert torch.equal(a[..., VOCAB:], torch.zeros_like(a[..., VOCAB:]))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "draft")
    assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(dirs[draft]).get_vocab()
    assert tok.chat_template


def test_export_refuses_what_the_engines_cannot_load(tmp_path, dirs, capsys):
    with pytest.raises(ValueError, match="tokenizer"):
        export("vllm", tmp_path / "a", dirs["target"], dirs["foreign"], Method.DRAFT, progress=False)
    with pytest.raises(ValueError, match="nothing to export"):
        export("vllm", tmp_path / "b", dirs["target"], None, Method.AR, progress=False)
    for method in (Method.LAYER_SKIP, Method.SELF, Method.SELF_DRAFT, Method.EARLY_EXIT, Method.SUFFIX):
        with pytest.raises(ValueError, match="nothing reproduces it there"):
            export("sglang", tmp_path / "s", dirs["target"], None, method, progress=False)
        assert not (tmp_path / "s").exists()  # nothing half-written
    with pytest.raises(ValueError, match="tgi"):
        export("tgi", tmp_path / "c", dirs["target"], None, Method.SUFFIX, progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        export("vllm", tmp_path / "full", dirs["target"], None, Method.SUFFIX, progress=False)
    # through the CLI: one error line, exit code 2
    code = cli.main(["export", "vllm", str(tmp_path / "d"), "--target", str(dirs["target"]),
                     "--method", "prompt-lookup", "--draft", str(dirs["draft"])])
    assert code == 2 and "--draft is for" in capsys.readouterr().err
    code = cli.main(["export", "sglang", str(tmp_path / "e"), "--target", str(dirs["target"]),
                     "--draft", str(dirs["draft"]), "--with-target", "--k", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "STANDALONE" in out
    # the launch command printed is the one launch.sh runs (the copy of the target beside it)
    assert f"python -m sglang.launch_server --model-path {tmp_path / 'e' / 'target'} " in out
    assert (tmp_path / "e" / "target" / "model.safetensors").exists()
    assert 'TARGET="${TARGET:-$HERE/target}"' in (tmp_path / "e" / "launch.sh").read_text()
    # --max-ngram as generate takes it (1..32, the shortest n-gram min(2, it); prompt lookup only)
    for args, words in [(["--max-ngram", "40"], "1..32"), (["--method", "draft", "--max-ngram", "3"], "'draft'")]:
        code = cli.main(["export", "vllm", str(tmp_path / "f"), "--target", str(dirs["target"]),
                         "--method", "prompt-lookup", *args])
        assert code == 2 and words in capsys.readouterr().err
    code = cli.main(["export", "vllm", str(tmp_path / "g"), "--target", str(dirs["target"]),
                     "--method", "prompt-lookup", "--max-ngram", "1"])
    config = json.loads((tmp_path / "g" / "speculative_config.json").read_text())
    assert code == 0 and (config["prompt_lookup_min"], config["prompt_lookup_max"]) == (1, 1)


def test_the_exported_directory_can_be_moved_and_launched(tmp_path, dirs):
    """launch.sh run from a moved DIR, with a stand-in `vllm` on PATH that prints what it
    was given: the draft path in the config is the moved one, the target is TARGET, extra
    arguments pass through; the config carries rope_theta for transformers 4."""
    import shutil
    import stat
    import subprocess

    export("vllm", tmp_path / "a", dirs["target"], dirs["draft"], Method.DRAFT, progress=False)
    moved = tmp_path / "else#where & 'co'" / "b"  # characters sed and shells read
    shutil.move(str(tmp_path / "a"), moved)
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env bash\npython3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", TARGET="Org/Target")
    out = subprocess.run([str(moved / "launch.sh"), "--port", "8001"], env=env, capture_output=True,
                         text=True, check=True).stdout
    out = json.loads(out)
    assert out[:2] == ["serve", "Org/Target"] and out[-2:] == ["--port", "8001"]
    config = json.loads(out[out.index("--speculative-config") + 1])
    assert config["model"] == str(moved / "draft") and config["method"] == "draft_model"
    source = json.loads((dirs["draft"] / "config.json").read_text())
    written = json.loads((moved / "draft" / "config.json").read_text())
    theta = source.get("rope_theta", (source.get("rope_parameters") or {}).get("rope_theta"))
    assert written["rope_theta"] == theta and written["dtype"] == "bfloat16"
    assert (moved / "draft" / "model.safetensors").stat().st_mode & 0o044 == 0o044


# --- draft heads: export eagle3|medusa HEAD --format vllm|sglang OUT ----------------------

def _heads(root: Path, target: Path) -> dict[str, Path]:
    """Random heads for the tiny target: an EAGLE-3 head (saved fp32, as a user's run may)
    and Medusa heads with their own and with the target's projection."""
    from specdecode.heads import Eagle3Head, MedusaHeads
    from specdecode.models.native import ModelArgs

    config = json.loads((target / "config.json").read_text())
    args = ModelArgs.from_hf_config(config)
    g = torch.Generator().manual_seed(0)
    e3 = Eagle3Head(args, torch.arange(3, VOCAB, 7), torch.randn(VOCAB, args.dim, generator=g), 40)
    m1 = MedusaHeads(args.dim, VOCAB, 3)
    m2 = MedusaHeads(args.dim, VOCAB, 2, lm_head=torch.randn(VOCAB, args.dim, generator=g))
    with torch.no_grad():
        for p in [*e3.parameters(), *m1.parameters(), *m2.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g))
    training = {"target": "tiny", "data": {"sources": ["stdlib", "sharegpt"]}}
    return {"eagle3": e3.save(root / "eagle3", dtype=torch.float32, training=training),
            "medusa": m1.save(root / "medusa", training=training),
            "medusa_shared": m2.save(root / "medusa_shared", training={"first_ids": 2048})}


@pytest.fixture(scope="module")
def heads(tmp_path_factory, dirs):
    return _heads(tmp_path_factory.mktemp("heads"), dirs["target"])


HEAD_CASES = [("vllm-eagle3", "eagle3", "eagle3", "vllm", None),
              ("sglang-eagle3", "eagle3", "eagle3", "sglang", 3),
              ("vllm-medusa", "medusa", "medusa", "vllm", None),
              ("vllm-medusa-shared", "medusa", "medusa_shared", "vllm", 1)]


@pytest.mark.parametrize("case,kind,head,engine,k", HEAD_CASES, ids=[c[0] for c in HEAD_CASES])
def test_exported_heads_equal_the_golden_files_and_load_back(tmp_path, dirs, heads, case, kind, head, engine, k):
    """The settings, launch script and notes are the golden ones; the tensors are the names,
    shapes and dtypes the engine loads (golden too); the weights are the head's, in bf16."""
    from safetensors.torch import load_file

    from specdecode.export import export_head, head_tensor_table
    from specdecode.heads import Eagle3Head, MedusaHeads
    from specdecode.models.native import ModelArgs

    out = tmp_path / "out"
    r = export_head(kind, heads[head], engine, out, dirs["target"], k)
    tensors = load_file(str(out / "draft" / "model.safetensors"))
    config = json.loads((out / "draft" / "config.json").read_text())
    table = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sorted(tensors.items())}
    assert table == {n: (s, str(d).removeprefix("torch.")) for n, (s, d) in head_tensor_table(kind, config).items()}
    written = {name: _normalized(out / name, out, dirs["target"]) for name in FILES if (out / name).exists()}
    written["tensors.txt"] = "".join(f"{n} {list(s)} {d}\n" for n, (s, d) in table.items())
    for name in (*FILES, "tensors.txt"):
        golden = GOLDEN / case / name
        if os.environ.get("SPECDECODE_UPDATE_GOLDEN") and name in written:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(written[name])
        assert (name in written) == golden.exists(), f"{case}/{name}: written {name in written}"
        if name in written:
            assert written[name] == golden.read_text(), f"{case}/{name} differs from the golden file"
    assert config["torch_dtype"] == "bfloat16" and (r.config is None) == (engine == "sglang")
    src = json.loads((heads[head] / "config.json").read_text())
    # heads trained over the first ids draft over those in vLLM too: its truncated vocabulary
    first = src.get("training", {}).get("first_ids")
    assert config.get("truncated_vocab_size") == (first or src.get("truncated_vocab_size"))
    assert ("token_map" in tensors) == bool(first) and (not first or torch.equal(tensors["token_map"], torch.arange(first)))
    same = ("torch_dtype", "truncated_vocab_size")
    assert {k: v for k, v in config.items() if k not in same} == {k: v for k, v in src.items() if k not in same}
    if kind == "eagle3":
        args = ModelArgs.from_hf_config(json.loads((dirs["target"] / "config.json").read_text()))
        embed = torch.zeros(VOCAB, args.dim)
        a, b = Eagle3Head.load(out / "draft", args, embed), Eagle3Head.load(heads[head], args, embed)
    else:
        a, b = MedusaHeads.load(out / "draft"), MedusaHeads.load(heads[head])
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for n in sa:  # the export is the head rounded to bf16, nothing else
        want = sb[n].to(torch.bfloat16).float() if sb[n].is_floating_point() else sb[n]
        assert torch.equal(sa[n], want), n


def test_head_export_refuses_what_the_engines_would_not_load(tmp_path, dirs, heads, capsys):
    from safetensors.torch import load_file, save_file

    from specdecode.export import export_head

    with pytest.raises(ValueError, match="SGLang has no Medusa"):
        export_head("medusa", heads["medusa"], "sglang", tmp_path / "a", dirs["target"])
    with pytest.raises(ValueError, match="MedusaModel"):
        export_head("medusa", heads["eagle3"], "vllm", tmp_path / "b", dirs["target"])
    with pytest.raises(ValueError, match="another target.*vocab_size"):
        export_head("eagle3", heads["eagle3"], "vllm", tmp_path / "c", dirs["wide"])
    with pytest.raises(ValueError, match="allowed: 1..3"):
        export_head("medusa", heads["medusa"], "vllm", tmp_path / "d", dirs["target"], k=4)
    with pytest.raises(ValueError, match="is not a directory of an EAGLE-3 head.*specdecode train eagle3"):
        export_head("eagle3", dirs["target"] / "nothing", "vllm", tmp_path / "e", dirs["target"])

    def tampered(name, change):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text((heads["eagle3"] / "config.json").read_text())
        t = load_file(str(heads["eagle3"] / "model.safetensors"))
        change(t)
        save_file(t, str(bad / "model.safetensors"))
        return bad

    cases = {"missing midlayer.mlp.up_proj.weight": lambda t: t.pop("midlayer.mlp.up_proj.weight"),
             "d2t: .* int32": lambda t: t.update(d2t=t["d2t"].int()),
             r"fc.weight: \(32, 64\)": lambda t: t.update({"fc.weight": t["fc.weight"][:, :64].contiguous()}),
             "not strictly increasing": lambda t: t.update(d2t=t["d2t"].flip(0)),
             "t2d does not mark": lambda t: t.update(t2d=~t["t2d"]),
             "unexpected extra": lambda t: t.update(extra=torch.zeros(2))}
    for i, (message, change) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            export_head("eagle3", tampered(f"bad{i}", change), "vllm", tmp_path / f"o{i}", dirs["target"])
    assert not any((tmp_path / f"o{i}").exists() for i in range(len(cases)))  # nothing half-written
    # through the CLI: one error line, exit code 2
    for argv, message in ((["export", "medusa", str(heads["medusa"]), "--format", "sglang", str(tmp_path / "f")],
                           "SGLang has no Medusa"),
                          (["export", "eagle3", str(heads["eagle3"])], "HEAD OUT"),
                          (["export", "vllm", str(tmp_path / "g"), "--format", "sglang"], "--format is for heads"),
                          (["export", "eagle3", str(heads["eagle3"]), str(tmp_path / "h"), "--method", "draft"],
                           "are for draft model exports")):
        code = cli.main(argv + ["--target", str(dirs["target"])])
        assert code == 2 and message in capsys.readouterr().err, argv
    code = cli.main(["export", "eagle3", str(heads["eagle3"]), str(tmp_path / "i"), "--format", "sglang",
                     "--target", str(dirs["target"]), "--k", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "--speculative-algorithm EAGLE3 --speculative-draft-model-path" in out
    assert "--speculative-num-steps 2 " in out
    assert f"--model-path {dirs['target']} " in out
    assert "--speculative-num-steps 2" in (tmp_path / "i" / "launch.sh").read_text()
    with pytest.raises(ValueError, match="export_head"):
        export("vllm", tmp_path / "j", dirs["target"], None, Method.EAGLE3, progress=False)
