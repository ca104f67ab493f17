"""A GraphCache that replays on the CPU: "capture" records the function and its static buffers,
"replay" runs it again over those buffers (nested calls plain, as inside a real capture) and writes
its results into the captured outputs. What it checks on the CPU is the graph wiring: that a graphed
call reads only its inputs' buffers, and its caller only the outputs' buffers, across keys and
batches. Host work baked in at capture is not modelled (a real capture refuses host reads)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from worker.model.graphs import GraphCache


class _Replay:
    def __init__(self, cache: "ReplayingGraphs", fn, static_in, static_out):
        self.cache, self.fn, self.static_in, self.static_out = cache, fn, static_in, static_out

    def replay(self) -> None:
        self.cache._capturing = True
        try:
            fresh = self.fn(*self.static_in)
        finally:
            self.cache._capturing = False
        for dst, src in zip(tree_flatten(self.static_out)[0], tree_flatten(fresh)[0]):
            if isinstance(dst, torch.Tensor) and dst is not src:
                dst.copy_(src)


class ReplayingGraphs(GraphCache):
    def __init__(self):
        super().__init__(enabled=False)
        self.enabled = True

    def clear(self) -> None:
        self._graphs.clear()

    def _warm_up_stream(self):
        return contextlib.nullcontext()

    def _record(self, fn, static_in):
        static_out = fn(*static_in)          # a real capture records without running; run() copies the inputs in again
        return _Replay(self, fn, static_in, static_out), static_in, static_out


def use_replaying_graphs(rt) -> ReplayingGraphs:
    """Swap a runtime (after enable_graphs) onto a ReplayingGraphs."""
    g = ReplayingGraphs()
    rt.graphs = rt.decoder.graphs = g
    return g
