"""The ingress's routing table: method and path template to handler.

Templates use Starlette's syntax (`/v1/files/{file_id}`); a match puts its
parameters in `request.path_params`, where Starlette's own routing would.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from serving.gateway_config import CallerPolicy
from serving.http.errors import ApiError


@dataclass(frozen=True)
class Call:
    """One HTTP call as a handler sees it: its id, arrival time and authenticated caller."""

    request_id: str
    start_s: float
    """Monotonic time (the event loop's clock) the call reached the ingress."""
    caller: CallerPolicy


Handler = Callable[[Request, Call], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """A handler and whether it answers without a key (only /health does)."""

    handler: Handler
    public: bool = False


class RouteTable:
    """Finds the route for a request, in the order the routes were given."""

    def __init__(self, routes: dict[tuple[str, str], Route]) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Route]] = [
            (method, compile_path(template)[0], route)
            for (method, template), route in routes.items()
        ]

    def find(self, request: Request) -> Route:
        """The request's route, its path parameters set on the request; a 404 if none."""
        path = request.url.path
        for method, pattern, route in self._routes:
            match = pattern.match(path)
            if match is not None and method == request.method:
                request.scope["path_params"] = match.groupdict()
                return route
        raise ApiError(404, f"No route {request.method} {path}", code="not_found")
