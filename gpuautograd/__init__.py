"""gpuautograd: a functional, GPU-first replacement for `loss.backward()`."""

from . import rules  # noqa: F401 - registers every rule
from .api import Explanation, ValidationError, backward, compile_check, enable, explain, grad, reset, stats, validate

__all__ = ["backward", "grad", "enable", "explain", "validate", "compile_check", "stats", "reset", "Explanation", "ValidationError"]
__version__ = "0.1.0"
