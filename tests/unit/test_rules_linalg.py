"""Gradients of matrix and vector product nodes against torch.autograd (mm, addmm, bmm, baddbmm,
addbmm, mv, addmv, addr, dot, vdot), and the view compositions torch.matmul and F.linear become."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.capture.nodeview import NodeView
from gpuautograd.ir.builder import Builder
from gpuautograd.ir.program import InputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.rules import lookup
from tests.helpers import DTYPES, check_grads, check_node, rand

SIZES = [(7, 13, 5), (33, 65, 17)]  # (m, k, n), odd on purpose


def leaf(*shape, dtype=torch.float64, noncontiguous=False):
    """tests.helpers.rand, also for 0-dim shapes."""
    if not shape:
        return torch.randn((), dtype=dtype).requires_grad_()
    return rand(*shape, dtype=dtype, noncontiguous=noncontiguous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SIZES)
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_mm(dtype, m, k, n, noncontiguous):
    a = rand(m, k, dtype=dtype, noncontiguous=noncontiguous)
    b = rand(k, n, dtype=dtype)
    check_node(torch.mm, a, b, node="MmBackward0")


ONE_SIDED = {
    "MmBackward0": (torch.mm, [(7, 13), (13, 5)]),
    "BmmBackward0": (torch.bmm, [(2, 7, 13), (2, 13, 5)]),
    "AddmmBackward0": (torch.addmm, [(5,), (7, 13), (13, 5)]),
    "BaddbmmBackward0": (torch.baddbmm, [(5,), (2, 7, 13), (2, 13, 5)]),
    "AddbmmBackward0": (torch.addbmm, [(5,), (2, 7, 13), (2, 13, 5)]),
    "MvBackward0": (torch.mv, [(7, 13), (13,)]),
    "AddmvBackward0": (torch.addmv, [(7,), (7, 13), (13,)]),
    "AddrBackward0": (torch.addr, [(7, 13), (7,), (13,)]),
    "DotBackward0": (torch.dot, [(13,), (13,)]),
}


@pytest.mark.parametrize("node,which", [(n, i) for n, (_, shapes) in ONE_SIDED.items() for i in range(len(shapes))])
def test_one_operand_requires_grad(node, which):
    # torch saves a factor only when the other side needs a gradient: the rule must not read it otherwise
    op, shapes = ONE_SIDED[node]
    inputs = [rand(*s, requires_grad=i == which) for i, s in enumerate(shapes)]
    grads = check_node(op, *inputs, node=node)
    assert len(grads) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(17,), (1, 17), (33, 1), (33, 17), ()])
@pytest.mark.parametrize("alpha,beta", [(1, 1), (0.5, 2.0), (3, 0)])
def test_addmm(dtype, bias_shape, alpha, beta):
    bias = leaf(*bias_shape, dtype=dtype)
    a = rand(33, 65, dtype=dtype, noncontiguous=True)
    b = rand(65, 17, dtype=dtype)
    check_node(lambda c, x, y: torch.addmm(c, x, y, alpha=alpha, beta=beta), bias, a, b, node="AddmmBackward0")


def test_addmm_without_bias_grad():
    bias = rand(5, requires_grad=False)
    check_node(lambda c, x, y: torch.addmm(c, x, y, alpha=2.0), bias, rand(7, 13), rand(13, 5), node="AddmmBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SIZES)
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_bmm(dtype, m, k, n, noncontiguous):
    a = rand(3, m, k, dtype=dtype, noncontiguous=noncontiguous)
    b = rand(3, k, n, dtype=dtype)
    check_node(torch.bmm, a, b, node="BmmBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(3, 7, 5), (7, 5), (1, 1, 5)])
@pytest.mark.parametrize("alpha,beta", [(1, 1), (0.5, -1.5)])
def test_baddbmm(dtype, bias_shape, alpha, beta):
    bias = rand(*bias_shape, dtype=dtype)
    a = rand(3, 7, 13, dtype=dtype)
    b = rand(3, 13, 5, dtype=dtype, noncontiguous=True)
    check_node(lambda c, x, y: torch.baddbmm(c, x, y, alpha=alpha, beta=beta), bias, a, b, node="BaddbmmBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(13, 5), (5,), ()])
@pytest.mark.parametrize("alpha,beta", [(1, 1), (0.5, -1.5)])
def test_addbmm(dtype, bias_shape, alpha, beta):
    bias = leaf(*bias_shape, dtype=dtype)
    a = rand(3, 13, 7, dtype=dtype, noncontiguous=True)
    b = rand(3, 7, 5, dtype=dtype)
    check_node(lambda c, x, y: torch.addbmm(c, x, y, alpha=alpha, beta=beta), bias, a, b, node="AddbmmBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,node", [(torch.dot, "DotBackward0"), (torch.vdot, "VdotBackward0")])
@pytest.mark.parametrize("n", [1, 13, 65])
def test_dot(dtype, op, node, n):
    check_node(op, rand(n, dtype=dtype), rand(n, dtype=dtype), node=node)


def test_dot_of_strided_vectors():
    base = rand(13, 5)
    check_node(lambda x, y: torch.dot(x[:, 2], y), base, rand(13), node="DotBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(7, 13), (33, 65)])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_mv(dtype, m, k, noncontiguous):
    check_node(torch.mv, rand(m, k, dtype=dtype, noncontiguous=noncontiguous), rand(k, dtype=dtype), node="MvBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(33,), (1,), ()])
@pytest.mark.parametrize("alpha,beta", [(1, 1), (2.5, 0)])
def test_addmv(dtype, bias_shape, alpha, beta):
    bias = leaf(*bias_shape, dtype=dtype)
    fn = lambda c, m, v: torch.addmv(c, m, v, alpha=alpha, beta=beta)  # noqa: E731
    check_node(fn, bias, rand(33, 65, dtype=dtype, noncontiguous=True), rand(65, dtype=dtype), node="AddmvBackward0")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(7, 13), (13,), (7, 1)])
@pytest.mark.parametrize("alpha,beta", [(1, 1), (-0.5, 3)])
def test_addr(dtype, bias_shape, alpha, beta):
    bias = leaf(*bias_shape, dtype=dtype)
    fn = lambda c, u, v: torch.addr(c, u, v, alpha=alpha, beta=beta)  # noqa: E731
    check_node(fn, bias, rand(7, dtype=dtype), rand(13, dtype=dtype), node="AddrBackward0")


def test_complex_product_rule_conjugates_the_other_factor():
    # handed complex values, the mm rule writes derivatives.yaml's conjugated formula: each
    # factor's gradient is a product with the conjugate transpose of the other factor
    b = Builder()
    c128 = TensorType((3, 2), torch.complex128, torch.device("cpu"))
    grad = b.input(c128, InputSpec("grad", 0))
    self_ = b.input(c128, InputSpec("saved", 0))
    mat2 = b.input(c128.with_(shape=(2, 2)), InputSpec("saved", 1))
    node = NodeView("MmBackward0", {"self": self_, "mat2": mat2}, [c128], [c128, c128.with_(shape=(2, 2))], [True, True])
    grad_self, grad_mat2 = lookup("MmBackward0")(b, node, [grad])
    assert grad_self.dtype == grad_mat2.dtype == torch.complex128
    assert sum(i.op == "conj" for i in b.program.instrs) == 2, [i.op for i in b.program.instrs]


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
@pytest.mark.parametrize("shape_a,shape_b", [((7, 13), (13, 5)), ((2, 7, 13), (13, 5)), ((7, 13), (13,)), ((2, 1, 7, 13), (3, 13, 5))])
def test_complex_matmul_compositions(dtype, shape_a, shape_b):
    check_grads(torch.matmul, rand(*shape_a, dtype=dtype, noncontiguous=True), rand(*shape_b, dtype=dtype))


# -- compositions: torch.matmul and F.linear go through view nodes around Mm/Bmm/Addmm ------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape_a,shape_b",
    [
        ((7, 13), (13, 5)),  # Mm
        ((2, 7, 13), (13, 5)),  # View, Mm, UnsafeView
        ((13,), (13, 5)),  # Unsqueeze, Mm, Squeeze
        ((7, 13), (13,)),  # Mv
        ((2, 7, 13), (2, 13, 5)),  # Bmm
        ((2, 1, 7, 13), (3, 13, 5)),  # Expand, broadcast batch dims
    ],
)
def test_matmul_compositions(dtype, shape_a, shape_b):
    check_grads(torch.matmul, rand(*shape_a, dtype=dtype), rand(*shape_b, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch", [(7,), (2, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear(dtype, batch, with_bias):
    x = rand(*batch, 13, dtype=dtype)
    w = rand(5, 13, dtype=dtype)
    if with_bias:
        check_grads(F.linear, x, w, rand(5, dtype=dtype))
    else:
        check_grads(F.linear, x, w)


def test_linear_weight_gradient_comes_out_in_the_weight_layout():
    # The weight enters addmm transposed (column-major); like torch's mm_mat2_backward, the rule
    # computes its gradient transposed so that it needs no copy to become weight.grad.
    x, w, bias = rand(7, 13), rand(5, 13), rand(5)
    check_node(F.linear, x, w, bias, node="AddmmBackward0")
    program = gpuautograd.explain(F.linear(x, w, bias).sum()).program
    producer = {id(o): i.op for i in program.instrs for o in i.outputs if o is not None}
    weight_grad = next(v for v, spec in program.outputs if v is not None and v.shape == (5, 13))
    assert producer[id(weight_grad)] == "mm", str(program)
