"""Which parameters carry a DistributedDataParallel reducer's hooks, and at which reducer index.

DDP's reducer registers a C++ post hook on every parameter's AccumulateGrad node; Python can't
see it, so the parameters are recorded at the source: `import gpuautograd` wraps DDP's
`_ddp_init_helper` (the one place that builds the reducer, from `__init__` and from unpickling)
and reads the list it hands to `dist.Reducer`: position k in that list is the reducer's
variable index k. Nothing is kept alive on DDP's behalf: records hang off the DDP module weakly.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from ..capture import hooks


@dataclass
class DDPRecord:
    params: list[torch.Tensor]  # the reducer's variables, in reducer index order
    expect_sparse: list[bool]
    hooks_removed: bool = False  # ddp._remove_autograd_hooks() ran: no reducer hook fires any more
    ids: list[int] = field(default_factory=list)


# DDP module -> its record; the entry vanishes with the module (and with it the parameter list).
_records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# id(param) -> [(weakref to the DDP module, its record, reducer index)]; a parameter can sit in two
# DDPs. A module's entries leave with it (weakref callback), so no record outlives its module.
_by_param: dict[int, list[tuple[weakref.ref, DDPRecord, int]]] = {}
# Why the registry could not be installed (None when it was); then no parameter is ever known.
install_problem: str | None = "gpuautograd.distributed.install() has not run"


def _drop(ids: list[int], is_stale) -> None:
    """Remove the entries of these parameter ids whose DDP reference `is_stale(ref)`."""
    for i in ids:
        entries = _by_param.get(i)
        if entries is None:
            continue
        entries[:] = [e for e in entries if not is_stale(e[0])]
        if not entries:
            del _by_param[i]


def register(ddp, parameters, expect_sparse) -> None:
    """Record the reducer's parameter list of `ddp` (called right after DDP built its reducer)."""
    params = list(parameters)
    if not all(isinstance(p, torch.Tensor) for p in params):
        return  # not the list we know: leave the module unknown, so its leaves fall back
    hooks.note_hooks()  # the reducer hooks the parameters: the Python walk reads their bits from now on
    sparse = [bool(s) for s in expect_sparse] if expect_sparse is not None else [False] * len(params)
    ids = [id(p) for p in params]
    old = _records.get(ddp)
    if old is not None:  # a rebuilt reducer (unpickling): the new list replaces the old one
        _drop(old.ids, lambda r: r() is ddp)
    ref = weakref.ref(ddp, lambda dead: _drop(ids, lambda r: r is dead or r() is None))
    rec = _records[ddp] = DDPRecord(params, sparse, ids=ids)
    for k, i in enumerate(ids):
        _by_param.setdefault(i, []).append((ref, rec, k))


def owners(var: torch.Tensor) -> list[tuple[object, DDPRecord, int]]:
    """The (DDP module, record, reducer index) of every recorded reducer that holds `var`."""
    entries = _by_param.get(id(var))
    if not entries:
        return []
    out = []
    for ref, rec, k in entries:
        ddp = ref()
        if ddp is not None and rec.params[k] is var:
            out.append((ddp, rec, k))
    return out


def install() -> None:
    """Wrap DDP's reducer construction (once). On a torch whose DDP lacks the method, record why."""
    global install_problem
    if install_problem is None:
        return
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception as e:  # a torch built without distributed support
        install_problem = f"torch.nn.parallel.DistributedDataParallel is unavailable ({e})"
        return
    init_helper = getattr(DDP, "_ddp_init_helper", None)
    remove_hooks = getattr(DDP, "_remove_autograd_hooks", None)
    if init_helper is None:
        install_problem = "this torch's DistributedDataParallel has no _ddp_init_helper, so gpuautograd can't see its reducer's parameters"
        return

    @functools.wraps(init_helper)
    def ddp_init_helper(self, *args, **kwargs):
        result = init_helper(self, *args, **kwargs)
        # torch calls it as (parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)
        parameters = args[0] if args else kwargs.get("parameters")
        sparse = args[1] if len(args) > 1 else kwargs.get("expect_sparse_gradient")
        if isinstance(parameters, (list, tuple)):
            register(self, parameters, sparse)
        return result

    DDP._ddp_init_helper = ddp_init_helper
    if remove_hooks is not None:

        @functools.wraps(remove_hooks)
        def remove_autograd_hooks(self):
            remove_hooks(self)
            rec = _records.get(self)
            if rec is not None:
                rec.hooks_removed = True

        DDP._remove_autograd_hooks = remove_autograd_hooks
    install_problem = None
