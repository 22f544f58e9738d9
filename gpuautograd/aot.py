"""Ahead-of-time compilation of a captured backward's kernels for CUDA, with no GPU present.

`compile_check` plans the backward exactly as the "triton" backend would (GPU block sizes) and
compiles every generated kernel with `triton.compile` for each target architecture. A build
machine without a GPU can prove that the kernels compile for the GPU it ships to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .codegen.compile import body_hash, compile_ahead


@dataclass(frozen=True)
class CompileFailure:
    kernel: str
    arch: int
    message: str

    def __str__(self) -> str:
        return f"{self.kernel} for sm_{self.arch}: {self.message}"


@dataclass
class CompileReport:
    kernels: int = 0  # distinct kernels in the plan
    compiled: int = 0  # successful (kernel, arch) compilations
    failures: list[CompileFailure] = field(default_factory=list)
    archs: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        archs = ", ".join(f"sm_{a}" for a in self.archs)
        head = f"compile_check: {self.kernels} kernels x [{archs}]: {self.compiled} compiled, {len(self.failures)} failed"
        return "\n".join([head] + [f"  FAILED {f}" for f in self.failures])


def compile_kernels(kernel_sources, archs, report: CompileReport) -> CompileReport:
    """Compile each distinct kernel body once per arch; kernels that share a body (the same block in
    another layer) share its result, as they share one compiled function at run time."""
    report.archs = tuple(archs)
    outcome: dict[tuple[str, int], str | None] = {}  # (body hash, arch) -> the error, or None
    for ks in kernel_sources:
        report.kernels += 1
        for arch in archs:
            key = (body_hash(ks), arch)
            if key not in outcome:
                try:
                    compile_ahead(ks, arch)
                    outcome[key] = None
                except Exception as e:  # the compiler's own message is the useful part
                    outcome[key] = f"{type(e).__name__}: {str(e).strip() or type(e).__name__}"
            if outcome[key] is None:
                report.compiled += 1
            else:
                report.failures.append(CompileFailure(ks.name, arch, outcome[key]))
    return report
