"""The pointer table: the addresses that change between replays, in one small device tensor.

On CUDA the host fills one of a few pinned buffers and copies it to the device table with a
non-blocking copy on the current stream, so the host never waits for the GPU. A buffer is reused
only after the event recorded behind its last copy has completed: rewriting a pinned buffer whose
copy is still queued would hand the queued replay the next call's addresses. On the CPU the table
is written in place.
"""

from __future__ import annotations

import torch

HOST_BUFFERS = 4  # how many backwards the host may run ahead of the GPU before it waits


class PointerTable:
    def __init__(self, slots: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        n = max(slots, 1)
        self.device_table = torch.zeros(n, dtype=torch.int64, device=device)
        if self.cuda:
            self.host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(HOST_BUFFERS)]
            self.events = [None] * HOST_BUFFERS
            self.turn = 0
            self.last_stream = None
            self.last_event = None
        else:
            self.host = [self.device_table]
        self.host_np = [h.numpy() for h in self.host]
        self.current = 0

    def begin(self) -> None:
        """Start a call: take a host buffer whose previous copy has finished."""
        if not self.cuda:
            return
        self.current = self.turn
        self.turn = (self.turn + 1) % HOST_BUFFERS
        event = self.events[self.current]
        if event is not None:
            event.synchronize()
        stream = torch.cuda.current_stream(self.device)
        if self.last_stream is not None and stream != self.last_stream:
            stream.wait_event(self.last_event)  # the previous call's replay still reads the device table

    def write(self, lo: int, addresses: list[int]) -> None:
        self.host_np[self.current][lo : lo + len(addresses)] = addresses

    def upload(self, lo: int, hi: int) -> None:
        if self.cuda:
            self.device_table[lo:hi].copy_(self.host[self.current][lo:hi], non_blocking=True)

    def end(self) -> None:
        """After the call's last replay: mark when its host buffer and the device table are free."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        self.events[self.current] = event
        self.last_stream, self.last_event = stream, event
