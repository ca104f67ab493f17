"""How `GraphCache` captures: as torch.cuda.graph does (device cache emptied, a side stream, the
cache's pool, thread-local errors), but keeping torch's pinned host cache, whose page-locked
buffers the warm-up reserves for the first batches' frames (`staging.reserve_pinned`). torch 2.11's
`torch.cuda.graph` empties it before every capture: on the H200 (2026-12-04) 16 full-HD scenes'
buffers then took 94.8 ms a scene to pin after a capture against 0.004 ms through `GraphCache`.
Checked on the CPU with torch's CUDA calls recorded."""

import contextlib

import torch

from worker.model.graphs import GraphCache


def test_a_capture_keeps_the_pinned_host_cache(monkeypatch):
    events = []

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            events.append(("begin", pool, capture_error_mode))

        def capture_end(self):
            events.append("end")

    @contextlib.contextmanager
    def on_stream(stream):
        events.append(("stream", stream))
        yield
        events.append("stream exit")

    side = object()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: side)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("device cache emptied"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: events.append("pinned host cache emptied"),
                        raising=False)
    cache = GraphCache(enabled=False)
    cache._pool = pool = (0, 7)

    def fn(x):
        events.append("fn")
        return x + 1

    x = torch.zeros(2)
    graph, static_in, out = cache._record(fn, [x])
    assert isinstance(graph, Graph) and static_in == [x] and torch.equal(out, x + 1)
    assert events == ["synchronize", "device cache emptied", ("stream", side), ("begin", pool, "thread_local"),
                      "fn", "end", "stream exit"]
    events.clear()
    cache._record(fn, [x])                              # one capture stream for every capture
    assert ("stream", side) in events and "pinned host cache emptied" not in events
