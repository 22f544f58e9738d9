"""One launchable object per (kernel, backend): Triton's JIT on CUDA, its interpreter on the CPU.
Used by the kernels here and by the generated ones (`gpuautograd.codegen.compile`).

The kernels are plain functions, wrapped here rather than decorated: Triton's interpreter runs a
function wrapped in `InterpretedFunction` without TRITON_INTERPRET being set at import, and the
same function compiles through `triton.jit` (or ahead of time through `ASTSource`).
"""

import triton

_LAUNCHABLE: dict[tuple[object, bool], object] = {}


def launchable(fn, interpret: bool):
    key = (fn, interpret)
    kernel = _LAUNCHABLE.get(key)
    if kernel is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(fn)
        else:
            kernel = triton.jit(fn)
        _LAUNCHABLE[key] = kernel
    return kernel
