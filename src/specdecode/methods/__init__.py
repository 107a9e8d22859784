"""Every speculative decoding method, declared once (docs/DESIGN.md, "The method registry").

- :mod:`.spec`: what a method is (:class:`MethodSpec`, its :class:`Option` objects and hooks);
- family modules, each declaring its methods and options: :mod:`.draft` (a draft model),
  :mod:`.lookups` (prompt-lookup, suffix, hybrid, self), :mod:`.self_spec` (layer-skip,
  early-exit, self-draft), :mod:`.heads` (medusa, eagle3);
- :mod:`.registry`: :data:`METHODS`, :class:`Method` and :data:`OPTIONS`, read from them;
- :mod:`.options`: the ``name:key=value`` grammar; :mod:`.config`: :class:`SpeculativeConfig`;
- :mod:`.plan`: prepare / build proposer / build schedule, naming no method.
"""

from .config import KEYWORD_OPTIONS, SpeculativeConfig, prompt_lookup_method, speculative_config
from .draft import draft_proposer
from .heads import tree_size
from .options import BENCH_ROW_OPTIONS, METHOD_OPTIONS, method_options, name_and_options, split_method
from .plan import build_proposer, build_schedule, cannot_run, head_dir_for, prepare, read_files, with_prediction
from .registry import DEFAULT_METHOD, METHODS, OPTIONS, PLAIN, Method
from .self_spec import skips_given
from .spec import Export, Key, MethodSpec, Option

__all__ = ["BENCH_ROW_OPTIONS", "DEFAULT_METHOD", "KEYWORD_OPTIONS", "METHODS", "METHOD_OPTIONS", "OPTIONS", "PLAIN", "Export", "Key", "Method", "MethodSpec",
           "Option", "SpeculativeConfig", "build_proposer", "build_schedule", "cannot_run", "draft_proposer",
           "head_dir_for", "method_options", "name_and_options", "prepare", "prompt_lookup_method", "read_files", "with_prediction",
           "skips_given", "speculative_config", "split_method", "tree_size"]
