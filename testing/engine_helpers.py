"""Helpers shared by the engine tests: drive an engine to the end, check the KV books."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from bench.paths import DATA_DIR
from engine.config import default_cache_dir
from engine.engine import LLMEngine
from engine.kv_cache import KVCacheManager
from engine.model.loader import resolve_model_dir
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams
from small_model.distill.run import DistillSettings
from small_model.distill.trainer import TrainSettings

TEST_ENGINE_CONFIG = dict(
    model="default",
    dtype="float32",
    num_kv_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
)
"""Small and exact: fp32 for parity, a 1,024-token KV pool (47 MB) instead of 1 GB."""

QUALITY_PROMPTS = DATA_DIR / "quality_prompts.jsonl"
"""Chat prompts the project wrote (a `prompt` field per line): enough for a tiny distillation."""

MAX_STEPS = 2_000
"""Far more than any test needs: hitting it means a deadlock or a livelock."""


@dataclass
class Completion:
    """A request's deltas joined back together."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        assert self.finish_reason is None, f"{out.request_id} produced output after finishing"
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.new_logprobs or []
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.num_cached_tokens = out.num_cached_tokens


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def drain(engine: LLMEngine) -> dict[str, Completion]:
    """Step until every request has finished; return what each produced."""
    completions: dict[str, Completion] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            assert_all_blocks_free(engine.kv)
            return completions
        for out in engine.step():
            completions.setdefault(out.request_id, Completion()).add(out)
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def run_requests(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Completion]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    return drain(engine)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Completion:
    return run_requests(engine, {"only": (prompt, params)})["only"]


def assert_books_balance(kv: KVCacheManager, live: list[Request]) -> None:
    """Every block's ref count is the number of live requests holding it; the rest are free."""
    holders = [0] * kv.pool.num_blocks
    for request in live:
        assert len(set(request.block_ids)) == len(request.block_ids), "block listed twice"
        for block_id in request.block_ids:
            holders[block_id] += 1
    assert [block.ref_count for block in kv.pool.blocks] == holders
    assert kv.pool.num_free_blocks == holders.count(0)


def assert_all_blocks_free(kv: KVCacheManager) -> None:
    assert_books_balance(kv, [])
    assert kv.usage == 0.0


def write_slots(
    slot_tokens: dict[int, int], request: Request, start: int, end: int, block_size: int
) -> None:
    """Fake forward pass: 'compute' positions [start, end) by recording their token per slot."""
    for position in range(start, end):
        block_id = request.block_ids[position // block_size]  # IndexError: no slot reserved
        slot_tokens[block_id * block_size + position % block_size] = request.token_ids[position]


def assert_blocks_hold(
    slot_tokens: dict[int, int], block_ids: list[int], token_ids: list[int], block_size: int
) -> None:
    """The slots of `block_ids`, in order, hold `token_ids`: what a prefix hit promises."""
    for position, token in enumerate(token_ids):
        slot = block_ids[position // block_size] * block_size + position % block_size
        assert slot_tokens.get(slot) == token, f"slot {slot} of position {position} is stale"


def assert_slots_hold_tokens(
    slot_tokens: dict[int, int], request: Request, block_size: int
) -> None:
    """Every computed position's slot holds that very token: sharing and eviction were right."""
    computed = request.token_ids[: request.num_computed_tokens]
    assert_blocks_hold(slot_tokens, request.block_ids, computed, block_size)


def forget_fresh_blocks(kv: KVCacheManager, slot_tokens: dict[int, int]) -> None:
    """Spy on the pool: a block it hands out fresh holds garbage until computed again."""
    allocate, size = kv.pool.allocate, kv.block_size

    def allocate_fresh():
        block = allocate()
        for slot in range(block.block_id * size, (block.block_id + 1) * size):
            slot_tokens.pop(slot, None)
        return block

    kv.pool.allocate = allocate_fresh  # type: ignore[method-assign]


def tiny_distill_settings() -> DistillSettings:
    """A student of 2 of the default model's 30 layers, trained 2 steps on 6 short answers:
    quality is beside the point, its shape, loading and reproducibility are what tests need."""
    return DistillSettings(
        teacher=str(resolve_model_dir("default", default_cache_dir())),
        prompts_file=QUALITY_PROMPTS,
        max_prompts=6,
        max_answer_tokens=8,
        keep_layers=(0, 29),
        train=TrainSettings(max_steps=2),
    )


def scattered_block_tables(
    kv_lens: list[int], block_size: int, gen: torch.Generator
) -> tuple[int, list[list[int]]]:
    """A pool a few blocks larger than `kv_lens` need, and each sequence's blocks drawn from
    it in random order: kernels must read a block table, not assume contiguous blocks."""
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in kv_lens:
        tables.append(order[: -(-n // block_size)])
        order = order[-(-n // block_size) :]
    return num_blocks, tables


Result = TypeVar("Result")


def on_one_and_two_threads(compute: Callable[[], Result]) -> tuple[Result, Result]:
    """`compute()` at one torch thread, then at two (a kernel that splits its rows or outputs
    over torch's threads); the thread count is restored after."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = compute()
        torch.set_num_threads(2)
        return alone, compute()
    finally:
        torch.set_num_threads(threads)
