"""Locust load for tierserve: one user class per SLA tier, each with its own kind of traffic.

Start the server (`serve run configs/local.yaml`), then, in its own shell:

    locust -f bench/traffic/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

or let `python -m bench.traffic.run_locust` run it and plot the results. Users:

| class | tier (`X-SLA-Tier`) | traffic (bench/traffic/workloads.py) | think time |
| --- | --- | --- | --- |
| InteractiveChatUser | interactive | chat: log-normal prompt and output lengths | 1-4 s |
| StandardRagUser | standard | rag: a 1-2k token document and a question | 1-3 s |
| BatchClassifyUser | batch | classify: a short review, 1-5 output tokens | 0.1-0.5 s |

Every request streams a chat completion. Besides the POST row
(`<kind>[<tier>]`, timed to the end of the stream; a 429 counts as a
failure), each successful stream fires custom events named after its tier:
`TTFT` (first content token), `TPOT` (the request's mean inter-token
latency: (last - first token time) / (output tokens - 1)), `E2E` (whole
stream; response length = output tokens), and `GOOD` when the request met
its tier's TTFT and TPOT targets, so the GOOD rows' request rate is the
goodput. `POOL` events, named after the pool that served the request
(`x-tierserve-pool`), carry the end-to-end time per pool.

Options (also as environment variables, or in a locust `--config` file):
`--tier-weights` / LOCUST_TIER_WEIGHTS, e.g. `interactive=5,standard=3,batch=2`
(0 leaves a tier out); `--slo-config` / LOCUST_SLO_CONFIG, a Serve config
file to read the tiers' SLOs from (default: configs/local.yaml's values).

Locust patches the standard library with gevent: run it only as the
`locust` command, never import this file into tests or a Ray process.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment

from bench.traffic.workloads import DEFAULT_SLOS, WORKLOADS, Corpus, Slo, load_slos

CORPUS = Corpus.load()
DEFAULT_TIER_WEIGHTS = "interactive=5,standard=3,batch=2"


class TierUser(HttpUser):
    """A client of one SLA tier sending one kind of request, streamed and timed per token."""

    abstract = True
    tier: str
    kind: str
    """A key of bench.traffic.workloads.WORKLOADS."""
    slos: dict[str, Slo] = DEFAULT_SLOS
    """Set from --slo-config at start-up (shared by every user class)."""

    def on_start(self) -> None:
        """Each user draws its own request shapes."""
        self.rng = random.Random()

    @task
    def send(self) -> None:
        """One streamed chat completion; reports TTFT, TPOT, E2E, GOOD and POOL events."""
        request = WORKLOADS[self.kind](CORPUS, self.rng)
        start_s = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=request.body(), headers={"X-SLA-Tier": self.tier},
            stream=True, catch_response=True, name=f"{self.kind}[{self.tier}]",
        ) as response:  # fmt: skip
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
                return
            stream = read_stream(response.iter_lines(), start_s)
            # Locust timed the headers; the request lasts until the stream ends.
            response.request_meta["response_time"] = stream.e2e_ms
            if stream.error or stream.ttft_ms is None:
                response.failure(stream.error or "stream ended without a token")
                return
            self._report(stream, response.headers.get("x-tierserve-pool", "unknown"))

    def _report(self, stream: StreamTiming, pool: str) -> None:
        assert stream.ttft_ms is not None
        self._fire("TTFT", self.tier, stream.ttft_ms)
        if stream.tpot_ms is not None:
            self._fire("TPOT", self.tier, stream.tpot_ms)
        self._fire("E2E", self.tier, stream.e2e_ms, stream.num_output_tokens)
        self._fire("POOL", pool, stream.e2e_ms, stream.num_output_tokens)
        if self.slos[self.tier].met_by(stream.ttft_ms, stream.tpot_ms):
            self._fire("GOOD", self.tier, stream.e2e_ms)

    def _fire(self, request_type: str, name: str, time_ms: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=time_ms,
            response_length=length, exception=None, context={},
        )  # fmt: skip


class InteractiveChatUser(TierUser):
    """A person chatting: varied prompt and answer lengths, reading between turns."""

    tier = "interactive"
    kind = "chat"
    wait_time = between(1, 4)


class StandardRagUser(TierUser):
    """An assistant answering from retrieved documents: long prompts, short answers."""

    tier = "standard"
    kind = "rag"
    wait_time = between(1, 3)


class BatchClassifyUser(TierUser):
    """A pipeline labelling reviews: short prompts, a few tokens, little pause."""

    tier = "batch"
    kind = "classify"
    wait_time = between(0.1, 0.5)


USER_CLASSES: tuple[type[TierUser], ...] = (InteractiveChatUser, StandardRagUser, BatchClassifyUser)


@dataclass(frozen=True)
class StreamTiming:
    """What one SSE stream showed the client, in milliseconds from the request's start."""

    ttft_ms: float | None
    last_token_ms: float | None
    e2e_ms: float
    num_output_tokens: int
    error: str | None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None for a single token."""
        if self.ttft_ms is None or self.last_token_ms is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_ms - self.ttft_ms) / (self.num_output_tokens - 1)


def read_stream(lines: Iterable[bytes], start_s: float) -> StreamTiming:
    """Read an OpenAI chunk stream to its end, noting when content arrived.

    Output tokens come from the usage chunk (a chunk may carry several
    tokens when the server speculates), else one per content chunk.
    """
    first_ms = last_ms = None
    num_chunks = 0
    num_tokens = None
    error = None
    for line in lines:
        event = _event(line)
        if event is None:
            continue
        now_ms = (time.perf_counter() - start_s) * 1000
        if "error" in event:
            error = str(event["error"].get("message", event["error"]))
        if any(choice["delta"].get("content") for choice in event.get("choices", [])):
            first_ms = now_ms if first_ms is None else first_ms
            last_ms = now_ms
            num_chunks += 1
        if event.get("usage"):
            num_tokens = event["usage"]["completion_tokens"]
    e2e_ms = (time.perf_counter() - start_s) * 1000
    return StreamTiming(first_ms, last_ms, e2e_ms, num_tokens or num_chunks, error)


def _event(line: bytes) -> dict[str, Any] | None:
    """The JSON of one `data: {...}` line; None for blank lines and `data: [DONE]`."""
    if not line.startswith(b"data: {"):
        return None
    return json.loads(line[len(b"data: ") :])


def parse_weights(spec: str) -> dict[str, int]:
    """`interactive=5,standard=3` -> {"interactive": 5, "standard": 3}; tiers not named get 0."""
    weights: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        tier, _, weight = item.partition("=")
        if tier not in {cls.tier for cls in USER_CLASSES} or not weight.isdigit():
            tiers = [cls.tier for cls in USER_CLASSES]
            raise ValueError(f"bad tier weight {item!r}: write tier=integer, tiers: {tiers}")
        weights[tier] = int(weight)
    return weights


@events.init_command_line_parser.add_listener
def _add_options(parser: LocustArgumentParser) -> None:
    parser.add_argument(
        "--tier-weights", env_var="LOCUST_TIER_WEIGHTS", default=DEFAULT_TIER_WEIGHTS,
        help="Users per tier, relative: interactive=5,standard=3,batch=2 (0 leaves one out).",
    )  # fmt: skip
    parser.add_argument(
        "--slo-config", env_var="LOCUST_SLO_CONFIG", default="",
        help="Serve config file to read the tiers' SLOs from (default: configs/local.yaml's).",
    )  # fmt: skip


@events.init.add_listener
def _configure(environment: Environment, **_: Any) -> None:
    """Apply --tier-weights and --slo-config before any user spawns."""
    options = environment.parsed_options
    assert options is not None, "locust's command line sets parsed_options"
    weights = parse_weights(options.tier_weights)
    for cls in USER_CLASSES:
        cls.weight = weights.get(cls.tier, 0)
    environment.user_classes[:] = [cls for cls in environment.user_classes if cls.weight > 0]
    if not environment.user_classes:
        raise ValueError(f"--tier-weights {options.tier_weights!r} gives no tier a user")
    if options.slo_config:
        TierUser.slos = load_slos(Path(options.slo_config))
    active = {cls.tier for cls in USER_CLASSES if cls in environment.user_classes}
    missing = active - TierUser.slos.keys()
    if missing:
        source = options.slo_config or "the default SLOs"
        raise ValueError(f"{source} has no SLO for tiers {sorted(missing)}")
