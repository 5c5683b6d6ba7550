"""configs/grafana/tierserve-dashboard.json: a well-formed Grafana dashboard whose PromQL reads
only metrics (and labels) that serving/telemetry.py exports."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from bench.paths import CONFIGS_DIR
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from policies.placement import Placement
from policies.tiers import Tier
from serving.config import PoolConfig
from serving.http.streaming import SequenceProgress
from serving.pools.pool_monitor import PoolMonitor
from serving.telemetry import RequestRecord, Telemetry
from testing.fakes import FakeEngine, FakePoolHandle

DASHBOARD_PATH = CONFIGS_DIR / "grafana/tierserve-dashboard.json"
PENDING_METRICS: dict[str, set[str]] = {}
"""Referenced before telemetry exports them, with the labels their panels document."""

_IDENTIFIER = r"[A-Za-z_:][A-Za-z0-9_:]*"
_KEYWORDS = {
    "and", "or", "unless", "bool", "offset",
    "by", "without", "on", "ignoring", "group_left", "group_right",
}  # fmt: skip
_MODIFIER = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD_PATH.read_text())["panels"] if p["type"] != "row"]


def _expressions() -> list[str]:
    return [target["expr"] for panel in _panels() for target in panel["targets"]]


def referenced_metrics(expr: str) -> dict[str, set[str]]:
    """Each metric a PromQL expression selects, with the label names its matchers use."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals ($tier, regexes)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(_MODIFIER, " ", text)  # by (...), without (...), on (...) label lists
    selectors: dict[str, set[str]] = {}
    for match in re.finditer(rf"(?<![\w:.])({_IDENTIFIER})\s*(\{{[^}}]*\}})?\s*(\()?", text):
        name, matchers, call = match.groups()
        if call or name in _KEYWORDS:  # a function or an aggregation, not a metric
            continue
        labels = re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers or "")
        selectors.setdefault(name, set()).update(labels)
    return selectors


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by (...), without (...), on (...) and ignoring (...) clauses."""
    return {label.strip() for group in re.findall(_MODIFIER, expr) for label in group.split(",")}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name Telemetry renders after one request, with its label names."""
    pools = {"fast": PoolConfig(name="fast", model_name="m")}
    monitor = PoolMonitor(pools, {"fast": FakePoolHandle(FakeEngine(EngineConfig()))}, 1.0)
    asyncio.run(monitor.poll_once())
    telemetry = Telemetry("m", pools, monitor)
    telemetry.observe(_finished_request())
    telemetry.count_admitted("standard", Placement("fast", "downgrade"))
    labels: dict[str, set[str]] = {}
    for family in telemetry.registry.collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _finished_request() -> RequestRecord:
    """A three-token request, so every histogram and counter has samples."""
    choice = SequenceProgress(start_s=0.0, prompt_index=0)
    for i in range(3):
        output = RequestOutput("r", [i], "x", finished=i == 2, queue_time_s=0.1)
        choice.add(output, now_s=0.2 + 0.05 * i)
    tier = Tier(name="standard", ttft_ms=2000, tpot_ms=60, priority=1, pool="fast")
    return RequestRecord("r", "k", tier, "fast", "ok", [choice], end_s=0.4)


def test_dashboard_has_panels_with_queries_laid_out_on_the_grid() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] <= 24 - grid["w"], panel["title"]
        panel_cells = {
            (grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])
        }
        assert not cells & panel_cells, f"{panel['title']} overlaps another panel"
        cells |= panel_cells
    for panel in _panels():
        assert panel["title"] and panel["description"] and panel["targets"], panel
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


def test_parser_finds_metrics_matchers_and_groupings() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, tier) (rate(vllm:ttft_bucket{tier=~"$tier"}'
        "[$__rate_interval]))) / on (tier) group_left sum without (pool) (up offset 5m)"
    )
    assert referenced_metrics(expr) == {"vllm:ttft_bucket": {"tier"}, "up": set()}
    assert grouping_labels(expr) == {"le", "tier", "pool"}


def test_every_metric_the_dashboard_reads_is_exported(exported: dict[str, set[str]]) -> None:
    referenced = {name for expr in _expressions() for name in referenced_metrics(expr)}
    assert referenced - exported.keys() - PENDING_METRICS.keys() == set()
    assert "vllm:time_to_first_token_seconds_bucket" in referenced  # the parser found metrics


def test_matchers_and_groupings_use_the_metrics_labels(exported: dict[str, set[str]]) -> None:
    known = {**PENDING_METRICS, **exported}
    for expr in _expressions():
        selectors = referenced_metrics(expr)
        for name, labels in selectors.items():
            assert labels <= known[name], f"{name} has no label {labels - known[name]}: {expr}"
        available = set().union(*(known[name] for name in selectors))
        assert grouping_labels(expr) <= available, expr


def test_panels_on_pending_metrics_say_so() -> None:
    for panel in _panels():
        exprs = [target["expr"] for target in panel["targets"]]
        pending = {
            name for expr in exprs for name in referenced_metrics(expr)
        } & PENDING_METRICS.keys()
        for name in pending:
            assert name.removesuffix("_total") in panel["description"], panel["title"]
            assert "PENDING" in panel["description"], panel["title"]


def test_template_variables_read_exported_labels(exported: dict[str, set[str]]) -> None:
    variables = json.loads(DASHBOARD_PATH.read_text())["templating"]["list"]
    queries = [v["query"]["query"] for v in variables if v["type"] == "query"]
    assert queries
    for query in queries:
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", query).groups()  # type: ignore[union-attr]
        assert label in exported[metric], query
