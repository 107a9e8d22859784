"""Which view of a chat a draft of another tokenizer should read: the conversation as the
target's chat template renders it (its text, re-encoded by the draft's tokenizer), or the
same messages rendered by the draft's own chat template. Greedy, the same prompts, the
same K; prints acceptance and tokens per verify pass for each view (the outputs are the
target's either way). Usage: python benchmarks/xtok_chat_view.py [DRAFT] [N_PROMPTS]"""

import json
import sys
import time
from pathlib import Path

import torch

import specdecode
from specdecode.config import SamplingParams
from specdecode.engine import Engine
from specdecode.proposers import CrossTokenizerProposer

torch.set_num_threads(2)
draft_name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 6
target = specdecode.load("qwen2.5-coder-1.5b-instruct")
draft = specdecode.load(draft_name, role="draft")
data = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench"
questions = [json.loads(line) for line in open(data / "question.jsonl")]
prompts = [q["turns"][0] for q in questions[::max(1, len(questions) // n)]][:n]
rows = {"target-text": [0, 0, 0, 0], "own-template": [0, 0, 0, 0]}
for text in prompts:
    msgs = [{"role": "user", "content": text}]
    ids = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    own = draft.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False) \
        if getattr(draft.tokenizer, "chat_template", None) else None
    ref = None
    for view in rows:
        if view == "own-template" and own is None:
            continue
        p = CrossTokenizerProposer(draft.lm, target.tokenizer, draft.tokenizer, draft.eos_token_ids)
        p.draft_prompt_ids = own if view == "own-template" else None
        t0 = time.perf_counter()
        g = Engine(target.lm, p, 4).generate(ids, SamplingParams(max_new_tokens=64), target.eos_token_ids).run()
        dt = time.perf_counter() - t0
        ref = ref or g.token_ids
        assert g.token_ids == ref, "the two views must give the target's output"
        r = rows[view]
        r[0] += g.stats.num_draft_tokens; r[1] += g.stats.num_accepted_tokens
        r[2] += g.stats.num_verify_passes; r[3] += len(g.token_ids)
        print(f"{view:13s} {g.stats.num_accepted_tokens:3d}/{g.stats.num_draft_tokens:3d} accepted, "
              f"tau {len(g.token_ids) / g.stats.num_verify_passes:.2f}, {dt:.1f} s  {text[:50]!r}", flush=True)
for view, (prop, acc, passes, toks) in rows.items():
    if prop:
        print(f"{view}: acceptance {acc / prop:.3f}, tokens per verify pass {toks / passes:.2f} "
              f"({len(prompts)} prompts, K 4, 64 tokens, greedy)")
