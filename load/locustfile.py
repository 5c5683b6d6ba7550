"""Locust load for tierserve: streaming chat completions from a mix of SLA tiers.

Start the server (`serve run configs/local.yaml`), then, in its own shell:

    locust -f load/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

Each user sends a short chat turn (prompt ~60-400 tokens, 32-128 output
tokens, the shape of interactive traffic) tagged with a tier drawn from
TIER_WEIGHTS, and waits 0.5-2 s between turns. Besides locust's own
end-to-end times, the first content token of every stream is reported as a
`TTFT` request named after the tier, so the table shows TTFT per tier; the
`chat[<tier>]` rows time the whole stream.

Locust patches the standard library with gevent: run it only as the
`locust` command, never import this file into tests or a Ray process.
"""

from __future__ import annotations

import json
import random
import time

from locust import HttpUser, between, task

from load.prompts import chat_turn

MODEL = "SmolLM2-135M-Instruct"
TIER_WEIGHTS = {"interactive": 5, "standard": 3, "batch": 2}
PROMPT_TOKENS = (60, 400)
OUTPUT_TOKENS = (32, 128)


class ChatUser(HttpUser):
    """A chat client of a random tier, streaming, with think time between requests."""
    wait_time = between(0.5, 2)

    @task
    def chat(self) -> None:
        """One streamed chat request, timed to its first token and its end."""
        tier = random.choices(list(TIER_WEIGHTS), weights=list(TIER_WEIGHTS.values()))[0]
        prompt = chat_turn(random.randint(*PROMPT_TOKENS), random.Random())
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": random.randint(*OUTPUT_TOKENS),
            "stream": True,
        }
        start_s = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=body, headers={"X-SLA-Tier": tier},
            stream=True, catch_response=True, name=f"chat[{tier}]",
        ) as response:  # fmt: skip
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
                return
            first_token_s = _first_token_time(response.iter_lines())
            if first_token_s is None:
                response.failure("stream ended without a token")
                return
            # Locust timed the headers, which the ingress sends with the first token.
            response.request_meta["response_time"] = (time.perf_counter() - start_s) * 1000
            self._report_ttft(tier, (first_token_s - start_s) * 1000)

    def _report_ttft(self, tier: str, ttft_ms: float) -> None:
        self.environment.events.request.fire(
            request_type="TTFT", name=tier, response_time=ttft_ms,
            response_length=0, exception=None, context={},
        )  # fmt: skip


def _first_token_time(lines) -> float | None:
    """Read the SSE stream to its end; when the first content delta arrived (perf_counter)."""
    first_token_s = None
    for line in lines:
        if first_token_s is None and _has_content(line):
            first_token_s = time.perf_counter()
    return first_token_s


def _has_content(line: bytes) -> bool:
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[len(b"data: ") :])["choices"]
    return any(c["delta"].get("content") for c in choices)
