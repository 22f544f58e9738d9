"""What torch's engine tells a hook about the backward it runs in, when gpuautograd runs that backward.

A backward with hooks runs functionally inside a one-node graph task (distributed/graph_task.py),
so the engine's own introspection would describe that task, not the user's graph. Two functions
read the running task's graph:
- `torch._C._will_engine_execute_node(node)`: torch.autograd.graph.register_multi_grad_hook
  counts with it how many of its tensors get a gradient;
- `torch._C._current_graph_task_execution_order()`: the nodes in the order the engine runs them.
While a functional backward runs (on this thread), both answer for the user's graph, computed
from its roots and inputs as torch's engine computes them (engine.cpp: compute_dependencies,
init_to_execute, get_current_graph_task_execution_order); otherwise they are torch's own.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import Node

_ORIGINAL_WILL_EXECUTE = torch._C._will_engine_execute_node
_ORIGINAL_EXECUTION_ORDER = torch._C._current_graph_task_execution_order


@dataclass
class GraphView:
    roots: list  # the functions of the root edges (torch's graph_roots_)
    targets: list | None  # the functions of the inputs' edges, for grad() and backward(inputs=)
    captures: bool  # grad(): the inputs' gradients are captured, not accumulated
    _reachable: set | None = field(default=None, repr=False)
    _needed: set | None = field(default=None, repr=False)

    def reachable(self) -> set:
        """torch's nodes_in_graph_: every node an edge leads to from the graph's root (one root
        edge: the engine starts at that node itself, which is not its own successor)."""
        if self._reachable is None:
            if len(self.roots) == 1:
                stack = [nxt for nxt, _ in self.roots[0].next_functions if nxt is not None]
            else:
                stack = list(self.roots)
            seen = set(stack)
            while stack:
                for nxt, _ in stack.pop().next_functions:
                    if nxt is not None and nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            self._reachable = seen
        return self._reachable

    def needed(self) -> set:
        """Nodes whose exec_info says they run when there are inputs: on a path to one of them.
        Walked without recursion (a deep graph would pass Python's limit): forward from the roots
        to collect each node's predecessors, then backward from the targets."""
        if self._needed is None:
            predecessors: dict = {}
            seen, stack = set(self.roots), list(self.roots)
            while stack:
                fn = stack.pop()
                for nxt, _ in fn.next_functions:
                    if nxt is None:
                        continue
                    predecessors.setdefault(nxt, []).append(fn)
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            needed = {fn for fn in self.targets or () if fn in seen}
            stack = list(needed)
            while stack:
                for pred in predecessors.get(stack.pop(), ()):
                    if pred not in needed:
                        needed.add(pred)
                        stack.append(pred)
            self._needed = needed
        return self._needed

    def will_execute(self, fn) -> bool:
        if fn not in self.reachable():
            return False
        if self.targets is None:
            return True
        if fn not in self.needed():
            return False
        if self.captures and fn in self.targets and fn.name() == "torch::autograd::AccumulateGrad":
            raise RuntimeError(
                "A leaf node was passed to _will_engine_execute_node but we are currently running "
                "autograd.grad(). This is currently not supported."
            )
        return True

    def execution_order(self) -> list:
        if torch.autograd.is_multithreading_enabled():
            raise RuntimeError(
                "get_current_graph_task_execution_order expects the current backward to be executed with "
                "multithreading disabled, e.g. by running:\n\n>>> with torch.autograd.set_multithreading_enabled(False):\n"
                "...     torch.autograd.grad(...)\n"
            )

        # Kahn's algorithm as the engine schedules a single thread: a node is ready once every
        # edge into it has delivered, and the ready node with the highest sequence number runs first
        def successors(fn):
            return [n for n, _ in fn.next_functions if n is not None and (self.targets is None or n in self.needed())]

        deps: dict = {}
        seen, stack = set(self.roots), list(self.roots)
        while stack:
            for nxt in successors(stack.pop()):
                deps[nxt] = deps.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        tick = itertools.count()
        heap = [(-fn._sequence_nr(), next(tick), fn) for fn in dict.fromkeys(self.roots) if not deps.get(fn)]
        heapq.heapify(heap)
        order = []
        while heap:
            _, _, fn = heapq.heappop(heap)
            order.append(fn)
            for nxt in successors(fn):
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(heap, (-nxt._sequence_nr(), next(tick), nxt))
        return order


class _Current(threading.local):
    view: GraphView | None = None


_current = _Current()


@contextlib.contextmanager
def running(view: GraphView):
    """The functional backward of `view` runs on this thread (a hook's own backward nests)."""
    outer, _current.view = _current.view, view
    try:
        yield
    finally:
        _current.view = outer


def _will_engine_execute_node(node):
    view = _current.view
    if view is None or not isinstance(node, Node):
        return _ORIGINAL_WILL_EXECUTE(node)
    return view.will_execute(node)


def _current_graph_task_execution_order():
    view = _current.view
    return _ORIGINAL_EXECUTION_ORDER() if view is None else view.execution_order()


def install() -> None:
    torch._C._will_engine_execute_node = _will_engine_execute_node
    torch._C._current_graph_task_execution_order = _current_graph_task_execution_order
