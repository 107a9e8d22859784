"""The scripts in benchmarks/, each run here in a small mode: a script that no test runs is
not kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import specdecode
from tiny_dirs import VOCAB, tiny_dirs_in

SCRIPTS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` in ``tmp_path``, with this specdecode importable and its cache
    and temporary files under ``tmp_path``."""
    path = os.pathsep.join(p for p in (str(Path(specdecode.__file__).parent.parent),
                                       os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "SPECDECODE_CACHE": str(tmp_path / "cache"),
           "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)


def test_every_benchmark_script_is_run_by_a_test():
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    assert [p.name for p in sorted(SCRIPTS.glob("*.py")) if f'"{p.name}"' not in tests] == []


def test_device_check_on_the_cpu(tmp_path):
    """``python benchmarks/device_check.py cpu``, the check a lent GPU runs with ``cuda``:
    a load line per dtype, and each method's output, alone and in the batch, is plain
    decoding's."""
    proc = _run([SCRIPTS / "device_check.py", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    loads = [r for r in rows if r["check"] == "load"]
    assert [r["dtype"] for r in loads] == ["float32", "bfloat16"]
    assert all(isinstance(r["rows_exact"], bool) for r in loads)
    generated = [r for r in rows if r["check"] == "generate"]
    assert len(generated) == 2 * 6 * 2 and all(r.get("equal") is True for r in generated), generated
    assert [r.get("equal") for r in rows if r["check"] == "batch"] == [[True, True]] * 2


def test_forward_times_of_a_tiny_target(tmp_path_factory, tmp_path):
    """``python benchmarks/forward_times.py int8 MODEL target``: T(n) of each size in one
    JSON line."""
    target = tiny_dirs_in(tmp_path_factory)["target"]
    proc = _run([SCRIPTS / "forward_times.py", "int8", target, "target"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kind"] == "int8" and set(out["T_ms"]) == {"1", "2", "4", "8", "16", "17"}
    assert out["T8/T1"] > 0 and out["peak_rss_gib"] > 0 and out["prefill_ms_per_token"] > 0


def test_synthetic_gguf_of_small_shapes_loads_and_pairs(tmp_path, monkeypatch):
    """``python benchmarks/synthetic_gguf.py OUT --tokenizer-from GGUF ...``: llama.cpp's
    Q4_K_M mix (output Q6_K, attn_v / ffn_down Q6_K on llama.cpp's layers), the tokenizer
    listed padded to the embedding rows with [PAD<id>] tokens; the file loads natively and
    decodes (its Q4_K weights kept as they are), its verify rows equal one-token passes."""
    from gguf import GGUFReader
    from specdecode.models.gguf_file import GGUFFile
    from tiny_dirs import gguf_source_dir, write_tiny_gguf

    tok = tmp_path / "tok.gguf"
    write_tiny_gguf(gguf_source_dir(tmp_path / "src"), tok)
    out = tmp_path / "syn.gguf"
    proc = _run([SCRIPTS / "synthetic_gguf.py", out, "--tokenizer-from", tok, "--layers", 8,
                 "--hidden", 256, "--ffn", 512, "--heads", 4, "--kv-heads", 2, "--vocab", VOCAB + 64], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # 8 layers: more bits on layers 0, 3, 6 and 7 (llama.cpp's use_more_bits)
    assert report["types"] == {"Q6_K": 1 + 2 * 4, "Q4_K": 1 + 8 * 7 - 2 * 4, "F32": 8 * 5 + 1}
    reader = GGUFReader(str(out))
    assert reader.fields["tokenizer.ggml.tokens"].contents()[-1] == f"[PAD{VOCAB + 63}]"
    assert report["tokens_listed"] == VOCAB
    assert GGUFFile(out).tensors["blk.3.ffn_down.weight"].type.name == "Q6_K"
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    lm = specdecode.load(out, tokenizer=False).lm
    assert lm.vocab_size == VOCAB + 64
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    lm.allocate(1, 32)
    lm.forward(ids[:, :12], num_logits=0)
    singles = torch.cat([lm.forward(ids[:, i:i + 1])[0] for i in range(12, 20)])
    assert torch.isfinite(singles).all()
    lm.rollback(12)
    assert torch.equal(lm.forward(ids[:, 12:20])[0], singles)


def test_draft_projection_from_a_curve_and_forward_times(tmp_path):
    """``python benchmarks/draft_projection.py CURVE TARGET_TIMES DRAFT_TIMES``: per acceptance
    scale and answer length, the best K and every K's decode-only and end-to-end speedup,
    from the formulas its docstring gives."""
    curve = tmp_path / "curve.jsonl"
    curve.write_text(json.dumps({"humaneval": {f"ar_alpha_{j}": 0.9 ** j for j in range(1, 9)}}) + "\n")
    target, draft = tmp_path / "t.json", tmp_path / "d.json"
    target.write_text(json.dumps({"T_ms": {"1": 100, "2": 110, "4": 130, "8": 200}, "prefill_ms_per_token": 20}))
    draft.write_text(json.dumps({"T_ms": {"1": 10, "8": 40}, "prefill_ms_per_token": 2}))
    proc = _run([SCRIPTS / "draft_projection.py", curve, target, draft, "--prompt", 100, "--new", 128,
                 "--scale", 1.0, 0.5], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(x["scale"], x["new_tokens"]) for x in lines] == [(1.0, 128), (0.5, 128)]
    k2 = lines[0]["rows"][1]
    tau = 1 + 0.9 + 0.81
    assert k2["k"] == 2 and k2["tau"] == round(tau, 2)
    assert k2["decode"] == round(tau * 100 / (120 + 2 * 10), 2)  # T(3) interpolated: 120
    assert k2["end_to_end"] == round((100 * 20 + 128 * 100) / (100 * 22 + 128 / tau * 140), 2)
    assert lines[0]["best"]["end_to_end"] == max(r["end_to_end"] for r in lines[0]["rows"])
    assert lines[1]["best"]["end_to_end"] < lines[0]["best"]["end_to_end"]
    target.write_text(json.dumps({"T_ms": {"1": 100}}))
    proc = _run([SCRIPTS / "draft_projection.py", curve, target, draft], tmp_path)
    assert proc.returncode == 2 and "prefill_ms_per_token" in proc.stderr


def test_paired_ratios_of_a_runs_records(tmp_path):
    """``python benchmarks/paired_ratios.py records.jsonl A/B``: per subtask and overall, the
    median over prompts of B's seconds over A's on the same prompt; a method the run lacks
    is named with the run's methods."""
    seconds = {("x", "1"): 2.0, ("x", "2"): 4.0, ("y", "1"): 1.5}  # b's; a takes 1 s on each
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"method": m, "subtask": s, "prompt_id": p, "turn": 0,
                                           "seconds": 1.0 if m == "a" else b}) + "\n"
                               for (s, p), b in seconds.items() for m in ("a", "b")))
    proc = _run([SCRIPTS / "paired_ratios.py", records, "a/b"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["| pair | x | y | overall |", "|---|---|---|---|",
                                        "| a / b | 3.00× | 1.50× | 2.00× |"]
    proc = _run([SCRIPTS / "paired_ratios.py", records, "a/c"], tmp_path)
    assert proc.returncode == 1 and "'a/c': methods must be two of ['a', 'b'], as A/B" in proc.stderr


def test_assisted_example_of_tiny_models(tmp_path_factory, tmp_path):
    """``python benchmarks/assisted_example.py OUT``: plain decoding against the default
    method with a draft of the target's tokenizer and one of another, the same text."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "assisted.json"
    proc = _run([SCRIPTS / "assisted_example.py", out, "--target", dirs["target"], "--drafts",
                 f"{dirs['draft']},{dirs['foreign']}", "--prompt", "hello", "--max-new-tokens", "6",
                 "--repeats", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["drafts"]) == {str(dirs["draft"]), str(dirs["foreign"])}
    for r in result["drafts"].values():
        assert r["identical"] is True and len(r["seconds"]["plain"]) == len(r["seconds"]["default"]) == 2
        assert r["speedup"] > 0 and r["default_stats"]["num_generated_tokens"] == 6


def test_pard_curve_trains_measures_and_projects(tmp_path_factory, tmp_path):
    """``python benchmarks/pard_curve.py OUT`` on the tiny pair: answers recorded, a line a
    measurement (before and after a few steps) with both held-out sets; ``--project`` turns
    the last line and two forward-time lines into a speedup per K."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "pard"
    proc = _run([SCRIPTS / "pard_curve.py", out, "--target", dirs["target"], "--draft", dirs["wide"],
                 "--prompts", "12", "--humaneval", "2", "--max-new-tokens", "12", "--minutes", "0.02",
                 "--every", "0.01", "--batch", "2", "--layers", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert len(lines) >= 2 and lines[0]["steps"] == 0 and lines[-1]["steps"] >= 1
    assert lines[-1]["tokens_per_s"] > 0 and 0 <= lines[-1]["humaneval"]["alpha_2"] <= 1
    assert json.loads((out / "draft" / "config.json").read_text())["pard_token"] == VOCAB
    for name, t1 in (("t.json", 40.0), ("d.json", 10.0)):
        (tmp_path / name).write_text(json.dumps({"T_ms": {"1": t1, "4": 2 * t1, "8": 3 * t1, "16": 5 * t1}}) + "\n")
    proc = _run([SCRIPTS / "pard_curve.py", out, "--project", tmp_path / "t.json", tmp_path / "d.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    projected = json.loads((out / "projection.json").read_text())
    assert [r["k"] for r in projected["rows"]] == list(range(2, 9)) and projected["ceiling"] > 0


def test_soak_of_a_tiny_pair_passes_and_says_what_it_checked(tmp_path_factory, tmp_path):
    """``benchmarks/soak.py`` end to end on the tiny pair: a server of its own, mixed requests
    (greedy and seeded, streamed or not, chat and completions, methods, clients leaving,
    refused bodies), every completed response equal to its solo output, the server stopped by
    SIGINT cutting nothing."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "soak"
    proc = _run([SCRIPTS / "soak.py", "--out", out, "--target", dirs["target"], "--draft", dirs["draft"],
                 "--requests", "60", "--clients", "4", "--max-tokens", "16", "--prompts", "5",
                 "--max-len", "512", "--prompt-chars", "120", "--sample-every", "0.2", "--bad-share", "0.1",
                 "--disconnect-share", "0.3", "--max-rss-growth", "0.5"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    s = results["summary"]
    assert results["failures"] == [] and "**passed**" in (out / "report.md").read_text()
    assert s["requests"] == 60 and s["server_exit"] == 130 and s["queue_end"] == [0.0, 0.0]
    assert s["refused"] >= 1 and s["disconnected"] >= 1
    assert s["compared"] + s["refused"] + s["disconnected"] == 60
    assert set(results["methods"]) == {"ar", "prompt-lookup", "suffix", "draft", "hybrid"}
    kinds = {(x["chat"], x["seed"] is None, x["stream"]) for x in results["samples"] if x["bad"] is None}
    assert len(kinds) == 8  # every mix of chat or not, greedy or seeded, streamed or not
    assert len(results["health"]["rss_mib"]) >= 3


def test_soak_checks_fail_on_each_fault():
    """soak.evaluate names each fault the soak exists to catch."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("soak", SCRIPTS / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(soak)
    finally:
        del sys.modules["soak"]
    job = soak.Job(0, True, None, False, "ar", 8)
    solo = {soak.solo_key(job): "right"}
    health = soak.Health(rss_mib=[(0, 100.0), (10, 101.0), (20, 102.0)], fds=[(0, 20), (10, 21), (20, 21)])
    ok = dict(solo=solo, health=health, warm_s=5, end_queue=(0.0, 0.0), exit_code=130,
              server_log="stopped by SIGINT: no request was cut\n", max_rss_growth=0.05, fd_slack=4)
    good = [soak.Outcome(job, 200, "right"), soak.Outcome(soak.Job(0, True, None, False, "ar", 8, bad="oversized"), 413)]
    assert soak.evaluate(good, **ok) == []
    faults = {
        "differs from its solo output": dict(outcomes=[soak.Outcome(job, 200, "wrong")]),
        "got 400, not 413": dict(outcomes=[soak.Outcome(soak.Job(0, True, None, False, "ar", 8, bad="oversized"), 400)]),
        "500 None": dict(outcomes=[soak.Outcome(job, 500)]),
        "resident memory grew": dict(health=soak.Health(rss_mib=[(10, 100.0), (20, 110.0)], fds=[(10, 20)])),
        "file descriptors went from 20 to 30": dict(health=soak.Health(rss_mib=[(10, 100.0)], fds=[(10, 20), (20, 30)])),
        "the queue did not drain": dict(end_queue=(1.0, 0.0)),
        "stop on SIGINT": dict(exit_code=1),
        "traceback": dict(server_log="Traceback (most recent call last):\nno request was cut\n"),
    }
    for words, change in faults.items():
        kwargs = {**ok, "outcomes": good, **change}
        failures = soak.evaluate(**kwargs)
        assert len(failures) == 1 and words in failures[0], (words, failures)
