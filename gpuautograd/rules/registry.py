"""The one registry of functional backward rules, keyed by the exact `grad_fn.name()`.

A rule is `rule(b, node, grads) -> list`: `b` is the IR Builder, `node` a NodeView (saved values,
metadata, which edges need a gradient), `grads` one Value or None per forward output of the node.
It returns one Value or None per `next_functions` edge; None means "no gradient" (never a
materialized zero). The driver, not the rule, sums gradients that meet at a node and casts or
reduces each result to what the next node expects (validate_outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

RuleFn = Callable[..., Sequence]

RULES: dict[str, RuleFn] = {}


def register(*names: str):
    """Decorator: `@register("MulBackward0")` makes the function the rule of that node name."""

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            if name in RULES:
                raise ValueError(f"a rule for {name} is registered twice ({RULES[name].__module__} and {fn.__module__})")
            RULES[name] = fn
        return fn

    return deco


def lookup(name: str) -> RuleFn | None:
    return RULES.get(name)
