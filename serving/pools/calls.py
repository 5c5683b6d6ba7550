"""Deployment-handle calls that may never be answered.

A call to a deployment with no live replica (its node lost, Serve waiting for
room to place another) waits until one exists. The ingress must keep serving
the other pools meanwhile, so it never waits on one pool's call unbounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve.handle import DeploymentResponse


async def within(call: DeploymentResponse, timeout_s: float) -> Any:
    """The call's result, or TimeoutError after `timeout_s`; the call is cancelled when
    nobody waits for it any more (timed out, or the caller cancelled)."""
    try:
        return await asyncio.wait_for(_result(call), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        call.cancel()
        raise


async def first_answer(calls: list[DeploymentResponse]) -> Any:
    """The result of whichever call answers first; the others are cancelled (and their
    endings collected, so no cancelled call is reported as an unretrieved error)."""
    waiting = [asyncio.ensure_future(_result(call)) for call in calls]
    done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    for call in calls:
        call.cancel()
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return next(iter(done)).result()


async def _result(call: DeploymentResponse) -> Any:
    return await call
