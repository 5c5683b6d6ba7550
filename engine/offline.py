"""Driving an engine to completion outside serving: a whole list of requests queued at
once (distillation, labelling, benchmarks), each request's deltas back in order.

A function over `LLMEngine`'s public API, so the engine itself stays the step and the
request lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def run_all(
    engine: LLMEngine,
    requests: Sequence[tuple[list[int], SamplingParams]],
    on_finish: Callable[[], None] = lambda: None,
) -> list[list[RequestOutput]]:
    """Queue every (prompt, params) at once, step until all finish, and return each
    request's deltas in order. `on_finish` is called as each request ends (a progress bar)."""
    deltas: dict[str, list[RequestOutput]] = {}
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(f"offline-{index}", prompt, params)
        deltas[f"offline-{index}"] = []
    while engine.has_unfinished():
        for output in engine.step():
            deltas[output.request_id].append(output)
            if output.finished:
                on_finish()
    return list(deltas.values())
