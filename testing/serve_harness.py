"""Integration-test helpers: the app on a private Ray cluster, and its metrics and logs.
/metrics read back by name and labels, the ingress's request log read back from the Ray
session's files."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import ray

from bench.paths import REPO_ROOT
from engine.config import EngineConfig
from serving.app_config import TierserveConfig, load_config
from serving.pools.pool import EngineFactory
from testing import local_cluster


def fake_config(max_model_len: int = 4096, **updates: Any) -> TierserveConfig:
    """configs/local.yaml sized for the fake engine (no model, `max_model_len` of context),
    with stats polled every 0.1 s and `updates` applied to the top-level fields."""
    base = load_config(REPO_ROOT / "configs" / "local.yaml")
    pools = tuple(
        pool.model_copy(
            update={
                "engine": EngineConfig(
                    max_num_seqs=pool.engine.max_num_seqs, max_model_len=max_model_len
                )
            }
        )
        for pool in base.pools
    )
    data = {**base.model_dump(), "pools": pools, "stats_poll_interval_s": 0.1, **updates}
    return TierserveConfig.model_validate(data)


REAL_MAX_MODEL_LEN = 1024
"""The context of real_engine_config's engines."""
TEST_SLO_SCALE = 4.0
"""What the real-model test apps scale every tier's TTFT and TPOT targets by. Their engines
are exact (fp32, unquantized): idle, the interactive pool took 309 ms to a first token and
31.7 ms a token here, over configs/local.yaml's 25 ms. Placement then sends an interactive
request to whichever pool's prediction meets the SLO, at times the offline one, and the
tests that expect an idle pool to serve its own tier failed in one full run of three."""


def real_engine_config(batch_dir: Path) -> TierserveConfig:
    """configs/local.yaml (speculation on the interactive pool), with small exact engines on
    the default model: unquantized, so both pools give the same greedy text
    (tests/unit/engine/test_quant_loader.py covers the quantized load path); SLOs those
    engines meet (TEST_SLO_SCALE); batch jobs kept in `batch_dir`."""
    base = load_config(REPO_ROOT / "configs" / "local.yaml").with_slos_scaled(TEST_SLO_SCALE)
    small = {
        "dtype": "float32", "num_kv_blocks": 64, "max_model_len": REAL_MAX_MODEL_LEN, "quant": None
    }  # fmt: skip
    pools = tuple(
        pool.model_copy(update={"engine": replace(pool.engine, **small)}) for pool in base.pools
    )
    jobs = base.batch_jobs.model_copy(update={"data_dir": str(batch_dir), "retry_delay_s": 0.1})
    return base.model_copy(
        update={"pools": pools, "stats_poll_interval_s": 0.1, "batch_jobs": jobs}
    )


def exact_config(max_model_len: int = 1024, **updates: Any) -> TierserveConfig:
    """configs/local.yaml on the real model with small exact engines (fp32, unquantized, 64
    KV blocks, no speculation) and SLOs they meet (TEST_SLO_SCALE), without the small pool
    (no student is distilled in tests), stats polled every 0.1 s, and `updates` applied to
    the top-level fields."""
    base = load_config(REPO_ROOT / "configs" / "local.yaml").with_slos_scaled(TEST_SLO_SCALE)
    small = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": max_model_len,
             "quant": None, "spec_decode": None}  # fmt: skip
    pools = tuple(
        pool.model_copy(update={"engine": replace(pool.engine, **small)})
        for pool in base.pools
        if base.small_model is None or pool.name != base.small_model.pool
    )
    changes = {"pools": pools, "small_model": None, "stats_poll_interval_s": 0.1, **updates}
    return base.with_changes(**changes)


@contextmanager
def serving(
    config: TierserveConfig, engine_cls: EngineFactory | None = None, keep: bool = False
) -> Iterator[str]:
    """The app on the shared cluster (tests/integration/conftest.py holds it), deleted
    when the block ends, or with `keep` left for the next block that keeps the same app."""
    with local_cluster.serving(config, engine_cls, shared=True, keep=keep) as base_url:
        yield base_url


def metric(base_url: str, name: str, api_key: str | None = None, **labels: str) -> float:
    """The first sample of `name` on /metrics whose labels include `labels`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{base_url}/metrics", headers=headers).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in /metrics")


def wait_for_metric(
    base_url: str,
    name: str,
    value: float,
    timeout_s: float,
    api_key: str | None = None,
    **labels: str,
) -> None:
    """Poll until the metric reads `value` (stats reach /metrics one poll period late, and
    an aborted stream leaves the engine only when its abort has crossed the process pipe)."""
    deadline = time.monotonic() + timeout_s
    while (seen := metric(base_url, name, api_key, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} read {seen}, not {value}"
        time.sleep(0.05)


def request_log(request_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The ingress's log line for `request_id` (lines reach the files a moment late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fields = request_logs().get(request_id)
        if fields is not None:
            return fields
        if time.monotonic() > deadline:
            raise TimeoutError(f"no log line for {request_id} under {_serve_logs_dir()}")
        time.sleep(0.2)


def request_logs() -> dict[str, dict[str, Any]]:
    """Every ingress log line by request id (as `x-tierserve-request-id` gives it, without
    the `cmpl-` or `chatcmpl-` of the response's id), read from the replica log files of
    the Ray session this process is connected to."""
    lines = {}
    for path in _serve_logs_dir().glob("replica_tierserve_Ingress_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find('{"request_id": "')
            if start >= 0:
                fields, _ = json.JSONDecoder().raw_decode(line[start:])
                lines[fields["request_id"].rsplit("-", 1)[-1]] = fields
    return lines


def request_replica(request_id: str, timeout_s: float = 10.0) -> str:
    """The ingress replica whose log holds `request_id`'s line (its log file's name)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for path in _serve_logs_dir().glob("replica_tierserve_Ingress_*.log"):
            if f'"request_id": "chatcmpl-{request_id}"' in path.read_text(errors="replace"):
                return path.name
        if time.monotonic() > deadline:
            raise TimeoutError(f"no log line for {request_id} under {_serve_logs_dir()}")
        time.sleep(0.2)


def _serve_logs_dir() -> Path:
    return Path(ray.get_runtime_context().get_temp_dir()) / "session_latest" / "logs" / "serve"
