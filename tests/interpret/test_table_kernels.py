"""The pointer-table kernels (gpuautograd.triton_kernels) in Triton's interpreter, on CPU tensors.

TableCopy: bit-exact copies of every word size, from and to strided tensors, several entries of
mixed sizes in one call, the grid-stride loop, both the 16-byte-aligned and the unaligned path,
and rebinding (the same object, called after the table changed, follows the new addresses: the
property that lets a captured CUDA graph replay on new tensors with no copy of its own).
TableMatmul: mm and bmm with table and static operands mixed, transposed and offset operands,
odd sizes, K = 0, and rebinding; fp32 against torch.mm, bf16/fp16 against the exact product of the
same inputs, each within the error bound of tests/table_helpers.assert_matmul_close.
"""

from __future__ import annotations

import pytest
import torch

from gpuautograd.triton_kernels import TableCopy, TableMatmul, matmul_strides, span
from tests.table_helpers import assert_bits_equal, assert_matmul_close, bits, table_of, values

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def layouts(dtype):
    """Layout name -> tensor, over fresh storage each time."""
    base = values((40, 70), dtype, seed=1)
    return {
        "contiguous_7x13": values((7, 13), dtype),
        "contiguous_33x65": values((33, 65), dtype, seed=2),
        "transposed": values((65, 33), dtype, seed=3).t(),
        "slice_with_offset": base[2:9, 3:16],  # storage offset 143, row stride 70: gaps between rows
        "expanded": values((13,), dtype, seed=4).expand(7, 13),
    }


# -- TableCopy ----------------------------------------------------------------------------------


def test_span_counts_the_elements_between_first_and_last():
    x = torch.empty(40, 70)
    assert span(x) == 2800
    assert span(x.t()) == 2800
    assert span(x[2:9, 3:16]) == 6 * 70 + 13
    assert span(torch.empty(13).expand(7, 13)) == 13
    assert span(x[:, :0]) == 0
    assert span(x[5]) == 70


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous_7x13", "contiguous_33x65", "transposed", "slice_with_offset", "expanded"])
def test_copy_in_is_bit_exact_for_every_layout(dtype, layout):
    src = layouts(dtype)[layout]
    n = span(src)
    static = torch.zeros(n + 5, dtype=dtype)  # longer than needed: the words past n must stay
    TableCopy(table_of(src), [(1, static, n)], "in", interpret=True)()
    assert_bits_equal(torch.as_strided(static, src.shape, src.stride()), src, layout)
    assert_bits_equal(static[:n], torch.as_strided(src, (n,), (1,)), f"{layout}: the whole span, gaps included")
    assert not bits(static[n:]).any(), f"{layout}: words past n_elems were written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous_33x65", "transposed", "slice_with_offset"])
def test_copy_out_is_bit_exact_and_writes_the_span(dtype, layout):
    dst = layouts(dtype)[layout]
    n = span(dst)
    around = torch.as_strided(dst, (n + 1,), (1,)) if layout == "slice_with_offset" else None
    after_span = None if around is None else around[n:].clone()  # the word right after the span: not ours
    static = values((n,), dtype, seed=9)
    TableCopy(table_of(dst), [(1, static, n)], "out", interpret=True)()
    assert_bits_equal(dst, torch.as_strided(static, dst.shape, dst.stride()), layout)
    if around is not None:
        # documented: the gaps between the rows of a slice get the static buffer's words too
        assert_bits_equal(around[:n], static, "the span, gaps included")
        assert_bits_equal(around[n:], after_span, "past the span nothing changed")


def test_the_aligned_and_unaligned_paths_both_copy():
    base = values((1000,), torch.float32)
    for offset in (0, 1, 2, 3, 4):  # 16-byte aligned at 0 and 4, unaligned between
        src = base[offset : offset + 900]
        assert (src.data_ptr() % 16 == 0) == (offset % 4 == 0)
        static = torch.zeros(900)
        TableCopy(table_of(src), [(1, static, 900)], "in", interpret=True, chunk_bytes=64)()
        assert_bits_equal(static, src, f"offset {offset}")


def test_several_entries_of_mixed_sizes_in_one_call():
    dyn = [values((33, 65), torch.float32), values((7, 13), torch.bfloat16).t(), values((5, 3), torch.int64), values((300,), torch.bool)]
    dyn += [values((2, 9), torch.float32, seed=5), values((0,), torch.bfloat16)]  # a second 4-byte entry, an empty one
    statics = [torch.zeros(span(t), dtype=t.dtype) for t in dyn]
    copy = TableCopy(table_of(*dyn), [(k + 1, s, span(t)) for k, (t, s) in enumerate(zip(dyn, statics))], "in", interpret=True)
    assert [(grid[0], options["WORD"].primitive_bitwidth) for grid, _, options in copy.launches] == [(1, 8), (2, 16), (2, 32), (1, 64)]
    copy()
    for t, s in zip(dyn, statics):
        assert_bits_equal(torch.as_strided(s, t.shape, t.stride()), t, str(t.dtype))


def test_grid_stride_loop_covers_entries_longer_than_the_grid():
    src = [values((1000,), torch.int64, seed=1), values((37,), torch.int64, seed=2), values((999,), torch.bfloat16, seed=3)]
    statics = [torch.zeros(t.numel(), dtype=t.dtype) for t in src]
    # 8-word chunks, at most 3 programs per entry: the 1000-word entry takes 125 chunks, 42 per program
    entries = [(k + 1, s, s.numel()) for k, s in enumerate(statics)]
    copy = TableCopy(table_of(*src), entries, "in", interpret=True, chunk_bytes=64, max_chunk_programs=3)
    assert all(grid[1] == 3 for grid, _, _ in copy.launches)
    copy()
    for t, s in zip(src, statics):
        assert_bits_equal(s, t)


@pytest.mark.parametrize("direction", ["in", "out"])
def test_rebinding_the_table_redirects_the_copy(direction):
    first, second = values((33, 65), torch.bfloat16, seed=1), values((65, 33), torch.bfloat16, seed=2).t()
    assert first.stride() != second.stride() and span(first) == span(second)
    table = table_of(first)
    static = torch.zeros(span(first), dtype=torch.bfloat16)
    copy = TableCopy(table, [(1, static, span(first))], direction, interpret=True)
    if direction == "in":
        copy()
        assert_bits_equal(static.view(33, 65), first)
        table[1] = second.data_ptr()  # the only change: the table's slot
        copy()
        assert_bits_equal(torch.as_strided(static, second.shape, second.stride()), second)
    else:
        kept = second.clone()
        static.copy_(values((span(first),), torch.bfloat16, seed=3))
        copy()
        assert_bits_equal(first, static.view(33, 65))
        assert_bits_equal(second, kept, "not yet bound: untouched")
        first_after = first.clone()
        static.copy_(values((span(first),), torch.bfloat16, seed=4))
        table[1] = second.data_ptr()
        copy()
        assert_bits_equal(second, torch.as_strided(static, second.shape, second.stride()))
        assert_bits_equal(first, first_after, "unbound: untouched")


def test_copy_rejects_bad_arguments_with_context():
    static = torch.zeros(10)
    table = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        TableCopy(table.int(), [(0, static, 10)], "in", interpret=True)
    with pytest.raises(ValueError, match="slot must be an int in"):
        TableCopy(table, [(3, static, 10)], "in", interpret=True)
    with pytest.raises(ValueError, match="n_elems=11"):
        TableCopy(table, [(0, static, 11)], "in", interpret=True)
    with pytest.raises(ValueError, match="1-D contiguous"):
        TableCopy(table, [(0, torch.zeros(4, 5).t(), 20)], "in", interpret=True)
    with pytest.raises(ValueError, match="element size 16"):
        TableCopy(table, [(0, torch.zeros(4, dtype=torch.complex128), 4)], "in", interpret=True)
    with pytest.raises(ValueError, match="direction"):
        TableCopy(table, [(0, static, 10)], "sideways", interpret=True)
    with pytest.raises(ValueError, match="CUDA tensors"):
        TableCopy(table, [(0, static, 10)], "in", interpret=False)


# -- TableMatmul --------------------------------------------------------------------------------


def operand(kind: str, t: torch.Tensor, slot: int):
    return ("slot", slot) if kind == "slot" else ("static", t)


MM_CASES = {
    # name: (M, N, K, A transposed, B transposed, kinds of A, B, C, operands start one element into their storage)
    "all_slots_7x13x5": (7, 5, 13, False, False, ("slot", "slot", "slot"), False),
    "static_b_33x65x17": (33, 17, 65, False, False, ("slot", "static", "slot"), False),
    "transposed_a_static_c": (33, 65, 17, True, False, ("slot", "slot", "static"), False),
    "transposed_b_static_a": (17, 33, 65, False, True, ("static", "slot", "slot"), False),
    "both_transposed_even_k": (20, 24, 32, True, True, ("slot", "slot", "slot"), False),
    "all_static": (9, 11, 40, True, False, ("static", "static", "static"), False),
    "unaligned_slots": (33, 17, 40, False, True, ("slot", "slot", "slot"), True),
    "unaligned_static_a": (17, 33, 65, True, False, ("static", "slot", "slot"), True),
}


def matrix(rows: int, cols: int, dtype, transposed: bool, seed: int, offset: bool = False) -> torch.Tensor:
    """A rows x cols matrix, stored transposed if asked, starting one element into its storage
    (so not 16-byte aligned: the kernel's unaligned path) if `offset`."""
    g = torch.Generator().manual_seed(seed)
    shape = (cols, rows) if transposed else (rows, cols)
    storage = torch.randn(rows * cols + offset, generator=g).to(dtype)
    t = storage[int(offset) :].view(shape)
    return t.t() if transposed else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(MM_CASES))
def test_mm_matches_torch(case, dtype):
    m, n, k, a_t, b_t, kinds, offset = MM_CASES[case]
    a, b = matrix(m, k, dtype, a_t, 1, offset), matrix(k, n, dtype, b_t, 2, offset)
    c = matrix(m, n, dtype, False, 3, offset).fill_(float("nan"))
    assert all((t.data_ptr() % 16 != 0) == offset for t in (a, b, c))
    table = table_of(a, b, c)
    specs = [operand(kind, t, slot) for kind, t, slot in zip(kinds, (a, b, c), (1, 2, 3))]
    mm = TableMatmul(table, *specs, (1, m, n, k), (matmul_strides(a), matmul_strides(b), matmul_strides(c)), dtype, interpret=True)
    assert mm.options["K"] % mm.options["BLOCK_K"] == (0 if case == "both_transposed_even_k" else k % 16)
    mm()
    assert_matmul_close(c, a, b, case)


def test_bmm_with_a_shared_static_weight_and_offset_operands():
    batch, m, n, k = 3, 7, 5, 37
    big = torch.randn(batch, m + 1, k)
    a = big[:, 1:, :]  # storage offset 37 floats (148 bytes): not 16-byte aligned, the unaligned path
    assert a.data_ptr() % 16 != 0
    w = torch.randn(n, k).t()  # (k, n), transposed
    c = torch.zeros(batch, m, n)
    strides = (matmul_strides(a), (0, *w.stride()), matmul_strides(c))  # B's batch stride 0: one weight for all
    mm = TableMatmul(table_of(a, c), ("slot", 1), ("static", w), ("slot", 2), (batch, m, n, k), strides, torch.float32, interpret=True)
    mm()
    assert_matmul_close(c, a, w.expand(batch, k, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bmm_all_slots(dtype):
    a = torch.randn(4, 33, 20).to(dtype)
    b = torch.randn(4, 17, 20).to(dtype).transpose(1, 2)  # (4, 20, 17)
    c = torch.empty(4, 33, 17, dtype=dtype)
    mm = TableMatmul(
        table_of(a, b, c), ("slot", 1), ("slot", 2), ("slot", 3), (4, 33, 17, 20), tuple(map(matmul_strides, (a, b, c))), dtype, True
    )
    mm()
    assert_matmul_close(c, a, b)


def test_matmul_rebinding_follows_the_table():
    m, n, k = 33, 17, 65
    a1, b1, a2, b2 = (torch.randn(*s) for s in [(m, k), (k, n), (m, k), (k, n)])
    c1, c2 = torch.zeros(m, n), torch.zeros(m, n)
    table = table_of(a1, b1, c1)
    mm = TableMatmul(table, ("slot", 1), ("slot", 2), ("slot", 3), (1, m, n, k), ((0, k, 1), (0, n, 1), (0, n, 1)), torch.float32, True)
    mm()
    assert_matmul_close(c1, a1, b1)
    first = c1.clone()
    table[1:] = torch.tensor([a2.data_ptr(), b2.data_ptr(), c2.data_ptr()])
    mm()
    assert_matmul_close(c2, a2, b2)
    assert torch.equal(c1, first), "the previous output must not be written after rebinding"


def test_matmul_with_empty_k_writes_zeros():
    c = torch.full((3, 4), float("nan"))
    a, b = torch.empty(3, 0), torch.empty(0, 4)
    strides = ((0, 0, 1), (0, 4, 1), (0, 4, 1))
    TableMatmul(table_of(a, b), ("slot", 1), ("slot", 2), ("static", c), (1, 3, 4, 0), strides, torch.float32, interpret=True)()
    assert torch.equal(c, torch.zeros(3, 4))


def test_matmul_rejects_bad_arguments_with_context():
    table = torch.zeros(4, dtype=torch.int64)
    strides = ((0, 4, 1), (0, 4, 1), (0, 4, 1))
    ok = dict(shape=(1, 4, 4, 4), strides=strides, dtype=torch.float32, interpret=True)
    with pytest.raises(ValueError, match="float64 is not supported"):
        TableMatmul(table, ("slot", 0), ("slot", 1), ("slot", 2), **{**ok, "dtype": torch.float64})
    with pytest.raises(ValueError, match="operand B must be"):
        TableMatmul(table, ("slot", 0), ("pointer", 1), ("slot", 2), **ok)
    with pytest.raises(ValueError, match="slot 9 is not an index"):
        TableMatmul(table, ("slot", 0), ("slot", 9), ("slot", 2), **ok)
    with pytest.raises(ValueError, match="past its storage"):
        TableMatmul(table, ("static", torch.zeros(15)), ("slot", 1), ("slot", 2), **ok)
    with pytest.raises(ValueError, match="must be a torch.float32 tensor"):
        TableMatmul(table, ("static", torch.zeros(16, dtype=torch.float16)), ("slot", 1), ("slot", 2), **ok)
    with pytest.raises(ValueError, match="share one element"):
        TableMatmul(table, ("slot", 0), ("slot", 1), ("slot", 2), **{**ok, "strides": ((0, 4, 1), (0, 4, 1), (0, 0, 1))})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the command times the full shape set instead")
def test_extern_binding_bench_checks_both_paths_without_cuda(tmp_path, capsys):
    import json

    from bench.extern_binding import main

    assert main(["--out", str(tmp_path)]) == 0
    assert "timing needs CUDA" in capsys.readouterr().out
    written = json.loads((tmp_path / "extern_binding.json").read_text())
    assert written["meta"]["timed"] is False and written["results"] == []
    assert {(r["product"], r["dtype"]) for r in written["checks"]} == {
        (p, d) for p in ("x@W", "dY@W^T", "X^T@dY") for d in ("float32", "bfloat16")
    }
    assert all(r["static_check"]["ok"] and r["table_check"]["ok"] for r in written["checks"])
