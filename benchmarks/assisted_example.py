"""transformers-style assisted generation through specdecode's API, by default: plain
decoding against ``generate(target, prompt, assistant_model=draft)`` with no method named
(the default method), for drafts of the target's tokenizer and of another one: one untimed
run of each (what is measured once per model: forward-time profiles), then alternated
``--repeats`` times (A B, B A, ...), median seconds of each. Usage:

    python benchmarks/assisted_example.py OUT.json [--prompt TEXT] [--max-new-tokens N]
        [--drafts NAME,NAME] [--repeats N] [--temperature T]

Writes the per-run seconds, the medians, the ratio and whether the outputs were identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

import specdecode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafts", default="qwen2.5-coder-0.5b-instruct,smollm2-135m-instruct")
    p.add_argument("--prompt", default="Viết về Việt Nam")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(2)
    target = specdecode.load(args.target)
    common = dict(chat=True, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  **({"seed": 0} if args.temperature else {}))
    results = {"command": " ".join(["python", "benchmarks/assisted_example.py", *__import__("sys").argv[1:]]),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(), "drafts": {}}
    for name in args.drafts.split(","):
        draft = specdecode.load(name, role="draft")
        runs = {"plain": [], "default": []}
        texts = {}
        specdecode.generate(target, args.prompt, **common)  # untimed: once-per-model measurements
        specdecode.generate(target, args.prompt, assistant_model=draft, **common)
        for r in range(args.repeats):
            order = ("plain", "default") if r % 2 == 0 else ("default", "plain")
            for which in order:
                t0 = time.perf_counter()
                out = specdecode.generate(target, args.prompt, **common) if which == "plain" else \
                    specdecode.generate(target, args.prompt, assistant_model=draft, **common)
                runs[which].append(time.perf_counter() - t0)
                texts.setdefault(which, out.text)
                if which == "default":
                    stats = out.stats.to_dict()
        med = {k: statistics.median(v) for k, v in runs.items()}
        results["drafts"][name] = {"seconds": runs, "median_s": med,
                                   "speedup": med["plain"] / med["default"],
                                   "identical": texts["plain"] == texts["default"],
                                   "default_stats": {k: stats[k] for k in ("num_draft_tokens",
                                                                             "num_accepted_tokens",
                                                                             "num_generated_tokens",
                                                                             "by_proposer")}}
        print(name, json.dumps(results["drafts"][name], indent=None, default=str), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
