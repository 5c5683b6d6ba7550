"""What the soak reads and does to the server beside its traffic: the pools' residue on
/metrics once idle, the Serve processes' resident memory, and a pool replica killed.

Loopback servers only: memory is read from the local processes serving the port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import random
import time
from urllib.parse import urlsplit

import httpx
import psutil

from bench.report import log

SERVE_PROCESS_TITLES = ("ray::ServeReplica", "ray::ProxyActor")
IDLE_CONFIRM_S = 2.0
"""An idle reading must hold this long: longer than the ingress's stats poll period."""
IDLE_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


async def idle_residue(client: httpx.AsyncClient, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until no pool has held KV blocks or requests for IDLE_CONFIRM_S (stats
    reach /metrics one poll late), or `timeout_s` passes; each IDLE_METRICS name summed over
    the pools, as last read."""
    deadline_s = time.monotonic() + timeout_s
    idle_since_s = math.inf
    while True:
        text = (await client.get("/metrics")).text
        residue = {name: sum(_samples(text, name)) for name in IDLE_METRICS}
        now_s = time.monotonic()
        idle_since_s = min(idle_since_s, now_s) if not any(residue.values()) else math.inf
        if now_s - idle_since_s >= IDLE_CONFIRM_S or now_s > deadline_s:
            return residue
        await asyncio.sleep(0.2)


def _samples(metrics_text: str, name: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith(name + "{")
    ]


def loopback_port(base_url: str) -> int:
    """The port of a loopback `base_url`; ValueError for any other host."""
    url = urlsplit(base_url)
    host = url.hostname or ""
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"soak only targets loopback servers, not {host!r}")
    return url.port or 80


def serve_rss_mb(port: int) -> float:
    """Resident memory (MB) of the Serve replicas and proxies of the Ray node serving `port`.

    The process listening on `port` is the HTTP proxy; its parent is the node's raylet,
    whose workers are the processes counted. NaN when no local process listens there.
    """
    listeners = [
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    ]
    if not listeners:
        return math.nan
    raylet = psutil.Process(listeners[0]).parent()
    if raylet is None:
        return math.nan
    total = 0
    for process in raylet.children(recursive=True):
        try:
            title = " ".join(process.cmdline())
            if title.startswith(SERVE_PROCESS_TITLES):
                total += process.memory_info().rss
        except psutil.Error:  # exited meanwhile
            continue
    return total / 2**20


async def kill_one_pool_replica(app_name: str, rng: random.Random) -> None:
    """ray.kill one replica of one pool (Serve then starts a replacement)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#pool-"
    actors = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
    names = sorted(a["name"] for a in actors if a["name"].startswith(prefix))
    if not names:
        log(f"soak: no pool replica named {prefix}* to kill")
        return
    victim = rng.choice(names)
    log(f"soak: killing {victim}")
    ray.kill(await asyncio.to_thread(ray.get_actor, victim, namespace="serve"), no_restart=True)
