"""The SLA benchmark's report: the JSON lines of BENCHMARKS.md's SLA section from the
phases' windows (goodput, sheds, throughput ratios, prediction errors, first-token hops, CPU
shares), a goodput-vs-load plot, and every request of the closed-loop phases, one per line.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import emit, log, percentile
from bench.serving.sla_client import TIERS, Client, Outcome, Window, goodput

BENCH = "sla"


def report(ours: dict[str, Any], shared: dict[str, Any], factor: float, out: Path) -> None:
    """The JSON lines of BENCHMARKS.md's SLA section, a goodput-vs-load plot, and the
    overload's and protect phase's requests one per line (for reading misses one by one)."""
    extra = {"slo_scale": round(factor, 2)}
    _report_overload(ours, shared, extra)
    _report_protect(ours["client"], ours["protect"], extra)
    _report_load_sweep(ours["rates"], shared["rates"], extra)
    costs = ours["cost"]
    if costs.get("interactive"):
        ratio = costs.get("offline", 0.0) / costs["interactive"]
        emit(BENCH, "ratio.cost_per_1k.offline_vs_interactive", ratio, "x", **extra, **costs)
    _report_prediction_error(ours["client"], ours["overload"].outcomes, extra)
    _report_ttft_breakdown(ours["overload"].outcomes, extra)
    phases = {
        "overload": ours["overload"], **ours["protect"],
        "interactive_demand": ours["interactive_demand"],
    }  # fmt: skip
    for phase, window in phases.items():
        for kind, cores in window.cpu_shares.items():
            if cores >= 0.01:
                emit(BENCH, f"cpu_cores.{phase}.{kind}", cores, "cores", **extra)
    _plot(ours["rates"], shared["rates"], out / "sla_goodput_vs_load.png")
    for name, window in phases.items():
        with open(out / f"sla_{name}_requests.jsonl", "w") as f:
            for outcome in window.outcomes:
                f.write(json.dumps(dataclasses.asdict(outcome)) + "\n")


def _report_overload(ours: dict[str, Any], shared: dict[str, Any], extra: dict) -> None:
    """Goodput and sheds per tier, against the shared pool's, and the tokens per second."""
    client: Client = ours["client"]
    outcomes, shared_outcomes = ours["overload"].outcomes, shared["overload"].outcomes
    for tier in TIERS:
        emit(BENCH, f"goodput.{tier}.overload", goodput(client, outcomes, tier), "share", **extra)
        shed = sum(o.tier == tier and o.status == 429 for o in outcomes)
        emit(BENCH, f"shed.{tier}.overload", shed, "requests", **extra)
        emit(BENCH, f"goodput.{tier}.overload.shared",
             goodput(shared["client"], shared_outcomes, tier), "share", **extra)  # fmt: skip
    refused = [o for o in outcomes if o.tier == "interactive" and o.status == 429]
    reasons = Counter(o.refusal_reason for o in refused if o.batch_running_at_refusal > 0)
    emit(BENCH, "shed.interactive_while_batch_running", sum(reasons.values()), "requests",
         reasons=dict(reasons), **extra)  # fmt: skip
    alone = ours["interactive_demand"].outcomes
    shed_alone = sum(o.tier == "interactive" and o.status == 429 for o in alone)
    emit(BENCH, "shed.interactive.overload_streams_alone", shed_alone, "requests", **extra)
    emit(BENCH, "goodput.interactive.overload_streams_alone",
         goodput(client, alone, "interactive"), "share", **extra)  # fmt: skip
    streaming = sheds_while_batch_streams(outcomes)
    emit(BENCH, "shed.interactive_while_batch_streaming", len(streaming), "requests",
         reasons=dict(Counter(o.refusal_reason for o in streaming)), **extra)  # fmt: skip
    ours_tok_s, shared_tok_s = ours["overload"].tokens_per_s(), shared["overload"].tokens_per_s()
    emit(BENCH, "ratio.output_tokens_per_s.overload.tierserve_vs_shared",
         ours_tok_s / max(shared_tok_s, 1e-9), "x", tierserve=round(ours_tok_s, 1),
         shared=round(shared_tok_s, 1), **extra)  # fmt: skip


def sheds_while_batch_streams(outcomes: list[Outcome]) -> list[Outcome]:
    """The interactive refusals made while some batch request was streaming its tokens to
    this client (between its first and its last): batch work then held compute. The
    in-flight count (`batch_running_at_refusal`) also counts batch requests admitted but
    still waiting for their first token, paused while urgent prompts prefill."""
    spans = [
        (o.first_token_s, o.last_token_s)
        for o in outcomes
        if o.tier == "batch" and o.first_token_s is not None and o.last_token_s is not None
    ]
    return [
        o
        for o in outcomes
        if o.tier == "interactive"
        and o.status == 429
        and any(first <= o.start_s <= last for first, last in spans)
    ]


def _report_protect(client: Client, windows: dict[str, Window], extra: dict) -> None:
    """Interactive TPOT beside the heavy load over alone, its goodput, offline throughput."""
    tpots = {
        name: [o.tpot_s for o in windows[name].outcomes if o.tier == "interactive" and o.tpot_s]
        for name in ("alone", "protect")
    }
    for q in (50, 95):
        if not (tpots["alone"] and tpots["protect"]):
            log("no interactive request streamed in the alone or protect window: no TPOT ratio")
            break
        alone, beside = percentile(tpots["alone"], q), percentile(tpots["protect"], q)
        emit(BENCH, f"ratio.interactive_tpot.protect_vs_alone.p{q}", beside / alone, "x",
             protect_ms=round(beside * 1000, 1), alone_ms=round(alone * 1000, 1),
             n=len(tpots["protect"]), **extra)  # fmt: skip
    protected = windows["protect"].outcomes
    emit(BENCH, "goodput.interactive.protect", goodput(client, protected, "interactive"),
         "share", **extra)  # fmt: skip
    refused = sum(o.tier == "interactive" and o.status != 200 for o in protected)
    emit(BENCH, "shed.interactive.protect", refused, "requests", **extra)
    beside, without = (windows[n].tokens_per_s("offline") for n in ("protect", "no_interactive"))
    if without > 0:
        emit(BENCH, "ratio.offline_throughput.protect_vs_no_interactive", beside / without,
             "x", protect_tok_s=round(beside, 1), no_interactive_tok_s=round(without, 1),
             **extra)  # fmt: skip


def _report_load_sweep(ours: dict[float, float], shared: dict[float, float], extra: dict) -> None:
    for rate in ours:
        emit(BENCH, f"goodput.interactive.rate{rate}", ours[rate], "share", **extra)
        emit(BENCH, f"goodput.interactive.rate{rate}.shared", shared[rate], "share", **extra)
    over = [rate for rate in sorted(shared) if shared[rate] <= 0.7]
    if over:
        emit(
            BENCH,
            "goodput.interactive.tierserve_at_shared70",
            ours[over[0]],
            "share",
            rate=over[0],
            **extra,
        )
    else:
        log("the shared pool kept interactive goodput above 70% at every rate: raise the rates")


def prediction_errors(outcomes: list[Outcome]) -> dict[str, dict[str, list[float]]]:
    """Per pool, the measured minus predicted TTFT and TPOT (ms) of each admitted request."""
    errors: dict[str, dict[str, list[float]]] = {}
    for o in outcomes:
        pool = errors.setdefault(o.pool or "none", {"ttft": [], "tpot": []})
        if o.ttft_s is not None and o.predicted_ttft_ms is not None:
            pool["ttft"].append(o.ttft_s * 1000 - o.predicted_ttft_ms)
        if o.tpot_s is not None and o.predicted_tpot_ms is not None:
            pool["tpot"].append(o.tpot_s * 1000 - o.predicted_tpot_ms)
    return {name: pool for name, pool in errors.items() if pool["ttft"]}


def ttft_error_share_of_slo(client: Client, outcomes: list[Outcome]) -> dict[str, float]:
    """Per tier, the median absolute TTFT prediction error over the tier's (scaled) TTFT
    SLO: the issue's target reads it against the SLO the prediction is placed by."""
    errors: dict[str, list[float]] = {}
    for o in outcomes:
        if o.ttft_s is not None and o.predicted_ttft_ms is not None:
            errors.setdefault(o.tier, []).append(abs(o.ttft_s * 1000 - o.predicted_ttft_ms))
    return {
        tier: percentile(tier_errors, 50) / client.tiers[tier].ttft_ms
        for tier, tier_errors in errors.items()
    }


def _report_prediction_error(client: Client, outcomes: list[Outcome], extra: dict) -> None:
    """The absolute error's percentiles over all pools and per pool, the TTFT bias, and per
    tier the median TTFT error as a share of the tier's SLO."""
    per_pool = prediction_errors(outcomes)
    every = {
        kind: [e for pool in per_pool.values() for e in pool[kind]] for kind in ("ttft", "tpot")
    }
    if every["ttft"]:
        emit(BENCH, "prediction_bias_ms.ttft.p50", percentile(every["ttft"], 50), "ms", **extra)
    for suffix, errors in [("", every), *((f".{name}", e) for name, e in per_pool.items())]:
        for kind, quantiles in (("ttft", (50, 95)), ("tpot", (50,))):
            absolute = [abs(e) for e in errors[kind]]
            for q in quantiles if absolute else ():
                emit(
                    BENCH,
                    f"prediction_error_ms.{kind}.p{q}{suffix}",
                    percentile(absolute, q),
                    "ms",
                    n=len(absolute),
                    **extra,
                )
    for tier, share in ttft_error_share_of_slo(client, outcomes).items():
        emit(BENCH, f"prediction_error_share_of_slo.ttft.p50.{tier}", share, "share", **extra)


def _report_ttft_breakdown(outcomes: list[Outcome], extra: dict) -> None:
    """Per pool and tier, the median first token as the client and the ingress saw it, and
    the ingress's median of each hop on the way (serving/http/streaming.py)."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        if o.ttft_s is not None and o.server_ttft_ms is not None and o.ttft_hops_ms:
            groups.setdefault((o.pool or "none", o.tier), []).append(o)
    for (pool, tier), group in sorted(groups.items()):
        parts = {
            "client": percentile([o.ttft_s * 1000 for o in group if o.ttft_s], 50),
            "ingress": percentile([o.server_ttft_ms or 0.0 for o in group], 50),
        }
        for hop in group[0].ttft_hops_ms or {}:
            parts[hop] = percentile([(o.ttft_hops_ms or {}).get(hop) or 0.0 for o in group], 50)
        for part, value in parts.items():
            emit(BENCH, f"ttft_breakdown_ms.p50.{pool}.{tier}.{part}", value, "ms",
                 n=len(group), **extra)  # fmt: skip


def _plot(ours: dict[float, float], shared: dict[float, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    axis.plot(list(ours), list(ours.values()), marker="o", label="tierserve")
    axis.plot(list(shared), list(shared.values()), marker="s", label="one shared pool")
    axis.axhline(0.7, color="grey", linestyle=":")
    axis.set_xlabel("offered load (requests/s, tiers 1:1:1)")
    axis.set_ylabel("interactive goodput (share meeting SLO)")
    axis.set_ylim(0, 1.05)
    axis.legend()
    axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    log(f"wrote {path}")
