"""The worker's HTTP side port (aiohttp): health, models, metrics. No inference over HTTP.

* ``GET /v1/health/live``  200 while the process runs.
* ``GET /v1/health/ready`` 200 only after the engine is loaded and every K warmed (and the Kafka
  clients started); 503 before that and while draining.
* ``GET /v1/models``       ``engine.models_payload()`` (profile, speculative_decoding, k_values,
  speculative_model, ...).
* ``GET /v1/metrics`` and ``GET /metrics``: Prometheus text exposition.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from worker.metrics import CONTENT_TYPE_LATEST, WorkerMetrics

__all__ = ["HealthState", "make_app", "SidePort"]

log = logging.getLogger("alpamayo.http")


@dataclass
class HealthState:
    """What the side port reports; the service flips the flags."""

    metrics: WorkerMetrics
    models: Callable[[], dict]
    ready: bool = False
    status: str = "loading"          # loading | ready | draining | failed
    detail: dict = field(default_factory=dict)

    def set_ready(self, ready: bool, status: str) -> None:
        self.ready = ready
        self.status = status
        self.metrics.ready.set(1 if ready else 0)
        if ready:
            self.metrics.ready_since.set_to_current_time()


def make_app(state: HealthState) -> web.Application:
    async def live(_request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def ready(_request: web.Request) -> web.Response:
        body = {"status": state.status, **state.detail}
        return web.json_response(body, status=200 if state.ready else 503)

    async def models(_request: web.Request) -> web.Response:
        return web.json_response(state.models())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/v1/health/live", live)
    app.router.add_get("/v1/health/ready", ready)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/metrics", metrics)
    app.router.add_get("/metrics", metrics)
    return app


class SidePort:
    """Runs the app on the current event loop."""

    def __init__(self, state: HealthState, host: str, port: int):
        self.state, self.host, self.port = state, host, port
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None

    async def start(self) -> int:
        self._runner = web.AppRunner(make_app(self.state), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        log.info("side port on http://%s:%s", self.host, self.bound_port)
        return self.bound_port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
