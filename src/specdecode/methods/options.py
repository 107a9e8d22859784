"""The one syntax of a method name with options, ``name:key=value:...`` (generate, the API,
the server, bench rows): parsed here into a method and its
:class:`~specdecode.methods.config.SpeculativeConfig` fields, with errors that say where an
option belongs.
"""

from __future__ import annotations

from typing import Callable

from .registry import METHODS, OPTIONS, Method

# every method option's key=value (for help texts and bench rows): key -> (its registry
# option, what its value looks like, its SpeculativeConfig fields from the text)
METHOD_OPTIONS: dict[str, tuple[str, str, Callable[[str], dict]]] = {
    key: (option.name, k.example, k.parse) for option in OPTIONS.values() for key, k in option.keys.items()}

# the options a bench row adds to a method name (``specdecode bench --methods draft:k=4``),
# and what gives each of them to generate and the API
BENCH_ROW_OPTIONS = {  # key -> (the command line's option, the Python API's argument)
    "k": ("--k", "num_speculative_tokens="), "max_k": ("--max-k", "max_speculative_tokens="),
    "p_min": ("--draft-p-min", "draft_p_min="), "ngram": ("--max-ngram", "max_matching_ngram_size="),
    "cache": (None, "suffix_cache="),  # generate runs one request: no session to keep
    "dtype": ("--draft-dtype", "load(draft, dtype=)"),
    "backend": ("--draft-backend", "load(draft, backend=)"), "model": ("--draft", "draft="),
    "rule": ("--acceptance-rule", "acceptance_rule="),
}


def method_options(method: str, opts: dict) -> dict:
    """The SpeculativeConfig fields of ``method``'s own options, consumed from ``opts`` (a
    dict of key=value texts); keys the method does not take are left in ``opts``. Raises
    ValueError for a bad value."""
    out = {}
    for key, k in METHODS[method].keys().items():
        if key in opts:
            out.update(k.parse(opts.pop(key)))
    return out


def name_and_options(text: str) -> tuple[str, dict[str, str]]:
    """"draft:k=4:tree=2" -> ("draft", {"k": "4", "tree": "2"}). Raises ValueError naming a
    part that is not key=value, an empty value or a key given twice."""
    name, *parts = text.split(":")
    opts = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"method option {part!r} in {text!r} must look like key=value")
        if not value:
            example = METHOD_OPTIONS[key][1] if key in METHOD_OPTIONS else "VALUE"
            raise ValueError(f"method option {key}= in {text!r} has no value; e.g. {key}={example}")
        if key in opts:
            raise ValueError(f"method option {key}= is given twice in {text!r}; give it once")
        opts[key] = value
    return name, opts


def _bench_row_hint(name: str, keys: list[str]) -> str:
    """Where the bench-row options ``keys`` given to method ``name`` go instead (generate,
    bench and the Python API take them as options of their own)."""
    return "".join(f" ({k}= is a bench row's option: give "
                   + (f"{cli} on the command line, " if (cli := BENCH_ROW_OPTIONS[k][0]) else "")
                   + f"{BENCH_ROW_OPTIONS[k][1]} in the Python API)" for k in keys)


def split_method(text: str, row_hint: Callable[[str, list[str]], str] = _bench_row_hint) -> tuple[str, dict]:
    """"layer-skip:layers=3+5-8" -> ("layer-skip", {"skip_layers": (3, 5, 6, 7, 8)}): a method
    name with its own options. Raises ValueError naming an unknown method, or an option it
    does not take; for a bench row's option (:data:`BENCH_ROW_OPTIONS`) the message ends with
    ``row_hint(name, keys)``: where the caller takes it instead."""
    name, opts = name_and_options(text)
    Method.parse(name)
    fields = method_options(name, opts)
    if opts:
        mine = list(METHODS[name].keys())
        rows = [k for k in sorted(opts) if k in BENCH_ROW_OPTIONS]
        raise ValueError(f"method {name!r} takes no option {sorted(opts)} in {text!r}; "
                         f"allowed: {', '.join(mine) or 'none'}" + (row_hint(name, rows) if rows else ""))
    return name, fields
