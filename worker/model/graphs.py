"""CUDA graphs keyed by shape: the first call of a key runs the function (twice, on a side
stream, to warm up), captures it, then replays; later calls copy their inputs into the captured
buffers and replay. Used for the decoder step per (rows, T), the draft pass and the expert's
whole flow-matching loop per rows bucket, all over persistent caches whose addresses never move.

Outputs are the graph's own buffers: consume them before the next call of the same key.
A call made while another key is being captured (or warmed up) runs plainly, inside that graph:
a whole decoding step captures its decoder step and draft pass with it. Disabled (plain calls) on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


class GraphCache:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._graphs: dict[Any, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}
        self._pool = torch.cuda.graph_pool_handle() if enabled else None
        self.captures = 0
        self.replays = 0
        self._capturing = False
        self._stream: torch.cuda.Stream | None = None     # the captures' stream, made on first capture

    def __len__(self) -> int:
        return len(self._graphs)

    def holds(self, key) -> bool:
        return key in self._graphs

    def static_inputs(self, key) -> list[torch.Tensor] | None:
        """The captured input buffers of `key` (None before its capture)."""
        entry = self._graphs.get(key)
        return None if entry is None else entry[1]

    def count(self, kind) -> int:
        """Graphs whose key starts with `kind` (keys are tuples, their first item the kind)."""
        return sum(1 for k in self._graphs if k[0] == kind)

    def clear(self) -> None:
        """Drop every graph (e.g. after swapping weights). Later captures use a new memory pool:
        capturing into a pool whose graphs were all freed trips an internal assert of torch's
        caching allocator (seen on torch 2.11 when the fp8 profile re-captured after bf16)."""
        self._graphs.clear()
        if self.enabled:
            self._pool = torch.cuda.graph_pool_handle()

    def run(self, key, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        """fn(*inputs) with every input a tensor; fn must only read/write tensors whose storage
        outlives the graph (persistent caches, weights) besides its inputs and outputs."""
        if not self.enabled or self._capturing:
            return fn(*inputs)
        entry = self._graphs.get(key)
        if entry is None:
            self._capturing = True
            try:
                entry = self._capture(fn, inputs)
            finally:
                self._capturing = False
            self._graphs[key] = entry
            self.captures += 1
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs):
            if dst is not src:                  # a caller may hand back the buffers themselves
                dst.copy_(src)
        graph.replay()
        self.replays += 1
        return static_out

    def _capture(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]):
        """Two warm-up calls (cuBLAS handles, Triton tuning), each from the inputs' values: fn may
        update its inputs in place (a decoding step advances its rows), and a warm-up that ran
        from the previous one's results would write past where the real call will."""
        static_in = [t.clone() for t in inputs]

        def restore():
            for dst, src in zip(static_in, inputs):
                dst.copy_(src)
        with self._warm_up_stream():
            for _ in range(2):
                restore()
                fn(*static_in)
        restore()
        return self._record(fn, static_in)

    @contextlib.contextmanager
    def _warm_up_stream(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, fn: Callable[..., Any], static_in: list[torch.Tensor]):
        """Capture fn as `torch.cuda.graph` does (synchronize, the device cache emptied, a side
        stream, the cache's pool, thread-local errors) but without emptying torch's pinned host
        cache, which torch.cuda.graph does before every capture: that dropped the page-locked
        buffers the warm-up keeps for the first batches' frames (`staging.reserve_pinned`; the
        expert's captures come after it), so the first batches pinned fresh ones again (~150 ms a
        full-HD scene on the H200), and so would a batch after any capture while serving."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(self._pool, capture_error_mode="thread_local")
            try:
                static_out = fn(*static_in)
            finally:
                graph.capture_end()
        return graph, static_in, static_out


def bucket(n: int, limit: int) -> int:
    """Smallest power of two >= n (rows are padded up to it so graphs are reused), capped."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max(limit, n))
