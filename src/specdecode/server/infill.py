"""``POST /infill``: llama.cpp server's fill-in-the-middle endpoint, as its editor clients
(llama.vscode, llama.vim) send it and read it: request fields ``input_prefix``,
``input_suffix``, ``input_extra`` ([{"filename", "text"}] repository context), ``prompt``
(text continuing the prefix), ``n_predict``, ``n_indent``, ``t_max_predict_ms``,
``response_fields``, ``stream``, and its sampling fields (and specdecode's ``method``, as on
/v1/completions); response fields ``content``,
``tokens_predicted``, ``tokens_evaluated``, ``stop_type``, ``truncated``, ``timings``.
The prompt is laid out as llama.cpp lays it out (:func:`specdecode.fim.infill_ids`).

Defaults are llama.cpp server's: temperature 0.8, top_k 40, top_p 0.95, n_predict -1 (the
rest of the context). Accepted with no effect, as there: ``t_max_prompt_ms``,
``cache_prompt`` (no prompt cache here: ``tokens_cached`` is 0), ``samplers`` (the sampling
order here is fixed; llama.cpp's "infill" sampler is not applied), ``id_slot``. Sampling
fields that would change the output and are not implemented (``min_p`` other than 0,
penalties, mirostat, grammars, ``n_probs``) are refused with 400 naming the field; other
unknown fields are ignored, as llama.cpp ignores them.
"""

from __future__ import annotations

import json
import time

from .protocol import Job, _number, bad, method_of

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # llama.cpp server's
# llama.cpp fields that change the output and are not implemented here: value when neutral
REFUSED = {"min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "mirostat": 0, "grammar": "", "json_schema": None, "n_probs": 0, "typical_p": 1.0,
           "xtc_probability": 0.0, "dry_multiplier": 0.0, "logit_bias": None}


class Cut:
    """llama.cpp's two early stops of an infill, applied to the text as it grows: ``n_indent``
    (the first line after a newline indented less than n_indent ends the middle, cut where
    its text starts) and ``t_max_predict_ms`` (once a newline was generated, the middle ends
    at the next piece after that many milliseconds from its first token). A cut middle is a
    prefix of the full one: speculation changes nothing."""

    def __init__(self, n_indent: int, t_max_predict_ms: int):
        self.n_indent, self.t_max = n_indent, t_max_predict_ms
        self.first: float | None = None

    def end(self, text: str) -> int | None:
        """Where ``text`` (the middle so far) is cut, or None to go on."""
        now = time.monotonic()
        self.first = self.first or now
        if self.n_indent > 0:
            start = 0
            while (nl := text.find("\n", start)) >= 0:
                start = nl + 1
                line = text[start:]
                indent = len(line) - len(line.lstrip(" \t"))
                if indent < len(line) and indent < self.n_indent:
                    return start + indent
        if self.t_max > 0 and "\n" in text and (now - self.first) * 1000 > self.t_max:
            return len(text)
        return None


def check_infill(body: dict, ctx) -> tuple[Job, Cut, list[str] | None]:
    """A :class:`Job` (kind "infill", one prompt), its :class:`Cut` and ``response_fields``
    from an /infill body; OpenAIError 400 naming the bad field."""
    strings = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "")
        if not isinstance(value, str):
            raise bad(f"'{name}' must be a string, got {json.dumps(value)[:80]}", name)
        strings[name] = value
    for name, neutral in REFUSED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise bad(f"'{name}' is not supported by this server (allowed: {neutral!r} or absent)", name)
    extra = body.get("input_extra") or []
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"'stream' must be true or false, got {stream!r}", "stream")
    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise bad("'response_fields' must be a list of field names (\"timings/prompt_n\" for a "
                  "nested one)", "response_fields")
    n_predict = _number(body, "n_predict", -1, -1, (1 << 31) - 1, integer=True)
    method = method_of(body, ctx)
    ids = ctx.infill(strings["input_prefix"], strings["input_suffix"], strings["prompt"], extra,
                     max(n_predict, 0), fields=("input_prefix", "input_suffix"), repo=True)
    room = ctx.max_context - len(ids)
    if room < 1:  # (the prefix and suffix are cut to fit; the prompt is not)
        raise bad(f"the infill prompt has {len(ids)} tokens: no room is left in the server's "
                  f"{ctx.max_context} positions a request", "prompt" if strings["prompt"] else "input_prefix")
    cap = room if n_predict in (-1, 0) else n_predict
    if cap > room:
        raise bad(f"the infill prompt ({len(ids)} tokens) plus n_predict={n_predict} is more than "
                  f"the server's {ctx.max_context} positions a request (at most {room})", "n_predict")
    stop = body.get("stop") or None
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a list of non-empty strings", "stop")
    temperature = _number(body, "temperature", DEFAULTS["temperature"], 0.0, 2.0)
    sampling = dict(max_new_tokens=cap, min_new_tokens=0, temperature=temperature,
                    top_p=_number(body, "top_p", DEFAULTS["top_p"], 1e-9, 1.0),
                    top_k=max(0, _number(body, "top_k", DEFAULTS["top_k"], -1, 1 << 31, integer=True)),
                    repetition_penalty=1.0, stop=stop, acceptance_rule=None)
    seed = _number(body, "seed", -1, -(1 << 63), (1 << 63) - 1, integer=True)
    cut = Cut(_number(body, "n_indent", 0, 0, 1 << 20, integer=True),
              _number(body, "t_max_predict_ms", 0, 0, 1 << 40, integer=True))
    _number(body, "t_max_prompt_ms", 0, -1, 1 << 40, integer=True)  # accepted, as llama.cpp's
    job = Job("infill", ctx.model_name, [ids], 1, stream, False, sampling, method, None,
              None if seed == -1 else seed, None, False, ctx.fim_eos())
    return job, cut, fields


def body(job: Job, text: str, finish: str, stats, predicted: int, cut: bool, word: str = "") -> dict:
    """The response (or a stream's last event): llama.cpp server's fields. stats: the
    generation's so far (a cut middle's are those of its last piece); word: the stop string
    that ended it, if one did."""
    prompt_n = len(job.prompts[0])
    prompt_ms = (stats.prefill_s if stats else 0.0) * 1000
    # (a middle cut before its end has no total yet: its passes' times)
    predicted_ms = (max(stats.total_s - stats.prefill_s, stats.draft_s + stats.verify_s) if stats else 0.0) * 1000
    stop_type = "limit" if cut or finish == "length" else "word" if word else "eos"

    def rate(n, ms):
        return n / ms * 1000 if ms > 0 else 0.0
    return {"index": 0, "content": text, "tokens": [], "id_slot": 0, "stop": True,
            "model": job.model, "tokens_predicted": predicted, "tokens_evaluated": prompt_n,
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": word, "tokens_cached": 0,
            "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                        "prompt_per_second": rate(prompt_n, prompt_ms),
                        "predicted_n": predicted, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                        "predicted_per_second": rate(predicted, predicted_ms)}}


def select(obj: dict, fields: list[str] | None) -> dict:
    """``obj`` reduced to ``response_fields`` as llama.cpp does: each path ("timings/prompt_n")
    a key of its own; paths it lacks left out. None or []: all of it (as llama.cpp)."""
    if not fields:
        return obj
    out = {}
    for path in fields:
        value, found = obj, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out
