"""Fill-in-the-middle: the FIM tokens (GGUF metadata, else their text), llama.cpp server's
prompt layout, the middle's end at the model's FIM stop, speculation equal to plain
decoding, and the three ways in: ``suffix=`` (API, ``generate --suffix``), ``suffix`` on
``/v1/completions`` (the openai client) and llama.cpp's ``/infill`` (plain HTTP, its
field names)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

import specdecode
from specdecode import fim
from test_server import Server
from tiny_dirs import FIM_TOKENS, fim_dirs, gguf_source_dir, tiny_dirs_in, write_tiny_gguf

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return total\n\nprint(add(1, 2))\n"
METHODS = ["prompt-lookup", "suffix", "draft", "hybrid"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fim_dirs(tmp_path_factory.mktemp("fim"))


@pytest.fixture(scope="module")
def pair(dirs):
    return specdecode.load(dirs["target"]), specdecode.load(dirs["draft"])


def test_fim_tokens_by_text_and_from_gguf_metadata(pair, tmp_path):
    target, _ = pair
    vocab = target.tokenizer.get_vocab()
    found = fim.fim_tokens(target)
    assert "<|fim_prefix|>" in FIM_TOKENS
    assert (found.pre, found.suf, found.mid) == (vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"],
                                                 vocab["<|fim_middle|>"])
    assert found.stops == (vocab["<|fim_pad|>"], vocab["<|repo_name|>"], vocab["<|file_sep|>"],
                           vocab["<|endoftext|>"])  # (llama.cpp's end of generation too)
    # a GGUF file's keys win over the texts (llama.cpp's order): here they name other ids
    src = gguf_source_dir(tmp_path / "src")
    path = tmp_path / "keys.gguf"
    write_tiny_gguf(src, path, metadata={"tokenizer.ggml.fim_pre_token_id": 5,
                                         "tokenizer.ggml.fim_suf_token_id": 6,
                                         "tokenizer.ggml.fim_mid_token_id": 7})
    keyed = specdecode.load(path, tokenizer=True)
    assert (fim.fim_tokens(keyed).pre, fim.fim_tokens(keyed).suf, fim.fim_tokens(keyed).mid) == (5, 6, 7)
    plain = specdecode.load(src)  # the test tokenizer: no FIM tokens
    assert fim.fim_tokens(plain) is None
    with pytest.raises(fim.FIMError, match="no fill-in-the-middle tokens"):
        specdecode.generate(plain, PREFIX, suffix=SUFFIX, max_new_tokens=4)


def test_the_prompt_is_laid_out_as_llama_cpp_lays_out_infill(pair):
    target, _ = pair
    tok, f = target.tokenizer, fim.fim_tokens(target)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)
    extra = [{"filename": "util.py", "text": "def helper():\n    pass\n"}]
    ids = fim.infill_ids(target, PREFIX, SUFFIX, prompt="tot", extra=extra, n_ctx=4096, n_predict=64)
    context = ([f.rep] + enc("myproject\n") + [f.sep] + enc("util.py\n") + enc(extra[0]["text"])
               + [f.sep] + enc("filename\n"))
    assert ids == context + [f.pre] + enc(PREFIX) + enc("tot") + [f.suf] + enc(SUFFIX) + [f.mid]
    # a single file (OpenAI's suffix): no repository context, whatever the room; /infill's
    # (repo=True): llama.cpp's even without chunks
    alone = [f.pre] + enc(PREFIX) + [f.suf] + enc(SUFFIX) + [f.mid]
    assert fim.infill_ids(target, PREFIX, SUFFIX, n_ctx=8192) == alone
    assert fim.infill_ids(target, PREFIX, SUFFIX, n_ctx=8192, repo=True) == (
        [f.rep] + enc("myproject\n") + [f.sep] + enc("filename\n") + alone)
    # suffix first (--spm-infill); no room for the context in a small window
    spm = fim.infill_ids(target, PREFIX, SUFFIX, extra=extra, n_ctx=2048, spm=True)
    assert spm == [f.suf] + enc(SUFFIX) + [f.pre] + enc(PREFIX) + [f.mid]
    # the prefix keeps its last 1,536 tokens, the suffix its first 510 less the prompt's
    long = "x = 1\n" * 2000
    cut = fim.infill_ids(target, long, long, prompt="tot", n_ctx=2048)
    p, s = enc(long), enc(long)
    assert cut == [f.pre] + p[-1536:] + enc("tot") + [f.suf] + s[:510 - len(enc("tot"))] + [f.mid]
    with pytest.raises(fim.FIMError, match="input_extra"):
        fim.infill_ids(target, PREFIX, SUFFIX, extra=[{"text": 3}])


@pytest.mark.parametrize("method", METHODS)
def test_speculative_fim_equals_plain_fim_greedy_and_seeded(pair, method):
    target, draft = pair
    kw = dict(suffix=SUFFIX, max_new_tokens=40)
    d = draft if method in ("draft", "hybrid") else None
    for sampling in ({"temperature": 0.8, "seed": 3}, {}):
        plain = specdecode.generate(target, PREFIX, method="ar", **kw, **sampling)
        spec = specdecode.generate(target, PREFIX, method=method, draft=d, **kw, **sampling)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.prompt_token_ids == fim.infill_ids(target, PREFIX, SUFFIX, n_predict=40)
    streamed = "".join(c.text for c in specdecode.stream(target, PREFIX, method=method, draft=d, **kw))
    assert streamed == plain.text  # (the greedy one)


def test_the_middle_ends_at_the_models_fim_stop(dirs, tmp_path):
    """A target whose <|fim_pad|> head row is twice a token's that plain decoding emits: the
    middle ends at the first <|fim_pad|> (finish "stop", not in the text), where decoding
    without the FIM stops goes on past it."""
    from safetensors.torch import load_file, save_file

    target = specdecode.load(dirs["target"])
    vocab = target.tokenizer.get_vocab()
    free = specdecode.generate(target, PREFIX, suffix=SUFFIX, max_new_tokens=20, eos_token_id=[])
    tid = free.token_ids[4]
    state = load_file(dirs["target"] / "model.safetensors")
    emb = state["model.embed_tokens.weight"]
    emb[vocab["<|fim_pad|>"]] = 2 * emb[tid]
    shutil_copy = tmp_path / "stopper"
    shutil_copy.mkdir()
    for f in dirs["target"].iterdir():
        if f.name != "model.safetensors":
            (shutil_copy / f.name).write_bytes(f.read_bytes())
    save_file(state, shutil_copy / "model.safetensors", metadata={"format": "pt"})
    stopper = specdecode.load(shutil_copy)
    free = specdecode.generate(stopper, PREFIX, suffix=SUFFIX, max_new_tokens=20, eos_token_id=[])
    pad = vocab["<|fim_pad|>"]
    assert pad in free.token_ids
    middle = specdecode.generate(stopper, PREFIX, suffix=SUFFIX, max_new_tokens=20, method="prompt-lookup")
    end = free.token_ids.index(pad) + 1
    assert middle.token_ids == free.token_ids[:end] and middle.finish_reason == "stop"
    assert "<|fim_pad|>" not in middle.text


def test_generate_suffix_on_the_command_line(dirs, tmp_path):
    (tmp_path / "before.py").write_text(PREFIX)
    (tmp_path / "after.py").write_text(SUFFIX)
    run = subprocess.run([sys.executable, "-m", "specdecode", "generate", "--target", str(dirs["target"]),
                          "--draft", str(dirs["draft"]), "--prompt-file", str(tmp_path / "before.py"),
                          "--suffix-file", str(tmp_path / "after.py"), "--max-new-tokens", "24",
                          "--compare", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    target = specdecode.load(dirs["target"])
    assert out["token_ids"] == specdecode.generate(target, PREFIX, suffix=SUFFIX, max_new_tokens=24).token_ids
    assert out["identical"] is True
    bad = subprocess.run([sys.executable, "-m", "specdecode", "generate", "--target", str(dirs["target"]),
                          "--prompt", "x", "--suffix", "y", "--chat"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "drop --chat" in bad.stderr


@pytest.fixture(scope="module")
def server(dirs):
    served = specdecode.load(dirs["target"]), specdecode.load(dirs["draft"])  # (its batch holds them)
    s = Server(lambda: served, method="hybrid").start()
    yield s
    s.stop()


def test_suffix_on_v1_completions_with_the_openai_client(server, pair):
    target, draft = pair
    client = server.client()
    want = specdecode.generate(target, PREFIX, suffix=SUFFIX, max_new_tokens=24, method="hybrid", draft=draft)
    got = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=24,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[PREFIX, PREFIX], suffix=SUFFIX, max_tokens=4)
    assert e.value.body["param"] == "prompt"


def test_infill_with_llama_cpp_field_names(server, pair):
    """llama.vscode's request shape: the middle is the library's for the same layout, only
    response_fields come back, n_indent cuts the first line indented less, a stream is
    events of content then the last one with stop: true."""
    target, draft = pair
    extra = [{"filename": "util.py", "text": "def helper():\n    pass\n"}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "",
            "n_predict": 24, "temperature": 0, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 0, "id_slot": 0}
    status, _, out = server.post("/infill", body)
    assert status == 200, out
    ids = fim.infill_ids(target, PREFIX, SUFFIX, extra=extra, n_ctx=server.worker.context, n_predict=24)
    eos = list(target.eos_token_ids) + list(fim.fim_tokens(target).stops)
    want = specdecode.generate(target, input_ids=ids, max_new_tokens=24, method="ar", eos_token_id=eos)
    ended = want.finish_reason == "stop" and want.token_ids[-1] in eos
    n = len(want.token_ids) - ended  # a stop token that ended the middle is not a predicted one
    assert out["content"] == want.text and out["tokens_predicted"] == n
    assert out["tokens_evaluated"] == len(ids) and out["timings"]["predicted_n"] == n
    status, _, few = server.post("/infill", {**body, "response_fields": ["content", "timings/prompt_n", "nope/x"]})
    assert few == {"content": want.text, "timings/prompt_n": len(ids)}
    # n_indent: the middle is cut where the first line indented less than n_indent starts
    lines = want.text.split("\n")
    shallow = next((i for i, line in enumerate(lines[1:], 1)
                    if line.strip() and len(line) - len(line.lstrip(" \t")) < 8), None)
    status, _, cut = server.post("/infill", {**body, "n_indent": 8})
    if shallow is None:
        assert cut["content"] == want.text
    else:
        line = lines[shallow]
        keep = "\n".join(lines[:shallow]) + "\n" + line[:len(line) - len(line.lstrip(" \t"))]
        assert cut["content"] == keep and cut["stop_type"] == "limit"
    if shallow is not None:  # a cut middle still reports its times
        assert cut["timings"]["prompt_ms"] > 0 and cut["timings"]["predicted_ms"] > 0
    # a stop string ends it as llama.cpp reports one; no response_fields: all of them
    word = want.text[3:6]
    status, _, stopped = server.post("/infill", {**body, "stop": [word], "response_fields": []})
    assert stopped["content"] == want.text[:want.text.find(word)]
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    # the method, as on /v1/completions
    status, _, plain = server.post("/infill", {**body, "method": "ar"})
    assert status == 200 and plain["content"] == want.text
    # streamed
    import urllib.request
    req = urllib.request.Request(server.url + "/infill", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == want.text
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])


def test_fim_errors_are_400_naming_the_field(server, tmp_path_factory):
    status, _, out = server.post("/infill", {"input_prefix": PREFIX, "min_p": 0.1})
    assert status == 400 and out["error"]["param"] == "min_p"
    status, _, out = server.post("/infill", {"input_prefix": PREFIX, "input_extra": [{"text": 5}]})
    assert status == 400 and out["error"]["param"] == "input_extra"
    status, _, out = server.post("/infill", {"input_prefix": 3})
    assert status == 400 and out["error"]["param"] == "input_prefix"
    status, _, out = server.post("/infill", {"input_prefix": "a", "input_extra": [{"filename": "a.py", "text": "\ud800"}]})
    assert status == 400 and out["error"]["param"] == "input_extra"
    status, _, out = server.post("/infill", {"input_prefix": "a", "method": "nonsense"})
    assert status == 400 and out["error"]["param"] == "method"
    status, _, out = server.post("/infill", {"input_prefix": "a", "prompt": "x = 1\n" * 400})
    assert status == 400 and out["error"]["param"] == "prompt"
    status, _, out = server.post("/v1/completions", {"model": "tiny", "prompt": "a", "suffix": 3})
    assert status == 400 and out["error"]["param"] == "suffix"
    # a server whose target has no FIM tokens
    dirs = tiny_dirs_in(tmp_path_factory)
    plain = Server(lambda: (specdecode.load(dirs["target"]), None), method="ar").start()
    try:
        status, _, out = plain.post("/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b"})
        assert status == 400 and out["error"]["param"] == "suffix" and "fill-in-the-middle" in out["error"]["message"]
        status, _, out = plain.post("/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 400 and out["error"]["param"] == "input_suffix"
    finally:
        plain.stop()
