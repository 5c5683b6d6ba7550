"""bench/serving/bench_sla.py builds what it deploys: every config, app and ingress model routing it
hands to Serve, without a cluster or a model, so the benchmark cannot break unseen again
(its shared-pool copy once kept a small model whose pool it had dropped)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from ray.serve import Application

from bench.serving import bench_sla
from bench.serving.bench_sla import (
    FULL,
    PROTECT_MIX,
    QUICK,
    SHARED_MAX_NUM_SEQS,
    add_server_timings,
    deployments,
    parse_args,
    protect_streams,
)
from bench.serving.sla_client import Client, Outcome, Window, closed_loop, timed
from bench.serving.sla_report import (
    prediction_errors,
    report,
    sheds_while_batch_streams,
    ttft_error_share_of_slo,
)
from serving.app import build_app
from serving.app_config import TierserveConfig, load_config
from serving.http.planner import model_routes

FACTOR = 2.5


@pytest.fixture(scope="module")
def configured() -> TierserveConfig:
    return load_config(parse_args([]).config)


@pytest.fixture(scope="module")
def built(configured: TierserveConfig) -> dict[str, TierserveConfig]:
    return deployments(configured, FACTOR)


def test_arguments_default_to_the_local_config_and_the_full_plan() -> None:
    args = parse_args([])
    assert args.config == Path("configs/local.yaml") and not args.quick
    quick = parse_args(["--quick", "--out", "results"])
    assert quick.quick and quick.out == Path("results")
    assert QUICK.concurrency < FULL.concurrency
    assert args.slo_scale is None  # measured on the machine unless pinned
    assert parse_args(["--slo-scale", "5"]).slo_scale == 5.0


@pytest.mark.parametrize("name", ["tierserve", "shared pool"])
def test_each_deployment_builds_as_serve_will_start_it(
    built: dict[str, TierserveConfig], name: str
) -> None:
    config = built[name]
    # What the ingress replica's constructor reads first: it died here on main.
    routes = model_routes(config)
    assert all(config.pool(pool) for pool in {t.pool for t in config.tiers})
    assert routes.small_pool is None or config.pool(routes.small_pool)
    TierserveConfig.model_validate(dict(config))
    assert isinstance(build_app(config), Application)


def test_slos_are_scaled_the_same_on_both_deployments(
    configured: TierserveConfig, built: dict[str, TierserveConfig]
) -> None:
    for config in built.values():
        for tier in config.tiers:
            assert tier.ttft_ms == configured.tier(tier.name).ttft_ms * FACTOR
            assert tier.tpot_ms == configured.tier(tier.name).tpot_ms * FACTOR


def test_the_shared_deployment_is_one_pool_first_come_first_served(
    configured: TierserveConfig, built: dict[str, TierserveConfig]
) -> None:
    shared = built["shared pool"]
    (pool,) = shared.pools
    assert pool.engine.max_num_seqs == SHARED_MAX_NUM_SEQS and pool.engine.spec_decode is None
    assert shared.small_model is None
    assert {(t.pool, t.overflow_pool, t.priority) for t in shared.tiers} == {("shared", None, 0)}
    assert built["tierserve"].pools == configured.pools


def test_the_protect_phase_is_light_interactive_load_beside_a_heavy_one(
    built: dict[str, TierserveConfig],
) -> None:
    config = built["tierserve"]
    interactive = protect_streams(["interactive"])
    background = protect_streams(["standard", "batch"])
    assert {config.tier(t).name for t in interactive + background} == set(PROTECT_MIX)
    # Well within what the interactive pool serves alone, and far past its batch beside it.
    assert len(interactive) < config.pool("interactive").engine.max_num_seqs
    assert len(background) > config.pool("interactive").engine.max_num_seqs
    assert protect_streams(["interactive", "standard", "batch"]) == interactive + background
    assert QUICK.protect_s * 3 + QUICK.overload_s + QUICK.rate_s * len(QUICK.rates) < 240


def test_a_phase_counts_the_tokens_streamed_within_it_by_pool() -> None:
    spread = Outcome("batch", 200, 0.0, num_tokens=101, first_token_s=5.0, last_token_s=15.0,
                     pool="offline")  # fmt: skip
    single = Outcome("interactive", 200, 0.0, num_tokens=1, first_token_s=12.0,
                     last_token_s=12.0, pool="interactive")  # fmt: skip
    refused = Outcome("interactive", 429, 0.0)
    assert spread.tokens_within(10.0, 20.0) == pytest.approx(50.5)
    assert spread.tokens_within(0.0, 5.0) == 0.0 and refused.tokens_within(0, 99) == 0.0
    window = Window([spread, single, refused], 10.0, 20.0)
    assert window.tokens_per_s("offline") == pytest.approx(5.05)
    assert window.tokens_per_s() == pytest.approx(5.15)


def test_prediction_errors_are_measured_minus_predicted_per_pool() -> None:
    outcomes = [
        Outcome(
            "interactive",
            200,
            0.0,
            ttft_s=0.3,
            tpot_s=0.05,
            predicted_ttft_ms=250,
            predicted_tpot_ms=40,
            pool="interactive",
        ),
        Outcome("batch", 200, 0.0, ttft_s=2.0, predicted_ttft_ms=2500, pool="offline"),
        Outcome("batch", 429, 0.0),
    ]
    errors = prediction_errors(outcomes)
    assert errors["interactive"]["ttft"] == [pytest.approx(50)]
    assert errors["interactive"]["tpot"] == [pytest.approx(10)]
    assert errors["offline"] == {"ttft": [pytest.approx(-500)], "tpot": []}
    assert set(errors) == {"interactive", "offline"}


def test_a_refusal_counts_against_batch_only_while_a_batch_request_streams() -> None:
    """Batch admitted but waiting for its first token holds no compute: only a refusal
    between a batch request's first and last token counts as made while batch streams."""
    batch = Outcome("batch", 200, start_s=0.0, first_token_s=10.0, last_token_s=20.0)
    waiting, streaming, after = (
        Outcome("interactive", 429, start_s=t, batch_running_at_refusal=1) for t in (5, 15, 25)
    )
    served = Outcome("interactive", 200, start_s=15.0)
    outcomes = [batch, waiting, streaming, after, served]
    assert sheds_while_batch_streams(outcomes) == [streaming]


def test_ttft_error_is_read_against_each_tiers_slo(configured: TierserveConfig) -> None:
    tiers = {t.name: t for t in configured.tiers}
    client = Client(httpx.AsyncClient(), tiers, "m")
    slo = tiers["interactive"].ttft_ms
    outcomes = [
        Outcome("interactive", 200, 0.0, ttft_s=slo / 1000, predicted_ttft_ms=slo * 0.9),
        Outcome("interactive", 200, 0.0, ttft_s=slo / 1000, predicted_ttft_ms=slo * 1.3),
        Outcome("interactive", 200, 0.0, ttft_s=slo / 1000, predicted_ttft_ms=slo * 1.05),
        Outcome("interactive", 429, 0.0),
    ]
    assert ttft_error_share_of_slo(client, outcomes) == {"interactive": pytest.approx(0.1)}


def test_the_ingress_log_lines_say_where_a_first_token_waited_and_why_a_refusal_came(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A served request gets its ingress TTFT and hops; a refused one its reason, the
    prediction it was refused on and every candidate pool's (which pool was late, and on
    TTFT or TPOT); a request with no line is left as the client saw it."""
    lines = {
        "served": {"status": "ok", "ttft_ms": 480.0, "ttft_hops_ms": {"to_pool": 12.0}},
        "refused": {
            "status": "refused", "reason": "shed_slo", "predicted_ttft_ms": 660.3,
            "predictions_ms": {"interactive": [2420.4, 52.4, 12], "offline": [660.3, 145.8, 1]},
        },
    }  # fmt: skip
    monkeypatch.setattr(bench_sla, "request_logs", lambda: lines)
    monkeypatch.setattr(time, "sleep", lambda _: None)
    served, refused, unlogged = (
        Outcome("interactive", status, 0.0, request_id=request_id)
        for status, request_id in ((200, "served"), (429, "refused"), (200, "gone"))
    )
    add_server_timings([served, refused, unlogged])
    assert (served.server_ttft_ms, served.ttft_hops_ms) == (480.0, {"to_pool": 12.0})
    assert served.refusal_reason is None and served.refusal_predictions_ms is None
    assert (refused.refusal_reason, refused.predicted_ttft_ms) == ("shed_slo", 660.3)
    assert refused.refusal_predictions_ms == lines["refused"]["predictions_ms"]
    assert unlogged.server_ttft_ms is None and unlogged.refusal_reason is None


def test_a_refused_stream_waits_its_retry_after_before_the_next_request() -> None:
    """Against a real ASGI app that refuses every request with Retry-After: 2."""
    arrivals: list[float] = []

    async def refuse(scope, receive, send) -> None:  # noqa: ANN001 - the ASGI callables
        arrivals.append(time.perf_counter())
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"retry-after", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})

    async def run() -> None:
        transport = httpx.ASGITransport(app=refuse)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
            client = Client(http, {}, "m")
            await closed_loop(client, ["interactive", "batch"], seconds=3.0)
            assert {o.retry_after_s for o in client.outcomes} == {2.0}

    asyncio.run(run())
    assert len(arrivals) == 4  # at 0 and 2 s per stream (a 1 s retry would make 6)


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


STREAM = _sse(
    [{"choices": [{"delta": {"content": t}}]} for t in ("a", "b", "c")]
    + [{"choices": [], "usage": {"completion_tokens": 3}}]
)


async def _serve_three_tokens(scope, receive, send) -> None:  # noqa: ANN001 - ASGI callables
    """Streams three tokens from the pool its tier names, with both predictions, after a
    millisecond's work (so every stream's worker gets its turn)."""
    await asyncio.sleep(0.001)
    tier = dict(scope["headers"])[b"x-sla-tier"]
    pool = b"offline" if tier == b"batch" else b"interactive"
    headers = [(b"x-tierserve-pool", pool), (b"x-tierserve-predicted-ttft-ms", b"5"),
               (b"x-tierserve-predicted-tpot-ms", b"1.5")]  # fmt: skip
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": STREAM})


def test_every_phase_reports_from_streamed_requests(
    configured: TierserveConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streams parsed from a real ASGI app, then the whole report, as main runs it."""

    async def run() -> dict:
        transport = httpx.ASGITransport(app=_serve_three_tokens)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
            client = Client(http, {t.name: t for t in configured.tiers}, "m")
            streams = protect_streams(["interactive", "batch"])
            names = ("alone", "no_interactive", "protect", "overload", "interactive_demand")
            # A second each: CI's loaded machine once stalled a 0.2 s window past its last token.
            windows = {name: await timed(client, streams, 1.0, settle_s=0.1) for name in names}
        rates, cost = {1.0: 1.0, 3.0: 0.5}, {"interactive": 1.0, "offline": 0.5}
        protect = {name: windows[name] for name in names[:3]}
        return {"client": client, "overload": windows["overload"], "protect": protect,
                "interactive_demand": windows["interactive_demand"], "rates": rates,
                "cost": cost}  # fmt: skip

    ours = asyncio.run(run())
    overload = ours["overload"]
    assert overload.end_s - overload.start_s == pytest.approx(0.9)  # the settling left out
    assert overload.outcomes[0].start_s < overload.start_s
    outcome = overload.outcomes[0]
    assert outcome.num_tokens == 3 and outcome.predicted_tpot_ms == 1.5 and outcome.tpot_s
    report(ours, {**ours, "protect": None}, FACTOR, tmp_path)
    written = (tmp_path / "sla_protect_requests.jsonl").read_text().splitlines()
    assert len(written) == len(ours["protect"]["protect"].outcomes)
    metrics = {json.loads(line)["metric"] for line in capsys.readouterr().out.splitlines()}
    assert {
        "ratio.interactive_tpot.protect_vs_alone.p50", "goodput.interactive.protect",
        "ratio.interactive_tpot.protect_vs_alone.p95",
        "ratio.offline_throughput.protect_vs_no_interactive",
        "ratio.output_tokens_per_s.overload.tierserve_vs_shared", "prediction_error_ms.ttft.p50",
        "prediction_error_ms.ttft.p95.offline", "prediction_error_ms.tpot.p50.interactive",
        "goodput.interactive.overload", "goodput.interactive.tierserve_at_shared70",
        "prediction_error_share_of_slo.ttft.p50.interactive",
        "shed.interactive.overload_streams_alone", "goodput.interactive.overload_streams_alone",
    } <= metrics  # fmt: skip
    assert (tmp_path / "sla_interactive_demand_requests.jsonl").read_text()
