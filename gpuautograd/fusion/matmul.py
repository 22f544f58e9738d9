"""Generated matmuls: an mm whose product one kernel reads takes that kernel's pointwise work as
an epilogue, or its column sums as partial sums of the tiles; an operand that is cheap to
recompute is computed as it is loaded (a prologue); a product another matmul's epilogue reads is
computed in that kernel, in a K loop of its own. Each choice goes through the cost model of
`fusion/heuristics.py`, and every "not fused" keeps its reason."""

from __future__ import annotations

import dataclasses

import torch

from ..codegen.kernel import NotFusible, Space, partial_sum_fits
from ..codegen.lowering import compute_dtype
from ..fusion import heuristics as H
from ..ir.printer import format_instr
from ..ir.program import Instr, Value
from ..ir.types import TensorType
from .analysis import Analysis, emit, is_space_sum
from .steps import Kernel, Library, kernel_bytes, step_reads

EPILOGUE_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def generated_matmul_reason(instr: Instr) -> str | None:
    """None when `instr` (an mm) can run as a generated Triton matmul, else why not."""
    a, b = instr.inputs
    y = instr.outputs[0]
    if y.dtype not in EPILOGUE_DTYPES or a.dtype != y.dtype or b.dtype != y.dtype:
        return f"{y.dtype} stays a library call"
    m, k = a.shape
    n = b.shape[1]
    if min(m, n, k) == 0 or min(m, n) == 1:
        return "a matrix-vector product (memory-bound: a library call reads it once)"
    if max(a.type.numel(), b.type.numel(), y.type.numel()) > H.INT32_LIMIT:
        return "an operand too large for 32-bit offsets"
    return None


def _call_bytes(instr: Instr) -> int:
    """Bytes the library call of an mm moves: both operands read, the product written."""
    return sum(v.type.numel() * v.dtype.itemsize for v in (*instr.inputs, instr.outputs[0]))


def prologue_pays(analysis: Analysis, instr: Instr, x: Value) -> bool:
    """Should the mm `instr` compute its operand `x` as it loads it instead of reading it stored?
    Where `x` is cheap to recompute, and the cost model estimates a generated matmul that skips
    storing `x` faster than the library call (with "always", wherever it is cheap)."""
    producer = analysis.producer.get(x.name)
    if H.MATMUL_EPILOGUES == "never" or instr.op != "mm" or generated_matmul_reason(instr) is not None:
        return False
    if producer is None or not analysis.fusible(producer) or x.name in analysis.realized or not analysis.recomputes_cheaply(x):
        return False
    if H.MATMUL_EPILOGUES == "always":
        return True
    a, b = instr.inputs
    y = instr.outputs[0]
    lib_bytes = _call_bytes(instr)
    stored = x.type.numel() * x.dtype.itemsize  # written by a kernel, read back by the library call
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return H.epilogue_pays(flops, str(y.dtype).removeprefix("torch."), (lib_bytes, stored, 1), (lib_bytes, 0, 1))


def matmul_kernel(analysis, instr: Instr, position: int, interpret: bool):
    """The generated kernel of an mm that computes an operand as it loads it, or why it can't be."""
    a, b = instr.inputs
    kernel = Kernel(Space((a.shape[0], b.shape[1]), contract=a.shape[1]), [instr.outputs[0]], position, matmul=instr)
    try:
        kernel.source = emit(analysis, kernel, None, "trial", interpret)
    except NotFusible as e:
        return str(e)
    return kernel


def fuse_epilogues(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool, ids) -> None:
    """A matmul whose result one kernel reads runs as a generated kernel that applies that kernel's
    pointwise work to each output tile before it stores it. The kernel's sums, if it has any,
    stay in a kernel of their own that reads the epilogue's results; a kernel that only adds the
    product up over its rows (a weight's gradient) becomes partial sums of the tiles. Taken where
    the cost model (`fusion/heuristics.py`) estimates the fused kernel faster on the GPU the
    project targets; a matmul generated for its prologue takes its epilogue wherever that moves
    fewer bytes (the generated matmul is paid for already)."""
    if H.MATMUL_EPILOGUES == "never":
        return
    prologue_matmuls = [k for k in merged if k.matmul is not None]  # none has an epilogue yet
    for lib in [s for s in libraries if s.instr.op == "mm"]:
        reason = _epilogue(analysis, merged, libraries, lib, interpret, ids)
        if reason is not None:
            decisions.append(f"not fused into a matmul epilogue: {format_instr(lib.instr)}: {reason}")
    for kern in prologue_matmuls:
        reason = _epilogue(analysis, merged, libraries, kern, interpret, ids)
        if reason is not None:
            decisions.append(f"generated for its prologue, without an epilogue: {format_instr(kern.matmul)}: {reason}")


def _epilogue(analysis, merged: list[Kernel], libraries: list[Library], step, interpret: bool, ids) -> str | None:
    """Fuse the matmul of `step` (a library call, or a matmul kernel generated for its prologue)
    with the kernel that reads its result, in place; None when done, else why not."""
    generated = isinstance(step, Kernel)
    instr = step.matmul if generated else step.instr
    a, b = instr.inputs
    y = instr.outputs[0]
    reason = generated_matmul_reason(instr)
    if reason is not None:
        return reason
    m, k = a.shape
    n = b.shape[1]
    if any(y.name in step_reads(analysis, s) for s in libraries if s is not step):
        return "a library call reads the product"
    readers = [kern for kern in merged if kern is not step and y.name in {v.name for v in kern.source.loads}]
    if len(readers) != 1:
        return f"{len(readers)} kernels read the product"
    consumer = readers[0]
    if consumer.matmul is not None:
        return _second_product(analysis, merged, libraries, step, consumer, interpret)
    sums = [v for v in consumer.members if is_space_sum(analysis, v)]
    tile = [v for v in consumer.members if v not in sums and v.type.numel() == m * n]
    rest = [v for v in consumer.members if v not in tile]
    space = Space((m, n), contract=k)
    if not tile and sums and len(rest) == len(sums):
        replacement = _sum_epilogue(analysis, space, instr, consumer, sums, interpret, ids)
        if isinstance(replacement, str):
            return replacement
        fused, remaining = replacement
    elif not tile:
        return "the kernel that reads it has no pointwise work over the product's elements"
    else:
        fused = Kernel(space, [y] + tile, consumer.first, matmul=instr)
        remaining = Kernel(consumer.space, rest, consumer.first) if rest else None
        try:
            if remaining is not None:
                remaining.source = emit(analysis, remaining, None, "trial", interpret)
            rest_reads_product = remaining is not None and y.name in {v.name for v in remaining.source.loads}
            stores = {v.name for v in tile} | ({y.name} if rest_reads_product or analysis.is_output(y) else set())
            fused.source = emit(analysis, fused, stores, "trial", interpret)
        except NotFusible as e:
            return str(e)
        if remaining is not None and {v.name for v in fused.source.loads} & {v.name for v in rest}:
            return "the epilogue reads a reduction of the kernel it came from"
    lib_bytes = kernel_bytes(step) if generated else _call_bytes(instr)
    consumer_bytes, fused_bytes = kernel_bytes(consumer), kernel_bytes(fused)
    rest_bytes = 0 if remaining is None else kernel_bytes(remaining)
    if fused_bytes + rest_bytes >= lib_bytes + consumer_bytes:
        return f"moves no fewer bytes ({fused_bytes + rest_bytes} against {lib_bytes + consumer_bytes})"
    before = (lib_bytes, consumer_bytes, 2)
    after = (fused_bytes, rest_bytes, 1 if remaining is None else 2)
    flops = 2.0 * m * n * k
    if not generated and H.MATMUL_EPILOGUES == "cost" and not H.epilogue_pays(flops, str(y.dtype).removeprefix("torch."), before, after):
        return "the cost model estimates the library call plus a separate kernel faster"
    at = merged.index(consumer)
    merged[at : at + 1] = [fused] + ([remaining] if remaining is not None else [])
    if generated:
        merged.remove(step)
    else:
        libraries.remove(step)
    return None


def _second_product(analysis, merged: list[Kernel], libraries: list[Library], step, consumer: Kernel, interpret: bool) -> str | None:
    """The product of `step` feeds another matmul kernel's epilogue (a sum of two products: SwiGLU's
    or attention's input gradient): that kernel computes this product's tile too, in a K loop of its
    own, instead of loading it. In place; None when done, else why not."""
    generated = isinstance(step, Kernel)
    instr = step.matmul if generated else step.instr
    a, b = instr.inputs
    y = instr.outputs[0]
    if consumer.space.shape != (a.shape[0], b.shape[1]) or analysis.is_output(y):
        return "the product is read by another matmul's epilogue at another shape, or returned"
    if generated and (step.extra_matmuls or step.partials or len(step.members) != 1):
        return "the product's kernel has work of its own"
    stored = {v.name for v in consumer.source.stores}
    trial = dataclasses.replace(consumer, extra_matmuls=consumer.extra_matmuls + (instr,), source=None)
    try:
        trial.source = emit(analysis, trial, {m.name for m in consumer.members if m.name in stored}, "trial", interpret)
    except NotFusible as e:
        return str(e)
    if y.name in {v.name for v in trial.source.loads}:
        return "the epilogue reads the product at another index than its tile"
    lib_bytes = kernel_bytes(step) if generated else _call_bytes(instr)
    before, after = kernel_bytes(consumer) + lib_bytes, kernel_bytes(trial)
    if after >= before:
        return f"moves no fewer bytes ({after} against {before})"
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    dtype = str(y.dtype).removeprefix("torch.")
    # the library call and its launch, against the bytes the kernel reads in addition (no launch)
    pays = H.epilogue_pays(flops, dtype, (lib_bytes, 0, 1), (after - kernel_bytes(consumer), 0, 0))
    if not generated and H.MATMUL_EPILOGUES == "cost" and not pays:
        return "the cost model estimates the library call faster than a second product in the epilogue"
    merged[merged.index(consumer)] = trial
    if generated:
        merged.remove(step)
    else:
        libraries.remove(step)
    return None


def _sum_epilogue(analysis, space: Space, instr: Instr, consumer: Kernel, sums: list[Value], interpret: bool, ids):
    """The matmul kernel and a finisher that replace a kernel of column sums of the product (and of
    what it computes from it): each tile adds up its rows, the finisher adds the row blocks up.
    Returns (fused, finisher), or why not."""
    y = instr.outputs[0]
    if not all(partial_sum_fits(space, analysis.producer[v.name]) for v in sums):
        return "the kernel that reads it adds up other dims than the product's rows"
    blocks = H.matmul_row_tiles(*space.shape, space.contract, interpret)
    pairs = []
    for v in sums:
        buffer_type = TensorType((blocks, v.type.numel()), compute_dtype(v.dtype), v.device)
        pairs.append((Value(next(ids), buffer_type, v.origin), v))
    fused = Kernel(space, [y], consumer.first, matmul=instr, partials=pairs)
    finisher = Kernel(Space((len(pairs), space.shape[1])), list(sums), consumer.first, partials=pairs, finisher=True)
    try:
        fused.source = emit(analysis, fused, {y.name} if analysis.is_output(y) else set(), "trial", interpret)
        finisher.source = emit(analysis, finisher, None, "trial", interpret)
    except NotFusible as e:
        return str(e)
    return fused, finisher
