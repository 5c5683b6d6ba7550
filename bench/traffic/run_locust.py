"""Run the locust load headless, then plot and report it: `python -m bench.traffic.run_locust`.

    .venv/bin/python -m bench.traffic.run_locust --url http://127.0.0.1:8000 [--quick]
    .venv/bin/python -m bench.traffic.run_locust --local [--fake-engine] --users 4 --duration 6

Locust runs as its own process (it patches the standard library with
gevent), writing CSV files and an HTML report into --out. This command then
reads the stats history and draws, with matplotlib:

- latency_vs_throughput.png: per tier, TTFT p50/p95 and E2E p50 against the
  tier's completed requests per second; per pool, E2E p50/p95 against the
  pool's requests per second (each point is one moment of the run);
- goodput.png: per tier, requests per second meeting the tier's SLO over
  time, beside all completed requests per second.

Headline figures go to stdout as JSON lines (bench "locust"); logs and
locust's own summary go to stderr. `--local` starts the app on a private
Ray cluster first (configs/local.yaml, or --serve-config); `--fake-engine`
serves it with testing/fakes.py's FakeEngine, no model, which the smoke test uses.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench.paths import REPO_ROOT
from bench.report import emit, log  # noqa: E402
from bench.traffic.workloads import load_slos  # noqa: E402

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from serving.app_config import TierserveConfig

Row = dict[str, str]
"""One row of a locust CSV, by column name."""
Stats = dict[tuple[str, str], Row]
"""Locust's final stats by (request type, name)."""
Headline = tuple[str, float, str]
"""(metric, value, unit) for report.emit."""

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_SERVE_CONFIG = REPO_ROOT / "configs" / "local.yaml"
CSV_PREFIX = "locust"
STOP_TIMEOUT_S = 60
"""When the load ends, requests in flight get this long to finish and be counted: cutting them
off would keep only the short ones."""
RATE_WINDOW_S = 5
"""Goodput and throughput over time are rates over this trailing window."""
FAKE_MAX_MODEL_LEN = 16384
"""The fake tokenizer counts characters: a 2k-token RAG prompt is ~10k of them."""


@dataclass(frozen=True)
class Load:
    """How many users, how fast they arrive, and for how long."""

    users: int
    spawn_rate: float
    duration_s: int


FULL = Load(users=8, spawn_rate=2, duration_s=60)
QUICK = Load(users=4, spawn_rate=2, duration_s=20)


@dataclass
class Series:
    """One locust stats row (a request type and name) over the run, from the history CSV."""

    times_s: list[float]
    rps: list[float]
    p50_ms: list[float | None]
    p95_ms: list[float | None]
    total: list[int]

    def add(self, time_s: float, row: Row | None) -> None:
        """The row at `time_s`; None (not written yet) keeps the count and has no latencies."""
        self.times_s.append(time_s)
        self.rps.append(float(row["Requests/s"]) if row else 0.0)
        self.p50_ms.append(_number(row["50%"]) if row else None)
        self.p95_ms.append(_number(row["95%"]) if row else None)
        previous = self.total[-1] if self.total else 0
        self.total.append(int(row["Total Request Count"]) if row else previous)


def main(argv: list[str] | None = None) -> None:
    """Run the load against --url or a --local app, then write plots and headline figures."""
    args = _parse_args(argv)
    load = _load(args)
    args.out.mkdir(parents=True, exist_ok=True)
    # stdout carries JSON lines only; Ray prints its workers' logs there.
    with redirect_stdout(sys.stderr), _target(args) as url:
        run_locust(url, load, args.out, args.serve_config)
    stats = read_stats(args.out / f"{CSV_PREFIX}_stats.csv")
    history = read_history(args.out / f"{CSV_PREFIX}_stats_history.csv")
    tiers = _tiers(stats, order=list(load_slos(args.serve_config)))
    pools = sorted(name for kind, name in stats if kind == "POOL")
    plot_latency_vs_throughput(history, tiers, pools, args.out / "latency_vs_throughput.png")
    plot_goodput(history, tiers, args.out / "goodput.png")
    emit_headlines(stats, tiers, pools, load)
    log(f"locust CSV, HTML report and plots in {args.out}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running tierserve, e.g. http://127.0.0.1:8000")
    target.add_argument("--local", action="store_true", help="start the app on a private cluster")
    parser.add_argument("--fake-engine", action="store_true", help="with --local: no model")
    parser.add_argument(
        "--serve-config",
        type=_absolute,
        default=DEFAULT_SERVE_CONFIG,
        help="Serve config: the app --local starts and the SLOs the load checks",
    )
    parser.add_argument("--users", type=int, help=f"default {FULL.users} ({QUICK.users} quick)")
    parser.add_argument(
        "--spawn-rate", type=float, help=f"users started per second (default {FULL.spawn_rate})"
    )
    parser.add_argument(
        "--duration",
        type=int,
        help=f"seconds of load (default {FULL.duration_s}, {QUICK.duration_s} quick)",
    )
    parser.add_argument("--out", type=_absolute, default="load_results", help="output folder")
    parser.add_argument("--quick", action="store_true", help="the same load, smaller and shorter")
    args = parser.parse_args(argv)
    if args.fake_engine and not args.local:
        parser.error("--fake-engine needs --local")
    return args


def _absolute(path: str) -> Path:
    """Paths from the command line, made absolute: locust runs from the repository root."""
    return Path(path).resolve()


def _load(args: argparse.Namespace) -> Load:
    """The preset (--quick or full), with any of --users, --spawn-rate, --duration overriding it."""
    preset = QUICK if args.quick else FULL
    return Load(
        users=args.users or preset.users,
        spawn_rate=args.spawn_rate or preset.spawn_rate,
        duration_s=args.duration or preset.duration_s,
    )


@contextmanager
def _target(args: argparse.Namespace) -> Iterator[str]:
    """The base URL to load: --url as given, or the --local app until the block ends."""
    if args.url:
        yield args.url.rstrip("/")
        return
    # Imported here: Ray (and the app) only when this process serves it.
    from serving.app_config import load_config
    from testing.local_cluster import serving

    config, engine_cls = load_config(args.serve_config), None
    if args.fake_engine:
        from testing.fakes import FakeEngine

        config, engine_cls = _fake_engine_config(config), FakeEngine
    log("starting tierserve on a private Ray cluster")
    with serving(config, engine_cls) as url:
        yield url


def _fake_engine_config(config: TierserveConfig) -> TierserveConfig:
    """The same tiers and pools, each engine reduced to what the fake reads (batch, length)."""
    pools = tuple(
        pool.model_copy(update={"engine": _fake_engine(pool.engine)}) for pool in config.pools
    )
    return config.model_copy(update={"pools": pools})


def _fake_engine(engine: EngineConfig) -> EngineConfig:
    return type(engine)(max_num_seqs=engine.max_num_seqs, max_model_len=FAKE_MAX_MODEL_LEN)


def run_locust(url: str, load: Load, out: Path, slo_config: Path) -> None:
    """Locust headless in its own process; its CSVs and HTML report land in `out`."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(load.users), "-r", str(load.spawn_rate), "-t", f"{load.duration_s}s",
        "--host", url, "--csv", str(out / CSV_PREFIX), "--csv-full-history",
        "--html", str(out / f"{CSV_PREFIX}_report.html"), "--only-summary",
        "--stop-timeout", str(STOP_TIMEOUT_S),
        "--exit-code-on-error", "0",  # shed requests are failures to report, not a crash
        "--slo-config", str(slo_config),
    ]  # fmt: skip
    log(f"running locust: {load.users} users for {load.duration_s}s against {url}")
    # stdout is for JSON lines only: locust's summary goes to stderr.
    subprocess.run(
        command,
        cwd=REPO_ROOT,
        stdout=sys.stderr,
        check=True,
        timeout=load.duration_s + STOP_TIMEOUT_S + 120,
    )


def read_stats(path: Path) -> Stats:
    """Locust's final stats, one row per (request type, name)."""
    with path.open(newline="") as file:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(file)}


def read_history(path: Path) -> dict[tuple[str, str], Series]:
    """Each stats row over time, on one timeline: a row not yet seen counts zero requests."""
    rows_at: dict[int, Stats] = defaultdict(dict)
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            rows_at[int(row["Timestamp"])][(row["Type"], row["Name"])] = row  # last one wins
    start = min(rows_at)
    keys = {key for rows in rows_at.values() for key in rows}
    history = {key: Series([], [], [], [], []) for key in keys}
    for timestamp in sorted(rows_at):
        for key, series in history.items():
            series.add(timestamp - start, rows_at[timestamp].get(key))
    return history


def _number(cell: str) -> float | None:
    return None if cell in ("", "N/A") else float(cell)


def _tiers(stats: Stats, order: list[str]) -> list[str]:
    """The tiers that sent requests (POST rows are named `<kind>[<tier>]`), in config order."""
    sent = {name.partition("[")[2].rstrip("]") for kind, name in stats if kind == "POST"}
    return sorted(sent, key=lambda tier: (order.index(tier) if tier in order else len(order), tier))


def trailing_rate(series: Series) -> list[float]:
    """Requests per second over the last RATE_WINDOW_S, from the cumulative counts."""
    rates = []
    for i, now_s in enumerate(series.times_s):
        j = bisect_left(series.times_s, now_s - RATE_WINDOW_S)
        span_s = now_s - series.times_s[j]
        rates.append((series.total[i] - series.total[j]) / span_s if span_s else 0.0)
    return rates


def plot_latency_vs_throughput(
    history: dict[tuple[str, str], Series], tiers: list[str], pools: list[str], path: Path
) -> None:
    """Latency against throughput, one panel per tier (top row) and per pool (bottom row)."""
    columns = max(len(tiers), len(pools), 1)
    figure, axes = plt.subplots(2, columns, figsize=(4.5 * columns, 7), squeeze=False)
    for axis, tier in zip(axes[0], tiers, strict=False):
        throughput = _series(history, "E2E", tier).rps
        _scatter(axis, throughput, _series(history, "TTFT", tier).p50_ms, "TTFT p50", "o")
        _scatter(axis, throughput, _series(history, "TTFT", tier).p95_ms, "TTFT p95", "^")
        _scatter(axis, throughput, _series(history, "E2E", tier).p50_ms, "E2E p50", "s")
        axis.set_title(f"tier {tier}")
    for axis, pool in zip(axes[1], pools, strict=False):
        series = _series(history, "POOL", pool)
        _scatter(axis, series.rps, series.p50_ms, "E2E p50", "s")
        _scatter(axis, series.rps, series.p95_ms, "E2E p95", "v")
        axis.set_title(f"pool {pool}")
    for axis in axes.flat:
        axis.set_xlabel("completed requests/s")
        axis.set_ylabel("latency (ms)")
        if axis.has_data():
            axis.legend(fontsize="small")
        elif axis.get_title():
            axis.text(0.5, 0.5, "no completed requests", ha="center", transform=axis.transAxes)
        else:  # a row with fewer tiers or pools than columns
            axis.set_axis_off()
    _save(figure, path)


def plot_goodput(history: dict[tuple[str, str], Series], tiers: list[str], path: Path) -> None:
    """Per tier over time: requests/s meeting the SLO (goodput) beside all completed ones."""
    columns = max(len(tiers), 1)
    figure, axes = plt.subplots(
        1, columns, figsize=(4.5 * columns, 3.5), squeeze=False, sharey=True
    )
    for axis, tier in zip(axes[0], tiers, strict=False):
        good, done = _series(history, "GOOD", tier), _series(history, "E2E", tier)
        axis.plot(done.times_s, trailing_rate(done), "--", label="completed")
        axis.plot(good.times_s, trailing_rate(good), label="met SLO (goodput)")
        axis.set_title(f"tier {tier}")
        axis.set_xlabel("time (s)")
        axis.legend(fontsize="small")
    axes[0][0].set_ylabel(f"requests/s (trailing {RATE_WINDOW_S} s)")
    _save(figure, path)


def _series(history: dict[tuple[str, str], Series], kind: str, name: str) -> Series:
    """The row's series; all zeros when it never appeared (say, no request met its SLO)."""
    if (kind, name) in history:
        return history[(kind, name)]
    times_s = next(iter(history.values())).times_s
    size = len(times_s)
    return Series(times_s, [0.0] * size, [None] * size, [None] * size, [0] * size)


def _scatter(
    axis: Axes, rps: list[float], latency_ms: list[float | None], label: str, marker: str
) -> None:
    """Latency against throughput at each moment locust measured both (rates start ~3 s in;
    a 0 ms percentile means no request finished in its window)."""
    points = [(x, y) for x, y in zip(rps, latency_ms, strict=True) if y and x > 0]
    if points:
        throughput, latency = zip(*points, strict=True)
        axis.scatter(throughput, latency, label=label, marker=marker, s=16)


def _save(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def emit_headlines(stats: Stats, tiers: list[str], pools: list[str], load: Load) -> None:
    """The run's figures per tier and per pool, as the project's benchmark JSON lines."""
    extra = {"users": load.users, "spawn_rate": load.spawn_rate, "duration_s": load.duration_s}
    headlines = [h for tier in tiers for h in tier_headlines(stats, tier)]
    for pool in pools:
        row = stats[("POOL", pool)]
        headlines += _percentiles(row, "e2e_ms", f"pool.{pool}", ("50%", "95%"))
        headlines += _throughput(row, f"pool.{pool}")
    for metric, value, unit in headlines:
        emit("locust", metric, value, unit, **extra)


def tier_headlines(stats: Stats, tier: str) -> list[Headline]:
    """Requests, failures (sheds included), SLO attainment, goodput, latencies, throughput."""
    posts = [
        row for (kind, name), row in stats.items() if kind == "POST" and name.endswith(f"[{tier}]")
    ]
    num_sent = sum(int(row["Request Count"]) for row in posts)
    num_failed = sum(int(row["Failure Count"]) for row in posts)
    good = stats.get(("GOOD", tier))
    num_good = int(good["Request Count"]) if good else 0
    headlines: list[Headline] = [
        (f"requests.{tier}", num_sent, "requests"),
        (f"failures.{tier}", num_failed, "requests"),
        (f"slo_attainment.{tier}", num_good / num_sent if num_sent else 0.0, "fraction"),
        (f"goodput_rps.{tier}", float(good["Requests/s"]) if good else 0.0, "req/s"),
    ]
    headlines += _percentiles(stats.get(("TTFT", tier)), "ttft_ms", tier, ("50%", "95%", "99%"))
    headlines += _percentiles(stats.get(("TPOT", tier)), "tpot_ms", tier, ("50%", "95%"))
    headlines += _percentiles(stats.get(("E2E", tier)), "e2e_ms", tier, ("50%", "95%"))
    return headlines + _throughput(stats.get(("E2E", tier)), tier)


def _percentiles(
    row: Row | None, metric: str, suffix: str, columns: tuple[str, ...]
) -> list[Headline]:
    """`<metric>.p50.<suffix>` and so on, for the columns locust filled in."""
    if row is None:
        return []
    return [
        (f"{metric}.p{column.rstrip('%')}.{suffix}", float(row[column]), "ms")
        for column in columns
        if _number(row[column]) is not None
    ]


def _throughput(row: Row | None, suffix: str) -> list[Headline]:
    """Completed requests/s and output tokens/s (E2E and POOL events carry output tokens as
    their response length)."""
    if row is None:
        return []
    rps = float(row["Requests/s"])
    return [
        (f"throughput_rps.{suffix}", rps, "req/s"),
        (f"throughput_tok_s.{suffix}", rps * float(row["Average Content Size"]), "tok/s"),
    ]


if __name__ == "__main__":
    main()
