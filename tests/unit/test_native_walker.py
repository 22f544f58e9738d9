"""The native walker against the Python walk: the same hits and misses, the same tensors handed to
the captured program; hooks only the native walker sees; the build, its flag and its fallback."""

from __future__ import annotations

import warnings
from itertools import repeat

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpuautograd
from bench.models import SUITE
from gpuautograd import flags, native
from gpuautograd.capture import walk as walk_module
from gpuautograd.runtime import engine
from tests import replay_cases
from tests.helpers import assert_close
from tests.replay_cases import Double

WALKERS = ("native", "python")


def _use(walker: str, monkeypatch) -> None:
    if walker == "python":
        monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    else:
        monkeypatch.delenv("GPUAUTOGRAD_NATIVE", raising=False)
        if native.load() is None:
            pytest.skip(f"the native walker is unavailable: {native.reason()}")


def _record_arguments(calls: list):
    """Wrap every cached plan so that each run appends the address and metadata of its saved-tensor
    arguments (the incoming gradient is a fresh tensor on each call)."""
    for entry in engine.CACHE.entries.values():
        if entry.compiled is not None and not hasattr(entry.compiled, "recorded"):
            inner, kinds = entry.compiled, [kind for kind, _ in entry.arg_plan]

            def recording(args, inner=inner, kinds=kinds):
                calls.append([(a.data_ptr(), tuple(a.shape), a.stride(), a.dtype) for a, k in zip(args, kinds) if k == "saved"])
                return inner(args)

            recording.recorded = True
            entry.compiled = recording


def _two_backwards(loss, leaves, walker, monkeypatch):
    """Capture, then hit, on one retained graph: the same saved tensors both times."""
    _use(walker, monkeypatch)
    gpuautograd.reset()
    calls: list = []
    gpuautograd.grad(loss, leaves, retain_graph=True)
    _record_arguments(calls)
    grads = gpuautograd.grad(loss, leaves, retain_graph=True)
    s = gpuautograd.stats()
    assert s["walker"] == walker, s
    return (s["captures"], s["cache_hits"], s["cache_misses"]), calls, grads


def _graphs():
    for name in ("mlp", "cnn", "gpt", "gpt-manual-attn", "llama"):
        torch.manual_seed(0)
        model, make_batch, loss_fn = SUITE[name](dtype=torch.float64)
        yield name, loss_fn(model, *make_batch(torch.Generator().manual_seed(0))), [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "gpt-manual-attn", "llama"])
def test_both_walkers_hit_alike_and_hand_the_program_the_same_tensors(name, monkeypatch):
    _, loss, leaves = next(g for g in _graphs() if g[0] == name)
    native_counts, native_calls, native_grads = _two_backwards(loss, leaves, "native", monkeypatch)
    python_counts, python_calls, python_grads = _two_backwards(loss, leaves, "python", monkeypatch)
    assert native_counts == python_counts == (1, 1, 1)
    assert len(native_calls) == len(python_calls) == 1
    assert native_calls == python_calls  # same addresses, shapes, strides, dtypes, in program order
    expected = torch.autograd.grad(loss, leaves)
    for a, b, e in zip(native_grads, python_grads, expected):
        assert_close(a, e)
        assert_close(b, e)


def test_both_walkers_hand_the_program_the_same_tensors_around_a_checkpoint(monkeypatch):
    # Nodes outside the checkpoint run functionally and read their saved tensors; the native walk
    # also collects the unhooked saved tensors of hooked nodes, which must not shift the slots.
    from torch.utils.checkpoint import checkpoint

    x, y = (torch.randn(4, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    h = checkpoint(lambda a: (a @ w).tanh() * a, x, use_reentrant=False)
    loss = ((h * y).exp() * h).sum()
    native_counts, native_calls, native_grads = _two_backwards(loss, [x, w, y], "native", monkeypatch)
    python_counts, python_calls, python_grads = _two_backwards(loss, [x, w, y], "python", monkeypatch)
    assert native_counts == python_counts == (1, 1, 1)
    assert len(native_calls) == 1 and native_calls[0] and native_calls == python_calls
    expected = torch.autograd.grad(loss, [x, w, y])
    for a, b, e in zip(native_grads, python_grads, expected):
        assert_close(a, e)
        assert_close(b, e)
    assert gpuautograd.stats()["fallbacks"] == {}


def _mm(a, b):
    return (torch.tanh(a @ b) * 1.5).sum()


def _variants(kind: str):
    """(first graph, second graph, leaves): the second differs from the first in one guard."""
    torch.manual_seed(0)
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    if kind == "stride":  # one saved tensor (mm's mat2), same shape, transposed layout
        m = torch.randn(3, 4, dtype=torch.float64)
        mt = torch.randn(4, 3, dtype=torch.float64).t()
        return (lambda: _mm(a, m)), (lambda: _mm(a, mt)), [a]
    if kind == "dtype":  # one saved tensor in another dtype (mul promotes; the node saves `other` as is)
        c64 = torch.randn(5, 3, dtype=torch.float64)
        c32 = c64.float()
        return (lambda: (a * c64).sum()), (lambda: (a * c32).sum()), [a]
    if kind == "scalar":  # one saved number (pow's `exponent`; `t * 2.0` would save a 0-dim tensor)
        return (lambda: torch.tanh(a).pow(2.0).sum()), (lambda: torch.tanh(a).pow(3.0).sum()), [a]
    if kind == "dim":  # one saved dimension list (sum's `dim`), same shapes: the node is a square's
        sq = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        return (lambda: (sq.sum(0) * torch.arange(4.0)).sum()), (lambda: (sq.sum(1) * torch.arange(4.0)).sum()), [sq]
    if kind == "alias":  # two saved tensors are one tensor, then two of the same metadata
        c, d = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        return (lambda: ((a * c).tanh() * (a * c)).sum()), (lambda: ((a * c).tanh() * (a * d)).sum()), [a]
    if kind == "edge":  # one edge leads elsewhere: same node types, same sizes
        c = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        return (lambda: (a * c + a).sum()), (lambda: (a * c + c).sum()), [a, c]
    raise ValueError(kind)


@pytest.mark.parametrize("walker", WALKERS)
@pytest.mark.parametrize("kind", ["stride", "dtype", "scalar", "dim", "edge", "alias"])
def test_a_graph_differing_in_one_guard_is_a_miss(kind, walker, monkeypatch):
    _use(walker, monkeypatch)
    first, second, leaves = _variants(kind)
    for make, expected in ((first, (1, 0)), (second, (2, 0)), (first, (2, 1)), (second, (2, 2))):
        out = gpuautograd.grad(make(), leaves, allow_unused=True)
        for g, e in zip(out, torch.autograd.grad(make(), leaves, allow_unused=True)):
            assert (g is None) == (e is None)
            if e is not None:
                assert_close(g, e)
        s = gpuautograd.stats()
        assert (s["captures"], s["cache_hits"]) == expected, (kind, s)
        assert s["walker"] == walker


def test_saved_tensors_are_one_tensor_by_object_not_by_data():
    # FSDP frees a parameter's storage after the forward and refills it before the backward uses
    # it: at the walk, every freed tensor's data pointer is null, yet each is its own tensor. A
    # view of the same data is another tensor too (its metadata could change apart).
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for t in (a, b):
        t.untyped_storage().resize_(0)
    assert a.data_ptr() == b.data_ptr()
    assert walk_module.saved_aliases([a, b, a, a.view(16), b]) == ((2, 0), (4, 1))


@pytest.mark.parametrize("walker", WALKERS)
def test_a_tensor_two_nodes_save_is_read_once_and_a_call_where_they_differ_misses(walker, monkeypatch):
    # The input c that both a * c and (a * c).exp()'s mul save is one program input; the key holds
    # that, so a call with two tensors there (same metadata) is a miss that says so, not a hit
    # that reads c for d.
    _use(walker, monkeypatch)
    torch.manual_seed(0)
    a = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    c, d = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    one = lambda: ((a * c).exp() * (a * c)).sum()  # noqa: E731
    two = lambda: ((a * c).exp() * (a * d)).sum()  # noqa: E731
    saved_inputs = lambda e: [v for v, spec in e.program.inputs if spec.kind == "saved"]  # noqa: E731
    assert len(saved_inputs(gpuautograd.explain(two()))) == len(saved_inputs(gpuautograd.explain(one()))) + 1
    gpuautograd.reset()
    for make in (one, two, one, two):
        (ours,) = gpuautograd.grad(make(), [a])
        assert_close(ours, torch.autograd.grad(make(), [a])[0])
    s = gpuautograd.stats()
    assert (s["captures"], s["cache_hits"], s["walker"]) == (2, 2, walker), s
    assert s["miss_reasons"][1].startswith("saved tensors that are one tensor changed"), s["miss_reasons"]


@pytest.mark.parametrize("walker", WALKERS)
def test_an_incoming_gradient_differing_in_strides_is_a_miss(walker, monkeypatch):
    _use(walker, monkeypatch)
    torch.manual_seed(0)
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 3, dtype=torch.float64)
    gt = torch.randn(3, 4, dtype=torch.float64).t()  # same shape, transposed layout
    for grad_out, expected in ((g, (1, 0)), (gt, (2, 0)), (g, (2, 1)), (gt, (2, 2))):
        (ours,) = gpuautograd.grad(torch.tanh(a) * 2, [a], grad_out)
        (eager,) = torch.autograd.grad(torch.tanh(a) * 2, [a], grad_out)
        assert_close(ours, eager)
        s = gpuautograd.stats()
        assert (s["captures"], s["cache_hits"]) == expected, s
        assert s["walker"] == walker


@pytest.mark.parametrize("walker", WALKERS)
def test_a_graph_larger_than_the_walkers_first_node_table_hits_and_matches_eager(walker, monkeypatch):
    """Past 256 nodes the native walker's node index grows: edges, a retained gradient found by
    its node, and the key must come out as on a small graph."""
    _use(walker, monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def run(backward):
        h, early = x, None
        for k in range(200):  # two nodes a step
            h = torch.tanh(h * w) + 0.1
            if k == 3:
                early = h
                early.retain_grad()
        backward(h.sum())
        return early.grad.clone(), x.grad.clone(), w.grad.clone()

    expected = None
    for _ in range(2):
        x.grad = w.grad = None
        expected = run(lambda loss: loss.backward())
        x.grad = w.grad = None
        for a, e in zip(run(gpuautograd.backward), expected):
            assert_close(a, e)
    s = gpuautograd.stats()
    assert (s["captures"], s["cache_hits"]) == (1, 1), s
    assert s["walker"] == walker and s["fallbacks"] == {}, s


def _tensor_id(t: torch.Tensor) -> tuple:
    # a saved output unpacks into a new tensor object per read: tell tensors apart by their data
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@pytest.mark.parametrize("name", sorted(SUITE))
def test_the_python_walks_generated_keys_match_saved_key(name):
    """Each node class's generated key function is saved_key() inlined: the same key and the same
    saved tensors in the same order, which lower.py's slots (assigned through saved_key) rely on."""
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name]()
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    w = walk_module.walk([loss.grad_fn])
    checked = 0
    for node, info in zip(w.nodes, w.classes):
        if info.kind is not walk_module.CPP:
            continue
        generated, general = [], []
        try:
            key = info.key(node, generated)
        except AttributeError:  # a list of tensors: the walk takes saved_key() itself
            continue
        assert key == tuple(map(walk_module.saved_key, info.read(node), info.tensor_flags, repeat(general))), info.name
        assert [_tensor_id(t) for t in generated] == [_tensor_id(t) for t in general], info.name
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_a_plain_hit_takes_the_short_path_and_matches_eager(name, monkeypatch):
    """A backward whose cached plan sends every result to a leaf never reaches prepare(): the short
    path builds the same key the general path cached (a key that differed would miss there and
    fall through, correct but slow)."""
    _use("native", monkeypatch)
    gpuautograd.reset()
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name]()
    batch = make_batch(torch.Generator().manual_seed(0))
    gpuautograd.backward(loss_fn(model, *batch))  # the capture takes the general path

    def no_general_path(*args, **kwargs):
        raise AssertionError("a plain hit reached prepare()")

    monkeypatch.setattr(engine, "prepare", no_general_path)
    for _ in range(2):
        replay_cases.step_beside_eager(model, lambda: loss_fn(model, *batch), gpuautograd.backward, assert_close)
    s = gpuautograd.stats()
    assert (s["captures"], s["cache_hits"], s["walker"]) == (1, 2, "native"), s


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_bound_plans_hit_binds_and_delivers_in_cpp_and_matches_eager(name, monkeypatch):
    _use("native", monkeypatch)
    replay_cases.native_replay_delivers_like_eager(replay_cases.Where("interpret-replay", "cpu", torch.float64), name, monkeypatch)


def test_walks_alive_at_once_keep_their_own_buffers(monkeypatch):
    """A thread reuses one walk's buffers for its next walk once the first is gone: a walk made
    while another is alive gets buffers of its own, and a reused set starts empty."""
    _use("native", monkeypatch)
    ext = native.load()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    one = torch.tensor(1.0, dtype=torch.float64)
    small, large = (x * 2).sum(), torch.tanh(x @ x.t()).exp().sum()
    first = ext.walk([small], (), [one])
    key, nodes = first.key, len(first)
    second = ext.walk([large], (), [one])
    assert first.key == key and len(first) == nodes and second.key != key and len(second) > nodes
    expected = second.key
    del first, second
    for root, want in ((small, key), (large, expected), (small, key)):
        again = ext.walk([root], (), [one])
        assert again.key == want
        del again


def test_the_cache_compares_a_digest_match_in_full(monkeypatch):
    """The short path finds its plan by the key's digest; a plan whose key has the same digest but
    other bytes is never returned."""
    from gpuautograd.runtime.cache import Entry, PlanCache

    _use("native", monkeypatch)
    ext = native.load()
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    nw = ext.walk([(x * 2).sum()], (), [torch.tensor(1.0, dtype=torch.float64)])
    digest = ext.digest(nw.key)
    cache = PlanCache()
    mine, other = Entry(None, None), Entry(None, None)
    cache.put(("reference", True, "native", nw.key, (), ()), mine, limit=8)

    def get_native(backend, accumulate, walk=nw):
        return cache.get(walk.match(cache.by_digest, backend, accumulate, ()))

    assert get_native("reference", True) is mine
    # walk_lookup (the short path's one call) walks, finds the same key and reads its entry, which
    # becomes the most recently used, as PlanCache.get makes it
    cache.put(("reference", True, "native", b"newer", (), ()), other, limit=8)

    def walk_lookup(backends):
        return ext.walk_lookup([(x * 2).sum()], [torch.tensor(1.0, dtype=torch.float64)], cache.by_digest, cache.entries, backends, True)

    again, entry = walk_lookup(("reference", None))
    assert entry is mine and next(reversed(cache.entries)) == ("reference", True, "native", nw.key, (), ())
    assert get_native("reference", True, again) is mine
    assert walk_lookup(("interpret", None))[1] is None
    # a backend that can't run on the root's device (None) walks nothing: the general path says why
    assert walk_lookup((None, "reference")) == (None, None)
    assert get_native("reference", False) is None and get_native("interpret", True) is None
    # other keys under the same digest (collisions, forced): a flipped last byte, one byte fewer,
    # one more; only the matching bytes hit
    cache.clear()
    impostors = [("reference", True, "native", b, (), ()) for b in (nw.key[:-1] + bytes([nw.key[-1] ^ 1]), nw.key[:-1], nw.key + b"\0")]
    for impostor in impostors:
        cache.put(impostor, other, limit=8)
    cache.by_digest[digest] = list(impostors)
    assert get_native("reference", True) is None
    cache.put(("reference", True, "native", nw.key, (), ()), mine, limit=8)
    cache.by_digest[digest][:0] = impostors
    assert get_native("reference", True) is mine
    # eviction forgets the digest
    cache.put(("reference", True, "native", b"other", (), ()), other, limit=1)
    assert get_native("reference", True) is None and set(cache.entries) == {("reference", True, "native", b"other", (), ())}


@pytest.mark.parametrize("case", ["custom Function", "retained grad", "node hook"])
def test_a_hit_the_short_path_declines_walks_once(case, monkeypatch):
    """An opaque node, a retained gradient or a hook sends the backward down the general path,
    which goes on with the short path's walk: one native walk per backward, not two."""
    _use("native", monkeypatch)
    gpuautograd.reset()
    ext = native.load()
    walks = []

    def counted(real):
        def call(*args):
            walks.append(1)
            return real(*args)

        return call

    for name in ("walk", "walk_lookup"):  # walk_lookup: the short path's walk and lookup in one call
        monkeypatch.setattr(ext, name, counted(getattr(ext, name)))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def run(backward):
        x.grad = None
        h = torch.tanh(x * 1.5)
        if case == "custom Function":
            h = Double.apply(h)
        elif case == "retained grad":
            h.retain_grad()
        else:
            h.grad_fn.register_prehook(lambda grads: None)
        backward((h * h).sum())
        return x.grad.clone(), h.grad.clone() if h.grad is not None else None

    for k in range(3):
        expected = run(lambda loss: loss.backward())
        walks.clear()
        got = run(gpuautograd.backward)
        assert len(walks) == 1, f"backward {k} walked the graph {len(walks)} times"
        assert_close(got[0], expected[0])
        if expected[1] is not None:
            assert_close(got[1], expected[1])


def _native_only(monkeypatch):
    _use("native", monkeypatch)


def _eager_and_ours(make, leaves, monkeypatch):
    """Gradients and hook calls of eager and of gpuautograd.backward on two fresh graphs."""
    results = []
    for run in (lambda loss: loss.backward(), gpuautograd.backward):
        for p in leaves:
            p.grad = None
        calls = []
        run(make(calls))
        results.append(([p.grad.clone() for p in leaves], len(calls)))
    return results


@pytest.mark.parametrize("where", ["prehook", "hook"])
def test_a_hook_on_a_cpp_node_runs_at_its_yield_point_as_in_eager(where, monkeypatch):
    _native_only(monkeypatch)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def make(calls):
        y = torch.sin(x) * 2.0
        if where == "prehook":
            y.grad_fn.register_prehook(lambda gout: calls.append(1) or (gout[0] * 3,))
        else:
            y.grad_fn.register_hook(lambda gin, gout: calls.append(1) or (gin[0] * 3, *gin[1:]))
        return y.sum()

    (eager, n_eager), (ours, n_ours) = _eager_and_ours(make, [x], monkeypatch)
    assert n_eager == n_ours == 1
    assert_close(ours[0], eager[0])
    assert not gpuautograd.stats()["fallbacks"] and gpuautograd.stats()["captures"] == 1


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # x needs no grad here
def test_a_module_full_backward_hook_runs_at_its_yield_point_as_in_eager(monkeypatch):
    _native_only(monkeypatch)
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    seen = []
    lin.register_full_backward_pre_hook(lambda module, gout: seen.append(1) or (gout[0] * 2,))
    lin.register_full_backward_hook(lambda module, gin, gout: seen.append(2))

    def make(calls):
        seen.clear()
        return F.gelu(lin(x)).sum()

    results = []
    for run in (lambda loss: loss.backward(), gpuautograd.backward):
        lin.zero_grad(set_to_none=True)
        run(make(None))
        results.append(([p.grad.clone() for p in lin.parameters()], len(seen)))
    assert not gpuautograd.stats()["fallbacks"]
    (eager, n_eager), (ours, n_ours) = results
    for a, e in zip(ours, eager):
        assert_close(a, e)
    assert n_ours == n_eager == 2


def test_a_tensor_hook_registered_before_an_in_place_op_is_honored(monkeypatch):
    _native_only(monkeypatch)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def make(calls):
        y = x * 2.0
        y.register_hook(lambda g: calls.append(1) or g * 5)
        y.mul_(3.0)  # the hook stays on the node that produced y before the in-place op
        return y.sum()

    (eager, n_eager), (ours, n_ours) = _eager_and_ours(make, [x], monkeypatch)
    assert n_eager == n_ours == 1
    assert_close(ours[0], eager[0])
    assert not gpuautograd.stats()["fallbacks"]


@pytest.mark.parametrize("use_reentrant", [False])
def test_checkpointing_runs_opaque_and_recomputes_as_often_as_eager(use_reentrant, monkeypatch):
    _native_only(monkeypatch)
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)

    def make(calls):
        def block(h):
            calls.append(1)
            return torch.tanh(h @ w).sin()

        return checkpoint(block, x, use_reentrant=use_reentrant).sum()

    (eager, n_eager), (ours, n_ours) = _eager_and_ours(make, [w], monkeypatch)
    assert n_eager == n_ours == 2  # the forward, then one recomputation inside the backward
    assert_close(ours[0], eager[0])
    assert gpuautograd.stats()["fallbacks"] == {}


def test_a_sparse_leaf_falls_back_with_the_reason(monkeypatch):
    _native_only(monkeypatch)
    dense = torch.randn(4, 3, dtype=torch.float64)
    s = dense.to_sparse().requires_grad_()
    y = torch.randn(3, 2, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="layout"):
        gpuautograd.backward(torch.sparse.mm(s, y).sum())
    expected = torch.autograd.grad(torch.sparse.mm(s, y).sum(), [s])[0]
    assert_close(s.grad.to_dense(), expected.to_dense())


def test_the_python_walk_runs_with_the_extension_disabled(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        x.grad = None
        gpuautograd.backward((x.exp() * x).sum())
        assert_close(x.grad, (x.exp() * (1 + x)).detach())
    s = gpuautograd.stats()
    assert s["walker"] == "python" and s["cache_hits"] == 1


def test_the_flag_is_validated(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "yes")
    with pytest.raises(ValueError, match="GPUAUTOGRAD_NATIVE='yes'"):
        flags.native()


@pytest.fixture
def fresh_native_state(monkeypatch):
    """A native module state as before the first load, restored afterwards."""
    monkeypatch.setattr(native, "state", native.State())


def _failing_build():
    raise RuntimeError("the compiler exited with status 1\nmore output")


def test_a_failed_build_warns_once_and_the_python_walk_runs(fresh_native_state, monkeypatch):
    monkeypatch.delenv("GPUAUTOGRAD_NATIVE", raising=False)
    monkeypatch.setattr(native, "_compile_or_load", _failing_build)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"could not be built .*status 1.*Python walk runs instead.*slower.*hooks"):
        gpuautograd.backward((x * x).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        x.grad = None
        gpuautograd.backward((x * x).sum())
    assert_close(x.grad, 2 * x.detach())
    assert gpuautograd.stats()["walker"] == "python"


def test_a_failed_build_is_an_error_when_the_native_walker_is_required(fresh_native_state, monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "1")
    monkeypatch.setattr(native, "_compile_or_load", _failing_build)
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="GPUAUTOGRAD_NATIVE=1 but the native walker could not be built"):
        gpuautograd.backward((x * x).sum())


def test_no_compiler_is_a_named_reason(fresh_native_state, monkeypatch):
    monkeypatch.delenv("GPUAUTOGRAD_NATIVE", raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler .'no-such-compiler-here'. is on PATH"):
        assert native.load() is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_graph_falls_back_with_the_reason(monkeypatch):
    _native_only(monkeypatch)
    nt = torch.nested.nested_tensor([torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)], requires_grad=True)

    def loss():
        return torch.cat([t.sum().reshape(1) for t in (nt * 2.0).sin().unbind()]).sum()

    with pytest.warns(RuntimeWarning, match="a nested tensor"):
        gpuautograd.backward(loss())
    ours = [g.clone() for g in nt.grad.unbind()]
    nt.grad = None
    loss().backward()
    for a, e in zip(ours, nt.grad.unbind()):
        assert_close(a, e)


def test_the_build_lives_in_a_cache_keyed_by_torch_and_the_source(monkeypatch):
    _native_only(monkeypatch)
    import os

    tag = native._tag()
    assert torch.__version__.replace("+", "_").replace(".", "_") in tag
    final = os.path.join(native.cache_root(), tag)
    assert any(f.startswith(f"gpuautograd_native_{tag}") for f in os.listdir(final))
    # a build in progress lives in a dot-directory renamed into place when done: none is left over
    assert not [d for d in os.listdir(native.cache_root()) if d.startswith(f".{tag}-")]


def test_explain_shows_the_yield_point_of_a_hook_the_native_walker_sees(monkeypatch):
    _native_only(monkeypatch)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = x.exp()
    y.grad_fn.register_prehook(lambda gout: None)
    report = gpuautograd.explain(y.sum())
    assert report.fallback_reason is None and "stage=pre" in str(report.program), report


def test_a_hook_on_an_accumulate_grad_node_runs_eagerly_with_the_reason(monkeypatch):
    """Hooks on a leaf's AccumulateGrad node itself (not on the leaf) are what DDP-like wrappers
    register in C++: outside the distributed planner, such a backward runs eagerly, and the hook runs."""
    _native_only(monkeypatch)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    calls = []
    y = x.exp()
    y.grad_fn.next_functions[0][0].register_hook(lambda gin, gout: calls.append(1))
    with pytest.warns(RuntimeWarning, match="hook is registered on autograd node torch::autograd::AccumulateGrad"):
        gpuautograd.backward(y.sum())
    assert calls == [1]
    assert_close(x.grad, x.detach().exp())


def test_saved_tensors_that_do_not_line_up_run_eagerly_with_the_reason(monkeypatch):
    _native_only(monkeypatch)
    from gpuautograd.capture import native_walk

    def mismatch(w, pw):
        raise RuntimeError("saved slot 0: the native walk's tensor 1 is not the Python walk's")

    monkeypatch.setattr(native_walk, "saved_permutation", mismatch)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="don't line up with the Python walk's .saved slot 0"):
        gpuautograd.backward((x.sin() * x).sum())
    assert_close(x.grad, (x.cos() * x + x.sin()).detach())
    x.grad = None
    gpuautograd.backward((x.sin() * x).sum())  # a hit of the cached fallback: warned once already
    assert_close(x.grad, (x.cos() * x + x.sin()).detach())
    assert sum(gpuautograd.stats()["fallbacks"].values()) == 2


def _native_or_skip():
    ext = native.load()
    if ext is None:
        pytest.skip(f"the native walker is unavailable: {native.reason()}")
    return ext


@pytest.mark.parametrize("name", sorted(SUITE))
def test_generated_readers_read_every_generated_node_of_the_suite(name):
    """Each node whose class Functions.h declares is read by its generated reader (not through
    compiled_args); the saved tensors' parity with the Python walk is checked above."""
    from gpuautograd.native import readers

    ext = _native_or_skip()
    with open(readers.header_path()) as f:
        readable, _ = readers.node_classes(f.read())
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name]()
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    nw = ext.walk([loss], [], [torch.ones_like(loss)])
    generated = sum(nw.node(i).name() in readable for i in range(len(nw)))
    assert generated > 0
    assert nw.read_by_readers == generated


def _global_state_from_torch() -> int:
    """global_state()'s answer, from the Python bindings api.py asks without the extension."""
    if torch.is_anomaly_enabled():
        return 1
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return 2
    if torch._C._are_functorch_transforms_active():
        return 3
    return 4 if torch._C._len_torch_dispatch_stack() or torch._C._autograd._profiler_enabled() else 0


def test_the_extensions_global_state_is_what_torchs_bindings_say():
    from torch.utils._python_dispatch import TorchDispatchMode

    ext = _native_or_skip()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen = {}

    out = torch.randn((), requires_grad=True) * 2

    def note(label):
        seen[label] = (ext.global_state(), _global_state_from_torch())
        # the short entry's one call makes the implicit gradient only where nothing rules it out
        assert (ext.loss_grad(out) is None) == (seen[label][0] != 0), label

    note("nothing")
    with torch.autograd.detect_anomaly(check_nan=False):
        note("anomaly")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        note("saved-tensor hooks")
    torch.func.vmap(lambda t: (note("vmap"), t)[1])(torch.ones(2))
    with Mode():
        note("dispatch mode")
    with torch.profiler.profile():
        note("profiler")
    assert seen == {
        "nothing": (0, 0),
        "anomaly": (1, 1),
        "saved-tensor hooks": (2, 2),
        "vmap": (3, 3),
        "dispatch mode": (4, 4),
        "profiler": (4, 4),
    }


def test_the_short_entrys_gradient_follows_the_native_flag(monkeypatch):
    """ext.loss_grad reads GPUAUTOGRAD_NATIVE as os.environ writes it: "0" (or a value the flag
    rejects, which the general path then reports) sends loss.backward() down the general path."""
    ext = _native_or_skip()
    out = torch.randn((), dtype=torch.float64, requires_grad=True) * 3
    for value, made in (("auto", True), ("1", True), ("0", False), ("sometimes", False)):
        monkeypatch.setenv("GPUAUTOGRAD_NATIVE", value)
        grad = ext.loss_grad(out)
        assert (grad is not None) == made, value
        if made:
            assert torch.equal(grad, torch.ones_like(out)) and grad.grad_fn is None
    monkeypatch.delenv("GPUAUTOGRAD_NATIVE")
    assert ext.loss_grad(out) is not None
    assert ext.loss_grad(torch.randn((), requires_grad=True).detach()) is None  # needs no gradient: torch's error, from the general path
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "sometimes")
    with pytest.raises(flags.FlagError, match="GPUAUTOGRAD_NATIVE"):
        gpuautograd.backward(out)


def test_the_extensions_implicit_gradient_is_torchs():
    from torch.overrides import TorchFunctionMode

    ext = _native_or_skip()

    def made(out):
        return torch.ones_like(out, memory_format=torch.preserve_format)

    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=torch.float64).to(dtype).requires_grad_()

    for out in (
        leaf(()) * 2,
        leaf((), dtype=torch.bfloat16) * 2,
        leaf(1, 1, dtype=torch.float64) * 2,
        leaf(1, 1, 1, 1).to(memory_format=torch.channels_last) * 2,
    ):
        grad, expected = ext.implicit_grad(out), made(out)
        assert (grad.dtype, grad.shape, grad.stride(), grad.device, grad.requires_grad) == (
            expected.dtype,
            expected.shape,
            expected.stride(),
            expected.device,
            expected.requires_grad,
        )
        assert torch.equal(grad, expected) and grad.grad_fn is None

    class Sub(torch.Tensor):
        pass

    complex_scalar = torch.randn((), dtype=torch.complex64, requires_grad=True) * 2
    declined = {
        "no grad": torch.ones(()),
        "two elements": leaf(2) * 2,
        "complex": complex_scalar,
        "a Parameter": nn.Parameter(torch.ones(())),
        "a subclass": (leaf(()) * 2).as_subclass(Sub),
    }
    assert {k: ext.implicit_grad(v) for k, v in declined.items()} == dict.fromkeys(declined)

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():  # torch's general path makes it, where the mode sees its ones_like
        assert ext.implicit_grad(leaf(()) * 2) is None
