"""Ahead-of-time tier for the linalg rules: the kernels that the decompositions' and solves'
backward plans generate (masks, spectral gaps, triangles, the pointwise around the library
calls) compile for sm_80 and sm_90, for both fused GPU backends."""

from __future__ import annotations

import warnings

import pytest
import torch

import gpuautograd
from tests.unit.test_rules_decompositions import CASES

# one case per rule whose plan has kernels of its own beyond library calls and views
REPRESENTATIVE = (
    "svd_tall",
    "svd_full_wide",
    "eigh_batched_nc_upper",
    "qr_wide",
    "cholesky_upper_batched_nc",
    "det_singular",
    "solve_triangular_upper_right_unit",
    "pinv_wide_nc",
    "lu_factor_tall_nc",
    "lu_solve_left_adjoint",
    "lu_unpack_wide",
)
BY_ID = {c.id: c for c in CASES}


@pytest.mark.parametrize("backend", ["cudagraph", "triton"])
@pytest.mark.parametrize("case_id", REPRESENTATIVE)
def test_linalg_kernels_compile_for_sm80_and_sm90(case_id, backend):
    case = BY_ID[case_id]
    inputs = case.make(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the deprecated torch.* spellings
        out = case.fn(*inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    report = gpuautograd.compile_check(outs, [torch.randn_like(o) for o in outs], archs=(80, 90), backend=backend)
    assert report.failures == [], str(report)
    assert report.kernels >= 1
    assert report.compiled == report.kernels * 2
