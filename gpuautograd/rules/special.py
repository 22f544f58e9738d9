"""Backward rules of the gamma family: lgamma, digamma, polygamma and mvlgamma, which
distributions' log-probabilities use. All pointwise; digamma and polygamma are IR ops with
Triton lowerings (codegen/special.py), so these gradients fuse."""

from __future__ import annotations

from .registry import register


def _polygamma(b, n: int, x):
    return b.digamma(x) if n == 0 else b.emit("polygamma", x, n=n)


@register("LgammaBackward0")
def lgamma_backward(b, node, grads):
    # self: grad * digamma(self)
    return [b.mul(grads[0], _polygamma(b, 0, node.saved("self")))]


@register("DigammaBackward0")
def digamma_backward(b, node, grads):
    # self: grad * polygamma(1, self)
    return [b.mul(grads[0], _polygamma(b, 1, node.saved("self")))]


@register("PolygammaBackward0")
def polygamma_backward(b, node, grads):
    # self: grad * polygamma(n + 1, self)
    return [b.mul(grads[0], _polygamma(b, node.saved("n") + 1, node.saved("self")))]


@register("MvlgammaBackward0")
def mvlgamma_backward(b, node, grads):
    # self: mvlgamma_backward(grad, self, p) = grad * sum_{i < p} digamma(self - i / 2)
    x = node.saved("self")
    total = None
    for i in range(node.saved("p")):
        term = _polygamma(b, 0, b.sub(x, i / 2) if i else x)
        total = term if total is None else b.add(total, term)
    return [b.mul(grads[0], total)]
