"""An accepted request's answer: its sequences run on the chosen pool and their deltas
streamed back, gathered into one response, or replayed from the semantic cache.

Apart from the ingress because this is the part that holds pool resources: leaving the
stream early, for any reason, must cancel the sequences in their pool (which frees their
KV blocks), and every way out writes the request's one log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import Response

from engine.outputs import RequestOutput
from serving.cache.replay import replay_response, replayed_usage
from serving.cache.semantic_cache import SemanticCache
from serving.http.accepted import AcceptedRequest
from serving.http.errors import ApiError, bad_request, deadline_exceeded, replica_unavailable
from serving.http.schemas.responses import Usage
from serving.http.streaming import merge_streams
from serving.pools.pool_monitor import PoolMonitor, SentSequence
from serving.telemetry import Telemetry

log = logging.getLogger(__name__)

Delta = tuple[int, RequestOutput]
"""A choice's index and its newest output."""


class Answers:
    """Runs accepted requests on their pools and answers them, each logged once."""

    def __init__(
        self,
        pools: dict[str, DeploymentHandle],
        monitor: PoolMonitor,
        telemetry: Telemetry,
        cache: SemanticCache,
        tokenizer: Any,
        log_prompts: bool,
    ) -> None:
        self._pools = pools
        self._monitor = monitor
        self._telemetry = telemetry
        self._cache = cache
        self._tokenizer = tokenizer
        self._log_prompts = log_prompts

    async def stream(self, accepted: AcceptedRequest) -> AsyncIterator[Delta]:
        """Every choice's deltas as they arrive; leaving early (the client left, the deadline
        passed, a replica died) cancels them in the pool."""
        handle = self._pools[accepted.pool].generate.options(stream=True)
        new_sequences = accepted.new_sequences()
        # With stream=True every call answers a generator; the stub can't tell.
        streams = [cast(DeploymentResponseGenerator, handle.remote(s)) for s in new_sequences]
        sequences = [
            SentSequence(
                accepted.tier.priority,
                len(s.prompt_token_ids),
                s.params.max_tokens,
                accepted.tpot_target_s,
            )  # fmt: skip
            for s in new_sequences
        ]
        status = "aborted"
        with self._monitor.track(accepted.pool, sequences):
            try:
                async for index, output in merge_streams(streams, accepted.deadline_s):
                    accepted.choices[index].add(output, time.monotonic())
                    sequences[index].num_output_tokens = output.num_output_tokens
                    yield index, output
                status = "ok"
            except Exception as error:
                status = "timeout" if isinstance(error, TimeoutError) else "error"
                if (api_error := _as_api_error(accepted, error)) is None:
                    raise
                raise api_error from None
            finally:
                for stream in streams:
                    stream.cancel()
                self._settle(accepted, status)

    async def collect(self, accepted: AcceptedRequest, events: AsyncIterator[Delta]) -> dict:
        """A non-streamed answer: every delta gathered, then the whole response."""
        async for _ in events:
            pass
        return accepted.endpoint.response(accepted.choices).model_dump(mode="json")

    def replay(self, accepted: AcceptedRequest, headers: dict[str, str]) -> Response:
        """A hit: the stored answer, its log line (with the usage it answers with), and now
        and then a false-hit check."""
        lookup = accepted.cache
        assert lookup is not None and lookup.entry is not None, "only hits replay"
        self._cache.check(lookup, accepted.body)
        usage = replayed_usage(lookup.entry.answer, len(accepted.prompts[0]))
        self._log(accepted, "cache_hit", usage)
        return replay_response(accepted, headers, usage)

    def _settle(self, accepted: AcceptedRequest, status: str) -> None:
        """A finished miss's answer is stored and logged. A hit's cancelled generation writes
        no log line: `replay` wrote the hit's."""
        lookup = accepted.cache
        if lookup is not None and status == "ok":
            answer = accepted.endpoint.response(accepted.choices).model_dump(mode="json")
            self._cache.remember(lookup, answer)
        if lookup is None or not lookup.hit:
            self._log(accepted, status)

    def _log(self, accepted: AcceptedRequest, status: str, replayed: Usage | None = None) -> None:
        record = accepted.log_record(status, self._tokenizer, self._log_prompts, replayed)
        self._telemetry.observe(record)


def _as_api_error(accepted: AcceptedRequest, error: Exception) -> ApiError | None:
    """What the client is told of a stream that failed: a deadline, the engine refusing
    the input, a lost replica; None for anything else (a 500 at the ingress)."""
    if isinstance(error, TimeoutError):
        return deadline_exceeded(accepted.time_limit_s)
    if isinstance(error, ValueError):
        return bad_request(str(_cause(error)))
    if isinstance(error, RayActorError):  # the replica died (Serve starts another)
        log.warning("request %s lost its replica: %s", accepted.request_id, error)
        return replica_unavailable()
    return None


def _cause(error: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper, whose text is a whole traceback."""
    return error.cause if isinstance(error, RayTaskError) and error.cause else error
