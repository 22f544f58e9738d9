"""Complex values in the functional backward: the complex-aware pointwise rules, the ops that
make or take apart complex values, and the FFTs, against torch.autograd on the reference executor.

Complex leaves are checked in complex128 and complex64; graphs that start from real leaves and go
through complex values (an rfft, a polar) in float64 and float32. Odd sizes and transposed
(non-contiguous) leaves throughout.
"""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import Case, check_grads, params, rand, run_case

COMPLEX = (torch.complex128, torch.complex64)
REAL = (torch.float64, torch.float32)


def cleaf(*shape, nc=False):
    return lambda dtype: (rand(*shape, dtype=dtype, noncontiguous=nc),)


def positive(*shape):
    return lambda dtype: torch.rand(*shape, dtype=dtype).add(0.5).requires_grad_()


CASES = [
    Case("mul", "MulBackward0", lambda a, b: a * b, lambda d: (rand(3, 5, dtype=d, noncontiguous=True), rand(3, 5, dtype=d)), COMPLEX),
    Case("mul-scalar", "MulBackward1", lambda a: torch.ops.aten.mul.Scalar(a, 2 - 3j), lambda d: (rand(7, dtype=d),), COMPLEX),
    Case(
        "mul-real-by-complex",
        "MulBackward0",
        lambda x, w: x * w,
        lambda d: (rand(4, 3, dtype=d), rand(3, dtype=torch.complex128)),
        (torch.float64,),
    ),
    Case("div", "DivBackward0", lambda a, b: a / b, lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d, noncontiguous=True)), COMPLEX),
    Case("div-scalar", "DivBackward1", lambda a: torch.ops.aten.div.Scalar(a, 1 + 2j), lambda d: (rand(5, dtype=d),), COMPLEX),
    Case("add-alpha", "AddBackward0", lambda a, b: torch.add(a, b, alpha=2 - 1j), lambda d: (rand(5, dtype=d), rand(5, dtype=d)), COMPLEX),
    Case("sub-alpha", "SubBackward0", lambda a, b: torch.sub(a, b, alpha=1 + 1j), lambda d: (rand(5, dtype=d), rand(5, dtype=d)), COMPLEX),
    Case("rsub", "RsubBackward1", lambda a: 3 - a, lambda d: (rand(5, dtype=d),), COMPLEX),
    Case("neg", "NegBackward0", lambda a: -a, cleaf(4, 3, nc=True), COMPLEX),
    Case("exp", "ExpBackward0", torch.exp, cleaf(3, 5), COMPLEX),
    Case("log", "LogBackward0", torch.log, cleaf(3, 5, nc=True), COMPLEX),
    Case("sqrt", "SqrtBackward0", torch.sqrt, cleaf(7), COMPLEX),
    Case("rsqrt", "RsqrtBackward0", torch.rsqrt, cleaf(7), COMPLEX),
    Case("abs", "AbsBackward0", torch.abs, cleaf(3, 5, nc=True), COMPLEX),
    Case("reciprocal", "ReciprocalBackward0", torch.reciprocal, cleaf(7), COMPLEX),
    Case("sin", "SinBackward0", torch.sin, cleaf(7), COMPLEX),
    Case("cos", "CosBackward0", torch.cos, cleaf(7), COMPLEX),
    Case("log1p", "Log1PBackward0", torch.log1p, cleaf(7), COMPLEX),
    Case("expm1", "Expm1Backward0", torch.expm1, cleaf(7), COMPLEX),
    Case("tanh", "TanhBackward0", torch.tanh, cleaf(3, 5), COMPLEX),
    Case("sigmoid", "SigmoidBackward0", torch.sigmoid, cleaf(3, 5), COMPLEX),
    Case("where", "WhereBackward0", lambda a, b: torch.where(a.real > 0, a, b), lambda d: (rand(6, dtype=d), rand(6, dtype=d)), COMPLEX),
    Case("to-real", "ToCopyBackward0", lambda a: a.to(torch.complex128).exp(), lambda d: (rand(5, dtype=d),), REAL),
    Case("conj", "ConjPhysicalBackward0", lambda a: torch.conj_physical(a) * a, cleaf(5), COMPLEX),
    Case("conj-view", "ConjBackward0", lambda a: a.conj() * a, cleaf(4, 3), COMPLEX),
    Case("view-as-real", "ViewAsRealBackward0", lambda a: torch.view_as_real(a) ** 2, cleaf(4, 3, nc=True), COMPLEX),
    Case("view-as-complex", "ViewAsComplexBackward0", lambda x: torch.view_as_complex(x).exp(), lambda d: (rand(4, 3, 2, dtype=d),), REAL),
    Case("real-imag", "SelectBackward0", lambda a: a.real * a.imag, cleaf(5, 3), COMPLEX),
    Case("complex", "ComplexBackward0", lambda a, b: torch.complex(a, b).exp(), lambda d: (rand(5, dtype=d), rand(5, dtype=d)), REAL),
    Case("polar", "PolarBackward0", lambda a, t: torch.view_as_real(torch.polar(a, t)), lambda d: (positive(6)(d), rand(6, dtype=d)), REAL),
    Case("angle", "AngleBackward0", torch.angle, cleaf(3, 4), COMPLEX),
    Case("angle-of-real", "AngleBackward0", lambda x: torch.angle(x) + x, lambda d: (rand(5, dtype=d),), REAL),
    Case("fft", "FftC2CBackward0", lambda a: torch.fft.fft(a, n=9), cleaf(3, 7), COMPLEX),
    Case("ifft-ortho", "FftC2CBackward0", lambda a: torch.fft.ifft(a, dim=0, norm="ortho"), cleaf(5, 3, nc=True), COMPLEX),
    Case("fft2-forward", "FftC2CBackward0", lambda a: torch.fft.fft2(a, norm="forward"), cleaf(2, 5, 6), COMPLEX),
    Case("rfft-odd", "FftR2CBackward0", lambda x: torch.fft.rfft(x), lambda d: (rand(3, 9, dtype=d),), REAL),
    Case(
        "rfft-even",
        "FftR2CBackward0",
        lambda x: torch.fft.rfft(x, norm="ortho"),
        lambda d: (rand(3, 8, dtype=d, noncontiguous=True),),
        REAL,
    ),
    Case("rfft2", "FftR2CBackward0", lambda x: torch.fft.rfft2(x), lambda d: (rand(2, 5, 7, dtype=d),), REAL),
    Case("rfftn-dims", "FftR2CBackward0", lambda x: torch.fft.rfftn(x, dim=(0, 2)), lambda d: (rand(4, 3, 6, dtype=d),), REAL),
    Case("irfft-odd", "FftC2RBackward0", lambda a: torch.fft.irfft(a, n=9), cleaf(3, 5), COMPLEX),
    Case("irfft-even", "FftC2RBackward0", lambda a: torch.fft.irfft(a, norm="forward"), cleaf(3, 5), COMPLEX),
    Case("irfft2", "FftC2RBackward0", lambda a: torch.fft.irfft2(a, s=(4, 7)), cleaf(2, 4, 4), COMPLEX),
    Case("hfft", "FftC2RBackward0", lambda a: torch.fft.hfft(a, n=8), cleaf(3, 5), COMPLEX),
]


@pytest.mark.parametrize("case,dtype", params(CASES))
def test_complex_rule(case, dtype):
    run_case(case, dtype)


def _spectral_conv(x, w):
    """A Fourier layer: rfft2, keep the low modes, multiply by complex weights, irfft2."""
    xf = torch.fft.rfft2(x)
    modes = xf[..., :3, :3]
    out = torch.einsum("bixy,ioxy->boxy", modes, w)
    full = torch.zeros(x.shape[0], w.shape[1], x.shape[-2], x.shape[-1] // 2 + 1, dtype=out.dtype)
    full[..., :3, :3] = out
    return torch.fft.irfft2(full, s=x.shape[-2:])


def test_a_complex_parameter_is_a_leaf_like_any_other():
    x = rand(2, 3, 8, 8)
    w = torch.randn(3, 4, 3, 3, dtype=torch.complex128, requires_grad=True)
    check_grads(_spectral_conv, x, w, allow_opaque=True)
    out = _spectral_conv(x, w).square().sum()
    out.backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    gpuautograd.backward(_spectral_conv(x, w).square().sum())
    torch.testing.assert_close((x.grad, w.grad), expected)


def test_a_stft_magnitude_loss_agrees_with_torch():
    signal = rand(2, 400)
    window = torch.hann_window(64, dtype=torch.float64)

    def loss(s):
        spec = torch.stft(s, 64, hop_length=16, window=window, return_complex=True)
        return spec.abs().clamp_min(1e-7).log()

    check_grads(loss, signal, allow_opaque=True)
