"""The one registry of functional backward rules, keyed by the exact `grad_fn.name()`.

A rule is `rule(b, node, grads) -> list`: `b` is the IR Builder, `node` a NodeView (saved values,
metadata, which edges need a gradient), `grads` one Value or None per forward output of the node.
It returns one Value or None per `next_functions` edge; None means "no gradient" (never a
materialized zero). The driver, not the rule, sums gradients that meet at a node and casts or
reduces each result to what the next node expects (validate_outputs).

A node whose values are complex runs its rule only where the rule says it follows torch's complex
convention (`register(..., complex=True)`: the conjugate Wirtinger derivative, and the real part
of a gradient that flows to a real input, as derivatives.yaml writes them); any other rule would
give a quietly wrong gradient there, so such a node runs as the live node instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

RuleFn = Callable[..., Sequence]

RULES: dict[str, RuleFn] = {}
COMPLEX_READY: set[str] = set()  # the node names whose rule is written for complex values too


def register(*names: str, complex: bool = False):
    """Decorator: `@register("MulBackward0")` makes the function the rule of that node name;
    `complex=True` says the rule is right for complex values as well."""

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            if name in RULES:
                raise ValueError(f"a rule for {name} is registered twice ({RULES[name].__module__} and {fn.__module__})")
            RULES[name] = fn
            if complex:
                COMPLEX_READY.add(name)
        return fn

    return deco


def lookup(name: str) -> RuleFn | None:
    return RULES.get(name)


def handles_complex(name: str) -> bool:
    return name in COMPLEX_READY
