"""Try the engine from a terminal: `python -m engine.generate --prompt "..."`.

Streams the answer as it is generated, then prints token counts and speed.
"""

from __future__ import annotations

import argparse
import sys
import time

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.process import configure_process
from engine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: prompt, sampling settings, model and threads."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default="default", help="'default', an HF folder or a .gguf file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Generate one answer, streaming it to stdout and timing it on stderr."""
    args = parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    configure_process(config)
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = chat_prompt_ids(tokenizer, args.prompt)
    try:
        engine.add_request("cli", prompt_ids, params)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    start, first, num_tokens, reason = time.perf_counter(), None, 0, None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            num_tokens, reason = out.num_output_tokens, out.finish_reason
            print(out.new_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    ttft = (first or start) - start
    print(
        f"\n[{len(prompt_ids)} prompt tokens, {num_tokens} generated, finish_reason={reason}, "
        f"TTFT {ttft * 1000:.0f} ms, {num_tokens / elapsed:.1f} tok/s]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
