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
