"""Replay hazards of the bound plan on CPU: the "interpret-replay" backend runs exactly what the
"cudagraph" backend captures (the fused plan bound through the pointer table, each segment a
function with no arguments over static state), calling each segment again on every backward
instead of replaying a graph. The hazards shared with the GPU tier live in tests/replay_cases.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import replay_cases as rc
from tests.helpers import train_side_by_side

CPU = rc.Where("interpret-replay", "cpu", torch.float64)
REPLAY = CPU.backend


@pytest.mark.parametrize("case", rc.CASES, ids=lambda c: c.__name__)
def test_replay_hazard(case):
    case(CPU)


def test_dtype_change_gets_its_own_plan():
    rc.dtype_change_gets_its_own_plan(CPU, torch.float32)


@pytest.mark.parametrize("fn", [rc.Double, rc.PassThrough], ids=lambda f: f.__name__)
def test_opaque_node_splits_the_plan_into_segments(fn):
    rc.opaque_node_splits_the_plan_into_segments(CPU, fn)


def test_number_of_bound_plans_is_bounded(monkeypatch):
    rc.number_of_bound_plans_is_bounded(CPU, monkeypatch)


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "cnn"])
def test_suite_models_train_like_eager(name):
    """Gradients and strides every step, accumulation over micro-batches, set_to_none after each
    optimizer step, against eager and the reference executor (float64)."""
    train_side_by_side(name, torch.float64, steps=4, backend=REPLAY)
    (program,) = rc.bound_programs()
    assert program.replays == 3


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_table_matmul_binding_trains_like_eager(name, monkeypatch):
    """GPUAUTOGRAD_EXTERN_BINDING=table: matmuls read their changing operands from the table
    (triton_kernels.table_matmul) instead of cuBLAS on copies (float32: the kernel's dtypes)."""
    monkeypatch.setenv("GPUAUTOGRAD_EXTERN_BINDING", "table")
    train_side_by_side(name, torch.float32, steps=3, backend=REPLAY)
    (program,) = rc.bound_programs()
    assert "through the table" in program.source and program.replays == 2


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_bitwise_equal_to_the_unbound_fused_plan(name):
    rc.bitwise_equal_to_the_unbound_plan(CPU, name, "interpret")
