"""Helpers of the pointer-table kernel tests (tests/interpret, tests/gpu): values with special
float words, bit-exact comparison, tables, and the matmul tolerances."""

from __future__ import annotations

import torch

INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

UNIT_ROUNDOFF = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}


def values(shape, dtype, seed=0, device="cpu") -> torch.Tensor:
    """Random values of any dtype, drawn on the CPU (the same on every device); float tensors of
    4 or more elements start with words a float copy could change."""
    return _values(shape, dtype, seed).to(device)


def _values(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        flat = x.view(-1)
        if flat.numel() >= 4:
            # words a float copy could change: -0.0, inf, a NaN, and a negative NaN with a payload
            flat[:3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=dtype)
            flat[3:4].view(INT_VIEW[x.element_size()]).fill_(-7)
        return x
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw words of t (bool as int8), for bit-exact comparison."""
    if t.dtype == torch.bool:
        return t.view(torch.int8)
    return t.view(INT_VIEW[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.shape == expected.shape, msg
    assert torch.equal(bits(actual.contiguous()), bits(expected.contiguous())), msg


def addresses(*tensors: torch.Tensor) -> list[int]:
    """A table's contents: slot 0 holds an address no kernel may use, slot k (from 1) tensors[k - 1]'s."""
    return [0xDEAD] + [t.data_ptr() for t in tensors]


def table_of(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.tensor(addresses(*tensors), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")


def assert_matmul_close(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Elementwise error bound, from the standard one for a K-term fp32 dot product:
    |fl(sum) - sum| <= K * u * sum|a_ik b_kj| with u = 2**-24.
    fp32: against torch.matmul, itself within that bound of the exact product, so the two differ by
    at most twice it. bf16/fp16: the kernel accumulates in fp32 and rounds once (to nearest on
    CUDA, toward zero in the interpreter: under 2 u of the result's dtype, relative); checked
    against the exact product of the same rounded inputs. NaN anywhere fails."""
    k = a.shape[-1]
    magnitude = torch.matmul(a.double().abs(), b.double().abs())
    accumulation = k * UNIT_ROUNDOFF[torch.float32] * magnitude
    if actual.dtype == torch.float32:
        expected = torch.matmul(a, b).double()
        bound = 2 * accumulation
    else:
        expected = torch.matmul(a.double(), b.double())
        rounding = 2 * UNIT_ROUNDOFF[actual.dtype]
        bound = rounding * expected.abs() + (1 + rounding) * accumulation
    error = (actual.double() - expected).abs()
    ok = error <= bound + 1e-30  # + a hair: an all-zero row/column has a bound of exactly 0
    if not bool(ok.all()):
        worst = torch.nan_to_num(error / (bound + 1e-30), nan=float("inf")).argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, error.shape))
        raise AssertionError(
            f"{msg}: {int((~ok).sum())} of {ok.numel()} elements outside the bound; worst at {index}: "
            f"got {actual[index].item()}, expected {expected[index].item()}, bound {bound[index].item():.3g}"
        )
