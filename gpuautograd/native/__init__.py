"""The native walker: the C++ sources below (walk.cpp's opening comment maps them), built on first
use against the installed torch.

The build goes into a per-user cache keyed by torch's version and the source's hash, so a new
torch or a changed source builds afresh and an unchanged one loads in milliseconds. Two
processes building at once take turns on a lock file; each build happens in a temporary
directory that is renamed into place only when complete, so a half-built cache never exists.

Without a compiler, or when the build fails, `load()` returns None and says why once: the
Python walk then runs (slower, and a backward with hooks runs eagerly). GPUAUTOGRAD_NATIVE=0 skips the
native walker; =1 turns a failed build into an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile

import torch

from .. import flags
from ..degrade import describe_error, report
from . import readers

HERE = os.path.dirname(os.path.abspath(__file__))
# One extension from all of them; a changed header changes the build's tag as a changed source does.
SOURCES = [
    os.path.join(HERE, name)
    for name in ("walk.cpp", "key.cpp", "saved_reader.cpp", "table.cpp", "delivery.cpp", "node_hooks.cpp", "bindings.cpp")
]
HEADERS = [os.path.join(HERE, name) for name in ("walk.h", "key.h", "saved_reader.h", "table.h", "delivery.h", "node_hooks.h")]
BUILDING = "building gpuautograd's native walker, a minute or two, once"
LOST = (
    "the hit path is slower (5-10 µs per autograd node), and a backward with hooks runs eagerly (only the extension calls a node's hooks)"
)


class State:
    module = None
    reason: str | None = None  # why the native walker is not in use
    tried = False


state = State()  # read by api.backward on every loss.backward() (state.module)


def _tag() -> str:
    """The build's name: torch's version, then a hash of what goes into it (the sources, the
    readers' generator and the installed torch's Functions.h they are generated from)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS, readers.__file__, readers.header_path()):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:16]
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return f"torch{version}_{digest}"


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpuautograd", "native")


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on `path` (a file), held while the block runs."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_from(directory: str, name: str):
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(directory, name + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def _build(tag: str, final: str):
    """Compile into a fresh temporary directory next to `final`, then rename it into place."""
    from torch.utils import cpp_extension

    print(f"[gpuautograd] {BUILDING}", file=sys.stderr, flush=True)
    scratch = tempfile.mkdtemp(prefix=f".{tag}-", dir=os.path.dirname(final))
    try:
        readers.write(scratch)  # saved_readers.inc, which saved_reader.cpp includes
        module = cpp_extension.load(
            name=f"gpuautograd_native_{tag}",
            sources=SOURCES,
            build_directory=scratch,
            extra_include_paths=[scratch, HERE],
            extra_cflags=["-O2"],
            verbose=False,
        )
        os.rename(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return module


def _compile_or_load():
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r}) is on PATH")
    tag = _tag()
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, tag)
    name = f"gpuautograd_native_{tag}"
    with _locked(os.path.join(root, tag + ".lock")):
        module = _import_from(final, name) if os.path.isdir(final) else None
        return module if module is not None else _build(tag, final)


def load():
    """The compiled module, or None (then `reason()` says why). Builds at most once per process."""
    mode = flags.native()
    if mode == "0":
        return None  # not remembered: the flag is read on every backward
    if state.tried:
        if state.module is None and mode == "1":
            raise RuntimeError(f"GPUAUTOGRAD_NATIVE=1 but {state.reason}")
        return state.module
    state.tried = True
    try:
        state.module = _compile_or_load()
    except Exception as e:  # a missing compiler, ninja or header, or a compile error on this torch
        state.reason = f"the native walker could not be built ({describe_error(e)})"
        if mode == "1":
            raise RuntimeError(f"GPUAUTOGRAD_NATIVE=1 but {state.reason}") from e
        # slower, not wrong: reported like every fallback (logged once; a warning only on request)
        report(f"gpuautograd: {state.reason}; the Python walk runs instead: {LOST}")
    return state.module


def built():
    """The compiled module where an earlier load() built or found it, else None; builds nothing.
    For the per-call checks it answers faster than Python can (GPUAUTOGRAD_NATIVE=0: None)."""
    return state.module if flags.native() != "0" else None


def reason() -> str | None:
    """Why the native walker is not in use (None while it is, or before the first `load()`)."""
    if flags.native() == "0":
        return "GPUAUTOGRAD_NATIVE=0"
    return state.reason


__all__ = ["load", "built", "reason", "cache_root", "BUILDING"]
