"""Ahead-of-time compilation of the table kernels for a CUDA architecture, with no GPU present.

Each function compiles one launch configuration exactly as `TableCopy` / `TableMatmul` would
launch it on CUDA (same constexprs, num_warps, num_stages), with the pointer arguments marked
16-byte aligned as Triton's JIT marks a freshly allocated tensor. Returns Triton's compiled
kernel (`.asm["ptx"]` holds the PTX); raises the compiler's error.
"""

import torch

from .table_copy import COPY_CHUNK_BYTES, copy_options, table_copy_kernel
from .table_matmul import matmul_plan, table_matmul_kernel

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def compile_function(fn, runtime_sig: dict, options: dict, aligned: list[int], arch: int):
    """Compile plain kernel function `fn` for sm_<arch>: `runtime_sig` types its runtime arguments,
    `options` holds its constexprs and launch options, `aligned` the positions of pointer
    arguments to mark 16-byte aligned. Also what `gpuautograd.compile_check` compiles with."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jitted = triton.jit(fn)
    constexprs = {k: v for k, v in options.items() if k not in LAUNCH_OPTIONS}
    sig = dict(runtime_sig)
    sig.update({name: "constexpr" for name in constexprs})
    # keyed by argument position: what every Triton 3.x accepts
    by_position = {(jitted.arg_names.index(name),): value for name, value in constexprs.items()}
    attrs = {(k,): [["tt.divisibility", 16]] for k in aligned}
    source = ASTSource(jitted, sig, constexprs=by_position, attrs=attrs)
    compile_options = {k: options[k] for k in LAUNCH_OPTIONS if k in options}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=compile_options)


def compile_table_copy(element_size: int, direction: str, arch: int, chunk_bytes: int = COPY_CHUNK_BYTES):
    """The copy kernel for one element size (1, 2, 4, 8) and direction ("in"/"out")."""
    options = copy_options(element_size, direction, chunk_bytes, interpret=False)
    return compile_function(table_copy_kernel, {"table_ptr": "*i64", "desc_ptr": "*i64"}, options, [0, 1], arch)


def compile_table_matmul(
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    strides: tuple[tuple[int, int, int], ...],
    arch: int,
    in_table: tuple[bool, bool, bool] = (True, True, True),
    blocks: tuple[int, int, int] | None = None,
):
    """The matmul kernel for one dtype, shape (batch, M, N, K), strides (A, B, C) and choice of
    table or static operands."""
    _, options = matmul_plan(shape, strides, dtype, in_table, interpret=False, blocks=blocks)
    pointer = POINTER_TYPES[dtype]
    runtime_sig = {"table_ptr": "*i64", "a_ptr": pointer, "b_ptr": pointer, "c_ptr": pointer}
    runtime_sig.update({"a_slot": "i32", "b_slot": "i32", "c_slot": "i32"})
    return compile_function(table_matmul_kernel, runtime_sig, options, [0, 1, 2, 3], arch)
