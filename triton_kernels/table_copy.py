"""Multi-tensor copy between table-addressed tensors and static buffers, for CUDA-graph replay.

A library call inside a captured graph (cuBLAS matmul) reads fixed addresses, but the tensors it
should read change address on every call. `TableCopy` bridges the two: with direction "in" it
copies each dynamic tensor, whose address sits in a slot of the pointer table, into a static
buffer the library call reads; with "out" it copies a static buffer (the library call's output)
to the dynamic tensor the table names. Every launch argument is fixed at construction (the table,
a descriptor tensor), so `__call__` can be captured in a `torch.cuda.graph` and replayed after the
table was refreshed with new addresses.

Elements are copied as raw words of their size (int8/16/32/64), bit-exact for every dtype,
bool and bf16 included. A strided source is copied as its whole span (`span(t)` elements from its
first element's address); the caller views the static buffer with the source's strides,
`torch.as_strided(static, t.size(), t.stride())`. With direction "out" the whole span is written
too, so a destination with gaps between its elements (a slice of a wider tensor) gets the static
buffer's words there: use "out" only on destinations that own their span (contiguous, or a
permutation of a contiguous tensor, such as a transposed view).
"""

import torch
import triton.language as tl

from ._launch import launchable

COPY_CHUNK_BYTES = 8192  # bytes one program copies per step: 64 per thread at 4 warps, four 16-byte vectors
COPY_NUM_WARPS = 4
# Cap of the grid's second dimension (CUDA allows 65535): programs loop over the chunks beyond it,
# so a huge entry needs no huge grid.
MAX_CHUNK_PROGRAMS = 1024
# The interpreter runs each program in Python, and numpy copies a large chunk as fast as a small
# one: large chunks, few programs. (The tests pass small `chunk_bytes` to cover the grid-stride loop.)
INTERPRET_COPY_CHUNK_BYTES = 16384
INTERPRET_MAX_CHUNK_PROGRAMS = 4
MAX_GRID_DIM1 = 65535  # CUDA's limit on gridDim.y
VECTOR_BYTES = 16  # width of the vectorized loads of the aligned path
DESCRIPTOR_FIELDS = 3  # per entry: table slot, static buffer's address, elements to copy
WORD_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
# the kernel's view of the constants above (Triton kernels read globals only as constexpr)
_VECTOR_BYTES = tl.constexpr(VECTOR_BYTES)
_DESCRIPTOR_FIELDS = tl.constexpr(DESCRIPTOR_FIELDS)


def table_copy_kernel(table_ptr, desc_ptr, WORD: tl.constexpr, TO_STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """Program (entry, p) copies the full chunks p, p + P, p + 2P, ... of its entry (P programs on
    grid dim 1); program (entry, 0) also copies the masked tail chunk."""
    entry = tl.program_id(0)
    slot = tl.load(desc_ptr + entry * _DESCRIPTOR_FIELDS)
    static_addr = tl.load(desc_ptr + entry * _DESCRIPTOR_FIELDS + 1)
    n = tl.load(desc_ptr + entry * _DESCRIPTOR_FIELDS + 2)
    dynamic_addr = tl.load(table_ptr + slot)
    if TO_STATIC:
        src_addr = dynamic_addr
        dst_addr = static_addr
    else:
        src_addr = static_addr
        dst_addr = dynamic_addr
    # A pointer made from an integer has no known alignment, so Triton would load one word per lane.
    # When both addresses are 16-byte aligned (the common case) the hints below let it use 16-byte
    # vectors; chunks are BLOCK words, a multiple of 16 bytes, so every chunk start stays aligned.
    src = src_addr.to(tl.pointer_type(WORD))
    dst = dst_addr.to(tl.pointer_type(WORD))
    lanes = tl.arange(0, BLOCK)
    full_chunks = n // BLOCK
    step = tl.num_programs(1)
    chunk = tl.program_id(1)
    # while loops, not range(): Triton 3.6's interpreter can't take a runtime range bound
    if ((src_addr | dst_addr) % _VECTOR_BYTES) == 0:
        while chunk < full_chunks:
            offsets = chunk.to(tl.int64) * BLOCK + lanes
            src_vec = tl.max_contiguous(tl.multiple_of(src + offsets, _VECTOR_BYTES), BLOCK)
            dst_vec = tl.max_contiguous(tl.multiple_of(dst + offsets, _VECTOR_BYTES), BLOCK)
            tl.store(dst_vec, tl.load(src_vec))
            chunk += step
    else:
        while chunk < full_chunks:
            offsets = chunk.to(tl.int64) * BLOCK + lanes
            tl.store(dst + offsets, tl.load(src + offsets))
            chunk += step
    if tl.program_id(1) == 0:
        offsets = full_chunks * BLOCK + lanes
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def span(t: torch.Tensor) -> int:
    """Elements from `t`'s first element to its last in memory, gaps included:
    `1 + sum((size - 1) * stride)`, 0 for an empty tensor. A static buffer of this many elements,
    viewed with `torch.as_strided(static, t.size(), t.stride())`, holds a copy of `t`."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def copy_options(element_size: int, direction: str, chunk_bytes: int, interpret: bool) -> dict:
    """The kernel's constexprs (and num_warps on CUDA) for one element size and direction."""
    options = {"WORD": WORD_TYPES[element_size], "TO_STATIC": direction == "in", "BLOCK": chunk_bytes // element_size}
    if not interpret:
        options["num_warps"] = COPY_NUM_WARPS
    return options


def _check_table(table: torch.Tensor, interpret: bool, who: str) -> None:
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64 or table.dim() != 1 or not table.is_contiguous():
        got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"{who}: the pointer table must be a contiguous 1-D int64 tensor, got {got}")
    if interpret and table.device.type != "cpu":
        raise ValueError(f"{who}: interpret=True runs in Triton's interpreter and needs CPU tensors; the table is on {table.device}")
    if not interpret and table.device.type != "cuda":
        raise ValueError(f"{who}: the compiled kernel needs CUDA tensors; the table is on {table.device} (use interpret=True on the CPU)")


class TableCopy:
    """Copies between table-addressed tensors and static buffers; one launch per element size.

    `entries` holds `(slot, static, n_elems)`: `static` a 1-D contiguous buffer on the table's
    device (its element size is the word size of the copy), `slot` the table index holding the
    address of the dynamic tensor's first element, `n_elems` the elements to copy (a strided
    tensor's `span`). `direction="in"`: dynamic -> static; `"out"`: static -> dynamic.
    `chunk_bytes` and `max_chunk_programs` override the defaults (tests use them to cover the
    grid-stride loop)."""

    def __init__(
        self,
        table: torch.Tensor,
        entries: list[tuple[int, torch.Tensor, int]],
        direction: str,
        interpret: bool = False,
        *,
        chunk_bytes: int | None = None,
        max_chunk_programs: int | None = None,
    ) -> None:
        _check_table(table, interpret, "TableCopy")
        if direction not in ("in", "out"):
            raise ValueError(f"TableCopy: direction must be 'in' (dynamic -> static) or 'out' (static -> dynamic), got {direction!r}")
        chunk_bytes = chunk_bytes or (INTERPRET_COPY_CHUNK_BYTES if interpret else COPY_CHUNK_BYTES)
        cap = max_chunk_programs or (INTERPRET_MAX_CHUNK_PROGRAMS if interpret else MAX_CHUNK_PROGRAMS)
        if chunk_bytes % VECTOR_BYTES or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"TableCopy: chunk_bytes must be a power of two and a multiple of {VECTOR_BYTES}, got {chunk_bytes}")
        if not 1 <= cap <= MAX_GRID_DIM1:
            raise ValueError(f"TableCopy: max_chunk_programs must be in [1, {MAX_GRID_DIM1}], got {cap}")
        self.table = table
        self.direction = direction
        self.interpret = interpret
        self.entries = [self._checked(k, entry) for k, entry in enumerate(entries)]  # holds the static buffers alive
        self._kernel = launchable(table_copy_kernel, interpret)
        self.launches = self._plan(chunk_bytes, cap)

    def _checked(self, k: int, entry) -> tuple[int, torch.Tensor, int]:
        slot, static, n = entry
        where = f"TableCopy entry {k} (slot {slot})"
        if not isinstance(slot, int) or not 0 <= slot < self.table.numel():
            raise ValueError(f"{where}: slot must be an int in [0, {self.table.numel()}) (the table's length)")
        if not isinstance(static, torch.Tensor) or static.dim() != 1 or not static.is_contiguous():
            raise ValueError(f"{where}: the static buffer must be a 1-D contiguous tensor")
        if static.device != self.table.device:
            raise ValueError(f"{where}: the static buffer is on {static.device}, the table on {self.table.device}")
        if static.element_size() not in WORD_TYPES:
            raise ValueError(f"{where}: element size {static.element_size()} ({static.dtype}) is not one of {sorted(WORD_TYPES)} bytes")
        if not isinstance(n, int) or not 0 <= n <= static.numel():
            raise ValueError(f"{where}: n_elems={n} must be an int in [0, {static.numel()}] (the static buffer's length)")
        return slot, static, n

    def _plan(self, chunk_bytes: int, cap: int) -> list[tuple[tuple[int, int], torch.Tensor, dict]]:
        """One (grid, descriptor, launch options) per element size; the descriptors share one tensor."""
        by_size: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        for entry in self.entries:
            by_size.setdefault(entry[1].element_size(), []).append(entry)
        groups = [by_size[size] for size in sorted(by_size)]
        rows = [[slot, static.data_ptr(), n] for group in groups for slot, static, n in group]
        self.descriptor = torch.tensor(rows, dtype=torch.int64).reshape(-1, DESCRIPTOR_FIELDS).to(self.table.device)
        launches, first = [], 0
        for group in groups:
            options = copy_options(group[0][1].element_size(), self.direction, chunk_bytes, self.interpret)
            chunks = max((n + options["BLOCK"] - 1) // options["BLOCK"] for _, _, n in group)
            grid = (len(group), max(1, min(chunks, cap)))
            launches.append((grid, self.descriptor[first : first + len(group)], options))
            first += len(group)
        return launches

    def __call__(self) -> None:
        """Launch once per element size; no allocation, host read or sync, so it can be captured."""
        for grid, descriptor, options in self.launches:
            self._kernel[grid](self.table, descriptor, **options)
