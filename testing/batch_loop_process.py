"""A batch job loop in a process of its own, for the kill-and-resume test: runs the active
batches under DATA_DIR with a fake endpoint (answers after a pause) until they are final.

Usage: python testing/batch_loop_process.py DATA_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from serving.batch.jobs import JobLoop
from serving.batch.store import BatchStore
from serving.config import BatchJobsConfig

ANSWER_DELAY_S = 0.02
MAX_IN_FLIGHT = 4


async def answer(endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A completion echoing the prompt, after a pause (so a kill lands mid-job)."""
    await asyncio.sleep(ANSWER_DELAY_S)
    return 200, {"id": f"cmpl-{body['prompt']}", "choices": [{"text": body["prompt"]}]}


async def main(data_dir: Path) -> None:
    store = BatchStore(data_dir)
    config = BatchJobsConfig(data_dir=str(data_dir), max_in_flight=MAX_IN_FLIGHT)
    loop = JobLoop(store, config, max_json_depth=32, send=answer)
    for batch_id in store.active_batch_ids():
        await loop.advance(batch_id)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
