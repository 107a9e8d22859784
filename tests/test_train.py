"""Training draft heads (specdecode.train, ``specdecode train``): the prompts and their
decontamination, the recorded features, the Medusa objective, the resumable training loop,
and the command end to end on a tiny target."""

from __future__ import annotations

import io
import json
import signal

import pytest
import torch
from torch import nn

import specdecode
from specdecode.bench.workloads import SPEC_BENCH_PATH
from specdecode.cli import main
from specdecode.heads import EAGLE3_ARCH, Eagle3Head, MedusaHeads, aux_layers, default_head_dir, draft_vocabulary
from specdecode.train import data, run
from specdecode.models.loading import checkpoint_tensor
from specdecode.models import native
from specdecode.train.features import TOPK, Sequence, load_sequences, read_manifest, record, recording_seconds
from specdecode.train.loop import Task, train
from specdecode.train.medusa import chain_acceptance, first_ids_labels, medusa_examples, medusa_loss, medusa_task
from tiny_dirs import _llama_config, _randomize, local_tokenizer, tiny_dirs_in


# ---------------------------------------------------------------- prompts

def test_a_prompt_sharing_an_8_word_run_with_the_evaluation_sets_is_dropped():
    bench = "Write a function that returns the sum of all even numbers in a list of integers."
    exclude = data.word_runs(bench)
    eight = data.Prompt("Please, WRITE a function that returns the sum of all even numbers, thanks", True, "sharegpt")
    seven = data.Prompt("please make a function that returns the sum of odd values", True, "sharegpt")
    assert data.word_runs(eight.text) & exclude  # case and punctuation do not hide a run
    assert not data.word_runs(seven.text) & exclude


def test_the_real_evaluation_sets_are_in_the_filter():
    """Spec-Bench's and HumanEval's own text is caught (both files are read)."""
    from specdecode.bench.workloads import SPEC_BENCH_PATH, _humaneval_problems
    runs = data.evaluation_runs()
    question = json.loads(SPEC_BENCH_PATH.read_text().splitlines()[0])["turns"][0]
    assert data.word_runs(question) & runs
    assert data.word_runs(_humaneval_problems()[7]["prompt"]) & runs


def test_tune_skips_calibration_prompts_are_not_the_benchs():
    """The layer-skip search calibrates on prompts that share no 8-word run with Spec-Bench or
    HumanEval (the prompts its profile is measured on), by the training data's own filter."""
    from specdecode.layer_skip import CALIBRATION_PROMPTS
    runs = data.evaluation_runs()
    for _, text in CALIBRATION_PROMPTS:
        assert data.word_runs(text) and not data.word_runs(text) & runs, text


class _Trickle(io.StringIO):
    """A stream that returns at most 7 characters a read, so records straddle reads."""

    def read(self, n=-1):
        return super().read(7)


def test_complete_sharegpt_records_are_recovered_from_a_cut_file(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} ünïcode"},
                                                {"from": "gpt", "value": "answer"}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[:text.index('"id": "4"') + 4]  # the last record is cut
    got = list(data.sharegpt_records(_Trickle(cut)))
    assert got == records[:4]
    assert list(data.sharegpt_records(_Trickle(text))) == records
    path = tmp_path / "sg.json"
    gpt_first = {"id": "g", "conversations": [{"from": "gpt", "value": "hi"}]}
    path.write_text(json.dumps(records[:2] + [gpt_first])[:-1])  # also cut: no closing bracket
    prompts = list(data.sharegpt_prompts(path))
    assert [p.text for p in prompts] == ["question 0 ünïcode", "question 1 ünïcode"]
    assert all(p.chat and p.source == "sharegpt" for p in prompts)
    with pytest.raises(ValueError, match="JSON array"):
        list(data.sharegpt_records(io.StringIO('{"a": 1}')))


def test_stdlib_prompts_are_documented_public_functions_as_written(tmp_path):
    (tmp_path / "mod.py").write_text(
        'import os\n\n@staticmethod\ndef public(a, b=2, *, c):\n    """Add the numbers a and b\n\n'
        '    and c, returning their sum."""\n    return a + b + c\n\n'
        'def _private(x):\n    """A private helper that is never a prompt."""\n\n'
        'def terse(x):\n    """Too short."""\n\ndef nodoc(x):\n    return x\n')
    (tmp_path / "test_mod.py").write_text('def tested(x):\n    """A test module function is not a prompt."""\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('def loads(s):\n    """Read an object from the string s."""\n    pass\n')
    got = [p.text for p in data.stdlib_prompts(tmp_path)]
    assert got == ['def public(a, b=2, *, c):\n    """Add the numbers a and b\n\n'
                   '    and c, returning their sum."""\n',
                   'def loads(s):\n    """Read an object from the string s."""\n']  # sorted by path
    assert all(not p.chat and p.source == "stdlib" for p in data.stdlib_prompts(tmp_path))


def test_prompts_alternate_between_sources_without_overlap_or_repeats(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text("".join(
        f'def f{i}(x):\n    """Return x times {i} for the caller, always."""\n\n' for i in range(4)))
    conv = [{"conversations": [{"from": "human", "value": v}]} for v in
            ("alpha question here", "alpha question here", "beta question here",
             "one two three four five six seven eight", "gamma question here")]
    (tmp_path / "sg.json").write_text(json.dumps(conv))
    exclude = data.word_runs("zero one two three four five six seven eight nine")
    paths = {"stdlib": tmp_path / "lib", "sharegpt": tmp_path / "sg.json"}
    prompts, summary = data.training_prompts(data.DEFAULT_SOURCES, 5, exclude, paths)
    assert [p.source for p in prompts] == ["stdlib", "sharegpt"] * 2 + ["stdlib"]
    assert [p.text for p in prompts if p.chat] == ["alpha question here", "beta question here"]
    everything, summary = data.training_prompts(data.DEFAULT_SOURCES, None, exclude, paths)
    assert summary["sharegpt"] == {"kept": 3, "dropped_overlap": 1}
    assert summary["stdlib"] == {"kept": 4, "dropped_overlap": 0}
    assert len({p.key for p in everything}) == len(everything) == 7
    with pytest.raises(ValueError, match="allowed: a comma-separated subset"):
        data.parse_sources("stdlib,wiki")
    assert data.parse_sources(" sharegpt ") == ("sharegpt",)


def test_questions_and_translation_prompts_in_spec_bench_shape(tmp_path):
    """questions: one-line short questions only; translation: the German that to_german
    writes for plain English sentences of the answers, in Spec-Bench's wording, dropped when
    it is not a translation; both decontaminated and round-robin like the other sources."""
    answer = ("Sure!\nThe river flows slowly through the old town every single spring. "
              "def f(x): return x + 1 is code. Short one. "
              "A second sentence about the weather in the mountains is here. "
              "The third plain sentence of this answer is about the sea today. "
              "The fourth plain sentence of this answer talks about the moon.")
    conv = [{"conversations": [{"from": "human", "value": v}, {"from": "gpt", "value": answer}]} for v in
            ("Who wrote the book about the old town?", "who?", "Explain this:\nwhat is it?",
             "Write a poem about the sea.", "Who wrote the book about the old town?",
             "What is " + "very " * 60 + "long?")]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv))
    assert [p.text for p in data.question_prompts(path)] == ["Who wrote the book about the old town?"] * 2
    assert list(data.english_sentences(path, per_conversation=9)) == [
        "The river flows slowly through the old town every single spring.",
        "A second sentence about the weather in the mountains is here.",
        "The third plain sentence of this answer is about the sea today.",
        "The fourth plain sentence of this answer talks about the moon."]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(conv[:1]))
    assert list(data.english_sentences(one)) == [  # the first two of a conversation
        "The river flows slowly through the old town every single spring.",
        "A second sentence about the weather in the mountains is here."]
    asked = []

    def to_german(sentences):
        asked.append(list(sentences))
        return ["Der Fluss fließt langsam durch die Altstadt.\n(This is my translation.)",
                sentences[1],                          # not translated: dropped
                "这是中文",                             # another script: dropped
                'Hier ist die Übersetzung:\n\n"Der vierte Satz handelt vom Mond."\n\nDiese Übersetzung ...'
                ][:len(sentences)]

    got = list(data.translation_prompts(to_german, path, batch=4))
    assert asked == [list(data.english_sentences(path, per_conversation=9))]
    assert [(p.text, p.chat, p.source) for p in got] == [
        ("Translate German to English: Der Fluss fließt langsam durch die Altstadt.", True, "translation"),
        ("Translate German to English: Der vierte Satz handelt vom Mond.", True, "translation")]
    with pytest.raises(ValueError, match="2 replies for 4 sentences"):
        list(data.translation_prompts(lambda s: s[:2], path, batch=4))
    with pytest.raises(ValueError, match="returned NoneType for 'The river"):
        list(data.translation_prompts(lambda s: [None] * len(s), path, batch=4))
    with pytest.raises(ValueError, match="returned NoneType for 4 sentences"):
        list(data.translation_prompts(lambda s: None, path, batch=4))
    # a reply that is English, a preface on the translation's line, German punctuation
    assert data.german_of("The behaviour of customers should not change at all.", "x" * 40) is None
    assert data.german_of("I'm ready to help. What's the user's task?", "x" * 40) is None
    assert data.german_of("Here's the German translation: Der Fuchs springt.", "The fox jumps.") == "Der Fuchs springt."
    assert data.german_of("Die Straße ist groß – wirklich.", "The street is big, really.") == "Die Straße ist groß – wirklich."
    # a target that writes no usable German is not asked for every sentence of the file
    many = tmp_path / "many.json"
    many.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": f"Sentence {a}{b} of the many that follow here."}]}
                                for a in "abcdefghij" for b in "abcdefghijklmnopqrst"]))  # 200 distinct
    calls = []
    assert list(data.translation_prompts(lambda s: calls.append(len(s)) or list(s), many, batch=8)) == []
    assert sum(calls) == data.MAX_DROPPED_IN_A_ROW
    exclude = data.word_runs("translate german to english der vierte satz handelt vom mond")
    prompts, summary = data.training_prompts(("questions", "translation"), None, exclude,
                                             {"sharegpt": path}, to_german=to_german)
    assert [p.source for p in prompts] == ["questions", "translation"]
    assert summary["questions"] == {"kept": 1, "dropped_overlap": 0}  # the repeat is not taken twice
    assert summary["translation"] == {"kept": 1, "dropped_overlap": 1}
    with pytest.raises(ValueError, match="translation source needs to_german"):
        data.training_prompts(("translation",), 2, exclude, {"sharegpt": path})
    assert data.parse_sources("questions,translation") == ("questions", "translation")
    with pytest.raises(ValueError, match="unknown: 'foo'"):
        data.parse_sources("questions,foo")
    with pytest.raises(ValueError, match="given twice: questions"):
        data.parse_sources("questions,questions")
    with pytest.raises(ValueError, match="each of stdlib, sharegpt, questions, translation at most once"):
        data.training_prompts(("questions", "wiki"), 2, exclude, {"sharegpt": path})
    assert data.training_prompts("questions", 1, exclude, {"sharegpt": path})[0][0].source == "questions"


def test_the_held_out_split_depends_on_the_prompt_only():
    prompts = [data.Prompt(f"question number {i}", True, "sharegpt") for i in range(2000)]
    held = [p for p in prompts if data.is_held_out(p)]
    assert 60 < len(held) < 140  # ~5 %
    assert [data.is_held_out(data.Prompt(p.text, True, "sharegpt")) for p in held] == [True] * len(held)


# ---------------------------------------------------------------- features

@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory):
    """A random 8-layer Llama with the test tokenizer: enough layers for EAGLE-3's three."""
    from transformers import LlamaForCausalLM
    root = tmp_path_factory.mktemp("deep")
    config = _llama_config(len(local_tokenizer()))
    config.num_hidden_layers = 8
    model = LlamaForCausalLM(config)
    _randomize(model, seed=11, std=0.2)
    model.save_pretrained(root)
    local_tokenizer().save_pretrained(root)
    return root


def test_the_captured_layers_are_the_engines_defaults_in_transformers_indices(deep_target_dir):
    """vLLM's and SGLang's EAGLE-3 default for n layers is transformers' hidden_states[2],
    [n // 2] and [n - 3]; ours are the residual stream after layers 1, n/2-1, n-4."""
    from transformers import AutoModelForCausalLM
    from specdecode.models.native import FINAL
    assert aux_layers(28) == [1, 13, 24] and aux_layers(6) == []
    layers = aux_layers(8)
    ids = [1, 15, 40, 7, 300, 22]
    hf = AutoModelForCausalLM.from_pretrained(deep_target_dir, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ours = specdecode.load(deep_target_dir, dtype="float32").lm
    ours.allocate(1, len(ids))
    out = ours.forward_rows(torch.tensor([ids]), output_hidden=(FINAL, *layers))
    for ours_i, hf_i in zip(layers, (2, 8 // 2, 8 - 3)):
        torch.testing.assert_close(out.hidden[ours_i], states[hf_i], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden[FINAL], states[-1], rtol=1e-4, atol=1e-4)


def test_the_targets_german_is_written_once_and_kept_for_a_resumed_run(deep_target_dir, tmp_path, monkeypatch):
    """The translation source's German is the target's greedy translation, asked in batches;
    a second writer (a resumed run, another process) reads it back instead of generating."""
    target = specdecode.load(deep_target_dir, dtype="float32")
    sentences = ["The river flows slowly through the old town.", "A second sentence is here now."]
    german = run._german_writer(target, tmp_path / "features")(sentences)
    results = [specdecode.generate(target, run.ASK_GERMAN + s, chat=True, max_new_tokens=96) for s in sentences]
    alone = [r.text if r.finish_reason != "length" else "" for r in results]  # a cut reply is none
    assert german == alone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / run.GERMAN_FILE).write_text("null")  # not this writer's file: written again
    assert run._german_writer(target, tmp_path / "other")(sentences) == alone
    assert json.loads((tmp_path / "features" / run.GERMAN_FILE).read_text()) == dict(zip(sentences, alone))

    def no_generation(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(run, "generate", no_generation)
    assert run._german_writer(target, tmp_path / "features")(sentences[::-1]) == alone[::-1]


def _prompts(n):
    return [data.Prompt(f"def function_{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n", False, "stdlib")
            for i in range(n)]


def test_recorded_features_are_the_targets_answers_and_states(deep_target_dir, tmp_path):
    target = specdecode.load(deep_target_dir)  # int8: the engine's own numerics
    prompts = _prompts(5)
    manifest = record(target, prompts[:3], tmp_path / "f", max_new_tokens=12, batch=2, progress=False)
    assert manifest["aux_layers"] == aux_layers(8) and len(manifest["done"]) == 3
    seqs = load_sequences(tmp_path / "f", False) + load_sequences(tmp_path / "f", True)
    assert len(seqs) == 3
    solo = {tuple(specdecode.generate(target, p.text, max_new_tokens=12).prompt_token_ids
                  + specdecode.generate(target, p.text, max_new_tokens=12).token_ids) for p in prompts[:3]}
    assert {tuple(s.tokens.tolist()) for s in seqs} == solo
    for s in seqs:
        t = len(s.tokens)
        assert s.final.shape == (t, 32) and s.aux.shape == (t, 3 * 32) and s.topk_ids.shape == (t, TOPK)
        # greedy answers: each answer token is the top-1 of the position before it
        assert s.topk_ids[s.start - 1:t - 1, 0].tolist() == s.tokens[s.start:].tolist()
        assert torch.all(s.topk_logp[:, :-1] >= s.topk_logp[:, 1:]) and torch.all(s.topk_logp <= 0)
    # a second call resumes: only the new prompts are generated
    shards = [s["file"] for s in manifest["shards"]]
    again = record(target, prompts, tmp_path / "f", max_new_tokens=12, batch=2, progress=False)
    assert len(again["done"]) == 5 and [s["file"] for s in again["shards"][:len(shards)]] == shards
    assert sum(s["sequences"] for s in again["shards"]) == 5
    # a smaller run on the same directory (--features with a lower --max-prompts) reads its own
    # prompts' sequences only (was: every recorded one, 400 where the run said 120)
    every = load_sequences(tmp_path / "f", False) + load_sequences(tmp_path / "f", True)
    assert len(every) == 5
    for chosen in (prompts[:2], prompts[3:], [prompts[4], prompts[0]]):
        mine = load_sequences(tmp_path / "f", False, {p.key for p in chosen}) + \
            load_sequences(tmp_path / "f", True, {p.key for p in chosen})
        want = {tuple(specdecode.generate(target, p.text, max_new_tokens=12).prompt_token_ids) for p in chosen}
        assert {tuple(q.tokens[:q.start].tolist()) for q in mine} == want
    # and counts the time its own prompts' answers took, not the directory's
    shards = again["shards"]
    assert all(sh["seconds"] > 0 for sh in shards)
    assert recording_seconds(again, {p.key for p in prompts}) == pytest.approx(sum(sh["seconds"] for sh in shards), abs=0.2)
    first = shards[0]["seconds"] / shards[0]["sequences"]
    assert recording_seconds(again, {again["done"][0]}) == pytest.approx(first, abs=0.1)
    assert recording_seconds(again, set()) == 0
    old = {**again, "shards": [{k: v for k, v in sh.items() if k != "seconds"} for sh in shards]}
    assert recording_seconds(old, {p.key for p in prompts[:2]}) == pytest.approx(again["recording_seconds"] * 2 / 5, abs=0.1)
    with pytest.raises(ValueError, match="max_new_tokens: 12 there, 13 now"):
        record(target, prompts, tmp_path / "f", max_new_tokens=13, progress=False)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "features.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        read_manifest(tmp_path / "bad")
    with pytest.raises(ValueError, match="holds no recorded features"):
        load_sequences(tmp_path, False)
    w = checkpoint_tensor(target, "lm_head.weight")
    assert w.shape == (target.lm.vocab_size, 32) and w.dtype == torch.float32


# ---------------------------------------------------------------- Medusa objective

def _sequence(t=10, start=4, dim=3):
    tokens = torch.arange(100, 100 + t)
    topk = torch.arange(t)[:, None] * 1000 + torch.arange(TOPK)  # label row j holds j*1000 + rank
    return Sequence(tokens, start, torch.arange(t * dim, dtype=torch.float32).view(t, dim),
                    torch.zeros(t, 0), topk, -torch.arange(TOPK, dtype=torch.float32).expand(t, TOPK))


def test_medusa_examples_pair_each_position_with_the_tokens_two_and_more_ahead():
    s = _sequence()
    ex = medusa_examples([s], num_heads=3)
    assert len(ex["hidden"]) == 10 - 1 - 3  # positions start-1 .. T-2
    assert torch.equal(ex["hidden"][0], s.final[3])
    # head i at position t: the label is the distribution at t+i+1, the token t+i+2
    assert ex["label_ids"][0, :, 0].tolist() == [4000, 5000, 6000]
    assert ex["next_tokens"][0].tolist() == [105, 106, 107]
    last = len(ex["hidden"]) - 1  # t = 8 = T-2
    assert ex["valid"][last].tolist() == [True, False, False]
    assert ex["next_tokens"][last].tolist() == [-1, -1, -1]  # token 10 is beyond the answer
    assert ex["next_tokens"][last - 1].tolist() == [109, -1, -1]


def test_chain_acceptance_counts_the_leading_heads_that_guess_right():
    class Fixed(nn.Module):  # head i guesses guesses[row][i]
        def __init__(self, guesses, vocab=8):
            super().__init__()
            self.g = torch.nn.functional.one_hot(torch.tensor(guesses), vocab).float().transpose(0, 1)

        def forward(self, hidden):
            return self.g[:, hidden[:, 0].long()]

    ex = {"hidden": torch.tensor([[0.0], [1.0], [2.0]]),
          "next_tokens": torch.tensor([[1, 2, 3], [1, 5, 3], [4, -1, -1]])}
    m = Fixed([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    got = chain_acceptance(m, ex)
    assert got["acceptance_length"] == pytest.approx(1 + (3 + 1 + 0) / 3)
    assert got["head1_top1"] == pytest.approx(2 / 3) and got["head2_top1"] == pytest.approx(1 / 2)
    assert chain_acceptance(m, {}) == {}


def test_the_loss_is_the_soft_cross_entropy_weighted_by_head():
    heads = MedusaHeads(3, 8, 2, lm_head=torch.eye(8, 3))
    batch = {"hidden": torch.randn(4, 3), "label_ids": torch.randint(0, 8, (4, 2, TOPK)),
             "label_logp": torch.randn(4, 2, TOPK), "valid": torch.tensor([[True, True]] * 3 + [[True, False]])}
    logq = torch.log_softmax(heads(batch["hidden"]), -1)
    p = torch.softmax(batch["label_logp"], -1)
    ce = [[-(p[b, i] * logq[i, b, batch["label_ids"][b, i]]).sum() for b in range(4)] for i in range(2)]
    want = (sum(ce[0]) + 0.8 * sum(ce[1][:3])) / (4 + 0.8 * 3)
    torch.testing.assert_close(medusa_loss(heads, batch), want)


def test_heads_train_and_are_measured_over_the_first_ids_they_draft():
    """With first_ids m (served heads draft over token ids < m only): logits over those ids,
    the target's top-k renormalised over its ids among them, a (position, head) without one
    left out of the loss, and held-out top-1 taken among them."""
    torch.manual_seed(0)
    heads = MedusaHeads(3, 8, 2, lm_head=torch.randn(8, 3))
    for b in heads.blocks[0].parameters():
        nn.init.normal_(b)
    hidden = torch.randn(4, 3)
    torch.testing.assert_close(heads(hidden, first_ids=5), heads(hidden)[..., :5])
    ids = torch.tensor([[[1, 6], [2, 3]], [[7, 4], [5, 6]], [[0, 1], [2, 7]], [[6, 7], [3, 4]]])
    ex = {"hidden": hidden, "label_ids": ids, "label_logp": torch.randn(4, 2, 2),
          "valid": torch.tensor([[True, True]] * 3 + [[True, False]]), "next_tokens": ids[..., 0]}
    got = first_ids_labels(ex, 5)
    assert got["valid"].tolist() == [[True, True], [True, False], [True, True], [False, False]]
    logq = torch.log_softmax(heads(hidden)[..., :5], -1)
    terms = []
    for b in range(4):
        for i in range(2):
            keep = [j for j in range(2) if ids[b, i, j] < 5]
            if ex["valid"][b, i] and keep:
                p = torch.softmax(ex["label_logp"][b, i, keep], -1)
                terms.append((0.8 ** i, -(p * logq[i, b, ids[b, i, keep]]).sum()))
    want = sum(w * t for w, t in terms) / sum(w for w, _ in terms)
    torch.testing.assert_close(medusa_loss(heads, got, first_ids=5), want)
    # held out: the top-1 among the first ids, even where a later id scores higher
    top_all, top_first = heads(hidden).argmax(-1), heads(hidden)[..., :5].argmax(-1)
    assert (top_all != top_first).any()
    held = {"hidden": hidden, "next_tokens": top_first.t()}
    assert chain_acceptance(heads, held, first_ids=5)["head1_top1"] == 1.0
    assert chain_acceptance(heads, held)["head1_top1"] < 1.0


# ---------------------------------------------------------------- the loop

def _toy_task(interrupt_at=None, signum=signal.SIGINT):
    torch.manual_seed(0)
    x = torch.randn(40, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    module = nn.Linear(4, 1)
    calls = {"n": 0}

    def loss(m, batch):
        calls["n"] += 1
        if calls["n"] == interrupt_at:
            signal.raise_signal(signum)  # as Ctrl-C (or kill) would, mid-step
        return ((m(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()

    def evaluate(m):
        return {"mse": float(((m(x).squeeze(-1) - y) ** 2).mean())}

    def save(m, out, info):
        torch.save(m.state_dict(), out / "toy.pt")
        (out / "info.json").write_text(json.dumps(info))

    return Task(module, list(range(40)), lambda idx: {"x": x[idx], "y": y[idx]}, loss, evaluate, save,
                {"kind": "toy"})


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    plain = train(_toy_task(), tmp_path / "plain", epochs=3, batch_size=8, lr=0.05, progress=False)
    assert plain["history"][-1]["mse"] < plain["history"][0]["mse"]
    assert [h["loss"] for h in plain["history"]] == sorted(h["loss"] for h in plain["history"])[::-1]
    with pytest.raises(KeyboardInterrupt, match="run the same command again"):
        train(_toy_task(interrupt_at=8), tmp_path / "cut", epochs=3, batch_size=8, lr=0.05, progress=False)
    state = json.loads((tmp_path / "cut" / "checkpoint" / "trainer.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 3)  # 5 steps an epoch: epoch 2, after its 3rd step
    assert json.loads((tmp_path / "cut" / "info.json").read_text())["epochs"] == 1
    assert run.is_trained(tmp_path / "plain") and not run.is_trained(tmp_path / "cut")
    resumed = train(_toy_task(), tmp_path / "cut", epochs=3, batch_size=8, lr=0.05, progress=False)
    assert run.is_trained(tmp_path / "cut") and not run.is_trained(tmp_path / "nothing")
    a = torch.load(tmp_path / "plain" / "toy.pt")
    b = torch.load(tmp_path / "cut" / "toy.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    with pytest.raises(ValueError, match="batch_size=8.*use the same settings"):
        train(_toy_task(), tmp_path / "cut", epochs=4, batch_size=4, progress=False)
    # SIGTERM (a batch system's, `timeout`'s) stops the same way, keeping the checkpoint
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="run the same command again"):
        train(_toy_task(interrupt_at=8, signum=signal.SIGTERM), tmp_path / "term", epochs=3, batch_size=8,
              lr=0.05, progress=False)
    state = json.loads((tmp_path / "term" / "checkpoint" / "trainer.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 3)
    assert signal.getsignal(signal.SIGTERM) == before  # restored
    with pytest.raises(ValueError, match="epochs=0 is invalid"):
        train(_toy_task(), tmp_path / "x", epochs=0)
    empty = _toy_task()
    empty.examples = []
    with pytest.raises(ValueError, match="no training examples"):
        train(empty, tmp_path / "x")


def test_bf16_precision_runs_the_steps_in_bfloat16_with_fp32_weights(tmp_path, monkeypatch):
    """precision="bf16": the loss's products are bfloat16 (autocast), the weights, their
    gradients and the held-out measures fp32; it still learns. "auto" follows the device."""
    from specdecode.train import loop
    task = _toy_task()
    seen = []
    inner = task.loss

    def loss(m, batch):
        seen.append(m(batch["x"]).dtype)
        return inner(m, batch)

    task.loss = loss
    result = train(task, tmp_path / "bf16", epochs=3, batch_size=8, lr=0.05, precision="bf16", progress=False)
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in task.module.parameters())
    seen.clear()
    task32 = _toy_task()
    task32.loss = loss
    full = train(task32, tmp_path / "fp32", epochs=3, batch_size=8, lr=0.05, precision="fp32", progress=False)
    assert set(seen) == {torch.float32}
    mse = [h["mse"] for h in result["history"]]
    assert mse == sorted(mse, reverse=True)  # it learns, about as fp32 does
    assert abs(mse[-1] / full["history"][-1]["mse"] - 1) < 0.05
    with pytest.raises(ValueError, match="precision 'fp16' is invalid; allowed: auto, bf16, fp32"):
        train(task, tmp_path / "x", precision="fp16")
    from specdecode.models import quant
    monkeypatch.setattr(quant, "cpu_flags", lambda: ("avx2", "avx512f", "avx512_bf16"))
    assert loop.resolve_precision("auto", "cpu") == "bf16" and loop.resolve_precision("fp32", "cpu") == "fp32"
    monkeypatch.setattr(quant, "cpu_flags", lambda: ("avx2", "avx512f"))  # bf16 would be emulated
    assert loop.resolve_precision("auto", "cpu") == "fp32" and loop.resolve_precision("bf16", "cpu") == "bf16"


def test_medusa_training_lowers_the_loss_on_recorded_features(deep_target_dir, tmp_path):
    target = specdecode.load(deep_target_dir)
    record(target, _prompts(8), tmp_path / "f", max_new_tokens=24, progress=False)
    seqs = load_sequences(tmp_path / "f", False)
    lm = target.lm
    heads = MedusaHeads(lm.args.dim, lm.vocab_size, 2, lm_head=checkpoint_tensor(target, "lm_head.weight"))
    task = medusa_task(heads, seqs, seqs[:2], {"target": "deep"})
    result = train(task, tmp_path / "heads", epochs=4, batch_size=16, lr=3e-2, progress=False)
    losses = [h["loss"] for h in result["history"]]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 1.0, losses
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["training"]["target"] == "deep" and len(config["training"]["history"]) == 4
    MedusaHeads.load(tmp_path / "heads")


# ---------------------------------------------------------------- the command

def test_train_medusa_end_to_end_and_the_heads_keep_the_output(tmp_path_factory, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # its own default heads
    monkeypatch.setattr(native, "DRAFT_VOCAB", 32)  # the heads draft (and train) over the first 32 ids
    target = tiny_dirs_in(tmp_path_factory)["target"]
    out = default_head_dir(str(target), "medusa")  # no --out: the target's default heads
    assert main(["generate", "--target", str(target), "--method", "medusa", "--prompt", "x"]) == 2
    assert f"`specdecode train medusa --target {target}` trains its default one into {out}" \
        in capsys.readouterr().err
    args = ["train", "medusa", "--target", str(target), "--data", "stdlib",
            "--max-prompts", "6", "--max-new-tokens", "10", "--epochs", "1", "--batch-size", "8",
            "--heads", "2"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "6 prompts (stdlib: 6" in printed.err and "no prompt was held out (6 prompts" in printed.out  # not a nan
    assert f"the default medusa head of {target} goes to {out}" in printed.err
    assert printed.out.rstrip().endswith("--method medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["num_heads"] == 2 and config["training"]["data"]["sources"] == ["stdlib"]
    assert config["vocab_size"] > 64 and config["training"]["first_ids"] == 32
    assert config["training"]["data"]["prompts"]["stdlib"]["kept"] == 6
    assert (out / "features" / "features.json").exists()
    assert "answers recorded in" in printed.out
    assert main(args) == 0  # everything done: nothing recorded again, the run resumes at its end
    assert "answers recorded by an earlier run in" in capsys.readouterr().out
    model = specdecode.load(target)
    prompt = "def add(a, b):"
    plain = specdecode.generate(model, prompt, method="ar", max_new_tokens=20)
    spec = specdecode.generate(model, prompt, method="medusa", max_new_tokens=20)
    assert spec.token_ids == plain.token_ids and spec.stats.num_draft_tokens > 0


def test_train_eagle3_end_to_end_warm_started_and_the_head_keeps_the_output(deep_target_dir, tmp_path, capsys):
    """`specdecode train eagle3` on the 8-layer tiny target: the head directory loads for the
    target, its config records the data, precision and draft vocabulary, the draft
    vocabulary is the most frequent answer tokens, the head it started from is the warm
    start (the target's output rows of those ids and final norm; fc selecting the last
    captured layer; o_proj and down_proj zero: the target's own early exit there), and
    `generate --method eagle3:head=DIR` gives the target's output."""
    out = tmp_path / "e3"
    args = ["train", "eagle3", "--target", str(deep_target_dir), "--out", str(out), "--data", "stdlib",
            "--max-prompts", "6", "--max-new-tokens", "12", "--epochs", "2", "--batch-size", "2",
            "--draft-vocab", "8", "--steps", "2", "--precision", "fp32"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "6 prompts (stdlib: 6" in printed.err and "trained an EAGLE-3 head on" in printed.out
    assert printed.out.rstrip().endswith(f"--method eagle3:head={out}")
    target = specdecode.load(deep_target_dir)
    lm, d = target.lm, target.lm.args.dim
    head = Eagle3Head.load(out, lm.args, lm.model.embed_tokens)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [EAGLE3_ARCH] and config["draft_vocab_size"] == 8
    training = config["training"]
    assert training["data"]["sources"] == ["stdlib"] and training["data"]["prompts"]["stdlib"]["kept"] == 6
    assert training["precision"] == "fp32" and training["draft_vocab_size"] == 8 and training["epochs"] == 2
    assert training["recipe"]["steps"] == 2 and len(training["history"]) == 2
    assert all(h["loss"] == h["loss"] for h in training["history"])  # finite, not nan
    # the draft vocabulary: the 8 most frequent tokens of the training answers
    seqs = load_sequences(out / "features", False)
    counts = torch.bincount(torch.cat([s.tokens[s.start:] for s in seqs]), minlength=lm.vocab_size)
    assert int((counts > 0).sum()) > 8  # more answer tokens than room: the choice matters
    inside = torch.zeros(lm.vocab_size, dtype=torch.bool)
    inside[head.draft_ids] = True
    assert len(head.draft_ids) == 8 and int(counts[inside].min()) >= int(counts[~inside].max())
    assert torch.equal(head.draft_ids, draft_vocabulary(counts.float(), 8))
    assert torch.equal(head.t2d, inside)
    # the warm start the run began from, built from the same recorded answers
    recipe = run.HeadRecipe(data=("stdlib",), max_prompts=6, max_new_tokens=12, draft_vocab=8, steps=2)
    warm = run._eagle3(target, recipe, seqs, [], {"target": target.name}).module.head
    ids = warm.draft_ids
    assert torch.equal(ids, head.draft_ids)
    assert torch.equal(warm.lm_head.weight, checkpoint_tensor(target, "lm_head.weight")[ids])
    assert torch.equal(warm.norm.weight, checkpoint_tensor(target, "model.norm.weight"))
    fc = warm.fc.weight
    assert torch.equal(fc[:, :2 * d], torch.zeros(d, 2 * d)) and torch.equal(fc[:, 2 * d:], torch.eye(d))
    assert not warm.midlayer.self_attn.o_proj.weight.any() and not warm.midlayer.mlp.down_proj.weight.any()
    # so its first step's logits are the target's output layer on the last captured state
    aux = seqs[0].aux.float()
    with torch.no_grad():
        h = warm.fc(aux)
        q, _, _, residual = warm.project(seqs[0].tokens[1:], h[:-1], torch.arange(len(h) - 1))
        _, logits = warm.finish(torch.randn_like(q), residual)
    g3 = aux[:-1, 2 * d:]
    early_exit = nn.functional.rms_norm(g3, (d,), checkpoint_tensor(target, "model.norm.weight"), lm.args.norm_eps) \
        @ checkpoint_tensor(target, "lm_head.weight")[ids].t()
    torch.testing.assert_close(logits, early_exit, rtol=1e-5, atol=1e-5)
    # training moved the head away from it
    assert not torch.equal(head.midlayer.self_attn.o_proj.weight, warm.midlayer.self_attn.o_proj.weight)
    # generating with the trained head gives the target's output
    assert main(["generate", "--target", str(deep_target_dir), "--method", f"eagle3:head={out}",
                 "--prompt", "def add(a, b):", "--max-new-tokens", "20", "--compare", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical"] is True and result["token_ids"] == result["ar"]["token_ids"]
    assert len(result["token_ids"]) == 20 and result["stats"]["num_draft_tokens"] > 0


def test_the_bench_trains_a_missing_default_head_once_then_measures_it(tmp_path_factory, tmp_path,
                                                                      capsys, monkeypatch):
    """`bench --methods ar,medusa` without head=: the default recipe (here a tiny one) trains
    the target's default heads before any timing, the rows are lossless, and a second run
    finds the heads trained and trains nothing."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # its own default heads
    monkeypatch.setattr(native, "DRAFT_VOCAB", 32)  # the heads draft (and train) over the first 32 ids
    target = tiny_dirs_in(tmp_path_factory)["target"]
    monkeypatch.setattr(run, "DEFAULT_RECIPE", run.HeadRecipe(
        data=("stdlib",), max_prompts=6, max_new_tokens=10, epochs=1, batch_size=8, heads=2))
    args = ["bench", "--no-memory", "--target", str(target), "--methods", "ar,medusa",
            "--workloads", "humaneval", "--limit", "1", "--max-new-tokens", "8"]
    assert main(args) == 0
    printed = capsys.readouterr()
    out = default_head_dir(str(target), "medusa")
    assert f"has no default medusa head yet: training it now into {out}" in printed.err
    assert run.is_trained(out) and MedusaHeads.load(out).num_heads == 2
    last = json.loads(printed.out.strip().splitlines()[-1])
    assert last["mismatches"] == 0 and set(last["methods"]) == {"ar", "medusa"}
    assert main(args) == 0
    assert "training it now" not in capsys.readouterr().err


class _Stop(Exception):
    pass


@pytest.fixture
def prompts_asked(monkeypatch):
    """Stops a training run where it asks for its prompts (raising _Stop); the list of what
    each run asked: (max_prompts, the question runs excluded)."""
    asked = []

    def prompts(data, max_prompts, exclude=None, to_german=None):
        asked.append((max_prompts, exclude))
        raise _Stop

    monkeypatch.setattr(run, "training_prompts", prompts)
    return asked


def test_the_default_recipe_asks_a_head_for_more_prompts_than_a_draft(deep_target_dir, tmp_path, prompts_asked):
    """Without --max-prompts a head's run (Medusa or EAGLE-3) answers 1,000 prompts, a
    distilled draft's 400 (its steps are dearer); a given number is every kind's."""
    target = specdecode.load(deep_target_dir)
    for kind, recipe in (("medusa", run.HeadRecipe()), ("eagle3", run.HeadRecipe()),
                         ("medusa", run.HeadRecipe(max_prompts=6)), ("eagle3", run.HeadRecipe(max_prompts=6))):
        with pytest.raises(_Stop):
            run.train_head(kind, target, tmp_path / kind, recipe)
    assert [n for n, _ in prompts_asked] == [1000, 1000, 6, 6] and run.DEFAULT_RECIPE.prompts_for("draft") == 400
    # a step's examples: EAGLE-3 one sequence (a batch pads to its longest), unless given
    assert [run.DEFAULT_RECIPE.batch_for(k) for k in ("medusa", "eagle3", "draft")] == [64, 1, 4]
    assert run.HeadRecipe(batch_size=3).batch_for("eagle3") == 3


def test_the_recipes_dataset_is_the_question_file_the_prompts_stay_apart_from(deep_target_dir, tmp_path,
                                                                               prompts_asked):
    """``train --dataset FILE`` (the recipe's dataset): no prompt may share an 8-word run with
    that file's questions; without it, with the copy of Spec-Bench shipped in the package."""
    question = "Name the three tallest mountains of the Andes with their heights in metres."
    mine = tmp_path / "question.jsonl"
    mine.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [question]}))
    shipped = json.loads(SPEC_BENCH_PATH.read_text().splitlines()[0])["turns"][0]
    target = specdecode.load(deep_target_dir)
    for i, recipe in enumerate((run.HeadRecipe(dataset=str(mine)), run.HeadRecipe())):
        with pytest.raises(_Stop):
            run.train_head("medusa", target, tmp_path / str(i), recipe)
    (_, given), (_, default) = prompts_asked
    assert data.word_runs(question) & given and not data.word_runs(question) & default
    assert data.word_runs(shipped) & default and not data.word_runs(shipped) & given


def test_an_out_directory_of_something_else_is_refused(tmp_path, capsys):
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "notes.txt").write_text("mine")
    assert main(["train", "eagle3", "--out", str(tmp_path / "h")]) == 2
    assert "holds files of something else (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "h").iterdir()] == ["notes.txt"]
    # another kind's run: refused before anything loads (was: its checkpoint resumed)
    from specdecode.heads import HEAD_ARCHS

    for kind, arch in HEAD_ARCHS.items():
        other = "eagle3" if kind == "medusa" else "medusa"
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
        for wrong in (other, "draft"):
            assert main(["train", wrong, "--out", str(d)]) == 2
            err = capsys.readouterr().err
            assert f"holds {'Medusa heads' if kind == 'medusa' else 'an EAGLE-3 head'} from an earlier run" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("not json")
    assert main(["train", "medusa", "--out", str(tmp_path / "junk")]) == 2
    assert "holds a config.json that is not a model's" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    (["--max-prompts", "1"], "--max-prompts must be an integer 2..1000000"),
    (["--data", "wiki"], "allowed: a comma-separated subset of stdlib, sharegpt, questions, translation"),
    (["--lr", "0"], "--lr must be between 0 and 1"),
    (["--heads", "9"], "--heads must be an integer 1..8"),
    (["--batch-size", "0"], "--batch-size must be an integer 1..65536"),
    (["--steps", "0"], "--steps must be an integer 1..8"),
    (["--intermediate-size", "0"], "--intermediate-size must be an integer 1..1000000"),
    (["--dataset", "nothere.jsonl"], "Spec-Bench question file not found: nothere.jsonl; --dataset takes"),
])
def test_bad_training_arguments_exit_2_with_the_allowed_values(tmp_path, capsys, bad, message):
    assert main(["train", "medusa", "--out", str(tmp_path / "h"), *bad]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- distilled draft (DistillSpec)

def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def recorded_tiny(tmp_path_factory):
    """The tiny target's answers to 10 prompts (8 to train on, 2 to measure)."""
    dirs = tiny_dirs_in(tmp_path_factory)
    target = specdecode.load(dirs["target"])
    out = tmp_path_factory.mktemp("tiny_features")
    record(target, _prompts(10), out, max_new_tokens=16, progress=False)
    seqs = load_sequences(out, False) + load_sequences(out, True)
    return dirs, seqs[:8], seqs[8:]


def test_teacher_forced_acceptance_equals_running_the_drafts_chains(recorded_tiny):
    """greedy_acceptance from one pass equals drafting each chain token by token with the
    draft and counting the tokens the target's recorded greedy answer accepts."""
    from specdecode.train.draft import greedy_acceptance
    dirs, seqs, _ = recorded_tiny
    draft = _hf(dirs["draft"])
    k, leads, firsts = 3, [], []
    for s in seqs[:3]:
        tokens = s.tokens.tolist()
        for r in range(s.start - 1, len(tokens) - 1):  # a chain drafted after tokens[:r+1]
            ctx, n = tokens[:r + 1], 0
            with torch.no_grad():
                for i in range(k):
                    guess = int(draft(torch.tensor([ctx])).logits[0, -1].argmax())
                    if r + 1 + i >= len(tokens) or guess != tokens[r + 1 + i]:
                        break
                    ctx, n = ctx + [guess], n + 1
            leads.append(n)
            firsts.append(n > 0)
    got = greedy_acceptance(draft, [{"tokens": s.tokens, "start": torch.tensor(s.start)} for s in seqs[:3]], k)
    assert 0 < sum(leads) < k * len(leads)  # some chains accepted in part: the case that matters
    assert got["acceptance_length"] == pytest.approx(1 + sum(leads) / len(leads))
    assert got["top1"] == pytest.approx(sum(firsts) / len(firsts))


def test_the_distillation_loss_is_the_forward_kl_over_the_targets_top_k(recorded_tiny):
    from specdecode.train.draft import distill_loss
    dirs, seqs, _ = recorded_tiny
    draft = _hf(dirs["draft"])
    s = seqs[0]
    ids = s.topk_ids.clone()
    ids[:, -1] = 10**6  # a token the draft's vocabulary lacks: left out
    ex = {"tokens": s.tokens, "start": torch.tensor(s.start), "topk_ids": ids, "topk_logp": s.topk_logp}
    with torch.no_grad():
        logq = torch.log_softmax(draft(s.tokens[None]).logits[0].float(), -1)
        rows = range(s.start - 1, len(s.tokens))
        want = -sum(float((s.topk_logp[r, :-1].exp() * logq[r, ids[r, :-1]]).sum()) for r in rows) / len(rows)
        assert float(distill_loss(draft, [ex])) == pytest.approx(want, rel=1e-5)


def test_distillation_trains_the_top_layers_toward_the_target(recorded_tiny, tmp_path):
    from specdecode.train.draft import draft_task, greedy_acceptance, trainable_layers
    dirs, seqs, held = recorded_tiny
    draft = _hf(dirs["draft"])
    frozen = {n: p.clone() for n, p in draft.named_parameters()}
    with pytest.raises(ValueError, match=r"--layers 3 is invalid; allowed: an integer 1..2"):
        trainable_layers(draft, 3)
    assert trainable_layers(draft, 1) == sum(p.numel() for p in draft.model.layers[-1].parameters()) \
        + draft.model.norm.weight.numel()
    examples = [{"tokens": s.tokens, "start": torch.tensor(s.start)} for s in seqs]
    before = greedy_acceptance(draft, examples)
    task = draft_task(draft, dirs["draft"], seqs, held, {"target": "tiny"})
    result = train(task, tmp_path / "d", epochs=4, batch_size=2, lr=3e-3, progress=False)
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < losses[0], losses
    assert greedy_acceptance(draft, examples)["top1"] > before["top1"]
    changed = {n for n, p in draft.named_parameters() if not torch.equal(p, frozen[n])}
    assert changed and all(n.startswith(("model.layers.1.", "model.norm.")) for n in changed), changed
    saved = json.loads((tmp_path / "d" / "distillation.json").read_text())
    assert saved["target"] == "tiny" and len(saved["history"]) == 4
    assert (tmp_path / "d" / "tokenizer.json").exists()


def test_train_draft_end_to_end_the_distilled_draft_keeps_the_output(tmp_path_factory, tmp_path, capsys):
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "distilled"
    args = ["train", "draft", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
            "--out", str(out), "--data", "stdlib", "--max-prompts", "40", "--max-new-tokens", "10",
            "--epochs", "1", "--layers", "1"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "before: acceptance_length" in printed.err
    assert "held-out acceptance length" in printed.out and "before)" in printed.out
    assert printed.out.rstrip().endswith(f"--draft {out}")
    assert main(args) == 0  # done: resumed at its end, nothing trained again
    again = capsys.readouterr()
    assert "already trained" in again.out and "before)" in again.out  # the draft's own measures kept
    target = specdecode.load(dirs["target"])
    distilled = specdecode.load(out, role="draft")
    prompt = "def add(a, b):"
    plain = specdecode.generate(target, prompt, method="ar", max_new_tokens=24)
    spec = specdecode.generate(target, prompt, method="draft", draft=distilled, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids and spec.stats.num_draft_tokens > 0
    # a draft of another tokenizer is refused before anything is recorded
    assert main(args[:4] + ["--draft", str(dirs["foreign"]), "--out", str(tmp_path / "f")] + args[8:]) == 2
    assert "has another tokenizer than target" in capsys.readouterr().err
    assert not (tmp_path / "f" / "features").exists()


def test_train_with_the_question_and_translation_sources_end_to_end(tmp_path_factory, tmp_path, capsys):
    """The README's `train draft --data questions,translation` on the tiny pair, reading the
    packaged ShareGPT file: the target writes the German (a random tiny model writes none a
    source would keep, so it gives up after MAX_DROPPED_IN_A_ROW sentences), the run trains
    on the questions, and the config says which sources gave how many prompts."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "qt"
    assert main(["train", "draft", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                 "--out", str(out), "--data", "questions,translation", "--max-prompts", "6",
                 "--max-new-tokens", "8", "--epochs", "1", "--layers", "1", "--precision", "fp32"]) == 0
    printed = capsys.readouterr()
    assert "6 prompts (questions: 6, translation: 0;" in printed.err
    german = json.loads((out / "features" / run.GERMAN_FILE).read_text())
    assert len(german) >= data.MAX_DROPPED_IN_A_ROW
    saved = json.loads((out / "distillation.json").read_text())
    assert saved["data"]["sources"] == ["questions", "translation"] and saved["precision"] == "fp32"


def test_two_processes_under_torchrun_share_one_run(tmp_path_factory, tmp_path):
    """The data-parallel path `accelerate launch` takes on many GPUs, here as two CPU
    processes (torchrun with ACCELERATE_USE_CPU=true): one process records the answers, each
    trains on half of every epoch (gradients averaged), and one reports and saves."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    target = tiny_dirs_in(tmp_path_factory)["target"]
    out = tmp_path / "heads"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "specdecode.cli",
                           "train", "medusa", "--target", str(target), "--out", str(out), "--data", "stdlib",
                           "--max-prompts", "8", "--max-new-tokens", "10", "--epochs", "2",
                           "--batch-size", "8", "--heads", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    examples = json.loads((out / "checkpoint" / "trainer.json").read_text())["examples"]
    steps = -(-(-(-examples // 2)) // 8)  # each process: half the examples, 8 a step
    assert f"0/{steps} [" in done.stderr and steps < -(-examples // 8)
    assert done.stderr.count("8 prompts (stdlib: 8") == 1  # one process recorded
    assert sum(s["sequences"] for s in read_manifest(out / "features")["shards"]) == 8
    assert done.stdout.count("wrote ") == 1 and done.stderr.count("epoch 2: loss") + done.stdout.count("epoch 2: loss") == 1
    assert MedusaHeads.load(out).num_heads == 2
