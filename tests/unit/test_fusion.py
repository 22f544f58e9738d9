"""The fusion planner, the symbolic indexing and the memory planner (planning only, nothing runs)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import indexing as ix
from gpuautograd.runtime.memory import Interval, plan_memory


def _plan(loss):
    return gpuautograd.explain(loss, backend="interpret")


def test_contiguous_index_collapses_to_the_linear_variable():
    idx = ix.unravel(ix.var("xindex", 4096), (2, 32, 64))
    assert ix.offset(idx, (2, 32, 64), (2048, 64, 1)).code == "xindex"
    merged = ix.reshape_index(idx, (2, 32, 64), (64, 64))
    assert ix.offset(merged, (64, 64), (64, 1)).code == "xindex"
    # a transpose can't collapse; a broadcast drops the expanded dim
    assert ix.offset(ix.permute_index(merged, (1, 0)), (64, 64), (64, 1)).code == "(xindex % 64) * 64 + xindex // 64"
    assert ix.offset(ix.expand_index(idx, (2, 32, 64), (2, 32, 1)), (2, 32, 1), (32, 1, 1)).code == "xindex // 64"


def test_reshape_index_matches_torch_on_odd_shapes():
    out_shape, in_shape = (3, 5, 7), (15, 7)
    flat = torch.arange(105).reshape(in_shape)
    view = flat.reshape(out_shape)
    for lin in (0, 1, 17, 104):
        out_index = [ix.const(int(i)) for i in torch.unravel_index(torch.tensor(lin), out_shape)]
        in_index = ix.reshape_index(out_index, out_shape, in_shape)
        values = [eval(i.code) for i in in_index]  # constants fold to plain integers
        assert flat[tuple(values)] == view.reshape(-1)[lin]


def test_softmax_backward_is_one_row_persistent_kernel():
    x = torch.randn(33, 65, requires_grad=True)
    e = _plan((F.softmax(x, -1) * torch.randn(33, 65)).sum())
    reductions = [k for k in e.kernels if k.space.startswith("reduce")]
    assert len(reductions) == 1 and len(e.kernels) <= 2, e.plan


def test_layer_norm_backward_is_at_most_two_kernels():
    x = torch.randn(7, 13, 48, requires_grad=True)
    ln = torch.nn.LayerNorm(48)
    e = _plan((ln(x) * torch.randn(7, 13, 48)).sum())
    assert len(e.kernels) <= 2 + 1, e.plan  # rows kernel, columns kernel, and the loss's own broadcast
    assert e.launches < sum(1 for _ in e.program.instrs)


def test_launches_count_kernels_and_library_calls():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    e = _plan(torch.tanh(lin(x)).sum())
    library = sum(1 for line in e.plan.splitlines() if "# library:" in line)
    matmuls = [k for k in e.kernels if k.space.startswith("matmul[")]
    assert e.launches == len(e.kernels) + library
    # the weight gradient's matmul (the input needs no gradient): at this size the cost model
    # generates it, computing tanh's backward as it loads it, so it is a kernel, not a library call
    assert library + len(matmuls) == 1 and e.launches == 2, e.plan


def test_decisions_name_what_was_not_fused_and_why():
    x = torch.randn(6, 6, requires_grad=True)
    e = _plan((torch.cumsum(x, 0) * x).sum())
    assert any(d.startswith("not fused:") and "cumsum" in d and "scan op" in d for d in e.decisions), e.decisions


def test_memory_planner_reuses_dead_buffers():
    # a -> b -> c chain: c can take a's place once a is dead; b overlaps both
    plan = plan_memory([Interval("a", 1000, 0, 1), Interval("b", 1000, 1, 2), Interval("c", 1000, 2, 3)])
    assert plan.offsets["c"] == plan.offsets["a"]
    assert plan.offsets["b"] != plan.offsets["a"]
    assert plan.arena_bytes == 2 * 1024 and plan.total_bytes == 3 * 1024


def test_memory_planner_never_overlaps_live_buffers():
    g = torch.Generator().manual_seed(0)
    intervals = []
    for k in range(60):
        start, size, length = (int(torch.randint(0, hi, (), generator=g)) for hi in (40, 5000, 10))
        intervals.append(Interval(str(k), size + 1, start, start + length))
    plan = plan_memory(intervals)
    for a in intervals:
        for b in intervals:
            if a is b or a.end < b.start or b.end < a.start:
                continue
            a0, b0 = plan.offsets[a.key], plan.offsets[b.key]
            assert a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0, (a, b)
    assert plan.arena_bytes <= plan.total_bytes


def test_planned_arena_of_a_model_is_smaller_than_all_intermediates():
    from bench.models import SUITE

    model, make_batch, loss_fn = SUITE["gpt"]()
    e = _plan(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))))
    assert 0 < e.arena_bytes < e.intermediate_bytes
    assert f"arena {e.arena_bytes} bytes" in e.memory and f"of {e.intermediate_bytes} bytes" in e.memory  # the same numbers


def test_the_fused_plan_frees_every_saved_tensor_after_its_last_reader():
    from bench.models import SUITE

    model, make_batch, loss_fn = SUITE["llama"]()
    e = _plan(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))))
    lines = e.plan.splitlines()
    deleted = {name.strip() for line in lines if line.strip().startswith("del ") for name in line.strip()[4:].split(",")}
    saved = [v.name[1:] for v, spec in e.program.inputs if spec.kind == "saved"]
    assert saved and set(saved) <= deleted
    for name in saved:  # deleted right after the last line that reads it
        reads = re.compile(rf"\b{name}\b")
        last_read = max(
            k for k, line in enumerate(lines) if not line.strip().startswith(("#", "del")) and reads.search(line.split("  #")[0])
        )
        follow = lines[last_read + 1].strip()
        assert follow.startswith("del ") and name in follow[4:].replace(",", " ").split(), (name, lines[last_read], follow)
