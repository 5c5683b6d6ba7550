"""Speculative decoding benchmark: batch-1 TPOT with and without speculation, in one run.

  python -m bench.engine.bench_spec [--quick] [--threads N] [--sweep]

Three prompt sets from data/spec_prompts/: (a) `grounded` (summarize, rewrite,
extract from a text in the prompt) with prompt lookup (`ngram`); (b) `chat`
(open questions) with a draft model (`draft`): the default model cut to its
first --draft-layers layers, as no distilled draft exists yet; (c)
`adversarial` (novel text the prompt cannot predict) with `ngram`, where drafts
keep failing and the draft length must keep the cost down.

Every request runs alone (batch 1), greedy (temperature 0), in the engine's
own dtype (bf16 where the CPU has native bf16 kernels, else fp32), EOS
honoured, the same prompts in the same order on both sides. The side without
speculation and the side with it alternate prompt by prompt, so background
load on the shared cores hits both alike. TPOT is per request, (last token
time - first token time) / (output tokens - 1), averaged over the requests;
`decode_tok_s` is all tokens after the first over all that time. Each
speculating side also reports where its step time goes (`step_ms.*`: target
forward passes by query length, proposer, verification).

`--sweep` instead tries draft depths and k on a few prompts and prints one
line per setting. The defaults came from it plus step counts (timings on the
shared cores were too noisy to rank settings by themselves):
- ngram k=8, ngram_min=1: a 9-token verify costs ~1.13x a 1-token step at
  batch 1 (memory-bound), so long drafts are cheap, and the draft length
  (engine/spec_decode.py) keeps them long only while they pay. Replaying the
  12 grounded prompts' greedy answers through the lookup, a 1-gram fallback
  cut the steps by a tenth against ngram_min=2 (it catches the first token
  of a copied span, where a 2-gram still straddles the seam).
- draft: the first 4 of 30 layers, k=2. No truncation depth pays on this
  model: greedy acceptance was ~0.05 for 2-12 layers, 0.10 at 16, 0.22 at 24
  and 0.24 at 27, while a draft of N layers costs about (3.5N + 28) / 134 of
  a target step (the 28M-parameter lm_head is paid whatever N). The shallow
  draft fails cheapest and the draft length then mutes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from bench.paths import DATA_DIR
from bench.report import emit, log
from engine.config import EngineConfig, SpecDecodeConfig, auto_dtype_name
from engine.engine import LLMEngine
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.chat import chat_prompt_ids
from engine.sampling_params import SamplingParams

DTYPE = auto_dtype_name()
PROMPT_DIR = DATA_DIR / "spec_prompts"
CASES = (  # (prompt set, proposer, ratio metric)
    ("grounded", "ngram", "ratio.tpot_speedup.ngram_grounded"),
    ("chat", "draft", "ratio.tpot_speedup.draft_chat"),
    ("adversarial", "ngram", "ratio.tpot_speedup.adversarial"),
)


def load_prompts(engine: LLMEngine, prompt_set: str, limit: int | None) -> list[list[int]]:
    """The chat-templated prompts of one prompt set, at most `limit`."""
    lines = (PROMPT_DIR / f"{prompt_set}.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:limit]
    return [chat_prompt_ids(engine.tokenizer, text) for text in texts]


@dataclass
class Timings:
    """Seconds spent in each instrumented call, and how many calls."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def wrap(self, fn, name_of):
        """`fn`, timed into the bucket `name_of(*args)` names."""

        def timed(*args, **kwargs):
            """Call `fn` and add its wall time to its bucket."""
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            name = name_of(*args)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return result

        return timed

    def mean_ms(self, name: str) -> float:
        """Mean milliseconds per call of one bucket."""
        return self.seconds[name] / self.calls[name] * 1000 if self.calls[name] else 0.0


def instrument(engine: LLMEngine) -> Timings:
    """Time the target's forward passes (by packed query length), proposing and verifying."""
    timings = Timings()

    def forward_name(batch) -> str:
        """The timing bucket of a forward pass: by packed length, or prefill."""
        q_len = batch.input_ids.numel()
        return f"forward_q{q_len}" if q_len <= 16 else "forward_prefill"

    engine.runner.forward = timings.wrap(engine.runner.forward, forward_name)
    sampler = engine.runner.sampler
    sampler.sample = timings.wrap(sampler.sample, lambda *_: "sample_and_verify")
    engine.step = timings.wrap(engine.step, lambda: "step")
    if engine.speculator is not None:
        spec = engine.speculator
        spec.propose = timings.wrap(spec.propose, lambda *_: "propose")
    return timings


@dataclass
class Result:
    """One request's tokens and decode timing."""

    token_ids: list[int]
    tpot_ms: float | None
    decode_s: float
    num_decode_tokens: int


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Result:
    """One request alone; times the tokens after the first."""
    engine.add_request("bench", prompt, params)
    token_ids: list[int] = []
    first = last = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
                token_ids += out.new_token_ids
    num_decode = len(token_ids) - 1
    tpot = (last - first) / num_decode * 1000 if num_decode > 0 else None
    return Result(token_ids, tpot, last - first, num_decode)


@dataclass
class Side:
    """The results of one engine over one prompt set."""

    results: list[Result] = field(default_factory=list)

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token over the requests."""
        return statistics.mean(r.tpot_ms for r in self.results if r.tpot_ms is not None)

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens per second over the requests."""
        num_tokens = sum(r.num_decode_tokens for r in self.results)
        return num_tokens / sum(r.decode_s for r in self.results)


def spec_counters(engine: LLMEngine) -> tuple[int, int, int]:
    """The speculator's counters: drafts, draft tokens, accepted tokens."""
    s = engine.stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def compare(
    plain: LLMEngine, spec: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[Side, Side, dict[str, float], Timings, Timings]:
    """Run every prompt on both engines, alternating; return both sides and spec counters."""
    plain_t, spec_t = instrument_once(plain), instrument_once(spec)
    for timings in (plain_t, spec_t):
        timings.seconds.clear()
        timings.calls.clear()
    before = spec_counters(spec)
    base, sped = Side(), Side()
    for prompt in prompts:
        base.results.append(run_one(plain, prompt, params))
        sped.results.append(run_one(spec, prompt, params))
    after = spec_counters(spec)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
    counters = dict(
        acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
        mean_accepted_len=1 + accepted / drafts if drafts else 0.0,
        num_drafts=drafts,
        greedy_match_frac=sum(
            a.token_ids == b.token_ids for a, b in zip(base.results, sped.results, strict=True)
        )
        / len(prompts),
    )
    return base, sped, counters, plain_t, spec_t


_TIMINGS: dict[int, Timings] = {}


def instrument_once(engine: LLMEngine) -> Timings:
    """Instrument an engine once, however many cases reuse it."""
    if id(engine) not in _TIMINGS:
        _TIMINGS[id(engine)] = instrument(engine)
    return _TIMINGS[id(engine)]


def engine_config(args: argparse.Namespace, spec: SpecDecodeConfig | None) -> EngineConfig:
    """Engine settings for a side: the engine's dtype, batch 1, with or without speculation."""
    return EngineConfig(
        num_threads=args.threads,
        kv_cache_memory_gb=0.25,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        seed=args.seed,
        spec_decode=spec,
    )


def ngram_spec(args: argparse.Namespace, k: int | None = None, ngram_min: int | None = None):
    """Prompt-lookup settings, defaulting to the command line's."""
    return SpecDecodeConfig(
        method="ngram",
        num_speculative_tokens=k or args.ngram_k,
        ngram_min=ngram_min or args.ngram_min,
        ngram_max=args.ngram_max,
    )


def draft_spec(args: argparse.Namespace, k: int | None = None, layers: int | None = None):
    """Draft-model settings, defaulting to the command line's."""
    return SpecDecodeConfig(
        method="draft",
        num_speculative_tokens=k or args.draft_k,
        draft_model="default",
        draft_num_layers=layers or args.draft_layers,
    )


def warm_up(engine: LLMEngine) -> None:
    """One short request, so lazy set-up does not land in the first measurement."""
    run_one(
        engine,
        chat_prompt_ids(engine.tokenizer, "Say hello."),
        SamplingParams(max_tokens=8, temperature=0),
    )


def report_profile(label: str, timings: Timings, common: dict) -> None:
    """Per-step costs: forward passes by query length, propose, verify."""
    names = sorted(timings.calls, key=lambda n: (not n.startswith("forward_q"), len(n), n))
    for name in names:
        if name in ("step", "forward_prefill") or timings.calls[name] < 3:
            continue
        emit(
            "spec",
            f"step_ms.{name}.{label}",
            timings.mean_ms(name),
            "ms",
            calls=timings.calls[name],
            **common,
        )
    step_s = timings.seconds["step"]
    parts = {n: s / step_s for n, s in timings.seconds.items() if n != "step"}
    log(
        f"  {label}: {timings.calls['step']} steps, {timings.mean_ms('step'):.1f} ms/step; "
        "share of step time: " + ", ".join(f"{n} {f:.0%}" for n, f in sorted(parts.items()))
    )


def bench(args: argparse.Namespace) -> None:
    """Every (prompt set, proposer) case against no speculation; print JSON lines."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    limit = args.num_prompts
    common = dict(
        threads=torch.get_num_threads(),
        dtype=DTYPE,
        seed=args.seed,
        quick=args.quick,
        max_tokens=args.max_tokens,
        temperature=0,
        loadavg_1m=round(os.getloadavg()[0], 2),
    )
    plain = LLMEngine(engine_config(args, None))
    spec_engines = {
        "ngram": LLMEngine(engine_config(args, ngram_spec(args))),
        "draft": LLMEngine(engine_config(args, draft_spec(args))),
    }
    settings = {
        "ngram": dict(k=args.ngram_k, ngram_min=args.ngram_min, ngram_max=args.ngram_max),
        "draft": dict(k=args.draft_k, draft="default", draft_num_layers=args.draft_layers),
    }
    for engine in (plain, *spec_engines.values()):
        warm_up(engine)
    for prompt_set, proposer, ratio_name in CASES:
        engine = spec_engines[proposer]
        prompts = load_prompts(engine, prompt_set, limit)
        log(f"{prompt_set} x {proposer}: {len(prompts)} prompts, max_tokens={args.max_tokens}")
        base, sped, counters, plain_t, spec_t = compare(plain, engine, prompts, params)
        extra = dict(common, n=len(prompts), **settings[proposer])
        emit("spec", f"tpot_ms.none.{prompt_set}", base.tpot_ms, "ms", **extra)
        emit("spec", f"tpot_ms.{proposer}.{prompt_set}", sped.tpot_ms, "ms", **extra)
        emit("spec", f"decode_tok_s.none.{prompt_set}", base.decode_tok_s, "tok/s", **extra)
        emit("spec", f"decode_tok_s.{proposer}.{prompt_set}", sped.decode_tok_s, "tok/s", **extra)
        emit("spec", ratio_name, base.tpot_ms / sped.tpot_ms, "x", **extra)
        emit(
            "spec",
            f"acceptance_rate.{proposer}.{prompt_set}",
            counters["acceptance_rate"],
            "frac",
            **extra,
        )
        emit(
            "spec",
            f"mean_accepted_len.{proposer}.{prompt_set}",
            counters["mean_accepted_len"],
            "tok",
            **extra,
        )
        emit(
            "spec",
            f"greedy_match_frac.{proposer}.{prompt_set}",
            counters["greedy_match_frac"],
            "frac",
            **extra,
        )
        report_profile(f"none.{prompt_set}", plain_t, extra)
        report_profile(f"{proposer}.{prompt_set}", spec_t, extra)


def sweep(args: argparse.Namespace) -> None:
    """TPOT speed-up of a few proposer settings on a few prompts, one line each (stderr)."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    plain = LLMEngine(engine_config(args, None))
    warm_up(plain)
    grid = [("grounded", ngram_spec(args, k, m)) for k in (2, 4, 8) for m in (1, 2)]
    grid += [("adversarial", ngram_spec(args, 4, m)) for m in (1, 2)]
    grid += [("chat", draft_spec(args, k, n)) for n in (2, 4, 8, 12) for k in (1, 2, 4)]
    for prompt_set, spec in grid:
        engine = LLMEngine(engine_config(args, spec))
        warm_up(engine)
        prompts = load_prompts(engine, prompt_set, args.num_prompts)
        base, sped, counters, _, _ = compare(plain, engine, prompts, params)
        log(
            f"sweep {prompt_set:<12} {spec.method:<5} k={spec.num_speculative_tokens} "
            f"ngram_min={spec.ngram_min} layers={spec.draft_num_layers}: "
            f"speedup {base.tpot_ms / sped.tpot_ms:.2f}x  tpot {sped.tpot_ms:.1f} vs "
            f"{base.tpot_ms:.1f} ms  acceptance {counters['acceptance_rate']:.2f}  "
            f"mean_len {counters['mean_accepted_len']:.2f}"
        )
        del engine
        _TIMINGS.clear()


def main() -> None:
    """Parse the command line and run the benchmark or the sweep."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer prompts, shorter outputs")
    p.add_argument("--sweep", action="store_true", help="try proposer settings instead")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=None, help="per prompt set")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--ngram-k", type=int, default=8)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--draft-k", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.num_prompts is None:
        args.num_prompts = 2 if args.sweep else 4 if args.quick else None
    if args.max_tokens is None:
        args.max_tokens = 40 if args.sweep else 64 if args.quick else 128
    log(
        f"threads={torch.get_num_threads()} dtype={DTYPE} greedy (temperature 0) "
        f"batch=1 max_tokens={args.max_tokens} prompts/set={args.num_prompts or 'all'}"
    )
    if args.sweep:
        sweep(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
