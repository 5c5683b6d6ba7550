"""What passes between an engine's async front and the loop that steps it.

The same messages go to a loop in a thread (`EngineThread`) and across the pipe to
a child process (`EngineProcess`), so each is a small frozen dataclass that pickles.
Failures of single requests travel with the outputs (`Delivery`), since they end one
stream; a failure to start at all is its own message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import EngineStats, RequestOutput
from engine.prompt_limits import PromptLimits
from engine.request import Urgency
from engine.sampling_params import PoolingParams, SamplingParams

Delivery = list[tuple[str, RequestOutput | BaseException]]
"""Items for streams, by request id: an output, or the error that ends the stream."""


@dataclass(frozen=True)
class AddRequest:
    """Queue a request the front has checked against the engine's limits (front → loop)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    urgency: Urgency
    pooling: PoolingParams | None = None
    """Set for an embedding request (engine/pooling.py)."""


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its blocks (front → loop)."""

    request_id: str


InboxMessage = AddRequest | AbortRequest


@dataclass(frozen=True)
class EngineReady:
    """The child built its engine (child → parent, once)."""

    tokenizer: Any
    limits: PromptLimits
    stats: EngineStats


@dataclass(frozen=True)
class StartFailed:
    """The child could not build its engine (child → parent, once); the parent raises it."""

    error: BaseException


@dataclass(frozen=True)
class StepDone:
    """What one turn of the loop produced, and the stats after it (child → parent)."""

    items: Delivery
    stats: EngineStats
