"""Every environment flag of gpuautograd, in one place.

Each flag is read when it is used, so tests and users can change the environment at run time.
Each one validates its value: a bad one raises FlagError naming the flag and what it accepts.
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference", "interpret", "triton", "cudagraph", "interpret-replay")


class FlagError(ValueError):
    """An environment flag holds a value it does not accept."""


# os.environ.get runs five Python frames per read, and a backward reads three flags. On POSIX its
# backing dict (bytes to bytes, updated by every os.environ write) answers the same in one lookup,
# while os.environ is still that mapping (a test may replace it with a plain dict).
# os.environ as the process started with it; each write to it also reaches the C environment
# (putenv), where the native extension reads a flag without a Python call.
PROCESS_ENVIRON = os.environ
_ENVIRON_DATA = getattr(PROCESS_ENVIRON, "_data", None) if os.name == "posix" else None
if not isinstance(_ENVIRON_DATA, dict):
    _ENVIRON_DATA = None
_ENCODED_NAMES: dict[str, bytes] = {}


def _env(name: str, default: str) -> str:
    if _ENVIRON_DATA is None or os.environ is not PROCESS_ENVIRON:
        return os.environ.get(name, default)
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = _ENCODED_NAMES[name] = os.fsencode(name)
    raw = _ENVIRON_DATA.get(key)
    return default if raw is None else os.fsdecode(raw)


def _choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    value = _env(name, default)
    if value not in accepted:
        raise FlagError(f"{name}={value!r} is not valid; it accepts one of {', '.join(map(repr, accepted))}")
    return value


def _integer(name: str, default: int, low: int, high: int | None = None) -> int:
    """An integer in [low, high] (high None: no upper bound)."""
    text = _env(name, str(default))
    accepts = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
    try:
        value = int(text.strip())
    except ValueError:
        raise FlagError(f"{name}={text!r} is not valid; it accepts {accepts}") from None
    if value < low or (high is not None and value > high):
        raise FlagError(f"{name}={text!r} is out of range; it accepts {accepts}")
    return value


def backend() -> str:
    """GPUAUTOGRAD_BACKEND: the default backend ("auto" picks the best one for the device)."""
    return _choice("GPUAUTOGRAD_BACKEND", "auto", BACKENDS)


def debug_level() -> int:
    """GPUAUTOGRAD_DEBUG: 0 quiet, 1 cache misses and fallbacks, 2 also the program and the fused plan
    of each capture, 3 also every fusion decision with its reason."""
    return _integer("GPUAUTOGRAD_DEBUG", 0, 0, 3)


def cache_size() -> int:
    """GPUAUTOGRAD_CACHE_SIZE: cached programs kept (least recently used ones are dropped)."""
    return _integer("GPUAUTOGRAD_CACHE_SIZE", 64, 1)


def recapture_limit() -> int:
    """GPUAUTOGRAD_RECAPTURE_LIMIT: captures of one graph structure (with different sizes or
    layouts) before its further variants run eagerly."""
    return _integer("GPUAUTOGRAD_RECAPTURE_LIMIT", 8, 1)


def dump_dir() -> str:
    """GPUAUTOGRAD_DUMP_DIR: when set, every generated Triton kernel is written to this directory."""
    value = _env("GPUAUTOGRAD_DUMP_DIR", "")
    if value and os.path.exists(value) and not os.path.isdir(value):
        raise FlagError(f"GPUAUTOGRAD_DUMP_DIR={value!r} is not valid; it accepts a directory (or '' for none), and this is a file")
    return value


def max_segments() -> int:
    """GPUAUTOGRAD_MAX_SEGMENTS: captured segments one backward may have (opaque nodes split it);
    beyond this the backward runs its fused kernels without graph replay."""
    return _integer("GPUAUTOGRAD_MAX_SEGMENTS", 8, 0)


def warn_fallbacks() -> bool:
    """GPUAUTOGRAD_WARN_FALLBACKS: 1 also raises a RuntimeWarning for each fallback or degradation
    (once per reason); 0 (default) only logs it to the "gpuautograd" logger and counts it in stats()."""
    return _choice("GPUAUTOGRAD_WARN_FALLBACKS", "0", ("0", "1")) == "1"


WHEN_OBSERVED = ("eager", "functional")


def when_observed() -> str:
    """GPUAUTOGRAD_WHEN_OBSERVED: what a backward does while a TorchDispatchMode or the autograd
    profiler watches it. "eager" (default) runs torch's engine, so they see eager's ops, the
    autograd node each op runs in, and its per-node events; "functional" runs gpuautograd's program
    anyway, to count or profile what it launches (bench/counting.py does)."""
    return _choice("GPUAUTOGRAD_WHEN_OBSERVED", "eager", WHEN_OBSERVED)


EXTERN_BINDINGS = ("copy", "table")


def extern_binding() -> str:
    """GPUAUTOGRAD_EXTERN_BINDING: how a replayed matmul reads operands that change address:
    "copy" (default) copies them into static mirrors for cuBLAS inside the graph; "table" runs a
    Triton matmul that reads them from the pointer table (bench/extern_binding.py compares them)."""
    return _choice("GPUAUTOGRAD_EXTERN_BINDING", "copy", EXTERN_BINDINGS)


NATIVE_MODES = ("auto", "0", "1")


def native() -> str:
    """GPUAUTOGRAD_NATIVE: "auto" (default) builds the native walker on first use and falls back to
    the Python walk, reporting why, when that fails; "0" always runs the Python walk; "1" makes a
    failed build an error."""
    return _choice("GPUAUTOGRAD_NATIVE", "auto", NATIVE_MODES)


_BYTE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def cache_bytes() -> int | str | None:
    """GPUAUTOGRAD_CACHE_BYTES: the most bytes the cached plans may keep resident between calls
    (arenas, static buffers, mirrors, CUDA graph pools; see runtime/resident.py). A byte count with
    an optional binary suffix ("512M", "4G", "1048576"), "none" for no bound, or "auto" (default):
    a quarter of the CUDA device's total memory for plans on CUDA, no bound for CPU plans. Returns
    the count, None, or "auto". Least recently used plans are evicted first; a single plan larger
    than the bound is still kept (stats()["cache_oversize"])."""
    text = _env("GPUAUTOGRAD_CACHE_BYTES", "auto").strip()
    if text.lower() in ("auto", "none"):
        return None if text.lower() == "none" else "auto"
    number, suffix = text.upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in _BYTE_SUFFIXES:
        number, suffix = number[:-1], number[-1]
    try:
        value = int(number) * _BYTE_SUFFIXES[suffix]
    except ValueError:
        value = -1
    if value < 0:
        raise FlagError(f"GPUAUTOGRAD_CACHE_BYTES={text!r} is not valid; it accepts a byte count such as 512M or 4G, 'auto' or 'none'")
    return value
