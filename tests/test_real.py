"""Real models (fetched by `make models` / `specdecode models fetch`): SmolLM2-135M as its own
draft, and the default Qwen2.5-Coder pair, against plain greedy decoding."""

import pytest
import torch
import transformers

import specdecode
from specdecode.models import registry

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2():
    return specdecode.load("smollm2-135m-instruct")


def test_smollm2_plain_decoding_equals_transformers_generate(smollm2):
    prompt_ids = smollm2.tokenizer.encode("The three primary colours are")
    ours = specdecode.generate(smollm2, input_ids=prompt_ids, method="ar", max_new_tokens=40,
                               eos_token_id=[])
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("k", [3, 8])
def test_smollm2_as_its_own_draft(smollm2, k):
    prompt = "Write a short story about a robot who learns to paint."
    ar = specdecode.generate(smollm2, prompt, chat=True, method="ar", max_new_tokens=96)
    spec = specdecode.generate(smollm2, prompt, chat=True, draft=smollm2, max_new_tokens=96,
                               num_speculative_tokens=k, debug=True)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.num_draft_tokens > 0
    # every full round emits K+1 tokens
    assert spec.stats.num_verify_passes == -(-len(spec.token_ids) // (k + 1))


@pytest.fixture(scope="module")
def qwen_pair():
    return specdecode.load_pair(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT)


@pytest.mark.parametrize("prompt", [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
])
def test_default_qwen_pair_equals_greedy(qwen_pair, prompt):
    target, draft = qwen_pair
    assert target.lm.vocab_size == 151936 and draft.lm.vocab_size == 151936
    ar = specdecode.generate(target, prompt, chat=True, method="ar", max_new_tokens=32)
    spec = specdecode.generate(target, prompt, chat=True, draft=draft, max_new_tokens=32, debug=True)
    assert spec.token_ids == ar.token_ids
    assert len(spec.token_ids) == 32 or spec.finish_reason == "stop"
    assert spec.stats.acceptance_rate > 0.3  # a real draft of the same family, not noise
