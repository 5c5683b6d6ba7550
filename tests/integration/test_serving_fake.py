"""The Serve app end to end over real Ray Serve and HTTP, with a fake engine (no model).

One app per module; each test sends a few short requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
from ray import serve

from serving.app_config import TierserveConfig, load_config
from serving.gateway_config import ApiKeyConfig, GatewayConfig
from serving.pools.pool_monitor import serve_running_replicas
from testing.fakes import FakeEngine
from testing.serve_harness import metric, serving, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
SMALL_MODEL = "SmolLM2-student"
KEY = "test-key"
INTERACTIVE_SLOTS = 4
"""The interactive pool's batch here, whatever configs/local.yaml ships: the overflow test
fills exactly these slots."""


def _config() -> TierserveConfig:
    base = load_config("configs/local.yaml")
    pools = tuple(
        pool.model_copy(
            update={
                "engine": pool.engine.__class__(
                    max_num_seqs=INTERACTIVE_SLOTS
                    if pool.name == "interactive"
                    else pool.engine.max_num_seqs,
                    max_model_len=4096,
                ),
                "max_queued_requests": 2 if pool.name == "interactive" else 64,
            }
        )
        for pool in base.pools
    )
    gateway = GatewayConfig(
        require_api_key=True,
        api_keys=(
            ApiKeyConfig(key=KEY, name="tests"),
            ApiKeyConfig(key="batch-key", name="batch-team", default_tier="batch"),
            ApiKeyConfig(key="limited-key", name="limited", requests_per_minute=2),
        ),
    )
    return base.model_copy(
        update={"pools": pools, "gateway": gateway, "stats_poll_interval_s": 0.1}
    )


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(_config(), FakeEngine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def _chat(client: openai.OpenAI, **kwargs):
    messages = [{"role": "user", "content": "hi"}]
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, **kwargs
    )


def test_chat_completion_names_pool_and_model(client: openai.OpenAI) -> None:
    raw = _chat(client, max_tokens=4)
    completion = raw.parse()
    assert completion.choices[0].message.content == "abcd"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    assert completion.usage.prompt_tokens == len("<user>hi<assistant>")
    # standard: the cheapest pool predicted to meet its SLO (the idle fakes predict 0 ms)
    assert raw.headers["x-tierserve-pool"] == "offline"
    assert raw.headers["x-tierserve-model"] == MODEL
    assert float(raw.headers["x-tierserve-predicted-ttft-ms"]) >= 0


def test_chat_stream_follows_openai_chunk_format(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abc"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_completions_take_a_list_of_prompts_and_n(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=2)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(c.text == "ab" for c in completion.choices)
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 8


def test_streamed_completion_with_n_merges_choices(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "abc", 1: "abc"}


@pytest.mark.parametrize(
    ("headers", "body", "key", "pool"),
    [
        ({"X-SLA-Tier": "interactive"}, {}, KEY, "interactive"),
        ({}, {"tier": "batch"}, KEY, "offline"),
        ({}, {}, "batch-key", "offline"),
        # standard goes to the cheapest pool predicted to meet its SLO (idle fakes: offline)
        ({"X-SLA-Tier": "standard"}, {"tier": "batch"}, "batch-key", "offline"),
    ],
)
def test_tier_routes_to_configured_pool(
    base_url: str, headers: dict[str, str], body: dict[str, str], key: str, pool: str
) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    raw = _chat(client, max_tokens=1, extra_headers=headers, extra_body=body)
    assert raw.headers["x-tierserve-pool"] == pool
    assert raw.headers["x-tierserve-tier"] == (headers or body or {"": "batch"}).popitem()[1]


async def _hold_streams(
    base_url: str, count: int, tier: str, max_tokens: int
) -> list[asyncio.Task]:
    """Start `count` long streams and wait until each has its first token."""
    started = asyncio.Event()
    num_started = 0

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal num_started
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}", "X-SLA-Tier": tier}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            lines = r.aiter_lines()
            await anext(lines)
            num_started += 1
            if num_started == count:
                started.set()
            async for _ in lines:
                pass

    http = httpx.AsyncClient(base_url=base_url, timeout=60)
    tasks = [asyncio.create_task(one(http)) for _ in range(count)]
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.sleep(0.3)  # let the stats poll see them
    return tasks


def test_standard_overflows_to_offline_when_interactive_is_full(base_url: str) -> None:
    async def scenario() -> tuple[str, str]:
        tasks = await _hold_streams(base_url, INTERACTIVE_SLOTS, "interactive", max_tokens=2000)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            auth = {"Authorization": f"Bearer {KEY}"}
            standard = await http.post("/v1/completions", json=body, headers=auth)
            shed = await http.post(
                "/v1/completions", json=body, headers={**auth, "X-SLA-Tier": "interactive"}
            )
            more = await _hold_streams(base_url, 2, "interactive", max_tokens=2000)
            refused = await http.post(
                "/v1/completions", json=body, headers={**auth, "X-SLA-Tier": "interactive"}
            )
        for task in tasks + more:
            task.cancel()
        await asyncio.gather(*tasks, *more, return_exceptions=True)
        return standard.headers["x-tierserve-pool"], shed.status_code, refused

    pool, queued_status, overflowed = asyncio.run(scenario())
    assert pool == "offline"
    assert queued_status == 200  # a fifth interactive request queues (limit 2) ...
    # ... and past the queue limit it overflows to the offline pool at top priority:
    # interactive is refused only when its own demand exceeds the whole deployment
    assert overflowed.status_code == 200
    assert overflowed.headers["x-tierserve-pool"] == "offline"
    wait_for_metric(
        base_url, "vllm:num_requests_running", 0, timeout_s=30, api_key=KEY, pool="interactive"
    )


def test_disconnect_aborts_the_request_in_the_engine(base_url: str) -> None:
    max_tokens = 2000  # ten seconds of fake tokens
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}", "X-SLA-Tier": "batch"}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream at once
        next(lines)
        wait_for_metric(
            base_url, "vllm:num_requests_running", 1, timeout_s=30, api_key=KEY, pool="offline"
        )
    wait_for_metric(
        base_url, "vllm:num_requests_running", 0, timeout_s=30, api_key=KEY, pool="offline"
    )
    assert metric(base_url, "vllm:kv_cache_usage_perc", KEY, pool="offline") == 0
    assert metric(base_url, "tierserve:requests_total", KEY, tier="batch", status="aborted") >= 1


def _post(base_url: str, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=30)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("body", "key", "status", "code"),
    [
        (CHAT, None, 401, "invalid_api_key"),
        (CHAT, "wrong", 401, "invalid_api_key"),
        ({"model": MODEL}, KEY, 400, None),
        ({**CHAT, "model": "gpt-9"}, KEY, 404, "model_not_found"),
        ({**CHAT, "max_tokens": 5000}, KEY, 400, "context_length_exceeded"),
        ({**CHAT, "temperature": -1}, KEY, 400, None),
        ({**CHAT, "top_p": 0}, KEY, 400, None),
        ({**CHAT, "min_tokens": 5}, KEY, 400, None),
        ({**CHAT, "tier": "platinum"}, KEY, 400, None),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            KEY,
            400,
            None,
        ),
    ],
)
def test_errors_use_openai_format(
    base_url: str, body: dict, key: str | None, status: int, code: str | None
) -> None:
    response = _post(base_url, "/v1/chat/completions", body, key)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["code"] == code


def test_invalid_json_is_a_400(base_url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_context_length_error_names_the_numbers(base_url: str) -> None:
    message = _post(base_url, "/v1/chat/completions", {**CHAT, "max_tokens": 5000}).json()
    assert "4096" in message["error"]["message"] and "5019" in message["error"]["message"]


def test_rate_limit_answers_429_with_retry_after(base_url: str) -> None:
    statuses = [
        _post(
            base_url,
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 1},
            "limited-key",
        )
        for _ in range(3)
    ]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert int(statuses[-1].headers["retry-after"]) >= 1


def test_models_health_and_metrics(base_url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL, SMALL_MODEL]
    listed = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    for card in listed.json()["data"]:  # each model with the pools serving it, as configured
        pools = [p for p in _config().pools if p.model_name == card["id"]]
        assert card["pools"] == [
            {"pool": p.name, "model": p.engine.model, "max_model_len": 4096,
             "seeded_reproducible": False}  # the fake engine promises nothing
            for p in pools
        ]  # fmt: skip
        assert card["max_model_len"] == 4096 and card["seeded_reproducible"] is False
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok"  # the fake small pool serves no student: no router fits
    assert health["difficulty_router"]["router"] == "not_a_student"
    _chat(client, max_tokens=2, extra_headers={"X-SLA-Tier": "interactive"})
    assert httpx.get(f"{base_url}/metrics").status_code == 401  # keys are required here
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in [
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "tierserve:slo_met_total", "tierserve:cost_per_1k_output_tokens",
    ]:  # fmt: skip
        assert name in text, name
    assert metric(base_url, "tierserve:slo_checked_total", KEY, tier="interactive") >= 1


def test_serve_reports_each_pools_running_replicas(base_url: str) -> None:
    """What the ingress counts pools live by (serving/pools/pool_monitor.py): every pool of
    the running app has a replica Serve runs; a deployment Serve does not list has none."""
    handles = {
        pool.name: serve.get_deployment_handle(f"pool-{pool.name}", app_name="tierserve")
        for pool in _config().pools
    }
    gone = SimpleNamespace(app_name="tierserve", deployment_name="pool-gone")
    counts = serve_running_replicas({**handles, "gone": gone})()  # type: ignore[dict-item]
    assert counts.pop("gone") == 0
    assert counts.keys() == handles.keys() and all(n >= 1 for n in counts.values()), counts
