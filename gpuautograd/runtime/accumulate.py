"""Where gradients land: AccumulateGrad's semantics for leaves and retain_grad()'s for non-leaves,
as torch implements them (torch/csrc/autograd/functions/accumulate_grad.h)."""

from __future__ import annotations

import torch


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    if any(sz == 0 for sz in t.shape):
        return True
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """A gradient may be stolen as .grad only with the variable's strides (ignoring size-1 dims)."""
    if grad.stride() == variable.stride() and variable.is_contiguous():
        return True  # the common case, decided without the general check below
    if not non_overlapping_and_dense(variable):
        return grad.is_contiguous()
    for size, gs, vs in zip(grad.shape, grad.stride(), variable.stride()):
        if size != 1:
            if gs != vs:
                return False
        elif gs == 0:
            return False
    return True


def clone_obey_contract(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    if non_overlapping_and_dense(variable):
        return grad.new_empty_strided(variable.shape, variable.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def accumulate_grad(variable: torch.Tensor, new_grad: torch.Tensor, owned: bool) -> None:
    """`owned`: nothing else references new_grad (torch's use_count check), so it may become .grad."""
    existing = variable.grad
    if new_grad.layout != torch.strided or (existing is not None and existing.layout != torch.strided):
        # A sparse gradient (an opaque node's, e.g. gather(sparse_grad=True)), or a sparse .grad.
        if existing is None:
            variable.grad = new_grad if owned else new_grad.clone()
        elif existing.layout == torch.strided:
            existing.add_(new_grad)
        else:
            variable.grad = new_grad + existing  # torch has no add(sparse, dense)
        return
    if existing is None:
        if owned and obeys_layout_contract(new_grad, variable):
            variable.grad = new_grad
        else:
            variable.grad = clone_obey_contract(new_grad, variable)
    else:
        existing.add_(new_grad)


def retain_grad(tensor: torch.Tensor, new_grad: torch.Tensor) -> None:
    existing = tensor.grad
    if existing is None:
        tensor.grad = new_grad.clone(memory_format=torch.contiguous_format)
    else:
        tensor.grad = existing + new_grad


class AddInPlace:
    """Leaves whose .grad exists accumulate in place (AccumulateGrad's `grad += new`), all of them
    in one `torch._foreach_add_` instead of one add per parameter: one call, and on CUDA a few
    kernel launches, for the micro-batches of gradient accumulation."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.news: list[torch.Tensor] = []

    def take(self, existing: torch.Tensor, new_grad: torch.Tensor) -> bool:
        """Queue `existing += new_grad` (a leaf's .grad, not None), when both are dense."""
        if existing.layout != torch.strided or new_grad.layout != torch.strided:
            return False
        self.grads.append(existing)
        self.news.append(new_grad)
        return True

    def run(self) -> None:
        if self.grads:
            torch._foreach_add_(self.grads, self.news)
