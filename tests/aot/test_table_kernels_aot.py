"""The pointer-table kernels compile ahead of time for sm_80 and sm_90, no GPU needed, with the
launch options TableCopy / TableMatmul use on CUDA. The PTX is also checked for what the design
relies on: 16-byte vector loads on the copy's aligned path, asynchronous 16-byte copies into
shared memory (the pipelined K loop) and tensor-core instructions in the half-precision matmul,
and no TF32 in the fp32 matmul (exact fp32 products, as torch.mm by default).
"""

from __future__ import annotations

import re

import pytest
import torch

from gpuautograd.triton_kernels.aot import compile_table_copy, compile_table_matmul

ARCHS = (80, 90)
VECTOR_LOAD = {1: "ld.global.v4.b32", 2: "ld.global.v4.b32", 4: "ld.global.v4.b32", 8: "ld.global.v2.b64"}
ASYNC_16_BYTES = re.compile(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10")
TENSOR_CORE = {80: "mma.sync.aligned", 90: "wgmma.mma_async"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
def test_copy_compiles_for_each_word_size_with_vector_loads(element_size, arch):
    for direction in ("in", "out"):
        ptx = compile_table_copy(element_size, direction, arch).asm["ptx"]
        assert f".target sm_{arch}" in ptx
        assert VECTOR_LOAD[element_size] in ptx, f"{element_size}-byte words, {direction}: no 16-byte loads on the aligned path"


# (batch, M, N, K) and strides (A, B, C): a GPT-like weight-gradient shape (A transposed), and an
# odd-sized batched product whose rows are not 16-byte multiples (masks, no vectorization).
GPT_SHAPE = ((1, 256, 512, 192), ((0, 1, 256), (0, 512, 1), (0, 512, 1)))
ODD_BMM = ((3, 33, 65, 40), ((33 * 40, 40, 1), (40 * 65, 1, 40), (33 * 65, 65, 1)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matmul_compiles_for_each_dtype(dtype, arch):
    shape, strides = GPT_SHAPE
    ptx = compile_table_matmul(dtype, shape, strides, arch).asm["ptx"]
    assert f".target sm_{arch}" in ptx
    assert ASYNC_16_BYTES.search(ptx), "the aligned path lost its 16-byte asynchronous loads"
    if dtype == torch.float32:
        assert "tf32" not in ptx, "fp32 must multiply in fp32 (input_precision='ieee')"
        assert "fma.rn.f32" in ptx
    else:
        assert TENSOR_CORE[arch] in ptx


@pytest.mark.parametrize("in_table", [(True, False, True), (False, True, False)], ids=["static_b", "static_a_and_c"])
def test_odd_batched_matmul_with_static_operands_compiles(in_table):
    shape, strides = ODD_BMM
    ptx = compile_table_matmul(torch.bfloat16, shape, strides, 90, in_table=in_table).asm["ptx"]
    assert TENSOR_CORE[90] in ptx
