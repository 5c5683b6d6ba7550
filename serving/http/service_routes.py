"""The routes that describe the service rather than serve a completion: the models it
offers (`/v1/models`), whether it can serve (`/health`) and its metrics (`/metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from policies.model_routing import AUTO_MODEL
from serving.config import PoolConfig
from serving.http.routes import Call, Route
from serving.http.schemas.responses import ModelCard, ModelList, PoolModel
from serving.http.student_router import StudentRouter
from serving.pools.pool_monitor import PoolMonitor
from serving.pools.slo_watch import SloWatch
from serving.telemetry import Telemetry


@dataclass(frozen=True)
class ServiceRoutes:
    """Handlers over the ingress's live view of its pools; none of them touches a pool."""

    model_names: tuple[str, ...]
    pools: tuple[PoolConfig, ...]
    monitor: PoolMonitor
    slo_watch: SloWatch
    telemetry: Telemetry
    router: StudentRouter | None = None
    """The difficulty router's choice, with a small model."""

    def routes(self) -> dict[tuple[str, str], Route]:
        """Method and path of each route; only /health answers without a key."""
        return {
            ("GET", "/v1/models"): Route(self._list_models),
            ("GET", "/health"): Route(self._health, public=True),
            ("GET", "/metrics"): Route(self._metrics),
        }

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Every pool's name, as health reports them."""
        return tuple(pool.name for pool in self.pools)

    async def _list_models(self, request: Request, call: Call) -> Response:
        """The models requests may name (`auto`, which lets the router choose, is not one),
        each with the pools serving it, their context lengths and whether a seed reproduces."""
        names = [n for n in self.model_names if n != AUTO_MODEL]
        cards = [self._model_card(name) for name in names]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    def _model_card(self, name: str) -> ModelCard:
        pools = [
            PoolModel(
                pool=pool.name,
                model=pool.engine.model,
                max_model_len=self.monitor.reported_max_model_len(pool.name),
                seeded_reproducible=self._seeded_reproducible(pool.name),
            )
            for pool in self.pools
            if pool.model_name == name
        ]
        lengths = [p.max_model_len for p in pools if p.max_model_len is not None]
        reproducible = [p.seeded_reproducible for p in pools]
        return ModelCard(
            id=name, created=0, max_model_len=max(lengths, default=None),
            seeded_reproducible=None if None in reproducible else all(reproducible), pools=pools,
        )  # fmt: skip

    def _seeded_reproducible(self, pool: str) -> bool | None:
        """Whether every live replica of `pool` is batch-invariant (None: none reported)."""
        stats = self.monitor.replica_stats(pool)
        return all(s.seeded_reproducible for s in stats) if stats else None

    async def _health(self, request: Request, call: Call) -> Response:
        """503 while some pool has no live replica, so a load balancer routes elsewhere; a
        pool still waiting for its model (the small model before it is distilled) is named
        in `unavailable` but does not fail the check: everything else serves. Tiers whose
        SLO their pools miss even idle are named in `slo_infeasible` (it serves, late). With
        a small model, `difficulty_router` says which router routes `model: auto` for the
        student it serves, or why none does."""
        waiting = {
            name: reason
            for name in self.pool_names
            if (reason := self.monitor.unavailable_reason(name)) is not None
        }
        down = [
            n for n in self.pool_names if not self.monitor.replica_stats(n) and n not in waiting
        ]
        details: dict[str, Any] = {"unavailable": waiting} if waiting else {}
        if infeasible := self.slo_watch.infeasible():
            details["slo_infeasible"] = infeasible
        if self.router is not None:
            details["difficulty_router"] = self.router.health()
        if down:
            body = {"status": "degraded", "pools_down": down, **details}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", **details})

    async def _metrics(self, request: Request, call: Call) -> Response:
        return Response(self.telemetry.render(), media_type=CONTENT_TYPE_LATEST)
