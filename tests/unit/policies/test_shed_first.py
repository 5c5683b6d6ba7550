"""Batch is shed first: while the interactive tier is refused for want of time, batch
requests on its pools are refused too, for as long as the interactive Retry-After."""

from __future__ import annotations

from policies.placement import Placement, RequestShape, ShedFirst, place
from testing.synthetic_pools import BATCH, INTERACTIVE, STANDARD, decoding, pool


def interactive_refusal(retry_after_s: int) -> Placement:
    return Placement(None, "shed_slo", retry_after_s=retry_after_s)


def test_batch_is_refused_while_interactive_is_being_refused():
    shed_first = ShedFirst()
    shed_first.note(INTERACTIVE, interactive_refusal(3), now_s=100.0)
    refusal = shed_first.refusal(BATCH, now_s=101.2)
    assert refusal is not None and refusal.pool is None
    assert (refusal.reason, refusal.retry_after_s) == ("shed_for_urgent", 2)
    assert shed_first.refusal(BATCH, now_s=103.0) is None, "the hold ends with its Retry-After"


def test_only_tiers_that_queue_are_held_and_only_by_a_protected_tiers_slo_shed():
    shed_first = ShedFirst()
    shed_first.note(INTERACTIVE, interactive_refusal(3), now_s=0.0)
    assert shed_first.refusal(STANDARD, now_s=1.0) is None  # it downgrades, never queues
    assert shed_first.refusal(INTERACTIVE, now_s=1.0) is None
    quiet = ShedFirst()
    quiet.note(BATCH, Placement(None, "shed_queue_full", retry_after_s=9), now_s=0.0)
    quiet.note(INTERACTIVE, Placement("fast", "slo"), now_s=0.0)
    assert quiet.refusal(BATCH, now_s=1.0) is None


def test_a_real_interactive_shed_holds_batch_on_the_pool_it_overflows_to():
    """Placement's own refusal: both pools busy with interactive prompts past its TTFT."""
    busy = decoding(0, 4, remaining=500)
    pools = {"fast": pool("fast", busy, max_queued=0), "bulk": pool("bulk", busy, max_queued=0)}
    refused = place(INTERACTIVE, RequestShape(2000, 64), pools)
    assert refused.reason == "shed_slo"
    shed_first = ShedFirst()
    shed_first.note(INTERACTIVE, refused, now_s=0.0)
    assert BATCH.pool == "bulk" and shed_first.refusal(BATCH, now_s=0.5) is not None
