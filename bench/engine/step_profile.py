"""Where an engine step's time goes: projections and MLP, attention, the output head, the
rest of the model, and everything outside it (scheduling, tensor preparation, sampling).

Forward hooks on the model's modules time each part with the wall clock (a CPU
runs every op synchronously, so a module's hooks bracket its whole work), and
the step itself is timed around `LLMEngine.step`. Hooks cost microseconds per
call: nothing beside a prefill step of hundreds of milliseconds, but a decode step of
16 sequences (25 ms here) calls 152 hooked modules and took about 4% longer hooked.
That time falls between the timed modules, in `other_model`. So decode steps, alike
from one to the next, alternate hooked and unhooked, and the difference of their mean
times is the hooks' cost, taken out of `other_model` (`without_hook_cost`): whole runs
of the same steps, one hooked and one not, differed by up to 7% here either way.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import nn

from engine.engine import LLMEngine

ATTENTION_LINEARS = ("qkv_proj", "o_proj")
MLP_LINEARS = ("gate_up_proj", "down_proj")
"""The decoder's matmuls, whatever wraps them (packed, padded, quantized)."""
PARTS = ("linears", "attention", "output_head", "other_model", "outside_model")


class _Clock:
    """Seconds spent inside each timed module kind, summed over calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}

    def hooks(self, module: nn.Module, kind: str) -> list[Any]:
        """Time every call of `module` as `kind`; the handles to remove the hooks."""

        def start(mod: nn.Module, _args: Any) -> None:
            self._started[id(mod)] = time.perf_counter()

        def stop(mod: nn.Module, _args: Any, _out: Any) -> None:
            self.seconds[kind] += time.perf_counter() - self._started.pop(id(mod))

        return [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]


def _timed_modules(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(module, kind) for each module whose time is a part or bounds one."""
    yield model, "model"
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in ATTENTION_LINEARS:
            yield module, "attention_linears"
        elif last in MLP_LINEARS:
            yield module, "mlp_linears"
        elif last == "self_attn":
            yield module, "attention_module"
        elif name == "lm_head":
            yield module, "output_head"


@contextmanager
def _hooked(model: nn.Module, clock: _Clock) -> Iterator[None]:
    handles = [h for module, kind in _timed_modules(model) for h in clock.hooks(module, kind)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def step_until_decoding(engine: LLMEngine, request_ids: set[str]) -> None:
    """Step until every request in `request_ids` has its first token (prefill done), so
    that what is profiled next is decoding."""
    waiting = set(request_ids)
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}


def profile_steps(engine: LLMEngine, every_other: bool = False) -> dict[str, float]:
    """Step the engine until it has nothing left, every step hooked or, with `every_other`
    (steps alike, as decode steps are), every other one from the first; each part's share
    of the hooked steps' time with the hooks' own cost taken out (PARTS, summing to 1),
    that time under `total_s`, and the cost's share of the hooked time under `hook_cost`
    (0 unless two steps of each kind were compared)."""
    clock = _Clock()
    step_s: dict[bool, list[float]] = {True: [], False: []}
    while engine.has_unfinished():
        hooked = not every_other or len(step_s[True]) <= len(step_s[False])
        with _hooked(engine.model, clock) if hooked else nullcontext():
            start_s = time.perf_counter()
            engine.step()
            step_s[hooked].append(time.perf_counter() - start_s)
    s = clock.seconds
    hooked_s = sum(step_s[True])
    parts = {
        "linears": s["attention_linears"] + s["mlp_linears"],
        "attention": s["attention_module"] - s["attention_linears"],
        "output_head": s["output_head"],
        "other_model": s["model"] - s["attention_module"] - s["mlp_linears"],
        "outside_model": hooked_s - s["model"] - s["output_head"],
    }
    return without_hook_cost(parts, step_s[True], step_s[False])


def without_hook_cost(
    seconds: dict[str, float], hooked_steps_s: list[float], plain_steps_s: list[float]
) -> dict[str, float]:
    """Shares of each part's `seconds` over hooked steps, with the hooks' cost per step (the
    hooked steps' mean time over the unhooked steps') taken out of `other_model`, where
    the hooks run, and out of the total."""
    hooked_s = sum(hooked_steps_s)
    hook_cost_s = 0.0
    if len(hooked_steps_s) >= 2 and len(plain_steps_s) >= 2:
        per_step_s = statistics.mean(hooked_steps_s) - statistics.mean(plain_steps_s)
        hook_cost_s = min(max(0.0, per_step_s * len(hooked_steps_s)), seconds["other_model"])
    total_s = hooked_s - hook_cost_s
    seconds = {**seconds, "other_model": seconds["other_model"] - hook_cost_s}
    return {
        **{part: part_s / total_s for part, part_s in seconds.items()},
        "total_s": total_s,
        "hook_cost": hook_cost_s / hooked_s,
    }
