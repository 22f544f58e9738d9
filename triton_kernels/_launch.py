"""One launchable object per (kernel, backend): Triton's JIT on CUDA, its interpreter on the CPU.
Used by the kernels here and by the generated ones (`gpuautograd.codegen.compile`).

The kernels are plain functions, wrapped here rather than decorated: Triton's interpreter runs a
function wrapped in `InterpretedFunction` without TRITON_INTERPRET being set at import, and the
same function compiles through `triton.jit` (or ahead of time through `ASTSource`).
"""

import threading

import triton

# Triton's interpreter patches triton.language's module globals while a kernel runs, so two kernels
# interpreted at once on two threads break each other ("Did you forget to add @triton.jit ?"):
# interpreted launches take turns. (Compiled CUDA kernels need no such lock.)
_INTERPRETER = threading.Lock()


class _OneAtATime:
    """An interpreted kernel whose launches hold the interpreter lock: `kernel[grid](*args)`."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with _INTERPRETER:
                return launch(*args, **kwargs)

        return run


_LAUNCHABLE: dict[tuple[object, bool], object] = {}


def launchable(fn, interpret: bool):
    key = (fn, interpret)
    kernel = _LAUNCHABLE.get(key)
    if kernel is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = _OneAtATime(InterpretedFunction(fn))
        else:
            kernel = triton.jit(fn)
        _LAUNCHABLE[key] = kernel
    return kernel
