"""``specdecode check-pair TARGET DRAFT``: whether and how a draft can speculate for a target,
read from their tokenizers and configs (no weights loaded); with ``--measure``, the speedup
a short run of both on this machine shows."""

from __future__ import annotations

import json
import sys

from ..api import generate
from ..models.loading import load_pair, resolve_model_path
from ..models.native import read_json
from ..tokenmap import compare_tokenizers
from .common import EXIT_CODES_HELP, run_command


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _side(name: str) -> tuple[object, dict]:
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): check-pair compares "
                         "tokenizers; give the model directory with its tokenizer files")
    config = read_json(path / "config.json")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - re-raised with what it concerns
        raise ValueError(f"cannot load the tokenizer in {path} ({type(e).__name__}: {e})") from None
    config = config.get("text_config", config)  # multimodal configs nest the decoder's
    return tok, {
        "path": str(path), "model_type": config.get("model_type"),
        "vocab_rows": config.get("vocab_size"),
        "max_context": config.get("max_position_embeddings")}


def check_pair(target: str, draft: str) -> dict:
    """The report of :func:`specdecode.tokenmap.compare_tokenizers` on the two models'
    tokenizers, with each model's path, architecture, embedding rows and context length (in
    tokens). Raises ValueError / ModelFetchError as :func:`resolve_model_path` does."""
    ttok, tinfo = _side(target)
    dtok, dinfo = _side(draft)
    report = {"target": {"name": target, **tinfo}, "draft": {"name": draft, **dinfo}}
    report.update(compare_tokenizers(ttok, dtok))
    if report["mode"] == "same" and (tinfo["vocab_rows"] or 0) != (dinfo["vocab_rows"] or 0):
        report["why"] += (f"; the embedding rows differ ({tinfo['vocab_rows']} vs "
                          f"{dinfo['vocab_rows']}): the draft's probability of rows it lacks is 0")
    limits = [c for c in (tinfo["max_context"], dinfo["max_context"]) if c]
    if len(limits) == 2 and dinfo["max_context"] < tinfo["max_context"]:
        report["context_note"] = (f"the draft's context ({dinfo['max_context']} tokens) is shorter than "
                                  f"the target's ({tinfo['max_context']}): past it the draft stops proposing")
    return report


# a code prompt and a prose one: the two kinds of text a pair meets most
MEASURE_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number, with a docstring.",
                   "Explain in a short paragraph why the sky is blue.")


def measure_pair(target: str, draft: str, tokens: int) -> dict:
    """A short measurement of the pair on this machine: both models loaded as ``generate``
    loads them; on each of MEASURE_PROMPTS (chat, when the target has a template) plain
    decoding and the draft method (K auto), greedy, ``tokens`` new tokens each, after an
    untimed warm-up that pays the once-per-model profiles. Returns the acceptance rate,
    mean acceptance length, tokens/s of each and their ratio (the speedup; its prompts are
    two, so it is a first look: the bench measures properly), and whether every output
    equals plain decoding's. Raises as :func:`~specdecode.models.loading.load_pair` does."""
    if tokens < 1:
        raise ValueError(f"--measure takes a positive number of new tokens, got {tokens}")
    tgt, drf = load_pair(target, draft)
    chat = bool(getattr(tgt.tokenizer, "chat_template", None))
    common = dict(chat=chat, max_new_tokens=tokens, temperature=0.0)
    generate(tgt, MEASURE_PROMPTS[0], method="draft", draft=drf, num_speculative_tokens="auto",
             **{**common, "max_new_tokens": 8})
    plain_s = spec_s = 0.0
    accepted = drafted = passes = generated = 0
    identical = True
    for prompt in MEASURE_PROMPTS:
        plain = generate(tgt, prompt, method="ar", **common)
        spec = generate(tgt, prompt, method="draft", draft=drf, num_speculative_tokens="auto", **common)
        identical &= spec.token_ids == plain.token_ids
        plain_s += plain.stats.total_s
        spec_s += spec.stats.total_s
        accepted += spec.stats.num_accepted_tokens
        drafted += spec.stats.num_draft_tokens
        passes += spec.stats.num_verify_passes
        generated += spec.stats.num_generated_tokens
    return {"new_tokens": tokens, "prompts": len(MEASURE_PROMPTS), "identical": identical,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_acceptance_length": round(generated / passes, 2) if passes else None,
            "plain_tokens_per_second": round(generated / plain_s, 2),
            "draft_tokens_per_second": round(generated / spec_s, 2),
            "speedup": round(plain_s / spec_s, 2)}


def _print(r: dict) -> None:
    t, d = r["target"], r["draft"]
    print(f"target  {t['name']}: {t['model_type']}, {r['target_tokens']} tokens "
          f"({t['vocab_rows']} embedding rows), context {t['max_context']}")
    print(f"draft   {d['name']}: {d['model_type']}, {r['draft_tokens']} tokens "
          f"({d['vocab_rows']} embedding rows), context {d['max_context']}")
    print(f"mode    {r['mode']}: {r['why']}")
    if r["mode"] == "refused":
        return
    if r["mode"] == "cross":
        print(f"overlap {r['exact_overlap']} draft tokens ({100 * r['exact_overlap_share']:.1f} %) are one target "
              "token exactly (sampled requests use the draft's probabilities there, point masses elsewhere)")
    print(f"bos     added in front of a text: target {r['bos_added']['target']}, draft {r['bos_added']['draft']}")
    print(f"eos     target {r['eos']['target']}, draft {r['eos']['draft']}")
    if r["mode"] == "cross":
        mapped = ", ".join(f"{a} -> {b}" for a, b in r["special_mapped"].items()) or "none"
        print(f"special target {len(r['special']['target'])}, draft {len(r['special']['draft'])}; "
              f"the same on both sides: {mapped}")
    ct = r["chat_template"]
    print(f"chat    template: target {'yes' if ct['target'] else 'no'}, draft {'yes' if ct['draft'] else 'no'}"
          + ("" if r["mode"] == "same" else ", the same" if ct["same"] else
             ", different (a chat request's draft reads the conversation in its own template)"))
    s = r["sample_split"]
    print(f"split   {s['text']!r}: {s['target']} target tokens, {s['draft']} draft tokens"
          + ("" if s["round_trip"] else " (a tokenizer changed the text: speculation stops there)"))
    if "context_note" in r:
        print(f"context {r['context_note']}")
    m = r.get("measured")
    if m:
        print(f"measured {m['speedup']:.2f}x plain decoding ({m['draft_tokens_per_second']} vs "
              f"{m['plain_tokens_per_second']} tokens/s; acceptance rate {m['acceptance_rate']}, mean "
              f"acceptance length {m['mean_acceptance_length']}; {m['prompts']} prompts of {m['new_tokens']} "
              f"new tokens, outputs {'identical' if m['identical'] else 'DIFFERENT'} to plain decoding)")


def _cmd(args) -> int:
    report = check_pair(args.target, args.draft)
    if args.measure is not None and report["mode"] != "refused":
        print(f"measuring the pair: {len(MEASURE_PROMPTS)} prompts, {args.measure} new tokens each, "
              "plain and speculative...", file=sys.stderr, flush=True)
        report["measured"] = measure_pair(args.target, args.draft, args.measure)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        _print(report)
    return 0 if report["mode"] != "refused" else 2


def add_parser(subparsers) -> None:
    """Add the ``check-pair`` command to an argparse subparsers object."""
    p = subparsers.add_parser(
        "check-pair", help="can DRAFT speculate for TARGET, and how (tokenizers compared)",
        description="Compare a target's and a draft's tokenizers and configs (no weights are loaded): "
                    "identity, vocabulary overlap, special tokens, chat templates, context lengths, and "
                    "the mode a pairing uses: 'same' (token ids straight through), 'cross' (another "
                    "tokenizer: the draft's proposals reach the target through text) or 'refused' "
                    "(exit code 2, with the reason).", epilog=EXIT_CODES_HELP)
    p.add_argument("target", metavar="TARGET", help="a known model name, a model directory, a .gguf file or a hub id")
    p.add_argument("draft", metavar="DRAFT", help="the same for the draft")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--measure", type=int, nargs="?", const=64, default=None, metavar="TOKENS",
                   help="also load both models and measure the speedup on this machine: two prompts, "
                        "plain decoding and the draft method, TOKENS new tokens each (default 64); a "
                        "first look, the bench measures properly")
    p.set_defaults(func=lambda args: run_command(_cmd, args))
