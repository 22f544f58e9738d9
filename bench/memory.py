"""What a backward leaves alive: the bytes of saved activations still held after it returns,
while the user keeps `loss`, for eager torch and gpuautograd side by side in one run.

    python -m bench.memory [--device cpu|cuda]

Eager backward releases every executed node's saved tensors. gpuautograd must too, or the next
forward would run with the previous step's activations still allocated. Parameters and inputs
stay alive in both (the model and the batch hold them), so they are not counted. On CUDA the peak
allocated during the backward is printed as well.
"""

from __future__ import annotations

import argparse

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gpuautograd
from gpuautograd.capture.walk import walk

from .models import SUITE


def _saved_activations(loss, held: set[int]) -> list[tuple[StorageWeakRef, int]]:
    """Weak references to the storages the graph saved, except those of parameters and inputs."""
    seen, out = set(), []
    for t in walk([loss.grad_fn]).saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key in held or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append((StorageWeakRef(storage), storage.nbytes()))
    return out


def measure(name: str, device: str) -> dict:
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](device=device)
    batch = make_batch(torch.Generator().manual_seed(0))
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    held |= {x.untyped_storage().data_ptr() for x in batch}
    gpuautograd.backward(loss_fn(model, *batch))  # capture once, so both rows measure a steady step
    row = {"model": name, "device": device}
    for mode in ("eager", "gpuautograd"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = loss_fn(model, *batch)
        refs = _saved_activations(loss, held)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        if mode == "eager":
            loss.backward()
        else:
            gpuautograd.backward(loss)
        if device == "cuda":
            torch.cuda.synchronize()
            row[f"{mode}_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        row["saved_bytes"] = sum(n for _, n in refs)
        row[f"{mode}_retained_bytes"] = sum(n for ref, n in refs if not ref.expired())
        del loss
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    print(f"saved activations still alive after backward, with `loss` held ({args.device}):")
    print(
        f"{'model':>16} {'saved KiB':>10} {'eager KiB':>10} {'gpuautograd KiB':>16}"
        + ("  peak eager / gpuautograd KiB" if args.device == "cuda" else "")
    )
    for name in SUITE:
        r = measure(name, args.device)
        kib = {k: v / 1024 for k, v in r.items() if k.endswith("_bytes")}
        line = f"{name:>16} {kib['saved_bytes']:>10.1f} {kib['eager_retained_bytes']:>10.1f} {kib['gpuautograd_retained_bytes']:>16.1f}"
        if args.device == "cuda":
            line += f"  {kib['eager_peak_bytes']:.1f} / {kib['gpuautograd_peak_bytes']:.1f}"
        print(line)


if __name__ == "__main__":
    main()
