"""Every registered method, read from the registry: its greedy output equals plain decoding
(alone and in the batched engine), and every option it does not honour is refused with a
message naming the methods that do. A method added to the registry fails here until it has
a fixture below."""

from __future__ import annotations

import pytest
import torch

import specdecode
from specdecode.heads import MedusaHeads
from specdecode.layer_skip import SkipProfile
from specdecode.methods import METHODS, OPTIONS, SpeculativeConfig, speculative_config
from specdecode.models.quant import q4k_kernel
from test_eagle3 import _deep_target_dir, _random_head

# a value other than the default for each option's fields (checks only: nothing is read)
SAMPLES = {
    "draft_p_min": {"draft_p_min": 0.3}, "tree": {"draft_tree_width": 2}, "ngram": {"max_ngram": 3},
    "suffix_cache": {"suffix_cache": "session"}, "skip": {"skip_layers": (1,)}, "exit_layer": {"exit_layer": 2},
    "self_draft_dtype": {"self_draft_dtype": "int8"}, "head": {"head_dir": "/heads"},
    "medusa_choices": {"medusa_choices": [[0], [1]]}, "lossy_typical": {"lossy_typical": 0.09},
    "tree_nodes": {"tree_nodes": 4},
}
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one two"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An 8-layer target (EAGLE-3 fuses three of its layers), in int8 where the int4 kernel
    runs (a self-draft must be of a lower precision), a draft model, a Medusa and an EAGLE-3
    head and a layer-skip profile for it; each method's text naming them."""
    root = tmp_path_factory.mktemp("conformance")
    path = _deep_target_dir(root / "target")
    int4 = q4k_kernel()[0] is not None
    target = specdecode.load(path, dtype="int8" if int4 else "float32")
    draft = specdecode.load(path, dtype="float32" if int4 else "int8")
    lm = target.lm
    medusa = MedusaHeads(lm.args.dim, lm.vocab_size, 2).save(root / "medusa")
    eagle3 = _random_head(lm.args, n=60, seed=3, embed=lm.model.embed_tokens(torch.arange(lm.vocab_size)))
    eagle3 = eagle3.save(root / "eagle3")
    n = lm.args.n_layers
    profile = root / "skip.json"
    SkipProfile((3, 5), 2, 0.9, 0.5, 1.1, n).save(profile)
    texts = {
        "ar": "ar", "draft": "draft", "prompt-lookup": "prompt-lookup", "suffix": "suffix", "hybrid": "hybrid",
        "layer-skip": f"layer-skip:profile={profile}", "early-exit": f"early-exit:layer={n // 2}",
        "self-draft": f"self-draft:dtype={'int4' if int4 else 'int8'}", "medusa": f"medusa:head={medusa}:tree=2",
        "eagle3": f"eagle3:head={eagle3}:nodes=6", "self": "self:layers=3+5",
    }
    return target, draft, texts


@pytest.mark.parametrize("name", list(METHODS))
def test_every_registered_method_keeps_plain_decodings_greedy_output(setup, name):
    target, draft, texts = setup
    assert name in texts, f"give the method {name!r} a fixture in this file"
    with_draft = {"draft": draft} if METHODS[name].needs_draft_model else {}
    plain = [specdecode.generate(target, p, method="ar", max_new_tokens=24).token_ids for p in PROMPTS]
    alone = [specdecode.generate(target, p, method=texts[name], max_new_tokens=24, debug=True, **with_draft)
             for p in PROMPTS]
    assert [r.token_ids for r in alone] == plain
    if METHODS[name].speculates:
        assert sum(r.stats.num_draft_tokens for r in alone) > 0  # it really proposed
    batched = specdecode.generate(target, PROMPTS, method=texts[name], max_new_tokens=24, **with_draft)
    assert [r.token_ids for r in batched] == plain


@pytest.mark.parametrize("name", list(METHODS))
def test_every_option_a_method_does_not_honour_is_refused_naming_those_that_do(name):
    assert set(SAMPLES) | {"draft"} == set(OPTIONS), "give each option a sample value here"
    spec = METHODS[name]
    for option, fields in SAMPLES.items():
        if option in spec.option_names:
            SpeculativeConfig(name, **fields)  # honoured: accepted
            continue
        with pytest.raises(ValueError) as e:
            SpeculativeConfig(name, **fields)
        honouring = [m for m in METHODS.values() if option in m.option_names]
        assert honouring and all(repr(m.name) in str(e.value) for m in honouring), str(e.value)
        assert str(e.value).startswith(OPTIONS[option].applies) and str(e.value).endswith(f"not {name!r}")
    if not spec.needs_draft_model:
        with pytest.raises(ValueError, match=f"not {name!r}: drop the draft model"):
            speculative_config(name, True)
    else:
        assert speculative_config(name, True).method.value == name


@pytest.mark.parametrize("name", list(METHODS))
def test_every_key_a_method_takes_is_in_its_help(name):
    """--method's help lists each method's own options from its spec: none left out."""
    spec = METHODS[name]
    assert all(f"{key}=" in spec.options_help for key in spec.keys()), (name, spec.options_help)
    assert bool(spec.options_help) == bool(spec.keys())


def test_a_methods_options_as_keyword_arguments_are_its_method_strings(setup):
    """generate(method=..., skip_layers=..., head_dir=...): a method's own options by their
    SpeculativeConfig names, as its method string gives them; a keyword that is no option is
    a TypeError naming the allowed ones, an option given both ways a ValueError."""
    target, _, texts = setup
    head = texts["medusa"].split("head=")[1].split(":")[0]
    plain = specdecode.generate(target, PROMPTS[0], method="ar", max_new_tokens=16).token_ids
    for method, kwargs, text in (("layer-skip", dict(skip_layers=[3, 5]), "layer-skip:layers=3+5"),
                                 ("early-exit", dict(exit_layer=4), "early-exit:layer=4"),
                                 ("medusa", dict(head_dir=head, draft_tree_width=2), texts["medusa"])):
        # an integer K: the default schedule prices K from measured pass times, so the number
        # of draft tokens would vary between two runs of the same options
        by_keyword = specdecode.generate(target, PROMPTS[0], method=method, max_new_tokens=16,
                                         num_speculative_tokens=3, **kwargs)
        by_text = specdecode.generate(target, PROMPTS[0], method=text, max_new_tokens=16,
                                      num_speculative_tokens=3)
        assert by_keyword.token_ids == by_text.token_ids == plain
        assert by_keyword.stats.num_draft_tokens == by_text.stats.num_draft_tokens > 0
        assert by_keyword.stats.accepted_per_position == by_text.stats.accepted_per_position
    with pytest.raises(TypeError, match="'skip_layer'; a method's own options are .*skip_layers"):
        specdecode.generate(target, PROMPTS[0], method="layer-skip", skip_layer=[3])
    with pytest.raises(ValueError, match="given both"):
        specdecode.generate(target, PROMPTS[0], method="layer-skip:layers=3", skip_layers=[3])
    with pytest.raises(ValueError, match="an exit layer .* applies to 'early-exit', not 'prompt-lookup'"):
        specdecode.generate(target, PROMPTS[0], method="prompt-lookup", exit_layer=2)


def test_option_fields_are_given_by_name():
    """A config's option fields follow the registry's order, so they are keyword-only: a
    positional value past the K settings is a TypeError, never another option's value."""
    with pytest.raises(TypeError):
        SpeculativeConfig("draft", None, "fixed", 16, 0.1, 2)
    assert SpeculativeConfig("draft", 3, "fixed", 16, draft_p_min=0.1).draft_p_min == 0.1
