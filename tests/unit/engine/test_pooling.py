"""Embedding requests through the engine: prefill-only sequences pooled into one vector.

The reference is the model's own dense forward over the whole prompt (no paged cache, no
chunks), mean-pooled and normalized here: the engine's chunked, batched, paged path must
give the same vector within fp32 tolerance.
"""

from __future__ import annotations

import torch

from engine.engine import LLMEngine
from engine.pooling import PooledStates
from engine.request import Request
from engine.sampling_params import PoolingParams, SamplingParams
from testing.engine_helpers import drain, greedy

EMBED = SamplingParams(max_tokens=1, temperature=0)
TOLERANCE = 1e-4


def _reference(engine: LLMEngine, prompt: list[int], pooling: str = "mean") -> torch.Tensor:
    """The dense forward's last-layer states of the whole prompt, pooled and normalized."""
    with torch.inference_mode():
        hidden = engine.model.forward(torch.tensor(prompt)).float()  # [T, hidden]
    pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


def _embed_all(engine: LLMEngine, prompts: dict[str, list[int]], **pooling) -> dict:
    """Every prompt queued as an embedding at once; the finished output of each."""
    outputs = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, EMBED, pooling=PoolingParams(**pooling))
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def test_a_chunked_embedding_equals_the_dense_mean_of_the_prompt(engine, tokenizer) -> None:
    # 64 tokens per step in the test engine: this prompt takes three chunks.
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 14)
    assert len(prompt) > 2 * engine.config.max_num_batched_tokens
    output = _embed_all(engine, {"e": prompt})["e"]
    vector = torch.tensor(output.embedding)
    assert output.finished and output.finish_reason == "stop"
    assert output.new_token_ids == [] and output.num_output_tokens == 0
    assert output.num_prompt_tokens == len(prompt)
    assert abs(vector.norm().item() - 1) < 1e-5
    assert torch.allclose(vector, _reference(engine, prompt), atol=TOLERANCE)


def test_last_token_pooling_is_the_last_positions_state(engine, tokenizer) -> None:
    prompt = tokenizer.encode("How do I reset my password?")
    output = _embed_all(engine, {"e": prompt}, pooling="last")["e"]
    reference = _reference(engine, prompt, "last")
    assert torch.allclose(torch.tensor(output.embedding), reference, atol=TOLERANCE)


def test_embeddings_batched_with_a_generation_equal_each_alone(engine, tokenizer) -> None:
    texts = ["What is the capital of France?", "Paris is lovely in spring.", "2 + 2 = 4"]
    prompts = {f"e{i}": tokenizer.encode(t) for i, t in enumerate(texts)}
    alone = {k: _embed_all(engine, {k: p})[k].embedding for k, p in prompts.items()}
    question = tokenizer.encode("Name three colours:")
    solo_text = _generate(engine, question)
    engine.add_request("gen", question, greedy(8))
    together = _embed_all(engine, prompts)
    assert together.keys() >= prompts.keys()
    for request_id, vector in alone.items():
        assert torch.allclose(
            torch.tensor(together[request_id].embedding), torch.tensor(vector), atol=TOLERANCE
        )
    assert together["gen"].finished  # the generation ran beside them, unharmed:
    assert _generate(engine, question) == solo_text


def test_a_cached_prefix_is_recomputed_for_an_embedding(engine, tokenizer) -> None:
    """The prefix cache holds K/V, not hidden states: an embedding computes its whole
    prompt even when a generation just cached it, and gets the same vector as cold."""
    prompt = tokenizer.encode("A long shared system prompt about kitchens. " * 6)
    cold = _embed_all(engine, {"cold": prompt})["cold"].embedding
    _generate(engine, prompt)  # fills the prefix cache with this prompt's blocks
    warm = _embed_all(engine, {"warm": prompt})["warm"]
    assert warm.num_cached_tokens == 0
    assert torch.allclose(torch.tensor(warm.embedding), torch.tensor(cold), atol=TOLERANCE)


def test_a_restarted_sum_forgets_the_chunks_before_preemption() -> None:
    """A preempted request is recomputed from position 0: its sum starts again there."""
    request = Request("r", [1, 2, 3, 4], EMBED, pooling=PoolingParams())
    states = PooledStates()
    rows = torch.arange(8.0).reshape(4, 2)
    states.add(request, 0, rows[:2])
    states.add(request, 0, rows[:2])  # recomputed after a preemption
    states.add(request, 2, rows[2:])
    expected = torch.nn.functional.normalize(rows.mean(dim=0), dim=0)
    assert torch.allclose(torch.tensor(states.finish(request)), expected)


def _generate(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("gen-alone", prompt, greedy(8))
    return drain(engine)["gen-alone"].token_ids
