"""``specdecode check-pair TARGET DRAFT``: whether and how a draft can speculate for a target,
read from their tokenizers and configs (no weights loaded)."""

from __future__ import annotations

import json

from ..models.loading import resolve_model_path
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


def _cmd(args) -> int:
    report = check_pair(args.target, args.draft)
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
    p.set_defaults(func=lambda args: run_command(_cmd, args))
