"""``specdecode generate``: the main job."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..api import _check_utf8, _sampling_params, stream
from ..config import ACCEPTANCE_RULES
from ..methods import METHODS, Method, head_dir_for, speculative_config
from ..proposers import HybridProposer
from .common import (EXIT_CODES_HELP, add_model_arguments, method_of, add_threads_argument, apply_threads,
                     k_argument, load_models, max_k_argument, run_command)

GENERATE_HELP = """\
Generate a completion with speculative decoding, streaming it as it is produced, then print
the statistics. Output is identical to the target's own greedy decoding (or, when sampling,
distributed exactly as the target's sampling).

examples:
  specdecode generate --prompt "Write a Python function that checks for primes." --chat
  specdecode generate --prompt "def quicksort(xs):" --k 6 --compare
  specdecode generate --prompt "Once upon a time" --temperature 0.8 --seed 1 --json
  specdecode generate --prompt-file before.py --suffix-file after.py   # fill in the middle
  specdecode generate --prompt-file ask.txt --chat --prediction-file old.py   # a predicted output
  specdecode generate --prompt "Ada Lovelace, 36: as JSON" --chat --json-schema person.json
"""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (speculative decoding)", description=GENERATE_HELP,
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the prompt text ('-' reads standard input)")
    given.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 text file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    after = p.add_mutually_exclusive_group()
    after.add_argument("--suffix", default=None,
                       help="fill in the middle: the text after the gap (the prompt is the text "
                            "before it); the output is the middle, in the target's FIM format "
                            "(llama.cpp server's /infill layout; a code model with FIM tokens)")
    after.add_argument("--suffix-file", metavar="PATH", default=None,
                       help="--suffix read from this UTF-8 text file")
    p.add_argument("--prediction-file", metavar="PATH", default=None,
                   help="a predicted output (OpenAI's Predicted Outputs): text the output is "
                        "expected to repeat for the most part, such as the file a request asks to "
                        "edit; proposed for free where the output follows it, with any --method "
                        "(the output is the method's all the same)")
    p.add_argument("--json-schema", metavar="PATH", default=None,
                   help="structured output: a JSON schema file; the output is JSON valid against it "
                        "(OpenAI's response_format json_schema; '{\"type\": \"object\"}' for any "
                        "JSON object), plain constrained decoding of the target whatever --method")
    add_model_arguments(p)
    defaults = ", ".join(f"{m.default_k} for {m.name}" for m in METHODS.values() if m.default_k)
    p.add_argument("--k", type=k_argument, default=None,
                   help=f"speculation length K: draft tokens per verify pass, 1..64 (default: {defaults}); "
                        "'heuristic': +2 after a fully accepted round, "
                        "-1 otherwise (transformers); 'auto': K chosen each round from this machine's "
                        "measured forward times and the acceptance so far")
    p.add_argument("--max-k", type=max_k_argument, default=None,
                   help="largest K for --k heuristic/auto, 1..64 (default 16)")
    p.add_argument("--draft-p-min", type=float, default=None, metavar="P",
                   help="stop drafting where the draft model's top probability is below P "
                        "(llama.cpp --draft-p-min; default: 0.5 for hybrid and for a draft of "
                        "another tokenizer, off for draft; 0 = off)")
    p.add_argument("--max-ngram", type=int, default=None,
                   help="prompt lookup: longest n-gram matched (default 5; shortest 2)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (transformers' meaning)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for sampling (default: random). With a seed the output is a "
                        "function of seed, prompt and target alone: the same text with every "
                        "method and K, and the same as --method ar (the gumbel rule)")
    p.add_argument("--acceptance-rule", default=None, choices=ACCEPTANCE_RULES,
                   help="how sampled draft tokens are accepted. gumbel (default with --seed): "
                        "each position's token is the target's Gumbel-max sample with noise keyed "
                        "on (seed, position), a draft token is kept when it equals it; "
                        "rejection (default without --seed): speculative sampling "
                        "(arXiv:2211.17192), a little higher acceptance, but the text moves with "
                        "the method and K. Both sample exactly the target's distribution")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    p.add_argument("--min-new-tokens", type=int, default=0, help="no EOS before this many new tokens")
    p.add_argument("--stop", nargs="+", default=None, metavar="STR",
                   help="stop when any of these strings is generated (cut from the text); taken "
                        "literally: use $'\\n' in bash for a newline")
    add_threads_argument(p)
    p.add_argument("--compare", action="store_true",
                   help="also run plain autoregressive decoding of the target and report the speedup "
                        "and (greedy) whether the outputs are identical")
    p.add_argument("--color", action="store_true",
                   help="shade each streamed token by who supplied it (ANSI background colours: "
                        "cyan an accepted draft-model token, green an accepted lookup token, red a "
                        "recovered token, yellow a bonus token; a legend follows the text)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (last line of stdout) instead of streamed text")
    p.set_defaults(func=lambda args: run_command(cmd_generate, args))


# ANSI backgrounds (black text) for who supplied a token: the page at / uses the same scheme
COLORS = {"accepted draft-model token": "\033[30;46m", "accepted lookup token": "\033[30;42m",
          "recovered (target, after a rejection)": "\033[30;41m",
          "bonus (target, after a fully accepted draft)": "\033[30;43m"}
_CODES = dict(zip(("draft", "lookup", "recovered", "bonus"), COLORS.values()))


def colored(spans) -> str:
    """A chunk's (text, TokenInfo) runs with ANSI colours by who supplied each (plain decoding's
    tokens, kind "target", uncoloured)."""
    out = []
    for text, info in spans:
        key = info.kind
        if key == "accepted":
            key = "draft" if info.proposer.startswith("draft") else "lookup"
        code = _CODES.get(key)
        if not code:
            out.append(text)
            continue
        # colour each line's part apart: a colour carried over a newline paints the next line
        out.append("\n".join(f"{code}{part}\033[0m" if part else "" for part in text.split("\n")))
    return "".join(out)


def _print_stats(label: str, stats: dict, finish: str, out) -> None:
    line = (f"[{label}] {stats['num_generated_tokens']} tokens in {stats['total_s']:.2f} s = "
            f"{stats['tokens_per_second']:.2f} tokens/s, finish: {finish}")
    if stats["num_draft_tokens"]:
        line += (f" | acceptance rate {stats['acceptance_rate']:.1%}, mean acceptance length "
                 f"{stats['mean_acceptance_length']:.2f} | time: prefill {stats['prefill_s']:.2f} s, "
                 f"draft {stats['draft_s']:.2f} s, verify {stats['verify_s']:.2f} s, "
                 f"other {stats['other_s']:.2f} s")
        if stats["mean_speculation_length"] is not None:
            line += f" | mean K {stats['mean_speculation_length']}"
        # a method choosing between proposers each round says whose drafts it took, one kind too
        mixed = label in METHODS and METHODS[label].proposer is HybridProposer
        if len(stats["by_proposer"]) > 1 or mixed:
            line += " | accepted by proposer: " + ", ".join(
                f"{name} {c['num_accepted_tokens']}/{c['num_draft_tokens']}"
                for name, c in stats["by_proposer"].items())
    if stats.get("lossy"):
        line += (" | LOSSY: Medusa's typical acceptance (lossy-typical=) changed the output; it is not "
                 "the target's sampling")
    print(line, file=out)


def _read_stdin() -> str:
    """Standard input as text, a byte that is not UTF-8 kept as a lone surrogate (as Python
    does for argv), so that the prompt check names it instead of a decode traceback."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "surrogateescape") if raw is not None else sys.stdin.read()


def _read_text_file(path: str, flag: str) -> str:
    """A UTF-8 text file's text (a byte that is not UTF-8 kept as a lone surrogate, for the
    text check to name); ValueError naming the flag for an empty path or an unreadable file."""
    if not path.strip():
        raise ValueError(f"{flag} is empty: give the path of a text file")
    try:  # a UTF-8 byte-order mark is not text (it became a token of its own)
        return Path(path).read_bytes().decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Raises ValueError for bad input, ModelFetchError when a model cannot be fetched."""
    if args.prompt_file is not None:
        where = f"--prompt-file {args.prompt_file}"
        prompt = _read_text_file(args.prompt_file, "--prompt-file")
    else:
        prompt = _read_stdin() if args.prompt == "-" else args.prompt
        where = "standard input" if args.prompt == "-" else "--prompt"
    _check_utf8(prompt, where)
    suffix = args.suffix if args.suffix_file is None else _read_text_file(args.suffix_file, "--suffix-file")
    if suffix is not None:
        _check_utf8(suffix, "--suffix-file" if args.suffix_file is not None else "--suffix")
        if args.chat:
            raise ValueError("--suffix fills in the middle of plain text: drop --chat")
    prediction = None
    if args.prediction_file is not None:
        prediction = _read_text_file(args.prediction_file, "--prediction-file")
        _check_utf8(prediction, "--prediction-file")
    response_format = None
    if args.json_schema is not None:
        text = _read_text_file(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema} is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {args.json_schema} must hold a JSON schema object, "
                             f"not {type(schema).__name__}")
        response_format = {"type": "json_schema", "json_schema": {"name": Path(args.json_schema).stem,
                                                                   "schema": schema}}
    method = method_of(args)
    threads = apply_threads(args)
    # check every value before spending seconds on loading models
    params = _sampling_params(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                     temperature=args.temperature, do_sample=None, top_k=args.top_k,
                     top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                     seed=args.seed, stop=args.stop, eos_token_id=None,
                     acceptance_rule=args.acceptance_rule)
    if args.color and args.json:
        raise ValueError("--color shades the streamed text, which --json does not print: give one of them")
    if args.max_k is not None and not isinstance(args.k, str):
        raise ValueError("--max-k caps K for --k heuristic or --k auto; with a fixed K use --k N")
    spec_args = dict(num_speculative_tokens=args.k, max_speculative_tokens=args.max_k or 16,
                     draft_p_min=args.draft_p_min, max_matching_ngram_size=args.max_ngram)
    draft_given = any(v is not None for v in (args.draft, args.draft_dtype, args.draft_backend))
    spec = speculative_config(args.method, draft_given, args.k, args.max_k or 16, args.draft_p_min,
                              args.max_ngram)
    head_dir_for(spec, args.target)  # a missing head is said before the target loads
    if not prompt.strip() and not suffix:
        raise ValueError(f"the prompt is empty ({where})")
    t0 = time.perf_counter()
    target, draft = load_models(args, method)
    if method.needs_draft_model and draft is None:  # --draft auto found none (said on stderr)
        args.method = "self"
        method = method_of(args)
    load_s = time.perf_counter() - t0
    common = dict(chat=args.chat, suffix=suffix, max_new_tokens=args.max_new_tokens,
                  min_new_tokens=args.min_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty,
                  seed=args.seed, stop=args.stop, acceptance_rule=args.acceptance_rule,
                  response_format=response_format)
    chunks = stream(target, prompt, draft=draft, method=args.method, prediction=prediction, **spec_args, **common)
    info = sys.stderr if args.json else sys.stdout
    if not args.json:
        print(f"# loaded {target.name} ({target.lm.weight_format})"
              + (f" + draft {draft.name} ({draft.lm.weight_format})" if draft else "")
              + f" in {load_s:.1f} s; {threads} thread(s)", file=sys.stderr)
    result = None
    for chunk in chunks:
        if not args.json:
            print(colored(chunk.spans) if args.color else chunk.text, end="", flush=True)
        result = chunk.result or result
    if not args.json:
        print()
    if args.color:
        print("colours: " + "  ".join(f"{code} {name} \033[0m" for name, code in COLORS.items())
              + "  uncoloured: target (no draft that round)", file=info)
    _print_stats(method.value, result.stats.to_dict(), result.finish_reason, info)
    if prediction is not None:
        print(f"prediction: {result.accepted_prediction_tokens} of its "
              f"{result.accepted_prediction_tokens + result.rejected_prediction_tokens} tokens are in "
              "the output", file=info)
    out = result.to_dict()
    out["threads"] = threads
    out["weights"] = {"target": target.lm.weight_format,
                      "draft": draft.lm.weight_format if draft else None}
    if args.compare and not method.spec.speculates and prediction is None:
        print("--compare: method ar is plain decoding itself; nothing to compare", file=info)
    elif args.compare:
        ar = None
        for chunk in stream(target, prompt, method=Method.AR, **common):
            ar = chunk.result or ar
        speedup = result.stats.tokens_per_second / ar.stats.tokens_per_second
        # speculative sampling equals plain sampling in distribution, not token for token;
        # the gumbel rule with a seed gives plain sampling's very tokens
        same_tokens = params.greedy or (params.rule == "gumbel" and params.seed is not None)
        lossy = result.stats.lossy  # its output differs by design: no lossless check
        identical = ar.token_ids == result.token_ids if same_tokens and not lossy else None
        _print_stats("ar", ar.stats.to_dict(), ar.finish_reason, info)
        verdict = {True: "identical to plain decoding", False: "DIFFERENT from plain decoding",
                   None: "(speculative sampling: equal in distribution, not compared)"}[identical]
        if lossy:
            verdict = "(LOSSY method: changed by design, not compared)"
        if identical is False and target.lm.weight_format.startswith("llama.cpp"):
            verdict += (" (the llama.cpp backend: its passes over several tokens round "
                        "differently from one-token passes; --backend native is exact)")
        print(f"speedup {speedup:.2f}x over plain decoding; output {verdict}", file=info)
        out["ar"] = {"text": ar.text, "token_ids": ar.token_ids,
                     "tokens_per_second": round(ar.stats.tokens_per_second, 3)}
        out["speedup"] = round(speedup, 4)
        out["identical"] = identical
    if args.json:
        print(json.dumps(out))
    return 0
