"""The method registry: every method, declared once in its family module, in one list.

:data:`METHODS` (name -> :class:`~specdecode.methods.spec.MethodSpec`) is what the
:class:`Method` enum, the CLI's ``--method`` choices and help, the API's ``method=``, the
bench's method list and options, and :class:`~specdecode.methods.config.SpeculativeConfig`
read; :data:`OPTIONS` the options the methods honour, each once.
"""

from __future__ import annotations

import difflib
from enum import Enum

from . import draft, heads, lookups, self_spec
from .spec import MethodSpec, Option

AR = MethodSpec("ar", "nobody: plain autoregressive decoding (the baseline)", None)
PLAIN = AR.name  # plain decoding: the baseline every speedup is measured against

# the order of help texts and choices: each family's methods together, ``self`` last
METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    AR, *draft.METHODS, *lookups.METHODS, *self_spec.METHODS, *heads.METHODS, lookups.SELF)}

OPTIONS: dict[str, Option] = {}
for _m in METHODS.values():
    for _o in _m.options:
        if OPTIONS.setdefault(_o.name, _o) is not _o:
            raise ImportError(f"two options named {_o.name!r}: each option is declared once")


def inapplicable(option: str, method: str) -> str:
    """The error message for ``option`` given to a ``method`` that does not honour it,
    naming the methods that do."""
    honouring = " and ".join(repr(m.name) for m in METHODS.values() if option in m.option_names)
    return f"{OPTIONS[option].applies} to {honouring}, not {method!r}"


class _MethodBase(str, Enum):
    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.value]

    @property
    def needs_draft_model(self) -> bool:
        return self.spec.needs_draft_model

    @classmethod
    def parse(cls, value) -> "Method":
        """The member named ``value`` (a name or a member). Raises ValueError listing the
        methods, with the nearest name where one is close."""
        try:
            return cls(value)
        except ValueError:
            near = difflib.get_close_matches(str(value).lower(), [*METHODS], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"method {value!r} is not one of {list(METHODS)}{hint}") from None


Method = _MethodBase("Method", {name.upper().replace("-", "_"): name for name in METHODS},
                     module="specdecode.methods")
Method.__doc__ = ("Who proposes draft tokens: one member per :data:`METHODS` entry "
                  "(``Method.AR`` is plain decoding, no proposer).")

# what runs where a draft model is given (or the CLI loads its default one) and no method is
# named: the hybrid, whose pay or stop keeps the draft from drafting where its rounds are
# measured slower than plain decoding (docs/methods/lookups.md)
DEFAULT_METHOD = Method.HYBRID
