"""Turn generated kernel source into launchable functions, cached by source hash.

The same source runs in Triton's interpreter (CPU tensors) or is compiled by Triton's JIT (CUDA),
and compiles ahead of time for any CUDA architecture with no GPU present (`compile_ahead`).
With GPUAUTOGRAD_DUMP_DIR set, every kernel is written there and loaded from that file, so
tracebacks and profilers point at readable source.
"""

from __future__ import annotations

import hashlib
import linecache
import os

import torch

from .. import flags
from ..degrade import describe_error, report
from ..runtime import stats as stats_module
from .kernel import KernelSource

_FUNCTIONS: dict[str, object] = {}  # body hash -> the Python function of the kernel

TRITON_TYPES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def body_hash(ks: KernelSource) -> str:
    """Kernels that differ only in their name and header comment (the same block in another layer)
    share one function, so a deep model compiles each distinct kernel once."""
    body = ks.source[ks.source.index("@triton.jit") :].replace(f"def {ks.name}(", "def kernel(", 1)
    return source_hash(body)


def _module_text(ks: KernelSource) -> str:
    return "import triton\nimport triton.language as tl\n\n\n" + ks.source


def dump_kernel(ks: KernelSource) -> str | None:
    """Write the kernel to GPUAUTOGRAD_DUMP_DIR when it is set (also a kernel loaded before it was
    set); returns the file's path, or None."""
    dump = flags.dump_dir()
    if not dump:
        return None
    filename = os.path.join(dump, f"{ks.name}_{source_hash(ks.source)}.py")
    if not os.path.exists(filename):
        os.makedirs(dump, exist_ok=True)
        with open(filename, "w") as f:
            f.write(_module_text(ks))
    return filename


def python_function(ks: KernelSource):
    """exec the kernel's source once per distinct body; register it so inspect can read it."""
    import triton
    import triton.language as tl

    digest = body_hash(ks)
    filename = dump_kernel(ks)
    fn = _FUNCTIONS.get(digest)
    if fn is not None:
        return fn
    text = _module_text(ks)
    if filename is None:
        filename = f"<gpuautograd kernel {source_hash(ks.source)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    # exec'd undecorated (the decorator line stays as a comment, so line numbers match the file):
    # each backend wraps the plain function itself
    src = text.replace("@triton.jit\n", "# @triton.jit\n")
    namespace = {"triton": triton, "tl": tl}
    exec(compile(src, filename, "exec"), namespace)
    fn = namespace[ks.name]
    _FUNCTIONS[digest] = fn
    return fn


def launchable(ks: KernelSource, interpret: bool):
    """The kernel as Triton's JIT (CUDA) or interpreter (CPU) runs it, one per distinct body."""
    from ..triton_kernels._launch import launchable as wrap

    dump_kernel(ks)
    return wrap(python_function(ks), interpret)


class Launcher:
    """Launches one kernel; if compiling or launching fails, reports it once and runs `fallback`
    (the kernel's instructions through the reference ops) from then on. Without a fallback (a
    kernel reading a pointer table has no tensors to hand one) the error propagates."""

    def __init__(self, ks: KernelSource, interpret: bool, fallback=None) -> None:
        self.ks = ks
        self.interpret = interpret
        self.fallback = fallback
        self.failed: str | None = None
        self.kernel = None
        self.grid = ks.grid
        self.options = dict(ks.constexprs)
        if not interpret:
            self.options["num_warps"] = ks.num_warps

    def launch(self, *args):
        if self.kernel is None:
            self.kernel = launchable(self.ks, self.interpret)
        self.kernel[self.grid](*args, **self.options)

    def __call__(self, *args):
        if self.fallback is None:
            return self.launch(*args)
        if self.failed is None:
            try:
                return self.launch(*args)
            except Exception as e:  # a compiler or launch error: keep the gradients right
                self.failed = describe_error(e)
                stats_module.STATS.kernel_fallbacks[self.ks.name] += 1
                report(
                    f"gpuautograd: kernel {self.ks.name} ({self.ks.space}) failed ({self.failed}); "
                    "its instructions run as reference torch ops instead"
                )
        n_in = len(self.ks.loads)
        self.fallback(args[:n_in], args[n_in : n_in + len(self.ks.stores)])


def signature(ks: KernelSource) -> tuple[dict, dict]:
    """ASTSource signature and constexprs of a kernel, from its parameters' dtypes."""
    sig = {}
    buffers = [(f"in{k}", v) for k, v in enumerate(ks.loads)] + [(f"out{k}", m) for k, m in enumerate(ks.stores)]
    for name, v in buffers:
        if name in ks.table_params:  # the address of the pointer-table slot that holds the base pointer
            sig[f"{name}_ref"] = "*i64"
        else:
            sig[name] = "*" + TRITON_TYPES[v.dtype]
    for v in ks.runtime_strides:
        k = ks.loads.index(v)
        for d in range(v.ndim):
            sig[f"in{k}_s{d}"] = "i64" if ks.int64 else "i32"
    for name in ks.constexprs:
        sig[name] = "constexpr"
    return sig, dict(ks.constexprs)


def compile_ahead(ks: KernelSource, arch: int):
    """Compile one kernel for CUDA sm_<arch> with no GPU (raises the compiler's error)."""
    from ..triton_kernels.aot import compile_function

    sig, constexprs = signature(ks)
    runtime_sig = {name: ty for name, ty in sig.items() if ty != "constexpr"}
    return compile_function(python_function(ks), runtime_sig, {**constexprs, "num_warps": ks.num_warps}, [], arch)
