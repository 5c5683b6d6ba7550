"""The batch job loop: each batch, oldest first, through validating → in_progress →
finalizing → completed (or failed, expired, cancelled), its lines sent to the serving path.

No Ray here: lines leave through `send`, which the runner deployment points at
the ingress (so a line gets the same validation, placement and limits as an
HTTP request) and tests point at a fake. All state is in the BatchStore, read
again at every status, so a loop started on the same data directory after a
kill carries on where the dead one stopped: lines in flight then are still
pending and run again; lines done are never sent again.

Lines run at the batch tier, `max_in_flight` at a time: enough to keep the
pool's batch full, while the engine's priority queue and the ingress's
admission put every other tier first. A line refused for load (429, 503, a
replica lost) waits and is sent again; any other answer is its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from serving.batch.lines import check_input, errors_json, output_record
from serving.batch.schemas import BatchError
from serving.batch.store import ACTIVE, BatchStore, PendingLine
from serving.config import BatchJobsConfig

log = logging.getLogger(__name__)

Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
"""Sends one request body to an endpoint; answers (HTTP status, JSON body)."""

RETRIED_STATUSES = frozenset({429, 503})
"""Answers that say "later", not "no": the line is sent again after a pause."""

IDLE_WAKE_S = 5.0
"""With nothing to do the loop still looks at the store this often (a batch added by
another process sharing the directory, in tests)."""


class JobLoop:
    """Runs every active batch to a final status, one batch at a time, oldest first."""

    def __init__(
        self, store: BatchStore, config: BatchJobsConfig, max_json_depth: int, send: Send
    ) -> None:
        self._store = store
        self._config = config
        self._max_json_depth = max_json_depth
        self._send = send
        self._wake = asyncio.Event()
        self._running: tuple[str, list[asyncio.Task[None]]] | None = None

    def wake(self) -> None:
        """A batch was added: start it now rather than at the next idle check."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Abort the lines in flight of `batch_id` (already marked cancelling in the store);
        the loop then writes what is done and marks it cancelled."""
        if self._running is not None and self._running[0] == batch_id:
            for worker in self._running[1]:
                worker.cancel()
        self._wake.set()

    async def run_forever(self) -> None:
        """Advance active batches; a fault in one batch is logged and that batch retried on
        the next round, never the end of the loop."""
        while True:
            self._wake.clear()
            for batch_id in self._store.active_batch_ids():
                try:
                    await self.advance(batch_id)
                except Exception:
                    log.exception("batch %s: job loop fault; retrying", batch_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)

    async def advance(self, batch_id: str) -> None:
        """Take the batch through each remaining status until it reaches a final one."""
        while (batch := self._batch(batch_id))["status"] in ACTIVE:
            status = batch["status"]
            if status == "validating":
                await self._validate(batch)
            elif status == "in_progress":
                await self._run_lines(batch)
            elif status == "finalizing":
                self._finalize(batch, "completed")
            else:  # cancelling
                self._finalize(batch, "cancelled")

    def _batch(self, batch_id: str) -> dict[str, Any]:
        batch = self._store.batch(batch_id)
        if batch is None:
            raise LookupError(f"batch {batch_id} is not in the store")
        return batch

    async def _validate(self, batch: dict[str, Any]) -> None:
        """Check every input line up front: start the batch, or fail it naming each bad line."""
        batch_id = batch["id"]
        if self._store.file(batch["input_file_id"]) is None:
            message = f"The input file {batch['input_file_id']} no longer exists."
            error = BatchError(code="file_not_found", message=message, param="input_file_id")
            self._store.set_status(batch_id, "failed", errors=errors_json([error]))
            return
        content = self._store.file_content(batch["input_file_id"])
        checked = await asyncio.to_thread(
            check_input, content, batch["endpoint"], self._config.max_lines, self._max_json_depth
        )
        if checked.errors:
            self._store.set_status(batch_id, "failed", errors=errors_json(checked.errors))
            log.info("batch %s failed validation: %d errors", batch_id, len(checked.errors))
        else:
            self._store.start(batch_id, checked.lines)
            log.info("batch %s in progress: %d lines", batch_id, len(checked.lines))

    async def _run_lines(self, batch: dict[str, Any]) -> None:
        """Send the pending lines, `max_in_flight` at a time, until none is left, the batch
        is cancelled, or its window closes."""
        batch_id = batch["id"]
        pending = iter(self._store.pending_lines(batch_id))
        workers = [
            asyncio.create_task(self._work(batch, pending))
            for _ in range(self._config.max_in_flight)
        ]
        self._running = (batch_id, workers)
        try:
            results = await asyncio.gather(*workers, return_exceptions=True)
        finally:
            self._running = None
            for worker in workers:
                worker.cancel()
        if self._batch(batch_id)["status"] == "cancelling":
            return
        faults = [r for r in results if isinstance(r, Exception)]
        if faults:
            raise faults[0]
        if self._store.pending_lines(batch_id):  # the window closed first
            self._finalize(batch, "expired")
        else:
            self._store.set_status(batch_id, "finalizing")

    async def _work(self, batch: dict[str, Any], lines: Iterator[PendingLine]) -> None:
        """One in-flight slot: take the next pending line, send it, record its outcome."""
        for line in lines:
            if time.time() >= batch["expires_at"]:
                return
            status, body = await self._send_until_taken(batch["endpoint"], json.loads(line.body))
            record = output_record(
                f"batch_req_{batch['id']}_{line.index}", line.custom_id, status, body
            )
            outcome = "completed" if status == 200 else "failed"
            self._store.finish_line(batch["id"], line.index, outcome, record)

    async def _send_until_taken(
        self, endpoint: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """The endpoint's answer; refusals for load, and lost replicas, are retried."""
        while True:
            try:
                status, answer = await self._send(endpoint, body)
            except Exception as error:  # the ingress replica died or is restarting
                log.warning("batch line not delivered (%s); retrying", error)
                status, answer = 503, {}
            if status not in RETRIED_STATUSES:
                return status, answer
            await asyncio.sleep(self._config.retry_delay_s)

    def _finalize(self, batch: dict[str, Any], final_status: str) -> None:
        """Write the output file (lines that succeeded) and the error file (lines that did
        not), both in input order, then mark the batch final."""
        batch_id = batch["id"]
        self._store.set_status(
            batch_id,
            final_status,
            output_file_id=self._write_results(batch_id, "completed", "output"),
            error_file_id=self._write_results(batch_id, "failed", "errors"),
        )
        log.info("batch %s %s", batch_id, final_status)

    def _write_results(self, batch_id: str, line_status: str, suffix: str) -> str | None:
        """The id of a file of the records of the lines that ended in `line_status`, None if
        none did. The id derives from the batch, so finalizing again after a crash replaces
        the file rather than leaving a second one."""
        records = self._store.results(batch_id, line_status)
        if not records:
            return None
        content = "".join(json.dumps(record) + "\n" for record in records).encode()
        name = f"{batch_id}_{suffix}.jsonl"
        return self._store.add_file("batch_output", name, content, f"file-{batch_id}-{suffix}").id
