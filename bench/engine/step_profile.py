"""Where an engine step's time goes: projections and MLP, attention, the output head, the
rest of the model, and everything outside it (scheduling, tensor preparation, sampling).

Forward hooks on the model's modules time each part with the wall clock (a CPU
runs every op synchronously, so a module's hooks bracket its whole work), and
the step itself is timed around `LLMEngine.step`. Hooks cost microseconds per
call: nothing beside a step of hundreds of milliseconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
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
def _hooked(model: nn.Module) -> Iterator[_Clock]:
    clock = _Clock()
    handles = [h for module, kind in _timed_modules(model) for h in clock.hooks(module, kind)]
    try:
        yield clock
    finally:
        for handle in handles:
            handle.remove()


def step_until_decoding(engine: LLMEngine, request_ids: set[str]) -> None:
    """Step until every request in `request_ids` has its first token (prefill done), so
    that what is profiled next is decoding."""
    waiting = set(request_ids)
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}


def profile_steps(engine: LLMEngine) -> dict[str, float]:
    """Step the engine until it has nothing left; each part's share of the steps' time
    (PARTS, summing to 1) and the steps' total seconds under `total_s`."""
    with _hooked(engine.model) as clock:
        start_s = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        total_s = time.perf_counter() - start_s
    s = clock.seconds
    parts = {
        "linears": s["attention_linears"] + s["mlp_linears"],
        "attention": s["attention_module"] - s["attention_linears"],
        "output_head": s["output_head"],
        "other_model": s["model"] - s["attention_module"] - s["mlp_linears"],
        "outside_model": total_s - s["model"] - s["output_head"],
    }
    return {**{k: v / total_s for k, v in parts.items()}, "total_s": total_s}
