"""Handle calls that may never be answered: the first answer wins, the rest are cancelled."""

from __future__ import annotations

import asyncio
import gc

import pytest

from serving.pools.calls import first_answer, within


class _Call:
    """Stands in for a DeploymentResponse: answers `value` after `delay_s` (None: never);
    once cancelled, its awaiter gets an error, as Serve's RequestCancelledError."""

    def __init__(self, value: str, delay_s: float | None) -> None:
        self.value, self.delay_s, self.cancelled = value, delay_s, False

    def __await__(self):
        return self._answer().__await__()

    async def _answer(self) -> str:
        waited_s = 0.0
        while self.delay_s is None or waited_s < self.delay_s:
            if self.cancelled:
                raise RuntimeError(f"{self.value} was cancelled")
            await asyncio.sleep(0.005)
            waited_s += 0.005
        return self.value

    def cancel(self) -> None:
        self.cancelled = True


def test_the_first_answer_wins_and_the_others_are_cancelled_quietly() -> None:
    errors: list[dict] = []
    calls = [_Call("slow", None), _Call("fast", 0.01), _Call("late", 0.5)]

    async def run() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        answer = await asyncio.wait_for(first_answer(calls), timeout=5)
        await asyncio.sleep(0.1)
        gc.collect()  # an unretrieved task error is reported when the task is collected
        return answer

    assert asyncio.run(run()) == "fast"
    assert all(call.cancelled for call in calls)
    assert errors == []


def test_a_call_past_its_time_is_cancelled() -> None:
    call = _Call("never", None)
    with pytest.raises(TimeoutError):
        asyncio.run(within(call, 0.05))
    assert call.cancelled
