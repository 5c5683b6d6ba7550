"""Test doubles that honour the real contracts: a model-free engine and tokenizer for
deployment tests, and a scripted draft proposer for speculation tests."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

from engine.config import EngineConfig
from engine.model.students import (
    CARD_FILE,
    ROUTER_FILE,
    STUDENT_MODEL,
    latest_student,
    students_dir,
)
from engine.outputs import EngineStats, RequestOutput
from engine.request import DEFAULT_URGENCY, Request, Urgency
from engine.sampling_params import SamplingParams
from engine.spec_decode import Proposal
from policies.difficulty import DifficultyModel
from policies.router_choice import ServedStudent
from serving.pools.pool import ReplicaStats

TOKEN_DELAY_S = 0.005
FAIL_MARKER = "<fake-fault>"
"""A prompt containing this makes the fake engine raise a RuntimeError: an unexpected fault."""
FAKE_EMBEDDING_DIM = 32
"""Length of the fake engine's embeddings."""
FAKE_NUM_DRAFTS = 10
"""Drafts a speculating fake reports, each as long as `spec_accepted_per_pos`, over twice
as many decodes (every other decode drafted)."""


class FakeTokenizer:
    """One token per character: counts are easy to predict in tests."""

    chat_template = "<role>content"
    """Renders roles and contents only, as the default model's does (tools in Hermes text)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per character."""
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        """The characters of the ids."""
        return "".join(chr(t) for t in token_ids)

    def __len__(self) -> int:
        """Every Unicode code point is a token."""
        return 0x110000

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
    ) -> str:
        """Roles as tags, the assistant turn opened."""
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def publish_fake_student(
    cache_dir: Path, name: str, weights_sha256: str, router: DifficultyModel | None = None
) -> Path:
    """What `tierserve distill` publishes as `name`, less the weights (a fake engine loads
    none): its folder with a model card naming the weights' digest, and `router` beside it."""
    folder = students_dir(cache_dir) / name
    folder.mkdir(parents=True)
    if router is not None:
        router.save(folder / ROUTER_FILE)
    card = {"name": name, "reproducible": {"weights_sha256": weights_sha256}}
    (folder / CARD_FILE).write_text(json.dumps(card))  # last: a student is one with a card
    return folder


class FakeEngine:
    """Writes a, b, c, ... one token every `token_delay_s` until max_tokens; tracks live
    requests. A prompt containing FAIL_MARKER fails with a RuntimeError (a bug, not a 400)."""

    token_delay_s = TOKEN_DELAY_S
    batch_limited = False
    """True: at most max_num_seqs requests run at once; the rest wait (num_waiting, queue time)."""
    prefix_caching = False
    """True: a prompt's full blocks already seen by this engine count as num_cached_tokens."""
    stats_fail = False
    """True: `stats()` raises, as for an engine whose load nobody can read."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model == STUDENT_MODEL:  # as the real loader: no student yet, no engine
            latest_student(config.cache_dir)
        self.tokenizer = FakeTokenizer()
        self.max_model_len = config.max_model_len or 256
        self._max_num_seqs = config.max_num_seqs
        self._block_size = config.block_size
        self._batch = asyncio.Semaphore(config.max_num_seqs)
        self._num_waiting = 0
        self._cached_prefixes: set[tuple[int, ...]] = set()
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        """Prompt tokens looked up in the prefix cache, and those found, as the engine's."""
        self._running: set[str] = set()
        self.alive = True
        """Set False to play an engine whose step loop died."""
        self.prompt_tokens_computed_per_s = 0.0
        """What `stats()` reports as the recent prompt rate."""
        self.spec_accepted_per_pos: list[int] = []
        """Accepted draft tokens per position; non-empty plays a speculating engine."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        urgency: Urgency = DEFAULT_URGENCY,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one token per delay, as the engine's deltas."""
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len ({self.max_model_len})")
        if FAIL_MARKER in self.tokenizer.decode(prompt_token_ids):
            raise RuntimeError("fake engine fault: internal detail")
        queue_time_s = await self._wait_for_slot()
        num_cached_tokens = self._cache_prefix(prompt_token_ids)
        self._running.add(request_id)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                token_id = ord("a") + i % 26
                last = i == params.max_tokens - 1
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    new_text=chr(token_id),
                    finished=last,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=i + 1,
                    num_cached_tokens=num_cached_tokens,
                    queue_time_s=queue_time_s,
                )
        finally:
            self._running.discard(request_id)
            if self.batch_limited:
                self._batch.release()

    async def embed(
        self, prompt_token_ids: list[int], request_id: str, urgency: Urgency = DEFAULT_URGENCY
    ) -> RequestOutput:
        """Characters counted into FAKE_EMBEDDING_DIM buckets, normalized: texts with the
        same letters embed alike, which is all a model-free test can ask."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt exceeds max_model_len ({self.max_model_len})")
        await asyncio.sleep(self.token_delay_s)
        counts = [0.0] * FAKE_EMBEDDING_DIM
        for token_id in prompt_token_ids:
            counts[token_id % FAKE_EMBEDDING_DIM] += 1.0
        norm = math.sqrt(sum(c * c for c in counts)) or 1.0
        return RequestOutput(
            request_id=request_id, new_token_ids=[], new_text="", finished=True,
            finish_reason="stop", num_prompt_tokens=len(prompt_token_ids),
            embedding=[c / norm for c in counts],
        )  # fmt: skip

    async def _wait_for_slot(self) -> float | None:
        """Seconds waited for a batch slot when batch_limited, else None (no queue)."""
        if not self.batch_limited:
            return None
        arrival_s = time.monotonic()
        self._num_waiting += 1
        try:
            await self._batch.acquire()
        finally:
            self._num_waiting -= 1
        return time.monotonic() - arrival_s

    def _cache_prefix(self, prompt_token_ids: list[int]) -> int:
        """Tokens of the prompt's leading full blocks seen before; then remembers its blocks."""
        if not self.prefix_caching:
            return 0
        ends = range(self._block_size, len(prompt_token_ids) + 1, self._block_size)
        blocks = [tuple(prompt_token_ids[:end]) for end in ends]
        num_cached = next(
            (i for i, b in enumerate(blocks) if b not in self._cached_prefixes), len(blocks)
        )
        self._cached_prefixes.update(blocks)
        self.prefix_cache_queries += len(prompt_token_ids)
        self.prefix_cache_hits += num_cached * self._block_size
        return num_cached * self._block_size

    def abort(self, request_id: str) -> None:
        """Forget the request."""
        self._running.discard(request_id)

    def stats(self) -> EngineStats:
        """Live requests as the running batch; the speculative counters if set."""
        if self.stats_fail:
            raise RuntimeError("fake engine: stats unavailable")
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            kv_cache_usage=len(self._running) / self._max_num_seqs,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=0,
            generation_tokens_per_s=0.0,
            prompt_tokens_computed_per_s=self.prompt_tokens_computed_per_s,
            spec_num_drafts=FAKE_NUM_DRAFTS if self.spec_accepted_per_pos else 0,
            spec_num_draft_tokens=FAKE_NUM_DRAFTS * len(self.spec_accepted_per_pos),
            spec_num_accepted_tokens=sum(self.spec_accepted_per_pos),
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            spec_num_decode_rows=2 * FAKE_NUM_DRAFTS if self.spec_accepted_per_pos else 0,
        )

    def is_alive(self) -> bool:
        """The `alive` flag."""
        return self.alive


class SlowFakeEngine(FakeEngine):
    """A fake slow enough (50 ms a token) to be caught mid-stream."""

    token_delay_s = 0.05


class QueueingFakeEngine(FakeEngine):
    """Runs at most max_num_seqs requests at once (20 ms a token), queues the rest, and caches
    prompt prefixes: load and cache state a router and an autoscaler can act on."""

    token_delay_s = 0.02
    batch_limited = True
    prefix_caching = True


class StatslessQueueingFakeEngine(QueueingFakeEngine):
    """A QueueingFakeEngine whose stats call fails: a replica no router can see the load of."""

    stats_fail = True


class FakePoolHandle:
    """Stands in for a pool's DeploymentHandle where only `handle.stats.remote()` is used:
    answers the fake engine's stats, or, with no engine (a pool without replicas), never.
    `student` is what its replica reports serving (set it to play a new student's rollout)."""

    def __init__(
        self,
        engine: FakeEngine | None,
        grammar_mask_s: float = 0.0,
        student: ServedStudent | None = None,
    ) -> None:
        self.stats = self
        self._engine = engine
        self._grammar_mask_s = grammar_mask_s
        self.student = student
        self.calls: list[asyncio.Future[ReplicaStats]] = []

    def remote(self) -> asyncio.Future[ReplicaStats]:
        """A cancellable call, as a DeploymentResponse is."""
        call: asyncio.Future[ReplicaStats] = asyncio.get_running_loop().create_future()
        if self._engine is not None:
            engine = self._engine
            stats = ReplicaStats(
                "r0",
                engine.stats(),
                engine.max_model_len,
                grammar_mask_s=self._grammar_mask_s,
                student=self.student,
            )
            call.set_result(stats)
        self.calls.append(call)
        return call


class ScriptedProposer:
    """Drafts from a known answer: right for a random number of tokens, then one wrong one.

    Its rejections land at every offset of a block, which the real proposers,
    cut short by the draft length after a few misses, rarely manage in a short test.
    """

    cooldown_steps = 1

    def __init__(self, answer: list[int], vocab_size: int, seed: int) -> None:
        self.answer, self.vocab_size, self.rng = answer, vocab_size, random.Random(seed)

    def propose(self, requests: dict[Request, int]) -> dict[Request, Proposal]:
        out = {}
        for request, k in requests.items():
            right = self.answer[request.num_tokens : request.num_tokens + k]
            num_right = self.rng.randint(0, len(right))
            drafts = right[:num_right]
            if num_right < len(right):
                drafts.append((right[num_right] + 1) % self.vocab_size)
            if drafts:
                out[request] = Proposal(drafts)
        return out

    def release(self, request: Request) -> None:
        pass
