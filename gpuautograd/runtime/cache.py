"""The plan cache: programs keyed by graph structure and tensor metadata, with readable misses.

The key is everything a program depends on, as the walk built it. On a miss, the most recent key
of the same graph structure (node types and edges) is compared with the new one, so `stats()`
can name the guard that failed ("node 3 (MmBackward0) saved self: f32[8, 16] -> f32[4, 16]").

Two bounds: GPUAUTOGRAD_CACHE_SIZE plans, and GPUAUTOGRAD_CACHE_BYTES resident bytes (what plans
keep allocated between calls, runtime/resident.py). Both evict the least recently used plans.
"""

from __future__ import annotations

import collections
import functools
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import flags, native
from ..degrade import report
from ..ir.program import Program
from ..ir.types import TensorType
from . import resident
from . import stats as stats_module


@dataclass
class Entry:
    program: Program | None
    compiled: Any  # a callable taking the argument list
    arg_plan: list[tuple[str, int]] = field(default_factory=list)
    sinks: list[tuple] = field(default_factory=list)  # kind, index, slot, owned, sources (custom outputs it comes from)
    opaque_nodes: list[int] = field(default_factory=list)  # released after the run
    functional_nodes: list[int] = field(default_factory=list)  # released before the run
    fallback_reason: str | None = None  # set when this graph must run eagerly
    cpp_opaque: bool = False  # an opaque node is a C++ node (its graph task must be backward()-like)
    yields: bool = False  # the program yields to the host to run hooks (ir/hook_ops.py)
    keepalive: Any = None  # what a native key refers to by address (the Python walk's key)
    native_arguments: Any = None  # arg_plan as the extension's ArgumentPlan (native walks only)
    python_binding: Any = None  # arg_plan and the release as engine.PythonBinding (Python walks only)
    leaf_delivery: Any = None  # the native extension's LeafDelivery for the leaf sinks (None: Python's)
    replay_native: Any = None  # a bound program's replay for the native short path (BoundProgram.replay_native)
    other_sinks: bool = True  # sinks other than leaves (retained grads, grad()'s results)
    maybe_undefined: list = field(default_factory=list)  # (output, sources) a custom backward's None may leave undefined
    # (native_arguments, leaf_delivery, replay_native) where a plain hit may take the engine's
    # short path, else None: set when the entry is cached, so a hit reads one field, not eight
    short_path: tuple | None = None
    oversize: bool = False  # counted in stats()["cache_oversize"] already


CACHE_OVERSIZE_REPORT = (
    "gpuautograd: a plan keeps more bytes resident than GPUAUTOGRAD_CACHE_BYTES allows ({setting}); "
    "it is kept, alone, since it runs on every call (explain().resident says what it holds)"
)


@functools.cache
def _auto_bound(device) -> int:
    """GPUAUTOGRAD_CACHE_BYTES=auto on CUDA: a quarter of the device's total memory."""
    return torch.cuda.get_device_properties(device).total_memory // 4


def _setting_text(setting, bound: int) -> str:
    return f"auto: {bound} bytes" if setting == "auto" else f"{bound} bytes"


STRUCTURES_KEPT = 1024  # graph structures remembered for miss diagnosis and recapture counts
EVICTED_KEPT = 1024  # evicted keys remembered, so that capturing one again is known as thrash


class PlanCache:
    def __init__(self) -> None:
        self.entries: collections.OrderedDict[Any, Entry] = collections.OrderedDict()
        # digest of the key bytes -> the native walks' keys with it that the short path may hit (no
        # retained grads): its lookup builds no key (gpt's is 13 kB)
        self.by_digest: dict[int, list] = {}
        # structure -> (last full key captured, captures so far); oldest structures are forgotten
        self.structures: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        # key of an evicted entry -> its fallback reason (None: it ran functionally); oldest forgotten
        self.evicted: collections.OrderedDict[Any, str | None] = collections.OrderedDict()

    def note_capture(self, structure, key) -> tuple[Any, int]:
        """Record a capture of `key`; returns the previous key of that structure (or None) and the
        number of captures of the structure, this one included."""
        previous, count = self.structures.pop(structure, (None, 0))
        self.structures[structure] = (key, count + 1)
        while len(self.structures) > STRUCTURES_KEPT:
            self.structures.popitem(last=False)
        return previous, count + 1

    def get(self, key) -> Entry | None:
        # The short path's native walk_lookup takes these two steps itself (a frame saved on a hit):
        # a change here is a change there.
        entry = self.entries.get(key)
        if entry is not None:
            try:
                self.entries.move_to_end(key)
            except KeyError:  # another thread's put evicted it just now; this call still has it
                pass
        return entry

    def put(self, key, entry: Entry, limit: int) -> None:
        if key not in self.entries and (digest := _short_path_digest(key)) is not None:
            self.by_digest.setdefault(digest, []).append(key)
        self.entries[key] = entry
        while len(self.entries) > limit:
            old_key, old = self.entries.popitem(last=False)
            self._forget(old_key, old)
        if hasattr(entry.compiled, "on_resident"):
            # a bound plan grows at its first call (mirrors, graphs): the bound is checked again then;
            # weakly, so that an evicted plan is freed by reference counting, not a later gc
            ref = weakref.ref(entry)
            entry.compiled.on_resident = lambda: (e := ref()) is not None and self.enforce_bytes(e)
        self.enforce_bytes(entry)

    def _forget(self, key, old: Entry) -> None:
        self._forget_digest(key)
        self.evicted[key] = old.fallback_reason
        while len(self.evicted) > EVICTED_KEPT:
            self.evicted.popitem(last=False)

    def resident_bytes(self) -> int:
        """The resident bytes of every cached plan (each computed when it was bound or first run)."""
        return sum(resident.total(e.compiled) for e in self.entries.values())

    def enforce_bytes(self, keep: Entry) -> None:
        """Evict least recently used plans until the resident total is within GPUAUTOGRAD_CACHE_BYTES.
        `keep`, the plan just cached or just grown, stays even when it alone is over the bound."""
        setting = flags.cache_bytes()
        if setting is None or resident.total(keep.compiled) == 0:
            return
        if setting == "auto":  # a quarter of the device, for CUDA plans only
            device = getattr(keep.compiled, "device", None)
            if device is None or device.type != "cuda":
                return
            bound, counted = _auto_bound(device), lambda e: getattr(e.compiled, "device", None) == device
        else:
            bound, counted = setting, lambda e: True
        held = [(k, e) for k, e in self.entries.items() if counted(e) and resident.total(e.compiled)]
        evicted = False
        excess = sum(resident.total(e.compiled) for _, e in held) - bound
        for k, e in held:  # oldest first
            if excess <= 0:
                break
            if e is keep:
                continue
            if self.entries.pop(k, None) is None:  # another thread's put evicted it just now
                continue
            excess -= resident.total(e.compiled)
            self._forget(k, e)
            stats_module.STATS.cache_byte_evictions += 1
            evicted = True
        if evicted:
            # Triton's kernel objects of a plan sit in reference cycles that hold launch arguments:
            # without a gc pass now, the memory this eviction is for would stay allocated
            gc.collect()
        if excess > 0 and not keep.oversize:
            keep.oversize = True
            stats_module.STATS.cache_oversize += 1
            report(CACHE_OVERSIZE_REPORT.format(setting=_setting_text(setting, bound)))

    def take_evicted(self, key) -> tuple[bool, str | None]:
        """(was `key` evicted, the fallback reason its entry had); forgets the eviction."""
        if key not in self.evicted:
            return False, None
        return True, self.evicted.pop(key)

    def _forget_digest(self, key) -> None:
        digest = _short_path_digest(key)
        keys = self.by_digest.get(digest, []) if digest is not None else []
        if key in keys:
            keys.remove(key)
            if not keys:
                del self.by_digest[digest]

    def clear(self) -> None:
        self.entries.clear()
        self.by_digest.clear()
        self.structures.clear()
        self.evicted.clear()


def _short_path_digest(key) -> int | None:
    """The digest of a native walk's key without retained grads, else None. Such a key is
    (backend, accumulate, "native", key bytes, retained, grad dtypes)."""
    if len(key) != 6 or key[2] != "native" or key[4] != () or (ext := native.load()) is None:
        return None
    return ext.digest(key[3])


def structure_of(key) -> tuple:
    """The part of a key that names the graph, not the sizes: node types, edges, roots, inputs."""
    backend, mode, _root_metas, roots, inputs, nodes = key
    return (backend, mode, roots, inputs, tuple(e[:2] if isinstance(e[0], type) else e for e in nodes if e[0] not in GUARDS))


# Key fields that guard one structure: hooks added or removed, saved tensors that are one tensor
# on one call and two on another (explain_miss names them).
GUARDS = ("hooks", "aliases")


HOOK_NAMES = ((1, "tensor hooks"), (2, "pre-hooks"), (4, "post-hooks"), (8, "post-accumulate-grad hooks"))


def _guard_of(nodes, name: str) -> dict:
    """A guard field of a key's node list ("hooks" or "aliases") as a dict; empty where absent."""
    return next((dict(e[1]) for e in nodes if e[0] == name), {})


def _explain_hooks(old: dict, new: dict, classes) -> str:
    for i in sorted(old.keys() | new.keys()):
        a, b = old.get(i, 0), new.get(i, 0)
        if a != b:
            names = lambda bits: ", ".join(n for bit, n in HOOK_NAMES if bits & bit) or "no hooks"  # noqa: E731
            return f"node {i} ({classes[i].name}) hooks changed: {names(a)} -> {names(b)}"
    return "new graph structure"


def _fmt_meta(meta) -> str:
    if isinstance(meta, tuple) and len(meta) == 4 and isinstance(meta[2], torch.dtype):
        return f"{TensorType(tuple(meta[0]), meta[2], meta[3])} stride {tuple(meta[1])}"
    if isinstance(meta, tuple) and len(meta) == 3 and isinstance(meta[1], torch.dtype):
        return str(TensorType(tuple(meta[0]), meta[1], meta[2]))
    return repr(meta)


def explain_miss(old, new, classes) -> str:
    """The first guard of `old` that `new` fails, in words."""
    head_names = ("backend", "mode", "root gradients", "roots", "inputs")
    for name, a, b in zip(head_names, old[:-1], new[:-1]):
        if a != b:
            if name == "root gradients":
                return f"root gradient changed: {', '.join(map(_fmt_meta, a))} -> {', '.join(map(_fmt_meta, b))}"
            return f"{name} changed: {a!r} -> {b!r}"
    hooks_old, hooks_new = _guard_of(old[-1], "hooks"), _guard_of(new[-1], "hooks")
    if hooks_old != hooks_new:
        return _explain_hooks(hooks_old, hooks_new, classes)
    for i, (a, b) in enumerate(zip(old[-1], new[-1])):
        if a == b or a[0] in GUARDS:
            continue
        if not isinstance(a[0], type):
            return f"retained tensors changed: {a!r} -> {b!r}"
        info = classes[i]
        where = f"node {i} ({info.name})"
        if a[2] != b[2]:
            return f"{where} gradient metadata: {', '.join(map(_fmt_meta, a[2]))} -> {', '.join(map(_fmt_meta, b[2]))}"
        if info.kind == "accumulate":
            return f"{where} leaf: {_fmt_meta(a[3])} -> {_fmt_meta(b[3])}"
        if info.kind == "cpp":
            for name, x, y in zip(info.saved_names, a[3], b[3]):
                if x != y:
                    return f"{where} saved {name}: {_fmt_meta(x)} -> {_fmt_meta(y)}"
        return f"{where}: {a[3]!r} -> {b[3]!r}"
    aliases_old, aliases_new = _guard_of(old[-1], "aliases"), _guard_of(new[-1], "aliases")
    if aliases_old != aliases_new:
        return f"saved tensors that are one tensor changed: slots {aliases_old or 'none'} -> {aliases_new or 'none'}"
    return "new graph structure"
