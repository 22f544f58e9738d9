"""Every environment flag of gpuautograd, in one place.

Each flag is read when it is used, so tests and users can change the environment at run time.
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference", "interpret", "triton", "cudagraph", "interpret-replay")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def backend() -> str:
    """GPUAUTOGRAD_BACKEND: the default backend ("auto" picks the best one for the device)."""
    value = _env("GPUAUTOGRAD_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"GPUAUTOGRAD_BACKEND={value!r} is not one of {BACKENDS}")
    return value


def debug_level() -> int:
    """GPUAUTOGRAD_DEBUG: 0 quiet, 1 cache misses and fallbacks, 2 also the program and the fused plan
    of each capture, 3 also every fusion decision with its reason."""
    return int(_env("GPUAUTOGRAD_DEBUG", "0"))


def cache_size() -> int:
    """GPUAUTOGRAD_CACHE_SIZE: cached programs kept (least recently used ones are dropped)."""
    return int(_env("GPUAUTOGRAD_CACHE_SIZE", "64"))


def recapture_limit() -> int:
    """GPUAUTOGRAD_RECAPTURE_LIMIT: recaptures of one graph structure before a warning says so."""
    return int(_env("GPUAUTOGRAD_RECAPTURE_LIMIT", "8"))


def dump_dir() -> str:
    """GPUAUTOGRAD_DUMP_DIR: when set, every generated Triton kernel is written to this directory."""
    return _env("GPUAUTOGRAD_DUMP_DIR", "")


def max_segments() -> int:
    """GPUAUTOGRAD_MAX_SEGMENTS: captured segments one backward may have (opaque nodes split it);
    beyond this the backward runs its fused kernels without graph replay, with a warning."""
    return int(_env("GPUAUTOGRAD_MAX_SEGMENTS", "8"))


EXTERN_BINDINGS = ("copy", "table")


def extern_binding() -> str:
    """GPUAUTOGRAD_EXTERN_BINDING: how a replayed matmul reads operands that change address:
    "copy" (default) copies them into static mirrors for cuBLAS inside the graph; "table" runs a
    Triton matmul that reads them from the pointer table (bench/extern_binding.py compares them)."""
    value = _env("GPUAUTOGRAD_EXTERN_BINDING", "copy")
    if value not in EXTERN_BINDINGS:
        raise ValueError(f"GPUAUTOGRAD_EXTERN_BINDING={value!r} is not one of {EXTERN_BINDINGS}")
    return value


NATIVE_MODES = ("auto", "0", "1")


def native() -> str:
    """GPUAUTOGRAD_NATIVE: "auto" (default) builds the native walker on first use and falls back to
    the Python walk with a warning when that fails; "0" always runs the Python walk; "1" makes a
    failed build an error."""
    value = _env("GPUAUTOGRAD_NATIVE", "auto")
    if value not in NATIVE_MODES:
        raise ValueError(f"GPUAUTOGRAD_NATIVE={value!r} is not one of {NATIVE_MODES}")
    return value
