"""gpuautograd under torch.distributed: multi-process runs with eager DDP as the reference.

Each test spawns a process group on loopback (gloo on CPU; NCCL when two GPUs are present) and
runs a list of scenarios from `scenarios.py` on every rank; grouping them keeps the number of
spawns (a few seconds each) small. A failed assertion on any rank fails the test with its traceback.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import scenarios

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is unavailable"
)

SUPPORTED = ["bucketed", "find_unused", "no_sync", "static_graph", "comm_hooks", "overlap"]
FSDP2 = list(scenarios.FSDP2_CONFIGS)
UNSUPPORTED = ["unknown_leaves", "unused_output"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, backend: str, names: list[str]) -> None:
    mp.spawn(scenarios.worker, args=(world, free_port(), backend, names), nprocs=world, join=True)


def test_ddp_two_ranks_gloo_supported_and_fallbacks():
    spawn(2, "gloo", SUPPORTED + UNSUPPORTED)


def test_fsdp2_two_ranks_gloo():
    spawn(2, "gloo", FSDP2)


def test_fsdp2_three_ranks_gloo():
    spawn(3, "gloo", FSDP2)


def test_ddp_three_ranks_gloo():
    spawn(3, "gloo", SUPPORTED + ["unknown_leaves"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_ddp_two_ranks_nccl():
    spawn(2, "nccl", SUPPORTED + ["unknown_leaves", "unused_output"])
