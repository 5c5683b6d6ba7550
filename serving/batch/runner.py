"""The batch runner deployment: keeps the Files and Batches APIs' state and runs the jobs.

One replica, the single writer of the SQLite store under `data_dir` (mount a
persistent volume there on KubeRay). The ingress forwards the API calls here;
the job loop sends each line back through the ingress's `run_batch_line`, so a
line is validated, placed and limited exactly as an HTTP request at the batch
tier. The ingress is reached as the front door of the runner's own app: it holds
this runner's handle, so the runner cannot be given its handle when the app is
built (Serve's graph has no cycles), and no deployment name is shared between them.
If Serve restarts this replica, the new one resumes every active batch.
Methods are async so the API and the loop share one event loop: no call
interleaves with the loop's bookkeeping halfway.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.batch.jobs import JobLoop
from serving.batch.schemas import (
    COMPLETION_WINDOWS,
    BatchCreate,
    BatchErrors,
    BatchList,
    BatchObject,
    FileObject,
    RequestCounts,
)
from serving.batch.store import BatchStore, StoredFile
from serving.config import BatchJobsConfig


@serve.deployment(num_replicas=1)
class BatchRunner:
    """Files, batches and the loop that runs them; answers are JSON-ready dicts."""

    async def __init__(self, config: BatchJobsConfig, max_json_depth: int) -> None:  # type: ignore[misc]
        self._store = BatchStore(Path(config.data_dir).expanduser())
        self._jobs = JobLoop(self._store, config, max_json_depth, self._send_line)
        self._ingress: DeploymentHandle | None = None
        self._loop = asyncio.create_task(self._jobs.run_forever())

    async def add_file(self, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        """Store an upload; its FileObject."""
        return _file_object(self._store.add_file(purpose, filename, content))

    async def file(self, file_id: str) -> dict[str, Any] | None:
        """The FileObject, or None."""
        stored = self._store.file(file_id)
        return None if stored is None else _file_object(stored)

    async def file_content(self, file_id: str) -> bytes | None:
        """The file's bytes, or None."""
        return None if self._store.file(file_id) is None else self._store.file_content(file_id)

    async def delete_file(self, file_id: str) -> bool:
        """Forget the file; False if there was none."""
        return self._store.delete_file(file_id)

    async def add_batch(self, request: BatchCreate) -> dict[str, Any]:
        """A new batch (validated by the loop, which starts on it now); its BatchObject."""
        window_s = COMPLETION_WINDOWS[request.completion_window]
        batch_id = self._store.add_batch(
            request.input_file_id,
            request.endpoint,
            request.completion_window,
            window_s,
            request.metadata,
        )
        self._jobs.wake()
        return self._batch_object(batch_id)

    async def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The BatchObject, or None."""
        return None if self._store.batch(batch_id) is None else self._batch_object(batch_id)

    async def batches(self, after: str | None, limit: int) -> dict[str, Any]:
        """A page of BatchObjects, newest first."""
        ids = self._store.batch_ids(after, limit + 1)
        data = [BatchObject.model_validate(self._batch_object(i)) for i in ids[:limit]]
        page = BatchList(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=len(ids) > limit,
        )
        return page.model_dump(mode="json")

    async def cancel(self, batch_id: str) -> dict[str, Any] | None:
        """Mark the batch cancelling (if it still runs) and abort its lines in flight."""
        if self._store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress")):
            self._jobs.cancel(batch_id)
        return await self.batch(batch_id)

    async def _send_line(self, endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self._ingress is None:  # the controller's answer is a blocking call: off the loop
            app_name = serve.get_replica_context().app_name
            self._ingress = await asyncio.to_thread(serve.get_app_handle, app_name)
        answer: tuple[int, dict[str, Any]] = await self._ingress.run_batch_line.remote(
            endpoint, body
        )
        return answer

    def _batch_object(self, batch_id: str) -> dict[str, Any]:
        row = self._store.batch(batch_id)
        assert row is not None
        counts = row.pop("line_counts")
        batch = BatchObject(
            **{k: v for k, v in row.items() if k not in ("errors", "metadata")},
            errors=BatchErrors.model_validate_json(row["errors"]) if row["errors"] else None,
            metadata=json.loads(row["metadata"]),
            request_counts=RequestCounts(
                total=sum(counts.values()),
                completed=counts.get("completed", 0),
                failed=counts.get("failed", 0),
            ),
        )
        return batch.model_dump(mode="json")


def _file_object(stored: StoredFile) -> dict[str, Any]:
    return FileObject(**asdict(stored)).model_dump(mode="json")
