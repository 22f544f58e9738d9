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
# Whether a hook was ever registered on a tensor (register_hook, register_post_accumulate_grad_hook)
# or an autograd node (grad_fn.register_hook / register_prehook, module backward hooks): until then
# the Python walk asks no node for its hooks. (The native walk reads them on every node.)
hooks_seen = False
# The hook dicts of autograd nodes (grad_fn.register_hook / register_prehook, module backward
# hooks, and a non-leaf tensor's hooks, which its node keeps after the tensor is gone), weakly: a
# node holds its dict while it lives. Only the native extension can see which nodes carry one, so
# without it a backward runs eagerly while any holds a hook (node_hooks_live).
_node_hook_dicts: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# id(dict) -> weak reference to the tensor whose hooks it holds: while the tensor lives, the walk
# finds its hooks through it (tracked_tensors) and the dict needs no blanket fallback.
_dict_owners: dict[int, weakref.ref] = {}
# Whether saved-tensor hooks were ever installed (torch.autograd.graph.saved_tensors_hooks,
# checkpointing, SavedTensor.register_hooks by the user): until then no saved value can carry an
# unpack hook, and the walk skips looking for them.
saved_hooks_seen = False
# Whether torch.native_dropout was ever called from Python with train=False: its node keeps no
# `train` flag, so from then on its rule defers to the live node (see the NativeDropoutBackward0
# rule). Called when the flag flips, so plans captured before it are dropped (engine registers).
eval_dropout_seen = False
on_eval_dropout: list = []
# Whether any leaf's grad_dtype was ever set: until then every leaf's .grad takes the leaf's dtype
# and the walk need not read it.
grad_dtype_seen = False
# Whether a non-leaf tensor was ever detached in place: eager's engine refuses a node whose saved
# input was detached so; from then on the walk looks. Where SavedTensor.unpack() exists (torch
# 2.13) it shows that exactly; older torches (2.11) have no such binding, so the tensors detached
# in place are remembered here, weakly (id -> tensor, as _tracked), for the walk to recognize.
inplace_detach_seen = False
detached_in_place: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
# SavedTensor.register_hooks as torch defines it: gpuautograd's own release calls it directly,
# without the watching wrapper (a Python frame per saved tensor, on every backward).
register_saved_hooks = torch._C._autograd.SavedTensor.register_hooks


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
        global hooks_seen
        handle = original_register_hook(self, hook)
        hooks_seen = True
        _track(self)
        if self.grad_fn is not None:  # its node keeps the dict after the tensor is gone
            _node_hook_dicts[id(self._backward_hooks)] = self._backward_hooks
            _dict_owners[id(self._backward_hooks)] = weakref.ref(self)
        return handle

    original_post_accumulate = torch.Tensor.register_post_accumulate_grad_hook

    def register_post_accumulate_grad_hook(self, hook):
        global hooks_seen
        hooks_seen = True
        return original_post_accumulate(self, hook)

    def retain_grad(self):
        original_retain_grad(self)
        _track(self)

    _watch_saved_tensor_hooks()
    _watch_eval_dropout()
    _watch_materialize_grads()
    _watch_grad_dtype()
    _watch_inplace_detach()
    _watch_node_hooks()
    register_post_accumulate_grad_hook.__doc__ = original_post_accumulate.__doc__
    torch.Tensor.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook
    register_hook.__doc__ = original_register_hook.__doc__
    retain_grad.__doc__ = original_retain_grad.__doc__
    torch.Tensor.register_hook = register_hook
    torch.Tensor.retain_grad = retain_grad
    _installed = True
    # What was registered before the wrappers existed. type() rather than isinstance(): some live
    # objects warn when their __class__ is read.
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch._C.TensorBase):
            continue
        if obj._backward_hooks or obj._post_accumulate_grad_hooks:
            note_hooks()
        if obj.grad_fn is not None and (obj._backward_hooks or obj.retains_grad):
            _tracked[id(obj)] = obj


# The weak dictionary's own dict: empty while no tensor is tracked (the common case), which a hit
# reads without a call and without the weak dictionary's Python-level __len__.
tracked_refs = _tracked.data


def tracked_tensors() -> list[torch.Tensor]:
    """The live non-leaf tensors that have had a hook registered or retain_grad() called."""
    if not tracked_refs:
        return []
    return list(_tracked.values())


def note_hooks() -> None:
    global hooks_seen
    hooks_seen = True


def node_hooks_live() -> bool:
    """Whether a live autograd node may carry a hook that no tracked tensor shows: a node's own
    hook dict, or a tensor's whose tensor is gone, alive and not empty."""
    live = False
    for key, d in list(_node_hook_dicts.items()):
        owner = _dict_owners.get(key)
        if d and (owner is None or owner() is None):
            live = True
            break
    if len(_dict_owners) > 2 * len(_node_hook_dicts) + 64:  # forget the owners of dead dicts
        for key in [k for k in _dict_owners if k not in _node_hook_dicts]:
            del _dict_owners[key]
    return live


def _watch_node_hooks() -> None:
    """grad_fn.register_hook and register_prehook, of C++ and custom Function nodes alike, make
    their handle through Function._register_hook."""
    original = torch.autograd.Function._register_hook

    def _register_hook(backward_hooks, hook):
        note_hooks()
        backward_hooks, handle = original(backward_hooks, hook)
        _node_hook_dicts[id(backward_hooks)] = backward_hooks
        _dict_owners.pop(id(backward_hooks), None)
        return backward_hooks, handle

    torch.autograd.Function._register_hook = staticmethod(_register_hook)


def _watch_saved_tensor_hooks() -> None:
    """Note the first use of saved-tensor hooks: the default-hooks stack that
    saved_tensors_hooks (and so checkpoint) pushes, and per-tensor register_hooks."""
    autograd_c = torch._C._autograd
    original_push = autograd_c._push_saved_tensors_default_hooks

    def push(pack, unpack):
        global saved_hooks_seen
        saved_hooks_seen = True
        return original_push(pack, unpack)

    autograd_c._push_saved_tensors_default_hooks = push
    saved_tensor = autograd_c.SavedTensor
    original_register = register_saved_hooks

    def register_hooks(self, *args, **kwargs):
        global saved_hooks_seen
        unpack = args[1] if len(args) > 1 else kwargs.get("unpack_hook")
        if not getattr(unpack, "_gpuautograd_release", False):
            saved_hooks_seen = True
        return original_register(self, *args, **kwargs)  # torch checks the arguments

    saved_tensor.register_hooks = register_hooks


def _watch_eval_dropout() -> None:
    original = torch.native_dropout

    def native_dropout(input, p, train):
        global eval_dropout_seen
        if train is False and not eval_dropout_seen:
            eval_dropout_seen = True
            for callback in on_eval_dropout:
                callback()
        return original(input, p, train)

    native_dropout.__doc__ = original.__doc__
    torch.native_dropout = native_dropout


MATERIALIZE_ATTR = "_gpuautograd_materialize_grads"


def _watch_materialize_grads() -> None:
    """ctx.set_materialize_grads(False) sets an attribute torch does not let Python read back;
    remember the value on the ctx (the custom Function's node) where the driver can read it."""
    ctx_cls = torch.autograd.function.FunctionCtx
    original = ctx_cls.set_materialize_grads

    def set_materialize_grads(self, value: bool):
        setattr(self, MATERIALIZE_ATTR, value)
        return original(self, value)

    set_materialize_grads.__doc__ = original.__doc__
    ctx_cls.set_materialize_grads = set_materialize_grads


def _watch_grad_dtype() -> None:
    descriptor = torch._C.TensorBase.__dict__["grad_dtype"]

    def set_grad_dtype(self, value):
        global grad_dtype_seen
        grad_dtype_seen = True
        descriptor.__set__(self, value)

    torch.Tensor.grad_dtype = property(descriptor.__get__, set_grad_dtype, doc=descriptor.__doc__)


def note_inplace_detach(tensor: torch.Tensor | None = None) -> None:
    global inplace_detach_seen
    inplace_detach_seen = True
    if tensor is not None:
        detached_in_place[id(tensor)] = tensor


def _watch_inplace_detach() -> None:
    original = torch.Tensor.detach_

    def detach_(self):
        if self.grad_fn is not None:
            note_inplace_detach(self)
        return original(self)

    detach_.__doc__ = original.__doc__
    torch.Tensor.detach_ = detach_
