"""GPU tier for the pointer-table kernels: captured once in a CUDA graph, replayed with the table
pointing at new tensors before each replay (skipped without CUDA).

What replay must show: the graph's launches read the addresses the table holds at replay time,
not at capture time, so every replay works on the tensors just bound, new allocations, strided
views and unaligned offsets included, while the tensors bound before are left alone.
"""

from __future__ import annotations

import pytest
import torch

from bench.extern_binding import capture
from gpuautograd.triton_kernels import TableCopy, TableMatmul, matmul_strides, span
from tests.table_helpers import addresses, assert_bits_equal, assert_matmul_close, table_of, values

DEVICE = "cuda"
ROUNDS = 3


def bind(table: torch.Tensor, *tensors: torch.Tensor) -> None:
    """The one host-to-device copy before a replay."""
    table.copy_(torch.tensor(addresses(*tensors), dtype=torch.int64))


def copy_sources(seed: int, unaligned: bool) -> list[torch.Tensor]:
    """One tensor per word size, strided and offset ones among them; fresh storage every call."""
    shift = 1 if unaligned else 0
    wide = values((40, 70), torch.int64, seed, DEVICE)
    return [
        values((33 * 65 + 1,), torch.float32, seed, DEVICE)[shift : shift + 33 * 65].view(33, 65),
        values((65, 33), torch.bfloat16, seed + 1, DEVICE).t(),
        values((3001,), torch.bool, seed + 2, DEVICE)[shift : shift + 3000],
        wide[2:9, 3:16],
    ]


def test_table_copy_in_and_out_replay_on_rebound_tensors():
    first = copy_sources(0, unaligned=False)
    statics = [torch.zeros(span(t), dtype=t.dtype, device=DEVICE) for t in first]
    outputs = [values((span(t),), t.dtype, 50 + k, DEVICE) for k, t in enumerate(first)]  # static -> dynamic
    n_in = len(first)
    first_destinations = [torch.empty_like(o) for o in outputs]  # alive while the warm-up call writes them
    table = table_of(*first, *first_destinations)
    copy_in = TableCopy(table, [(k + 1, s, s.numel()) for k, s in enumerate(statics)], "in")
    copy_out = TableCopy(table, [(n_in + k + 1, o, o.numel()) for k, o in enumerate(outputs)], "out")
    graph = capture(lambda: (copy_in(), copy_out()), 1)
    previous = None
    for round_ in range(ROUNDS):
        sources = copy_sources(10 * (round_ + 1), unaligned=round_ == 1)
        destinations = [torch.full_like(o, 0) for o in outputs]
        bind(table, *sources, *destinations)
        graph.replay()
        torch.cuda.synchronize()
        for src, static in zip(sources, statics):
            assert_bits_equal(torch.as_strided(static, src.shape, src.stride()), src, f"round {round_}: in, {src.dtype}")
        for dst, static in zip(destinations, outputs):
            assert_bits_equal(dst, static, f"round {round_}: out, {dst.dtype}")
        for dst, kept in previous or []:
            assert_bits_equal(dst, kept, f"round {round_}: a tensor bound before was written")
        previous = [(d, d.clone()) for d in destinations]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_table_matmul_replays_on_rebound_tensors(dtype, batch):
    m, n, k = 257, 129, 200

    def operands(seed: int, unaligned: bool):
        """A and C start one element into their storage when `unaligned` (sliced on the GPU, where
        the offset stays)."""
        g = torch.Generator().manual_seed(seed)
        shift = 1 if unaligned else 0
        a = torch.randn(batch * m * k + 1, generator=g).to(dtype).to(DEVICE)[shift : shift + batch * m * k].view(batch, m, k)
        b = torch.randn(batch, n, k, generator=g).to(dtype).to(DEVICE).transpose(1, 2)  # (batch, k, n), transposed
        c = torch.full((batch * m * n + 1,), float("nan"), dtype=dtype, device=DEVICE)[shift : shift + batch * m * n].view(batch, m, n)
        assert (a.data_ptr() % 16 != 0) == unaligned
        return a, b, c

    a, b, c = operands(0, False)
    table = table_of(a, b, c)
    mm = TableMatmul(table, ("slot", 1), ("slot", 2), ("slot", 3), (batch, m, n, k), tuple(map(matmul_strides, (a, b, c))), dtype)
    graph = capture(mm, 1)
    for round_ in range(ROUNDS):
        a, b, c = operands(round_ + 1, unaligned=round_ == 1)  # round 1 takes the kernel's unaligned path
        bind(table, a, b, c)
        graph.replay()
        torch.cuda.synchronize()
        assert_matmul_close(c, a, b, f"round {round_}")


def test_static_operands_and_table_operands_mix_in_a_replayed_graph():
    m, n, k = 300, 96, 130
    weight = torch.randn(n, k, device=DEVICE).t()  # static B (k, n), transposed, as a linear layer's weight
    out = torch.empty(m, n, device=DEVICE)  # static C
    x = torch.randn(m, k, device=DEVICE)
    table = table_of(x)
    strides = (matmul_strides(x), matmul_strides(weight), matmul_strides(out))
    mm = TableMatmul(table, ("slot", 1), ("static", weight), ("static", out), (1, m, n, k), strides, torch.float32)
    graph = capture(mm, 1)
    for round_ in range(ROUNDS):
        x = torch.randn(m, k, device=DEVICE)
        bind(table, x)
        graph.replay()
        torch.cuda.synchronize()
        assert_matmul_close(out, x, weight, f"round {round_}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_copy_in_library_matmul_copy_out_replays(dtype):
    """The static-buffer path: copy A and B in, torch.mm (cuBLAS) on the static buffers, copy C out."""
    m, n, k = 513, 257, 96

    def operands(seed: int):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(k, m, generator=g).to(dtype).t()  # transposed view: copied as its span, viewed back
        b = torch.randn(k, n, generator=g).to(dtype)
        return a.to(DEVICE), b.to(DEVICE), torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)

    a, b, c = operands(0)
    a_static = torch.empty(span(a), dtype=dtype, device=DEVICE)
    b_static = torch.empty(span(b), dtype=dtype, device=DEVICE)
    c_static = torch.empty(m * n, dtype=dtype, device=DEVICE)
    a_view, b_view = torch.as_strided(a_static, a.shape, a.stride()), torch.as_strided(b_static, b.shape, b.stride())
    table = table_of(a, b, c)
    copy_in = TableCopy(table, [(1, a_static, span(a)), (2, b_static, span(b))], "in")
    copy_out = TableCopy(table, [(3, c_static, m * n)], "out")

    def step():
        copy_in()
        torch.mm(a_view, b_view, out=c_static.view(m, n))
        copy_out()

    graph = capture(step, 1)
    for round_ in range(ROUNDS):
        a, b, c = operands(round_ + 1)
        bind(table, a, b, c)
        graph.replay()
        torch.cuda.synchronize()
        assert_matmul_close(c, a, b, f"round {round_}")
