"""A throwaway redis-server on a free loopback port: the semantic cache's shared backend in
tests and benchmarks (Debian's package, which `.ci/run` installs). Nothing is persisted."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from testing.local_cluster import free_port

READY_TIMEOUT_S = 10.0


@contextmanager
def redis_server() -> Iterator[str]:
    """Run redis-server until the block ends; yields its URL once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    client = redis.Redis.from_url(url)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with status {process.returncode}")
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(f"redis-server at {url} not ready after {READY_TIMEOUT_S}s")
