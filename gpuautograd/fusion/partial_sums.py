"""Column sums added up where the rows are: a kernel that computes a sum's rows block by block
stores one partial sum per program, and a small finisher adds the blocks up; finishers of the
same width run as one launch."""

from __future__ import annotations

import dataclasses

from ..codegen.kernel import NotFusible, Space, partial_sum_fits
from ..codegen.lowering import compute_dtype
from ..fusion import heuristics as H
from ..ir.ops import get_op
from ..ir.program import Value
from ..ir.types import TensorType
from .analysis import emit, is_space_sum
from .steps import Kernel, Library, kernel_bytes, kernel_names, reaches, schedule, step_writes, successors


def split_column_sums(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool, ids) -> None:
    """A kernel of column sums (a bias's or a norm weight's gradient: a sum over every row)
    re-reads what another kernel computes row block by row block. That kernel can add up its own
    rows of each sum instead and store one partial sum per program; a small kernel then adds the
    partials up. The column-sum kernel's other members (a norm's input gradient, merged there in
    bfloat16) move into such a kernel too: the column-sum kernel goes whole or stays (so launches
    never grow), and only where the plan then moves fewer bytes."""
    if not H.PARTIAL_COLUMN_SUMS:
        return
    for kern in list(merged):
        if kern.finisher or kern.matmul is not None or not _column_sums(analysis, merged, kern):
            continue
        reason = _split(analysis, merged, libraries, kern, ids, interpret)
        if reason is not None:
            decisions.append(f"column sums {kernel_names(kern)} not split into partial sums: {reason}")


def _column_sums(analysis, merged: list[Kernel], kern: Kernel) -> bool:
    """Does `kern` hold sums, each of which another kernel could add up as partial sums?"""
    sums = [analysis.producer[v.name] for v in kern.members if is_space_sum(analysis, v)]
    return bool(sums) and all(any(k is not kern and partial_sum_fits(k.space, i) for k in merged) for i in sums)


def _sole_casts(analysis, kern: Kernel, sums: list[Value]) -> dict[str, Value]:
    """Members that only cast one of the sums (a bfloat16 weight's gradient, summed in float32): the
    finisher stores the cast instead of the sum, when nothing else reads the sum."""
    casts = {}
    for m in kern.members:
        instr = analysis.producer[m.name]
        if instr.op != "cast" or not isinstance(instr.inputs[0], Value):
            continue
        s = instr.inputs[0]
        readers = analysis.users.get(s.name, [])
        if s in sums and readers == [analysis.position[id(instr)]] and not analysis.is_output(s):
            casts[s.name] = m
    return casts


def _split(analysis, merged: list[Kernel], libraries: list[Library], kern: Kernel, ids, interpret: bool) -> str | None:
    """Each sum goes, as partial sums, to the kernel that computes its rows for the fewest added
    bytes; each other member joins such a kernel the same way. Then the finisher replaces `kern`,
    if the steps still form no cycle."""
    steps = merged + libraries
    writer = {name: step for step in steps for name in step_writes(step)}
    succ = successors(analysis, steps, libraries)
    own = {m.name for m in kern.members}
    chosen: dict[int, list] = {}  # id(host) -> [host, its trial, partial pairs, joined members]
    sums = [m for m in kern.members if is_space_sum(analysis, m)]
    casts = _sole_casts(analysis, kern, sums)
    cast_members = {c.name for c in casts.values()}
    for m in sums + [m for m in kern.members if m not in sums and m.name not in cast_members]:
        is_sum = m in sums
        best = None
        for host in merged:
            if host is kern or host.finisher:
                continue
            if is_sum and not partial_sum_fits(host.space, analysis.producer[m.name]):
                continue
            _, current, pairs, joined = chosen.get(id(host), (host, host, [], []))
            if is_sum:
                partial_type = TensorType((_row_blocks(host, interpret), m.type.numel()), compute_dtype(m.dtype), m.device)
                buffer = Value(next(ids), partial_type, m.origin)  # one row per program, in the sum's accumulation dtype
                pairs, joins = pairs + [(buffer, m)], joined
            else:
                pairs, joins = pairs, joined + [m]
            trial = dataclasses.replace(host, members=host.members + joins, partials=host.partials + pairs, source=None)
            stored = ({v.name for v in host.source.stores} - {b.name for b, _ in host.partials}) | {v.name for v in joins}
            try:
                trial.source = emit(analysis, trial, stored, "trial", interpret)
            except NotFusible:
                continue
            added = {v.name for v in trial.source.loads} - {v.name for v in host.source.loads}
            if {v.name for v in trial.source.loads} & own:
                continue  # it would read what it is taking over
            if any(name in writer and reaches(succ, host, writer[name]) for name in added):
                continue  # what it would read is computed after it
            cost = kernel_bytes(trial) - kernel_bytes(current)
            if best is None or cost < best[0]:
                best = (cost, host, trial, pairs, joins)
        if best is None:
            return f"no kernel computes {m.name}'s rows without a cycle"
        _, host, trial, pairs, joins = best
        chosen[id(host)] = [host, trial, pairs, joins]
    pairs = [pair for _, _, group, _ in chosen.values() for pair in group]
    outs = [casts.get(s.name, s) for _, s in pairs]
    finisher = Kernel(Space((len(pairs), pairs[0][0].shape[1])), outs, kern.first, partials=pairs, finisher=True)
    finisher.source = emit(analysis, finisher, None, "trial", interpret)
    before = kernel_bytes(kern)
    after = kernel_bytes(finisher) + sum(kernel_bytes(trial) - kernel_bytes(host) for host, trial, _, _ in chosen.values())
    if after >= before:
        return f"moves no fewer bytes ({after} against {before})"
    proposal = list(merged)
    for host, trial, _, _ in chosen.values():
        proposal[proposal.index(host)] = trial
    proposal[proposal.index(kern)] = finisher
    try:
        schedule(analysis, proposal, libraries)
    except RuntimeError:
        return "the steps would form a cycle"
    merged[:] = proposal
    return None


def merge_finishers(analysis, merged: list[Kernel], libraries: list[Library], decisions, interpret: bool) -> None:
    """Finishers of the same width (each layer norm's weight and bias gradients, in bfloat16 split
    layer by layer) add their partial sums up in one launch. Not where steps have effects (a hook
    or a DDP bucket would wait for the last layer's sums), nor where it would form a cycle."""
    if any(get_op(s.instr.op).effect for s in libraries):
        return
    by_width: dict[int, list[Kernel]] = {}
    for kern in merged:
        if kern.finisher:
            by_width.setdefault(kern.partials[0][0].shape[1], []).append(kern)  # the columns it adds up
    for width, group in by_width.items():
        if len(group) < 2:
            continue
        pairs = [pair for kern in group for pair in kern.partials]
        outs = [m for kern in group for m in kern.members]
        one = Kernel(Space((len(pairs), width)), outs, max(k.first for k in group), partials=pairs, finisher=True)
        proposal = [k for k in merged if k not in group] + [one]
        try:
            one.source = emit(analysis, one, None, "trial", interpret)
            schedule(analysis, proposal, libraries)
        except (NotFusible, RuntimeError):
            decisions.append(f"finishers {', '.join(kernel_names(k) for k in group)} not merged: the steps would form a cycle")
            continue
        merged[:] = proposal


def _row_blocks(host: Kernel, interpret: bool) -> int:
    """How many programs split the rows of `host`: one partial sum each."""
    sp = host.space
    if sp.contract:
        return H.matmul_row_tiles(*sp.shape, sp.contract, interpret)
    return host.source.grid[0]
