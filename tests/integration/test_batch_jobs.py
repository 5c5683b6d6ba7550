"""The batch job loop and its store, without Ray: validation, outcomes, retries, cancel,
expiry, and a loop process killed mid-job then started again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.paths import REPO_ROOT
from serving.batch.jobs import JobLoop
from serving.batch.lines import check_input
from serving.batch.store import BatchStore
from serving.config import BatchJobsConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _line(custom_id: str, prompt: str = "hi", url: str = COMPLETIONS, **body: Any) -> str:
    request = {"model": "m", "prompt": prompt, "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request})


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_valid_input_keeps_file_order() -> None:
    checked = check_input(_jsonl([_line("b"), "", _line("a")]), COMPLETIONS, 10, 32)
    assert checked.errors == []
    assert [custom_id for custom_id, _ in checked.lines] == ["b", "a"]
    assert json.loads(checked.lines[0][1])["prompt"] == "hi"


def test_every_bad_line_is_reported_with_its_number() -> None:
    lines = [
        _line("ok"),
        "{not json",
        _line("ok"),  # duplicate custom_id
        _line("chat", url=CHAT),  # another endpoint
        _line("hot", temperature="hot"),  # a body the endpoint refuses
        json.dumps({"method": "POST", "url": COMPLETIONS, "body": {}}),  # no custom_id
        json.dumps({"custom_id": "get", "method": "GET", "url": COMPLETIONS, "body": {}}),
        json.dumps([1, 2]),
        _line("schema", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}),  # a grammar the library refuses
    ]  # fmt: skip
    errors = check_input(_jsonl(lines), COMPLETIONS, 100, 32).errors
    assert [(e.line, e.param) for e in errors] == [
        (2, None),
        (3, "custom_id"),
        (4, "url"),
        (5, "temperature"),
        (6, "custom_id"),
        (7, "method"),
        (8, None),
        (9, "response_format"),
    ]
    assert "earlier line" in errors[1].message
    assert "not valid JSON" in errors[0].message


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"", "empty_file"),
        (b"\xff\xfe", "invalid_file"),
        (_jsonl([_line("a"), _line("b")]), "too_many_lines"),
    ],
)
def test_unusable_files_fail_as_a_whole(content: bytes, code: str) -> None:
    checked = check_input(content, COMPLETIONS, 1, 32)
    assert checked.lines == [] and [e.code for e in checked.errors] == [code]


class FakeEndpoint:
    """Answers each prompt: "bad" with a 400, "busy" first with a 429, others with a 200."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.sent: list[str] = []
        self.delay_s = delay_s

    async def __call__(self, endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = body["prompt"]
        self.sent.append(prompt)
        await asyncio.sleep(self.delay_s)
        if prompt == "bad":
            return 400, {"error": {"message": "bad prompt"}}
        if prompt == "busy" and self.sent.count("busy") == 1:
            return 429, {"error": {"message": "later"}}
        return 200, {"id": f"cmpl-{prompt}", "choices": [{"text": prompt.upper()}]}


def _loop(tmp_path: Path, send: FakeEndpoint, **config: Any) -> tuple[BatchStore, JobLoop]:
    store = BatchStore(tmp_path)
    settings = BatchJobsConfig(data_dir=str(tmp_path), retry_delay_s=0.01, **config)
    return store, JobLoop(store, settings, 32, send)


def _submit(store: BatchStore, lines: list[str], window_s: int = 3600) -> str:
    stored = store.add_file("batch", "in.jsonl", _jsonl(lines))
    return store.add_batch(stored.id, COMPLETIONS, "24h", window_s, {"job": "test"})


def _records(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(row) for row in store.file_content(file_id).decode().splitlines()]


def test_batch_completes_with_outputs_and_errors_in_input_order(tmp_path: Path) -> None:
    send = FakeEndpoint()
    store, loop = _loop(tmp_path, send, max_in_flight=3)
    prompts = ["a", "bad", "busy", "b", "c"]
    batch_id = _submit(store, [_line(f"id-{p}", p) for p in prompts])
    asyncio.run(loop.advance(batch_id))
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "completed"
    assert batch["line_counts"] == {"completed": 4, "failed": 1}
    outputs = _records(store, batch["output_file_id"])
    assert [r["custom_id"] for r in outputs] == ["id-a", "id-busy", "id-b", "id-c"]
    assert outputs[0]["response"]["status_code"] == 200
    assert outputs[0]["response"]["body"]["choices"][0]["text"] == "A"
    errors = _records(store, batch["error_file_id"])
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("id-bad", 400)]
    assert send.sent.count("busy") == 2  # the 429 was sent again
    assert all(batch[f"{s}_at"] for s in ("in_progress", "finalizing", "completed"))


def test_invalid_file_fails_the_batch_and_runs_nothing(tmp_path: Path) -> None:
    send = FakeEndpoint()
    store, loop = _loop(tmp_path, send)
    batch_id = _submit(store, [_line("a"), "{oops"])
    asyncio.run(loop.advance(batch_id))
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "failed"
    assert json.loads(batch["errors"])["data"][0]["line"] == 2
    assert send.sent == []


def test_cancel_aborts_lines_in_flight_and_keeps_what_is_done(tmp_path: Path) -> None:
    send = FakeEndpoint(delay_s=0.05)
    store, loop = _loop(tmp_path, send, max_in_flight=2)
    batch_id = _submit(store, [_line(str(i), f"p{i}") for i in range(40)])

    async def cancel_midway() -> None:
        job = asyncio.create_task(loop.advance(batch_id))
        await asyncio.sleep(0.3)
        assert store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"))
        loop.cancel(batch_id)
        await asyncio.wait_for(job, 5)

    asyncio.run(cancel_midway())
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "cancelled"
    done = batch["line_counts"]["completed"]
    assert 0 < done < 40 and batch["line_counts"]["pending"] == 40 - done
    assert len(_records(store, batch["output_file_id"])) == done
    assert not store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"))


def test_a_batch_past_its_window_expires_with_what_is_done(tmp_path: Path) -> None:
    send = FakeEndpoint()
    store, loop = _loop(tmp_path, send)
    batch_id = _submit(store, [_line("a")], window_s=-1)
    asyncio.run(loop.advance(batch_id))
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "expired"
    assert batch["output_file_id"] is None and send.sent == []


def test_killed_loop_resumes_with_no_line_lost_or_duplicated(tmp_path: Path) -> None:
    """SIGKILL the loop's process mid-job, start another on the same directory."""
    store = BatchStore(tmp_path)
    num_lines = 200
    batch_id = _submit(store, [_line(f"id-{i}", f"p{i}") for i in range(num_lines)])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "testing.batch_loop_process", str(tmp_path)]
    first = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 60
    while _done(store, batch_id) < num_lines // 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_at_kill = _done(store, batch_id)
    assert 0 < done_at_kill < num_lines, "the kill should land mid-job"
    subprocess.run(command, env=env, check=True, timeout=120)
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "completed"
    outputs = _records(store, batch["output_file_id"])
    assert [r["custom_id"] for r in outputs] == [f"id-{i}" for i in range(num_lines)]
    assert [r["response"]["body"]["id"] for r in outputs] == [
        f"cmpl-p{i}" for i in range(num_lines)
    ]
    assert batch["line_counts"] == {"completed": num_lines}


def _done(store: BatchStore, batch_id: str) -> int:
    batch = store.batch(batch_id)
    return 0 if batch is None else batch["line_counts"].get("completed", 0)
