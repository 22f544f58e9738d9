"""Matmul and batched matmul whose operands' base pointers come from a pointer table or fixed tensors.

`TableMatmul` computes C = A @ B (per batch entry) for A (M x K), B (K x N), C (M x N), each
operand either `("slot", i)`, its base address read from the table's slot i when the kernel runs,
or `("static", tensor)`, a fixed tensor. Shapes, strides and dtype are fixed at construction and
every launch argument stays the same, so a call can be captured in a CUDA graph and replayed
with the table pointing at new tensors: a replacement for a library matmul that needs no copy
into static buffers. fp32, fp16 and bf16; products accumulate in fp32 and C is stored in the
operands' dtype. fp32 uses exact fp32 products (`input_precision="ieee"`, no TF32), as
`torch.mm` does by default.

Alignment: a pointer made from a table entry has no alignment Triton can see, and without one it
loads a word per lane and does not pipeline the K loop through shared memory. So each slot
operand is addressed as an offset from a small aligned "anchor" tensor the kernel receives as
its pointer argument; when every operand's offset is a multiple of 16 bytes (checked in the
kernel on every call) the offsets carry that as a hint and the loop gets vectorized, pipelined
loads; otherwise the same loop runs without the hint. Both paths compute the same result.
"""

import torch
import triton.language as tl

from ._launch import launchable
from .table_copy import _check_table

# (BLOCK_M, BLOCK_N, BLOCK_K) per dtype on CUDA; first choices, not tuned on a GPU yet.
CUDA_BLOCKS = {torch.float32: (128, 128, 32), torch.float16: (128, 128, 64), torch.bfloat16: (128, 128, 64)}
CUDA_NUM_WARPS = 8
CUDA_NUM_STAGES = 3
GROUP_M = 8  # row tiles that walk the column tiles together, so B's tiles are reused from L2
INTERPRET_BLOCKS = (16, 16, 16)  # the interpreter runs each program in numpy: small tiles, many of them cheap
VECTOR_BYTES = 16
MAX_BATCH = 65535  # the batch is grid dim 1 (CUDA's gridDim.y limit)
INT32_LIMIT = 2**31
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_VECTOR_BYTES = tl.constexpr(VECTOR_BYTES)  # the kernel's view (Triton kernels read globals only as constexpr)


def table_matmul_kernel(
    table_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    a_slot,
    b_slot,
    c_slot,
    A_IN_TABLE: tl.constexpr,
    B_IN_TABLE: tl.constexpr,
    C_IN_TABLE: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    WIDEN_TO_FP32: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    SAB: tl.constexpr,
    SAM: tl.constexpr,
    SAK: tl.constexpr,
    SBB: tl.constexpr,
    SBK: tl.constexpr,
    SBN: tl.constexpr,
    SCB: tl.constexpr,
    SCM: tl.constexpr,
    SCN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Program (tile, batch) computes one BLOCK_M x BLOCK_N tile of C for one batch entry.
    a_ptr/b_ptr/c_ptr are the static operands, or the anchor for a slot operand."""
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    group_width = GROUP_M * grid_n
    first_m = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_rows
    pid_n = (pid % group_width) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if OFFSETS_64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
        rk = rk.to(tl.int64)
    # Element offsets of this batch entry's matrices from a_ptr/b_ptr/c_ptr. A slot's address minus
    # the anchor's is a whole number of elements: both are addresses of this dtype.
    batch = tl.program_id(1).to(tl.int64)
    a_off = batch * SAB
    b_off = batch * SBB
    c_off = batch * SCB
    if A_IN_TABLE:
        a_off += (tl.load(table_ptr + a_slot) - a_ptr.to(tl.int64)) // ELEM_BYTES
    if B_IN_TABLE:
        b_off += (tl.load(table_ptr + b_slot) - b_ptr.to(tl.int64)) // ELEM_BYTES
    if C_IN_TABLE:
        c_off += (tl.load(table_ptr + c_slot) - c_ptr.to(tl.int64)) // ELEM_BYTES
    row_ok = rm[:, None] < M
    col_ok = rn[None, :] < N
    # The two branches are the same loop. In the first every offset is a multiple of VEC elements
    # (16 bytes), and `(off // VEC) * VEC`, equal to `off` there, shows Triton that it is: it
    # vectorizes and pipelines the loads. (An alignment fact does not cross the branch, and
    # tl.multiple_of marks the op that computed a value, which canonicalization may fold away.)
    VEC: tl.constexpr = _VECTOR_BYTES // ELEM_BYTES
    if ((a_off | b_off | c_off) % VEC) == 0:
        a_tile = a_ptr + (a_off // VEC) * VEC + rm[:, None] * SAM + rk[None, :] * SAK
        b_tile = b_ptr + (b_off // VEC) * VEC + rk[:, None] * SBK + rn[None, :] * SBN
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for kt in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(a_tile, mask=row_ok, other=0.0)
                b = tl.load(b_tile, mask=col_ok, other=0.0)
            else:
                k_left = K - kt * BLOCK_K
                a = tl.load(a_tile, mask=row_ok & (rk[None, :] < k_left), other=0.0)
                b = tl.load(b_tile, mask=(rk[:, None] < k_left) & col_ok, other=0.0)
            if WIDEN_TO_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            a_tile += BLOCK_K * SAK
            b_tile += BLOCK_K * SBK
        c_tile = c_ptr + (c_off // VEC) * VEC + rm[:, None] * SCM + rn[None, :] * SCN
        tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=row_ok & col_ok)
    else:
        a_tile = a_ptr + a_off + rm[:, None] * SAM + rk[None, :] * SAK
        b_tile = b_ptr + b_off + rk[:, None] * SBK + rn[None, :] * SBN
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for kt in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(a_tile, mask=row_ok, other=0.0)
                b = tl.load(b_tile, mask=col_ok, other=0.0)
            else:
                k_left = K - kt * BLOCK_K
                a = tl.load(a_tile, mask=row_ok & (rk[None, :] < k_left), other=0.0)
                b = tl.load(b_tile, mask=(rk[:, None] < k_left) & col_ok, other=0.0)
            if WIDEN_TO_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            a_tile += BLOCK_K * SAK
            b_tile += BLOCK_K * SBK
        c_tile = c_ptr + c_off + rm[:, None] * SCM + rn[None, :] * SCN
        tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=row_ok & col_ok)


def matmul_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch stride, row stride, column stride) of a 2-D matrix (batch stride 0) or 3-D batch."""
    if t.dim() == 2:
        return (0, *t.stride())
    if t.dim() == 3:
        return tuple(t.stride())
    raise ValueError(f"matmul_strides: expected a 2-D or 3-D tensor, got shape {tuple(t.shape)}")


def matmul_plan(
    shape: tuple[int, int, int, int],
    strides: tuple[tuple[int, int, int], ...],
    dtype: torch.dtype,
    in_table: tuple[bool, bool, bool],
    interpret: bool,
    blocks: tuple[int, int, int] | None = None,
) -> tuple[tuple[int, int], dict]:
    """(grid, launch options) of one matmul: its constexprs, and num_warps/num_stages on CUDA."""
    batch, m, n, k = shape
    (sab, sam, sak), (sbb, sbk, sbn), (scb, scm, scn) = strides
    if m > 1 and n > 1 and (scm == 0 or scn == 0) or (batch > 1 and scb == 0):
        raise ValueError(f"TableMatmul: C's strides {strides[2]} make several results share one element")
    block_m, block_n, block_k = blocks or (INTERPRET_BLOCKS if interpret else CUDA_BLOCKS[dtype])
    # furthest offset a tile computes, masked lanes included: int32 offsets up to 2**31
    tile_reach = max(
        (m + block_m) * sam + (k + block_k) * sak, (k + block_k) * sbk + (n + block_n) * sbn, (m + block_m) * scm + (n + block_n) * scn
    )
    grid = (((m + block_m - 1) // block_m) * ((n + block_n - 1) // block_n), batch)
    options = dict(
        A_IN_TABLE=in_table[0],
        B_IN_TABLE=in_table[1],
        C_IN_TABLE=in_table[2],
        ELEM_BYTES=torch.empty((), dtype=dtype).element_size(),
        WIDEN_TO_FP32=interpret and dtype == torch.bfloat16,  # the interpreter's tl.dot multiplies bf16 bit patterns
        OFFSETS_64=tile_reach >= INT32_LIMIT,
        M=m,
        N=n,
        K=k,
        SAB=sab,
        SAM=sam,
        SAK=sak,
        SBB=sbb,
        SBK=sbk,
        SBN=sbn,
        SCB=scb,
        SCM=scm,
        SCN=scn,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
    )
    if not interpret:
        options.update(num_warps=CUDA_NUM_WARPS, num_stages=CUDA_NUM_STAGES)
    return grid, options


class TableMatmul:
    """C = A @ B, each operand `("slot", index)` (address read from the table) or
    `("static", tensor)`; `shape` is (batch, M, N, K); `strides` holds each operand's
    (batch stride, row stride, column stride) in elements, in the order A, B, C; `dtype` is
    float32, float16 or bfloat16 for all three. `blocks` overrides (BLOCK_M, BLOCK_N, BLOCK_K)."""

    def __init__(
        self,
        table: torch.Tensor,
        a: tuple,
        b: tuple,
        c: tuple,
        shape: tuple[int, int, int, int],
        strides: tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]],
        dtype: torch.dtype,
        interpret: bool = False,
        *,
        blocks: tuple[int, int, int] | None = None,
    ) -> None:
        _check_table(table, interpret, "TableMatmul")
        if dtype not in TL_DTYPES:
            raise ValueError(f"TableMatmul: dtype {dtype} is not supported (float32, float16, bfloat16)")
        if len(shape) != 4 or not all(isinstance(s, int) for s in shape):
            raise ValueError(f"TableMatmul: shape must be (batch, M, N, K) ints, got {shape}")
        batch, m, n, k = shape
        if batch < 1 or m < 1 or n < 1 or k < 0:
            raise ValueError(f"TableMatmul: shape (batch, M, N, K) = {shape} needs batch, M, N >= 1 and K >= 0")
        if batch > MAX_BATCH:
            raise ValueError(f"TableMatmul: batch {batch} is over {MAX_BATCH} (CUDA's grid limit on the batch dimension)")
        if len(strides) != 3 or any(len(s) != 3 or not all(isinstance(x, int) and x >= 0 for x in s) for s in strides):
            raise ValueError(f"TableMatmul: strides must be three (batch, row, column) triples of ints >= 0, got {strides}")
        self.table, self.shape, self.strides, self.dtype, self.interpret = table, shape, strides, dtype, interpret
        esize = torch.empty((), dtype=dtype).element_size()
        # The pointer argument of every slot operand: 16 aligned bytes of the dtype, never read.
        self.anchor = torch.empty(VECTOR_BYTES // esize, dtype=dtype, device=table.device)
        dims = {"A": (m, k), "B": (k, n), "C": (m, n)}
        operands = [self._operand(name, spec, dims[name], s) for name, spec, s in zip("ABC", (a, b, c), strides)]
        self.grid, self.options = matmul_plan(shape, strides, dtype, tuple(slot >= 0 for _, slot in operands), interpret, blocks)
        self.args = (table, *(ptr for ptr, _ in operands), *(slot for _, slot in operands))
        self._kernel = launchable(table_matmul_kernel, interpret)

    def _operand(self, name: str, spec, dims: tuple[int, int], strides: tuple[int, int, int]) -> tuple[torch.Tensor, int]:
        """(pointer argument, table slot or -1) of one operand."""
        if not isinstance(spec, tuple) or len(spec) != 2 or spec[0] not in ("slot", "static"):
            raise ValueError(f"TableMatmul: operand {name} must be ('slot', index) or ('static', tensor), got {spec!r}")
        kind, value = spec
        if kind == "slot":
            if not isinstance(value, int) or not 0 <= value < self.table.numel():
                raise ValueError(f"TableMatmul: operand {name}'s slot {value!r} is not an index of the table (length {self.table.numel()})")
            return self.anchor, value
        t = value
        if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or t.device != self.table.device:
            got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"TableMatmul: static operand {name} must be a {self.dtype} tensor on {self.table.device}, got {got}")
        reach = (self.shape[0] - 1) * strides[0] + (dims[0] - 1) * strides[1] + (dims[1] - 1) * strides[2]
        available = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
        if min(dims) > 0 and reach >= available:
            raise ValueError(
                f"TableMatmul: static operand {name} with strides {strides} over {self.shape[0]} x {dims} reaches element {reach} "
                f"from its start, past its storage ({available} elements)"
            )
        return t, -1

    def __call__(self) -> None:
        """One launch; no allocation, host read or sync, so it can be captured in a CUDA graph."""
        self._kernel[self.grid](*self.args, **self.options)
