"""Every fusion and block-size heuristic, as named constants with the reason for each.

The planner and code generator read these and nothing else, so tuning happens in one file.
"""

from __future__ import annotations

# A reduction whose reduced extent fits in one block keeps the whole row in registers: its
# pointwise consumers (layer norm, softmax and cross-entropy backward) run in the same kernel.
MAX_PERSISTENT_COLS = 8192

# Elements of one tile (rows x cols) that a program holds at once on a GPU; more spills registers.
GPU_TILE_ELEMENTS = 4096
GPU_POINTWISE_BLOCK = 1024
# Looped reductions (rows too long to keep): a chunk of columns per iteration, a few rows per program.
GPU_LOOP_COLS = 512
GPU_LOOP_ROWS = 8
# Column reductions (a bias gradient: sum over tokens, features contiguous) always loop: a
# row-persistent tile would hold one feature per program and read it with strided loads.
GPU_COLUMN_ROWS = 64

# The interpreter runs each program instance in Python: fewer, larger blocks are much faster and
# exercise the same masks and indexing.
INTERPRET_TILE_ELEMENTS = 1 << 16
INTERPRET_POINTWISE_BLOCK = 1 << 16
INTERPRET_LOOP_COLS = 1 << 12
INTERPRET_LOOP_ROWS = 16
INTERPRET_COLUMN_ROWS = 256

# A kernel that computes a sum's rows block by block also adds them up per block (partial sums,
# then one small kernel adds the blocks): a bias's or a norm weight's gradient without a second
# read of every row. False: such sums stay in their own column-sum kernel.
PARTIAL_COLUMN_SUMS = True

# A value several instructions read is recomputed by each reader instead of stored when it takes at
# most this many instructions to compute from stored values, and those values together hold at
# most RECOMPUTE_MAX_READ times its bytes (a layer norm's normalized input: x and two per-row stats).
RECOMPUTE_MAX_OPS = 8
RECOMPUTE_MAX_READ = 1.25

# How far back the planner looks for a kernel to merge with (bounds the first-call cost).
MERGE_WINDOW = 24

# Indexing switches to int64 when an offset can reach this (int32 overflows past it).
INT32_LIMIT = 2**31 - 1

# Byte alignment of every buffer in the memory arena (cache lines, vector loads).
ARENA_ALIGNMENT = 256


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps(tile_elements: int) -> int:
    return 8 if tile_elements >= 4096 else 4 if tile_elements >= 512 else 2 if tile_elements >= 128 else 1


# Bytes of alignment a pointer read from the pointer table is promised to have (checked on every
# call), so its loads vectorize as those of an argument Triton specialized as 16-byte aligned.
POINTER_ALIGNMENT = 16


# -- matmuls with fused epilogues --------------------------------------------------------------
# A matmul whose result only feeds pointwise work runs as one generated kernel: the work is done
# on the output tile before the store. Tiles are first choices for sm_90, not tuned on a GPU yet;
# 64 x 64 leaves registers for the epilogue's loads.
# "cost": fuse where the cost model below estimates it faster; "always": wherever it moves fewer
# bytes; "never": every matmul stays a library call (the plan of earlier versions).
MATMUL_EPILOGUES = "cost"
GPU_MATMUL_BLOCKS = (64, 64, 32)
MATMUL_NUM_WARPS = 4
INTERPRET_MATMUL_BLOCK = 128  # the interpreter multiplies each tile with numpy: large tiles are cheap
MIN_MATMUL_BLOCK = 16  # tl.dot's smallest tile

# The cost model that chooses, per matmul, between the fused kernel and a library call plus the
# generated kernel that reads its result back. Figures of the H200 (the GPU the project targets);
# a generated matmul is assumed to reach TRITON_MATMUL_EFFICIENCY of the library's throughput
# until a GPU run measures it (python -m bench.matmul_epilogue).
H200_BANDWIDTH = 4.8e12  # bytes per second
H200_FLOPS = {"float32": 60e12, "tf32": 400e12, "bfloat16": 800e12, "float16": 800e12}
LAUNCH_SECONDS = 2e-6  # a kernel launch inside a CUDA graph, roughly
TRITON_MATMUL_EFFICIENCY = 0.8


def matmul_blocks(m: int, n: int, k: int, interpret: bool) -> tuple[int, int, int]:
    caps = (INTERPRET_MATMUL_BLOCK,) * 3 if interpret else GPU_MATMUL_BLOCKS
    return tuple(max(MIN_MATMUL_BLOCK, min(next_pow2(x), cap)) for x, cap in zip((m, n, k), caps))


def matmul_row_tiles(m: int, n: int, k: int, interpret: bool) -> int:
    """Row tiles of an M x N matmul kernel: each stores one partial sum of a column sum it adds up."""
    return -(-m // matmul_blocks(m, n, k, interpret)[0])


def epilogue_pays(flops: float, dtype_name: str, before: tuple[int, int, int], after: tuple[int, int, int]) -> bool:
    """Is the fused plan estimated faster? `before` is (library call's bytes, the kernels' bytes,
    launches) of the matmul and what reads its result; `after` the same for the fused kernel (its
    bytes first) and what stays apart. A matmul takes the longer of its traffic and its arithmetic."""
    peak = H200_FLOPS.get(dtype_name, H200_FLOPS["float32"])
    lib_bytes, kernel_bytes, launches = before
    fused_bytes, rest_bytes, launches_after = after
    unfused = max(flops / peak, lib_bytes / H200_BANDWIDTH) + kernel_bytes / H200_BANDWIDTH + launches * LAUNCH_SECONDS
    fused = max(flops / (peak * TRITON_MATMUL_EFFICIENCY), fused_bytes / H200_BANDWIDTH)
    fused += rest_bytes / H200_BANDWIDTH + launches_after * LAUNCH_SECONDS
    return fused < unfused
