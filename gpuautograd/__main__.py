"""Command line: `python -m gpuautograd compile-check ...`.

compile-check captures a backward on the CPU and compiles all its kernels for CUDA ahead of time:

    python -m gpuautograd compile-check --model gpt --model llama --arch 80 --arch 90
    python -m gpuautograd compile-check --factory mypkg.train:make_loss

A factory is `module:function`; the function returns a loss tensor, or the triple
(model, make_batch(generator), loss_fn(model, *batch)) that bench/models.py uses. Exits with 1
when any kernel fails to compile.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch


def _loss_from_factory(factory) -> torch.Tensor:
    made = factory()
    if isinstance(made, torch.Tensor):
        return made
    model, make_batch, loss_fn = made
    return loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))


def _factories(args) -> list[tuple[str, object]]:
    out = []
    if args.model:
        from bench.models import SUITE  # the repository's model suite

        for name in args.model:
            if name not in SUITE:
                raise SystemExit(f"unknown model {name!r}; the suite has {sorted(SUITE)}")
            out.append((name, SUITE[name]))
    for spec in args.factory or ():
        module, _, fn = spec.partition(":")
        if not fn:
            raise SystemExit(f"--factory takes module:function, got {spec!r}")
        out.append((spec, getattr(importlib.import_module(module), fn)))
    if not out:
        raise SystemExit("compile-check needs at least one --model or --factory")
    return out


def compile_check_main(argv) -> int:
    import gpuautograd

    parser = argparse.ArgumentParser(prog="python -m gpuautograd compile-check", description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", action="append", help="a model of bench/models.py SUITE (repeatable)")
    parser.add_argument("--factory", action="append", help="module:function returning a loss (repeatable)")
    parser.add_argument("--arch", action="append", type=int, help="CUDA compute capability as 80, 90 (default: 80 and 90)")
    parser.add_argument("--backend", default="cudagraph", choices=("cudagraph", "triton"), help="whose kernels (default: cudagraph)")
    args = parser.parse_args(argv)
    archs = tuple(args.arch or (80, 90))
    failed = 0
    for name, factory in _factories(args):
        report = gpuautograd.compile_check(_loss_from_factory(factory), archs=archs, backend=args.backend)
        print(f"{name}: {report}")
        failed += len(report.failures)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "compile-check":
        print(
            "usage: python -m gpuautograd compile-check [--model NAME] [--factory module:function] [--arch N] [--backend cudagraph|triton]",
            file=sys.stderr,
        )
        return 2
    return compile_check_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
