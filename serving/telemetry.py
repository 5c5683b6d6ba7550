"""Prometheus metrics (under vLLM's names, so existing dashboards and autoscalers read them)
and one log line per request, refused ones included.

Request metrics are labelled by pool and tier; engine metrics come from the
pools' polled stats and are labelled by pool (an engine batch mixes tiers).
Every completion request is one admission decision: its placement when it runs,
else the reason it was refused (placement's shedding, a key's rate limit, a
bad request), so refusals are counted where admissions are.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import EngineStats
from policies.latency import Prediction
from policies.placement import Placement
from policies.tiers import Tier, meets_slo
from serving.config import PoolConfig
from serving.http.errors import ApiError
from serving.http.routes import Call
from serving.http.schemas.responses import Usage
from serving.http.streaming import SequenceProgress, usage
from serving.pools.pool_monitor import PoolMonitor

request_log = logging.getLogger("ray.serve.tierserve.requests")
"""Under `ray.serve`, so the replica's Serve logging config (level, encoding, its log file
under the Ray session's logs/serve/) applies to the per-request lines."""

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 60.0)
_PREDICTION_ERROR_BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400)
_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.025, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.8, 1.6)


@dataclass(frozen=True)
class RequestRecord:
    """One finished (or failed) request, as telemetry sees it."""

    request_id: str
    key_name: str
    tier: Tier
    pool: str
    status: str
    """`ok`, `aborted` (client left), `timeout` (past the tier's deadline) or `error`."""
    choices: list[SequenceProgress]
    end_s: float
    prompt_text: str | None = None
    """Only when config.log_prompts is on."""
    request_text: str | None = None
    """The request's own words (what the difficulty router reads); with log_prompts only.
    `tierserve router train --from-logs` retrains the router on these."""
    max_tokens: int | None = None
    """As requested (None: not given)."""
    user: str | None = None
    """The body's `user`: OpenAI's id of the caller's end user, for tracing abuse to one."""
    placement: Placement | None = None
    """Why this pool, and the latency it was predicted to give (None: not placed)."""
    replayed: Usage | None = None
    """A semantic-cache hit's usage (its prompt, the stored completion), which the log line
    reports; no pool computed it, so the token counters leave it out."""


@dataclass
class Admission:
    """What the ingress has learned of a request on its way in, filled as it goes: the log
    line of a request refused before it runs says how far it got."""

    call: Call
    user: str | None = None
    tier: str | None = None
    placement: Placement | None = None


class Telemetry:
    """Request metrics (observed per finished request), engine metrics (read from the pool
    monitor at scrape time) and the per-request log line."""

    def __init__(self, model_name: str, pools: dict[str, PoolConfig], monitor: PoolMonitor) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._pool_models = {name: pool.model_name for name, pool in pools.items()}
        self._register_request_metrics(["model_name", "pool", "tier"])
        self._register_decision_metrics()
        self._output_tokens_by_pool = dict.fromkeys(pools, 0)
        self.registry.register(
            _EngineCollector(model_name, pools, monitor, self._output_tokens_by_pool)
        )

    def _register_request_metrics(self, labels: list[str]) -> None:
        """vLLM's per-request latency and token metrics, and the SLO counters."""
        r = self.registry
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
            buckets=_TOKEN_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time waiting in the engine before first scheduled.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", labels,
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", labels, registry=r)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self._requests = Counter(
            "tierserve:requests", "Finished requests by status.", [*labels, "status"], registry=r
        )
        self._slo_checked = Counter(
            "tierserve:slo_checked", "Completed requests checked against their tier's SLO.",
            labels, registry=r,
        )  # fmt: skip
        self._slo_met = Counter(
            "tierserve:slo_met", "Completed requests that met their tier's TTFT and TPOT.",
            labels, registry=r,
        )  # fmt: skip

    def _register_decision_metrics(self) -> None:
        """What the ingress decided: placements, model choices, how far predictions missed."""
        r = self.registry
        self._decisions = Counter(
            "tierserve:admission_decisions", "Placement decisions by tier, reason and pool.",
            ["tier", "reason", "pool"], registry=r,
        )  # fmt: skip
        self._model_decisions = Counter(
            "tierserve:model_decisions", "Model choices by tier, model and reason "
            "(pinned, not_routed, small_unavailable, no_router, easy, hard).",
            ["tier", "model", "reason"], registry=r,
        )  # fmt: skip
        self._prediction_error = Histogram(
            "tierserve:prediction_error_ms", "|measured - predicted| of completed requests' "
            "TTFT and TPOT, by pool and metric: how far placement's latency model is off.",
            ["pool", "metric"], buckets=_PREDICTION_ERROR_BUCKETS_MS, registry=r,
        )  # fmt: skip

    def observe(self, record: RequestRecord) -> None:
        """Count a finished request in the metrics and write its log line."""
        labels = (self._model_name, record.pool, record.tier.name)
        self._requests.labels(*labels, record.status).inc()
        for choice in record.choices:
            self._observe_choice(labels, record, choice)
        model = self._pool_models.get(record.pool, self._model_name)
        request_log.info(json.dumps(_log_fields(record, model)))

    def count_admitted(self, tier: str, placement: Placement) -> None:
        """Count an admitted request by its placement's reason and pool."""
        self._decisions.labels(tier, placement.reason, placement.pool or "none").inc()

    @contextmanager
    def refusals(self, admission: Admission) -> Iterator[None]:
        """Whatever ApiError refuses the request inside the block is counted and logged
        (`refuse`) on its way out."""
        try:
            yield
        except ApiError as error:
            self.refuse(admission, error)
            raise

    def refuse(self, admission: Admission, error: ApiError) -> None:
        """Count a refused request as an admission decision by its reason (pool `none`, tier
        `none` when refused before it had one) and write its log line."""
        self._decisions.labels(admission.tier or "none", error.reason, "none").inc()
        request_log.info(json.dumps(_refusal_fields(admission, error, time.monotonic())))

    def count_model_decision(self, tier: str, model: str, reason: str) -> None:
        """Count one model choice (policies/model_routing.py)."""
        self._model_decisions.labels(tier, model, reason).inc()

    def render(self) -> bytes:
        """Every metric in Prometheus's text format."""
        return generate_latest(self.registry)

    def _observe_choice(
        self, labels: tuple[str, str, str], record: RequestRecord, choice: SequenceProgress
    ) -> None:
        self._prompt_tokens.labels(*labels).inc(choice.num_prompt_tokens)
        self._generation_tokens.labels(*labels).inc(choice.num_output_tokens)
        self._output_tokens_by_pool[record.pool] += choice.num_output_tokens
        for gap_s in choice.inter_token_s:
            self._itl.labels(*labels).observe(gap_s)
        if choice.queue_time_s is not None:
            self._queue_time.labels(*labels).observe(choice.queue_time_s)
        ttft_s = choice.ttft_s
        if ttft_s is None:
            return
        self._ttft.labels(*labels).observe(ttft_s)
        self._e2e.labels(*labels).observe(record.end_s - choice.start_s)
        if record.status == "ok":
            self._slo_checked.labels(*labels).inc()
            if meets_slo(record.tier, ttft_s, choice.tpot_s):
                self._slo_met.labels(*labels).inc()
            self._check_prediction(record, ttft_s, choice.tpot_s)

    def _check_prediction(self, record: RequestRecord, ttft_s: float, tpot_s: float | None) -> None:
        """A completed request's latency against its placement's prediction, in the error
        histogram. Not fed back into placement: docs/sla.md says what each way of doing so
        that was tried did to goodput."""
        prediction = record.placement.prediction if record.placement else None
        if prediction is None:
            return
        self._prediction_error.labels(record.pool, "ttft").observe(
            abs(ttft_s - prediction.ttft_s) * 1000
        )
        if tpot_s is not None:
            self._prediction_error.labels(record.pool, "tpot").observe(
                abs(tpot_s - prediction.tpot_s) * 1000
            )


def _log_fields(record: RequestRecord, model: str) -> dict[str, object]:
    first = record.choices[0] if record.choices else None
    counted = record.replayed or usage(record.choices)
    fields: dict[str, object] = {
        "request_id": record.request_id,
        "key": record.key_name,
        "tier": record.tier.name,
        "pool": record.pool,
        "model": model,
        "status": record.status,
        "prompt_tokens": counted.prompt_tokens,
        "output_tokens": counted.completion_tokens,
        "ttft_ms": _ms(first.ttft_s if first else None),
        "queue_ms": _ms(first.queue_time_s if first else None),
        "latency_ms": _ms(record.end_s - first.start_s if first else None),
    }
    hops = first.ttft_hops_s() if first else None
    if hops is not None:
        fields["ttft_hops_ms"] = {hop: _ms(seconds) for hop, seconds in hops.items()}
    if record.max_tokens is not None:
        fields["max_tokens"] = record.max_tokens
    fields.update(_optional_fields(record.user, record.placement))
    if record.prompt_text is not None:
        fields["prompt"] = record.prompt_text
    if record.request_text is not None:
        fields["request_text"] = record.request_text
    return fields


def _refusal_fields(admission: Admission, error: ApiError, end_s: float) -> dict[str, object]:
    fields: dict[str, object] = {
        "request_id": admission.call.request_id,
        "key": admission.call.caller.name,
        "tier": admission.tier,
        "pool": None,
        "status": "refused",
        "http_status": error.status,
        "reason": error.reason,
        "message": str(error),
        "latency_ms": _ms(end_s - admission.call.start_s),
    }
    if error.retry_after_s is not None:
        fields["retry_after_s"] = round(error.retry_after_s, 1)
    fields.update(_optional_fields(admission.user, admission.placement))
    return fields


def _ttft_parts_ms(prediction: Prediction) -> dict[str, float]:
    """The predicted first token in the parts the model adds up, to read beside the
    measured hops (`ttft_hops_ms`): the step in progress, the slot wait, the prefill."""
    step_s = prediction.ttft_s - prediction.slot_wait_s - prediction.prefill_s
    return {
        "step_in_progress": _ms(step_s),
        "slot_wait": _ms(prediction.slot_wait_s),
        "prefill": _ms(prediction.prefill_s),
    }


def _optional_fields(user: str | None, placement: Placement | None) -> dict[str, object]:
    """The end user and, where placement ran, its reason and the predicted latency."""
    fields: dict[str, object] = {} if user is None else {"user": user}
    if placement is not None:
        fields["placement"] = placement.reason
    if placement is not None and placement.prediction is not None:
        fields["predicted_ttft_ms"] = _ms(placement.prediction.ttft_s)
        fields["predicted_tpot_ms"] = _ms(placement.prediction.tpot_s)
        fields["predicted_ttft_parts_ms"] = _ttft_parts_ms(placement.prediction)
    if placement is not None and placement.candidates:
        fields["predictions_ms"] = {
            pool: [_ms(p.ttft_s), _ms(p.tpot_s), p.num_ahead]
            for pool, p in placement.candidates.items()
        }
    return fields


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _sum(field: str) -> Callable[[list[EngineStats]], float]:
    """The total of one EngineStats counter over the live replicas."""
    return lambda stats: sum(getattr(s, field) for s in stats)


# (family, name, help, value over the live replicas' stats)
_ENGINE_METRICS: tuple[tuple[type, str, str, Callable[[list[EngineStats]], float]], ...] = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
     _sum("num_running")),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting in the engine.",
     _sum("num_waiting")),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1, mean of replicas.",
     lambda stats: _sum("kv_cache_usage")(stats) / max(len(stats), 1)),
    (GaugeMetricFamily, "tierserve:kv_cache_blocks", "KV blocks over the live replicas "
     "(more at the same memory with a quantized cache).", _sum("num_kv_blocks")),
    (GaugeMetricFamily, "tierserve:kv_max_num_seqs", "Sequences of max_model_len tokens the "
     "live replicas' KV caches hold at once.", _sum("kv_max_num_seqs")),
    (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.",
     _sum("prefix_cache_queries")),
    (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     _sum("prefix_cache_hits")),
    (CounterMetricFamily, "vllm:num_preemptions", "Requests preempted.",
     _sum("num_preemptions")),
    (CounterMetricFamily, "vllm:spec_decode_num_drafts", "Speculative steps proposed.",
     _sum("spec_num_drafts")),
    (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
     _sum("spec_num_draft_tokens")),
    (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     _sum("spec_num_accepted_tokens")),
)  # fmt: skip


def _accepted_per_pos(stats: list[EngineStats]) -> list[int]:
    """Accepted draft tokens at each draft position, summed over replicas."""
    positions = itertools.zip_longest(*(s.spec_accepted_per_pos for s in stats), fillvalue=0)
    return [sum(counts) for counts in positions]


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the monitor's latest replica stats at scrape time."""

    def __init__(
        self,
        model_name: str,
        pools: dict[str, PoolConfig],
        monitor: PoolMonitor,
        output_tokens_by_pool: dict[str, int],
    ) -> None:
        self._model_name = model_name
        self._pools = pools
        self._monitor = monitor
        self._output_tokens_by_pool = output_tokens_by_pool

    def collect(self) -> Iterator[Metric]:
        """Every engine metric, per pool, from the latest polled stats."""
        labels = ["model_name", "pool"]
        for family_cls, name, help_text, value in _ENGINE_METRICS:
            family = family_cls(name, help_text, labels=labels)
            for pool in self._pools:
                family.add_metric(
                    [self._model_name, pool], value(self._monitor.replica_stats(pool))
                )
            yield family
        yield self._accepted_per_pos_family()
        cost = GaugeMetricFamily(
            "tierserve:cost_per_1k_output_tokens", "Replica cost per 1k output tokens so far.",
            labels=labels,
        )  # fmt: skip
        for pool in self._pools:
            cost.add_metric([self._model_name, pool], self._cost_per_1k(pool))
        yield cost

    def _accepted_per_pos_family(self) -> Metric:
        """vLLM's per-position acceptance: how deep into a draft the target model agrees."""
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labels=["model_name", "pool", "position"],
        )
        for pool in self._pools:
            totals = _accepted_per_pos(self._monitor.replica_stats(pool))
            for position, count in enumerate(totals):
                family.add_metric([self._model_name, pool, str(position)], count)
        return family

    def _cost_per_1k(self, pool: str) -> float:
        output_tokens = self._output_tokens_by_pool[pool]
        if not output_tokens:
            return 0.0
        replica_hours = self._monitor.replica_seconds[pool] / 3600
        return self._pools[pool].price_per_replica_hour * replica_hours / (output_tokens / 1000)
