"""The reference executor: one torch call per IR op, on any device.

The program is turned into the source of one flat Python function (a trace you can read), with
each op's reference implementation bound as a global. Values are deleted after their last use,
so saved activations and intermediates are freed as the backward goes, as in eager.
"""

from __future__ import annotations

import functools
import math

import torch

from ..ir.ops import get_op
from ..ir.program import Program, Value
from ..ir.registry import OPAQUE
from .reference_folds import plan_folds

# Ops written as one Python expression, not a call of their reference implementation: those are
# most of a program's lines (arithmetic, views, sums), and the call of a partial and a wrapper
# function costs about as much as the torch op on small tensors. Each template gives exactly the
# reference implementation's result (ir/ops.py). `torch_...` globals are torch functions bound once;
# `torch_linear` only serves the folds of reference_folds.py.
_BINARY = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}"}
_BINARY.update({"eq": "{} == {}", "ne": "{} != {}", "lt": "{} < {}", "le": "{} <= {}", "gt": "{} > {}", "ge": "{} >= {}"})
# Ops that are one torch function of their operands with `dim` before them: the function as is,
# not a wrapper taking `dim` as a keyword (gnn's scatter-mean backward is five of them).
_DIM_FIRST = {"gather": "torch_gather", "index_select": "torch_index_select"}
_DIM_SECOND = {"scatter": "torch_scatter", "scatter_add": "torch_scatter_add"}
_GLOBALS = {
    "torch": torch,
    "torch_sum": torch.sum,
    "torch_mm": torch.mm,
    "torch_bmm": torch.bmm,
    "torch_linear": torch.nn.functional.linear,
    "torch_where": torch.where,
    "torch_gather": torch.gather,
    "torch_index_select": torch.index_select,
    "torch_scatter": torch.scatter,
    "torch_scatter_add": torch.scatter_add,
}


def _ints(values) -> str:
    """Sizes or dims as call arguments: `x.reshape(2, 3)` parses faster than `x.reshape((2, 3))`."""
    values = tuple(values)
    return ", ".join(map(repr, values)) if values else "()"


def _inline(op: str, args: list[str], attrs: dict) -> str | None:
    """The expression for `op` on the argument sources `args`, or None where there is none."""
    if op in _BINARY:
        return _BINARY[op].format(*args)
    if op == "neg":
        return f"-{args[0]}"
    if op in ("reshape", "expand"):
        return f"{args[0]}.{op}({_ints(attrs['shape'])})"
    if op == "permute":
        return f"{args[0]}.permute({_ints(attrs['dims'])})"
    if op == "sum" and attrs["dims"] and attrs.get("dtype") is None:
        return f"torch_sum({args[0]}, {tuple(attrs['dims'])!r}, {attrs['keepdim']!r})"
    if op == "cast" and isinstance(attrs["dtype"], torch.dtype):
        return f"{args[0]}.to({attrs['dtype']})"  # repr: torch.float32
    if op in ("mm", "bmm"):
        return f"torch_{op}({args[0]}, {args[1]})"
    if op == "where":
        return f"torch_where({', '.join(args)})"
    if op in _DIM_FIRST:  # (x, index): torch.gather(x, dim, index), torch.index_select(x, dim, index)
        return f"{_DIM_FIRST[op]}({args[0]}, {attrs['dim']!r}, {args[1]})"
    if op in _DIM_SECOND:  # (base, index, src): torch.scatter_add(base, dim, index, src)
        return f"{_DIM_SECOND[op]}({args[0]}, {attrs['dim']!r}, {args[1]}, {args[2]})"
    if op == "slice":
        return _basic_slice(args[0], attrs)
    return None


def _basic_slice(src: str, attrs: dict) -> str | None:
    """aten.slice(x, dim, start, end, step) as Python's basic indexing, which calls that very op
    (negative bounds wrap, both are clamped to the size): a third of its cost through the wrapper."""
    dim, start, end, step = (attrs[k] for k in ("dim", "start", "end", "step"))
    if not all(type(v) is int for v in (dim, start, end, step)) or dim < 0 or step < 1:
        return None
    return f"{src}[{':, ' * dim}{start}:{end}:{step}]"


def inline_view(op: str, src: str, attrs: dict) -> str | None:
    """A reshape, expand or permute of the local `src` as one method call (None: another op)."""
    return _inline(op, [src], attrs) if op in ("reshape", "expand", "permute") else None


class CompiledProgram:
    def __init__(self, fn, source: str) -> None:
        self.fn = fn
        self.source = source

    def __call__(self, args: list):
        return self.fn(args)


def local_name(v: Value) -> str:
    """The Python local that holds `v` in generated executors: %s3 -> s3, %12 -> v12."""
    return v.name[1:] if v.prefix else "v" + str(v.id)


def _operand_source(x, env: dict) -> str:
    if isinstance(x, Value):
        return local_name(x)
    if isinstance(x, float) and not math.isfinite(x):
        const = f"const_{len(env)}"
        env[const] = x
        return const
    return repr(x)


def _expression(k: int, instr, args: list[str], env: dict, fold, inline: bool = True) -> str:
    """The right-hand side of instruction `k`: a fold, an inline expression or a bound call
    (`inline` False: always the op's own implementation)."""
    if fold is not None:
        return fold.template.format(*args)
    expression = _inline(instr.op, args, instr.attrs) if inline else None
    if expression is None:
        fn_name = f"{instr.op}_{k}"
        impl = get_op(instr.op).impl
        env[fn_name] = functools.partial(impl, **instr.attrs) if instr.attrs else impl
        expression = f"{fn_name}({', '.join(args)})"
    return expression


def compile_reference(program: Program) -> CompiledProgram:
    folds = plan_folds(program)
    absorbed = {f.absorbed: k for k, f in folds.items()}
    operands = [folds[k].operands if k in folds else instr.inputs for k, instr in enumerate(program.instrs)]
    last_use: dict[int, int] = {}
    for k, xs in enumerate(operands):
        for x in xs:
            if isinstance(x, Value) and k not in absorbed:
                last_use[id(x)] = k
    keep = {id(v) for v, _ in program.outputs if v is not None}

    env: dict = dict(_GLOBALS)
    lines = ["def backward(args):"]
    params = [local_name(v) for v, _ in program.inputs]
    if params:
        lines.append(f"    {', '.join(params)}, = args")
        lines.append("    args.clear()  # the program now holds the only references")
        dead = [local_name(v) for v, _ in program.inputs if id(v) not in last_use and id(v) not in keep]
        if dead:
            lines.append(f"    del {', '.join(dead)}")

    maybe_sparse: set[int] = set()  # values that come straight from an opaque node (see _add)
    for k, instr in enumerate(program.instrs):
        if get_op(instr.op).kind == OPAQUE or (instr.op == "cast" and id(instr.inputs[0]) in maybe_sparse):
            maybe_sparse.update(id(o) for o in instr.outputs if o is not None)
        if k in absorbed:
            continue
        fold = folds.get(k)
        args = [_operand_source(x, env) for x in operands[k]]
        outs = ["_" if o is None else local_name(o) for o in instr.outputs]
        many = len(outs) > 1 or get_op(instr.op).kind == OPAQUE
        lhs = ", ".join(outs) + ("," if many and len(outs) == 1 else "")
        note = f"  # {program.instrs[fold.absorbed].op}, {instr.op}" if fold is not None else ""
        # A custom backward may return a sparse gradient: its sums take ops.py's layout-aware add.
        sparse_add = instr.op == "add" and any(id(x) in maybe_sparse for x in instr.inputs)
        lines.append(f"    {lhs} = {_expression(k, instr, args, env, fold, inline=not sparse_add)}{note}")
        dead = [
            local_name(x)
            for x in {id(x): x for x in operands[k] if isinstance(x, Value)}.values()
            if last_use[id(x)] == k and id(x) not in keep
        ]
        dead += [local_name(o) for o in instr.outputs if o is not None and id(o) not in last_use and id(o) not in keep]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    rets = ["None" if v is None else local_name(v) for v, _ in program.outputs]
    lines.append(f"    return ({', '.join(rets)}{',' if len(rets) == 1 else ''})")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<gpuautograd backward>", "exec"), env)
    return CompiledProgram(env["backward"], source)
