"""Which non-leaf tensors carry Python hooks or retain their grad.

Autograd nodes don't expose their tensor hooks to Python, and the walk only sees nodes, so the
tensors are tracked at the source: `Tensor.register_hook` and `Tensor.retain_grad` are wrapped
once, when gpuautograd is imported, to remember (weakly) every non-leaf tensor they touch.
Leaf hooks need no tracking: the AccumulateGrad node exposes its variable. Tensors that got a
hook or retain_grad() before the import are found once, at install, among the live objects.
"""

from __future__ import annotations

import gc
import weakref

import torch

# id(tensor) -> tensor; entries vanish with their tensor, so a reused id is never stale.
_tracked: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_installed = False


def _track(t: torch.Tensor) -> None:
    if t.grad_fn is not None:
        _tracked[id(t)] = t


def install() -> None:
    global _installed
    if _installed:
        return
    original_register_hook = torch.Tensor.register_hook
    original_retain_grad = torch.Tensor.retain_grad

    def register_hook(self, hook):
        handle = original_register_hook(self, hook)
        _track(self)
        return handle

    def retain_grad(self):
        original_retain_grad(self)
        _track(self)

    register_hook.__doc__ = original_register_hook.__doc__
    retain_grad.__doc__ = original_retain_grad.__doc__
    torch.Tensor.register_hook = register_hook
    torch.Tensor.retain_grad = retain_grad
    _installed = True
    # What was registered before the wrappers existed. type() rather than isinstance(): some live
    # objects warn when their __class__ is read.
    for obj in gc.get_objects():
        if issubclass(type(obj), torch._C.TensorBase) and obj.grad_fn is not None and (obj._backward_hooks or obj.retains_grad):
            _tracked[id(obj)] = obj


def tracked_tensors() -> list[torch.Tensor]:
    """The live non-leaf tensors that have had a hook registered or retain_grad() called."""
    return list(_tracked.values())
