"""The Files and Batches APIs through real Ray Serve and HTTP with the `openai` client, a
fake engine behind the pools: round trip, validation, cancel, paging, and the runner
replica killed mid-job."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cli.main import main
from serving.config import BatchJobsConfig
from serving.gateway_config import ApiKeyConfig, GatewayConfig
from testing.fakes import FakeEngine
from testing.local_cluster import kill_replica
from testing.serve_harness import fake_config, serving

MODEL = "SmolLM2-135M-Instruct"
KEY = "batch-test-key"
CHAT_ONLY_KEY = "chat-only-key"
MAX_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir = tmp_path_factory.mktemp("batches")
    gateway = GatewayConfig(
        require_api_key=True,
        api_keys=(
            ApiKeyConfig(key=KEY, name="jobs"),
            ApiKeyConfig(key=CHAT_ONLY_KEY, name="chat", allowed_tiers=("interactive",)),
        ),
    )
    jobs = BatchJobsConfig(data_dir=str(data_dir), max_in_flight=MAX_IN_FLIGHT, retry_delay_s=0.1)
    with serving(fake_config(gateway=gateway, batch_jobs=jobs), FakeEngine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def _requests(count: int, url: str = "/v1/chat/completions", max_tokens: int = 3) -> bytes:
    lines = []
    for i in range(count):
        if url == "/v1/chat/completions":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": f"q{i}"}]}
        else:
            body = {"prompt": f"q{i}"}
        body |= {"model": MODEL, "max_tokens": max_tokens}
        lines.append(
            json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def _submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions") -> str:
    """Upload `content` and start a batch on it; the batch's id."""
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    return batch.id


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    """The batch once final, waiting out restarts of the app's replicas."""
    deadline = time.monotonic() + timeout_s
    while (batch := _retrieve(client, batch_id)).status not in (
        "completed", "failed", "cancelled", "expired",
    ):  # fmt: skip
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    return batch


def _retrieve(client: openai.OpenAI, batch_id: str) -> Any:
    """The batch; while a killed replica is being replaced, its answer once it is back."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_openai_client_round_trip(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("in.jsonl", _requests(5)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == _requests(5)
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "nightly"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"suite": "nightly"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (5, 5)
    assert batch.error_file_id is None
    outputs = _lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(5)]
    response = outputs[0]["response"]
    assert response["status_code"] == 200
    assert response["body"]["object"] == "chat.completion"
    assert response["body"]["choices"][0]["message"]["content"] == "abc"
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_lines_the_endpoint_refuses_go_to_the_error_file(client: openai.OpenAI) -> None:
    good = json.loads(_requests(1, "/v1/completions"))
    too_long = {**good, "custom_id": "too-long", "body": {**good["body"], "max_tokens": 10**6}}
    content = "\n".join(json.dumps(line) for line in (good, too_long)).encode()
    batch = _wait(client, _submit(client, content, "/v1/completions"))
    assert batch.status == "completed"
    assert batch.request_counts is not None and batch.request_counts.failed == 1
    errors = _lines(client, batch.error_file_id)
    assert errors[0]["custom_id"] == "too-long"
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_invalid_input_fails_validation_naming_lines(client: openai.OpenAI) -> None:
    content = _requests(2) + b"{broken\n" + _requests(1)  # line 4 repeats req-0
    batch = _wait(client, _submit(client, content))
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.param) for e in batch.errors.data] == [(3, None), (4, "custom_id")]


def test_api_refusals_are_openai_errors(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id="file-x", endpoint="/v1/embeddings", completion_window="24h"
        )  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    uploaded = client.files.create(file=("in.jsonl", _requests(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError):  # metadata values are strings
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"runs": 3},  # type: ignore[dict-item]
        )
    chat_only = openai.OpenAI(base_url=f"{base_url}/v1", api_key=CHAT_ONLY_KEY, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        chat_only.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    answer = httpx.get(f"{base_url}/v1/batches?limit=0", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit"


def test_cancel_stops_a_running_batch(client: openai.OpenAI) -> None:
    batch_id = _submit(client, _requests(200, max_tokens=20))
    while client.batches.retrieve(batch_id).status != "in_progress":
        time.sleep(0.05)
    assert client.batches.cancel(batch_id).status in ("cancelling", "cancelled")
    batch = _wait(client, batch_id)
    assert batch.status == "cancelled"
    assert batch.request_counts is not None and batch.request_counts.completed < 200


def test_list_pages_newest_first(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("in.jsonl", _requests(1)), purpose="batch")
    created = [
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == created[0]
    for batch_id in created:
        _wait(client, batch_id)


@pytest.mark.parametrize(
    "victims",
    [("BatchRunner",), ("BatchRunner", "Ingress", "pool-offline", "pool-interactive")],
    ids=["runner", "whole-app"],
)
def test_killed_mid_job_resumes_without_loss_or_duplicates(
    client: openai.OpenAI, victims: tuple[str, ...]
) -> None:
    """Serve replaces the killed replicas; the new runner resumes from the store."""
    num_lines = 120
    batch_id = _submit(client, _requests(num_lines, max_tokens=20))
    while _completed(client, batch_id) < num_lines // 4:
        time.sleep(0.05)
    for deployment in victims:
        kill_replica(deployment)
    assert _completed(client, batch_id) < num_lines, "the kill should land mid-job"
    batch = _wait(client, batch_id, timeout_s=120)
    assert batch.status == "completed"
    outputs = _lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(num_lines)]
    assert batch.request_counts is not None and batch.request_counts.completed == num_lines


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = _retrieve(client, batch_id).request_counts
    return 0 if counts is None else counts.completed


def test_cli_submits_follows_and_fetches_results(
    base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(_requests(3, "/v1/completions"))
    server = ["batch", "--base-url", f"{base_url}/v1", "--api-key", KEY]
    submit = [*server, "submit", str(requests), "--endpoint", "/v1/completions", "--wait"]
    assert main([*submit, "--metadata", "run=cli"]) == 0
    printed = capsys.readouterr().out
    batch_id = printed.split()[0]
    assert '"status": "completed"' in printed
    assert main([*server, "status", batch_id]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"] == {"run": "cli"}
    output = tmp_path / "out.jsonl"
    assert main([*server, "results", batch_id, "-o", str(output)]) == 0
    assert capsys.readouterr().out.strip() == f"{output}: 3 lines"
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["req-0", "req-1", "req-2"]
    assert main([*server, "list", "--limit", "1"]) == 0
    assert capsys.readouterr().out.split()[:2] == [batch_id, "completed"]
    assert main([*server, "cancel", batch_id]) == 0  # a finished batch stays as it is
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
