"""Batch API benchmark: a job through the Files and Batches APIs against the same requests
sent straight to the offline pool's engine.

  python -m bench.serving.bench_batch [--quick] [--config configs/local.yaml]

1. Engine: every request added at once to an LLMEngine built as the offline pool's
   (same config, same thread count), stepped until all finish; once before the Batch
   API run and once after it, and their mean is the baseline (this shared machine
   drifts by 10% and more over the run's hour).
2. Batch API: the app as configured, on a private local Ray cluster; the same
   requests uploaded as one JSONL file and run as one batch, timed from create to
   completed. `ratio.batch_api_vs_engine` is engine time over batch time (throughput).
3. Kill and resume: a second batch (the first KILL_LINES requests); halfway through,
   the batch runner's replica is killed (Serve starts another, which resumes from the
   store), while one interactive chat stream after another runs alongside. Lost and
   duplicated lines are counted from the output and error files; the interactive
   TTFT p95 is set against the tier's TTFT target scaled to this machine
   (bench.serving.bench_sla's machine factor).

Prompts are random words (a passage and a question, ~PROMPT_TOKENS tokens): the
prefix cache shares only the chat template's opening. Every request decodes
OUTPUT_TOKENS tokens (EOS ignored), greedy, so both sides do the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.prompts import chat_turn
from bench.report import emit, log, percentile
from bench.serving.bench_sla import machine_factor
from engine.model.chat import chat_prompt_ids
from engine.process import configure_process
from engine.sampling_params import SamplingParams
from serving.app_config import TierserveConfig, load_config
from testing.local_cluster import kill_replica, serving

BENCH = "batch"
PROMPT_TOKENS = 96
OUTPUT_TOKENS = 32
INTERACTIVE_OUTPUT_TOKENS = 16
KILL_LINES = 300
"""Lines of the batch killed halfway (the first ones of the throughput batch)."""
FINAL = ("completed", "failed", "expired", "cancelled")
POLL_INTERVAL_S = 2.0
"""Between status calls. Each crosses the proxy, the ingress and the runner (~40 ms of CPU
here, measured): polled four times a second, they took a sixth of a core from the job."""


def make_messages(count: int, seed: int) -> list[str]:
    """`count` user turns of random words, the same for every side of the comparison."""
    rng = random.Random(seed)
    return [chat_turn(PROMPT_TOKENS, rng) for _ in range(count)]


def batch_file(model: str, messages: list[str]) -> bytes:
    """The requests as a Batch API input file (chat completions, greedy, fixed length)."""
    lines = []
    for i, text in enumerate(messages):
        body = {
            "model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        request = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps({**request, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def engine_seconds(config: TierserveConfig, messages: list[str]) -> float:
    """Wall time for the offline pool's engine to finish every request, added at once."""
    from engine.engine import LLMEngine  # torch and the model: only this side needs them

    engine_config = config.pool("offline").engine
    configure_process(engine_config)
    engine = LLMEngine(engine_config)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    prompts = [chat_prompt_ids(engine.tokenizer, text) for text in messages]
    start_s = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"line-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start_s


def submit(client: openai.OpenAI, content: bytes) -> str:
    """Upload the file and start a batch on it; the batch id."""
    uploaded = client.files.create(file=("bench.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def wait(client: openai.OpenAI, batch_id: str, on_progress: Any = None) -> Any:
    """Poll until the batch is final (retrying while the runner restarts); the batch."""
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError) as error:
            log(f"batch status unavailable ({error.__class__.__name__}); retrying")
            time.sleep(0.5)
            continue
        if batch.status in FINAL:
            return batch
        if on_progress is not None:
            on_progress(batch)
        time.sleep(POLL_INTERVAL_S)


def custom_ids(client: openai.OpenAI, batch: Any) -> list[str]:
    """Every custom_id in the batch's output and error files, repeats included."""
    ids = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            text = client.files.content(file_id).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines()]
    return ids


class InteractiveProbe(threading.Thread):
    """One streamed interactive chat after another until stopped; their TTFTs."""

    def __init__(self, base_url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.model = base_url, model
        self.ttfts_s: list[float] = []
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        rng = random.Random(7)
        with httpx.Client(base_url=self.base_url, timeout=120) as http:
            while not self.stop.is_set():
                self._one(http, chat_turn(PROMPT_TOKENS, rng))

    def _one(self, http: httpx.Client, text: str) -> None:
        body = {
            "model": self.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": INTERACTIVE_OUTPUT_TOKENS, "stream": True,
        }  # fmt: skip
        start_s = time.perf_counter()
        headers = {"X-SLA-Tier": "interactive"}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                self.refused += 1
                response.read()
                time.sleep(0.2)
                return
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                    self.ttfts_s.append(time.perf_counter() - start_s)
                    break
            for _ in lines:  # the rest of the stream
                pass


def _has_text(chunk: dict[str, Any]) -> bool:
    """Whether a chat chunk carries generated text (the opening one carries only the role)."""
    return any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", []))


def run_batches(config: TierserveConfig, messages: list[str], kill_lines: int) -> dict[str, Any]:
    """Phases 2 and 3 against one deployment (phase 3 on the first `kill_lines` requests)."""
    content = batch_file(config.model_name, messages)
    num_lines = len(messages)
    result: dict[str, Any] = {}
    with serving(config) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=2)
        log("--- warm-up batch (not counted)")
        wait(client, submit(client, batch_file(config.model_name, make_messages(8, seed=99))))
        log(f"--- batch API: {num_lines} lines")
        start_s = time.perf_counter()
        batch = wait(client, submit(client, content))
        result["batch_s"] = time.perf_counter() - start_s
        result["completed"] = batch.request_counts.completed
        log(f"--- kill and resume: {kill_lines} lines, interactive stream alongside")
        probe = InteractiveProbe(base_url, config.model_name)
        probe.start()
        killed: list[str] = []

        def kill_halfway(progress: Any) -> None:
            counts = progress.request_counts
            if not killed and counts is not None and counts.completed >= kill_lines // 2:
                killed.append(kill_replica("BatchRunner"))
                log(f"killed {killed[0]} at {counts.completed} lines")

        kill_content = batch_file(config.model_name, messages[:kill_lines])
        batch = wait(client, submit(client, kill_content), on_progress=kill_halfway)
        probe.stop.set()
        probe.join()
        ids = custom_ids(client, batch)
        result |= {
            "kill_status": batch.status,
            "killed": bool(killed),
            "lost": kill_lines - len(set(ids)),
            "duplicated": len(ids) - len(set(ids)),
            "interactive_ttfts_s": probe.ttfts_s,
            "interactive_refused": probe.refused,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 lines instead of 1000")
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    args = parser.parse_args()
    num_lines = 200 if args.quick else 1000
    config = load_config(args.config)
    messages = make_messages(num_lines, seed=0)
    log(f"--- engine: {num_lines} requests straight to the offline pool's engine")
    engine_before_s = engine_seconds(config, messages)
    factor = machine_factor(config)
    kill_lines = min(num_lines, KILL_LINES)
    runs = run_batches(config, messages, kill_lines)
    log("--- engine again, after the Batch API runs")
    engine_after_s = engine_seconds(config, messages)
    engine_s = (engine_before_s + engine_after_s) / 2
    common = {"lines": num_lines, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
    runs_s = {"before_s": round(engine_before_s, 1), "after_s": round(engine_after_s, 1)}
    emit(BENCH, "engine.seconds", engine_s, "s", **runs_s, **common)
    emit(BENCH, "batch.seconds", runs["batch_s"], "s", completed=runs["completed"], **common)
    emit(BENCH, "ratio.batch_api_vs_engine", engine_s / runs["batch_s"], "x", target=0.9, **common)
    killed = {"killed": runs["killed"], "lines": kill_lines, "status": runs["kill_status"]}
    emit(BENCH, "batch.lost_lines", runs["lost"], "lines", target=0, **killed)
    emit(BENCH, "batch.duplicated_lines", runs["duplicated"], "lines", target=0, **killed)
    ttfts_ms = [t * 1000 for t in runs["interactive_ttfts_s"]]
    slo_ms = config.tier("interactive").ttft_ms * factor
    p95 = percentile(ttfts_ms, 95) if ttfts_ms else float("nan")
    emit(
        BENCH, "batch.interactive_ttft_p95_ms_during_job", p95, "ms",
        requests=len(ttfts_ms), refused=runs["interactive_refused"], slo_ms=round(slo_ms),
        machine_factor=round(factor, 2), slo_met=p95 <= slo_ms,
    )  # fmt: skip


if __name__ == "__main__":
    main()
