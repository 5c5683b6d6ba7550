"""The Serve app end to end with the real engine: real Ray Serve, HTTP and the `openai` client
(structured outputs and tool calls: test_serving_structured.py).

One app for the module (two pools, each one fp32 engine on the default model,
one torch thread); every request is a few greedy tokens so the module runs
in about a minute. Counts are checked against the real tokenizer.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from testing.serve_harness import (
    REAL_MAX_MODEL_LEN,
    metric,
    wait_for_metric,
)

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _num_chat_tokens(tokenizer, messages: list[dict[str, str]]) -> int:
    """The prompt length by the tokenizer's own tokenizing template (not the ingress's path)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a mapping


def test_greedy_chat_answers_and_counts_tokens(real_client: openai.OpenAI, tokenizer) -> None:
    raw = real_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12,
        extra_headers={"X-SLA-Tier": "interactive"},
    )  # fmt: skip
    completion = raw.parse()
    answer = completion.choices[0].message.content
    assert "Paris" in answer
    assert raw.headers["x-tierserve-pool"] == "interactive"
    usage = completion.usage
    assert usage.prompt_tokens == _num_chat_tokens(tokenizer, QUESTION)
    num_answer_tokens = len(tokenizer.encode(answer, add_special_tokens=False))
    if completion.choices[0].finish_reason == "stop":  # the end token is counted, not shown
        assert usage.completion_tokens == num_answer_tokens + 1
    else:
        assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stream_on_the_offline_pool_matches_the_speculating_pool(
    real_client: openai.OpenAI,
) -> None:
    """Greedy text is the same streamed or not, with speculation (interactive) or without."""
    whole = real_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12
    )
    stream = real_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-SLA-Tier": "batch"},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


@pytest.mark.parametrize(
    ("tier", "pool"),
    # interactive keeps to its own pool while it is idle; standard may take either (the
    # cheaper one predicted to meet its SLO); batch runs only on offline
    [("interactive", {"interactive"}), ("standard", {"interactive", "offline"}),
     ("batch", {"offline"})],
)  # fmt: skip
def test_tier_header_routes_to_the_configured_pool(
    real_client: openai.OpenAI, tier: str, pool: set[str]
) -> None:
    raw = real_client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=1, extra_headers={"X-SLA-Tier": tier}
    )
    assert raw.headers["x-tierserve-pool"] in pool
    assert raw.parse().usage.completion_tokens == 1


def test_completion_usage_counts_the_prompt_tokens(real_client: openai.OpenAI, tokenizer) -> None:
    prompt = "The quick brown fox jumps over"
    completion = real_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0
    )
    assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert completion.usage.completion_tokens == 3


def test_disconnect_mid_stream_frees_the_kv_blocks(real_app_url: str) -> None:
    body = {
        "model": MODEL, "messages": QUESTION, "max_tokens": 500, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    headers = {"X-SLA-Tier": "batch"}
    with httpx.stream(
        "POST", f"{real_app_url}/v1/chat/completions", json=body, headers=headers
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream at once
        next(lines)
        wait_for_metric(real_app_url, "vllm:num_requests_running", 1, timeout_s=30, pool="offline")
        assert metric(real_app_url, "vllm:kv_cache_usage_perc", pool="offline") > 0
    wait_for_metric(real_app_url, "vllm:num_requests_running", 0, timeout_s=30, pool="offline")
    wait_for_metric(real_app_url, "vllm:kv_cache_usage_perc", 0, timeout_s=30, pool="offline")


def test_context_length_exceeded_names_the_real_token_counts(real_app_url: str, tokenizer) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": REAL_MAX_MODEL_LEN}
    response = httpx.post(f"{real_app_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    num_prompt = _num_chat_tokens(tokenizer, QUESTION)
    for number in (REAL_MAX_MODEL_LEN, num_prompt + REAL_MAX_MODEL_LEN, num_prompt):
        assert str(number) in error["message"]


def _served_beside(client: openai.OpenAI, tier: str, i: int) -> bool:
    """One request beside the seeded one; False if the tier turned it away."""
    question = [{"role": "user", "content": f"Count to {i + 3} in words, then explain. " * i}]
    try:
        client.chat.completions.create(
            model=MODEL, messages=question, temperature=1.0, max_tokens=12,
            extra_headers={"X-SLA-Tier": tier},
        )  # fmt: skip
    except openai.RateLimitError:
        return False
    return True


def test_models_say_a_seed_reproduces_on_each_pool_of_the_model(real_app_url: str) -> None:
    """This CPU's engines are batch-invariant (the test below holds them to it): /v1/models
    says so for the model and for each pool serving it."""
    listed = httpx.get(f"{real_app_url}/v1/models", timeout=30).json()["data"]
    (card,) = [c for c in listed if c["id"] == MODEL]
    assert card["seeded_reproducible"] is True
    assert {p["pool"]: p["seeded_reproducible"] for p in card["pools"]} == {
        "interactive": True, "offline": True,
    }  # fmt: skip


@pytest.mark.parametrize("tier", ["interactive", "batch"])
def test_a_seeded_request_gives_the_same_text_cold_warm_and_in_a_busy_batch(
    real_client: openai.OpenAI, tier: str
) -> None:
    """Five runs of one seeded sampling request on each pool (speculating interactive,
    plain offline): the first computes the whole prompt, the next reads it from the prefix
    cache, the last three share their steps with other requests."""
    messages = [{"role": "user", "content": f"Invent a name for a {tier} sailing boat."}]
    extra = {"extra_headers": {"X-SLA-Tier": tier}}

    def seeded() -> str:
        # As a batch client does: while the interactive tier is being shed (the runs before
        # fill its pool), the batch tier is refused for a Retry-After (ShedFirst).
        completion = real_client.with_options(max_retries=5).chat.completions.create(
            model=MODEL, messages=messages, temperature=0.9, seed=1234, max_tokens=16, **extra
        )
        return completion.choices[0].message.content

    texts = [seeded(), seeded()]
    num_served_beside = 0
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            # The seeded request first, so that an interactive pool under its SLO does
            # not turn it away; the others join its batch while it decodes.
            run = pool.submit(seeded)
            time.sleep(0.2)
            busy = [pool.submit(_served_beside, real_client, tier, i) for i in range(1, 4)]
            texts.append(run.result())
            num_served_beside += sum(future.result() for future in busy)
    assert texts == [texts[0]] * 5
    assert num_served_beside > 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_name_each_token_with_its_likeliest_alternatives(
    real_client: openai.OpenAI, stream: bool
) -> None:
    request = dict(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True,
        top_logprobs=3, stream=stream, extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        chunks = list(real_client.chat.completions.create(**request))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
    else:
        completion = real_client.chat.completions.create(**request)
        text = completion.choices[0].message.content
        entries = completion.choices[0].logprobs.content
    assert len(entries) == 6
    assert "".join(e.token for e in entries) == text
    for entry in entries:  # greedy: the chosen token is the likeliest
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token


def test_completion_logprobs_are_parallel_lists_with_offsets(real_client: openai.OpenAI) -> None:
    completion = real_client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and max(top, key=top.get) == token
        assert logprob == pytest.approx(top[token])


def test_logprobs_out_of_range_or_without_the_switch_are_400(real_app_url: str) -> None:
    bodies = [
        {"messages": QUESTION, "top_logprobs": 2},  # OpenAI requires logprobs: true
        {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
        {"prompt": "Hi", "logprobs": -1},
    ]
    for body in bodies:
        path = "chat/completions" if "messages" in body else "completions"
        response = httpx.post(
            f"{real_app_url}/v1/{path}", json={"model": MODEL, **body}, timeout=30
        )
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(
    real_client: openai.OpenAI, tokenizer, stream: bool
) -> None:
    """lm-evaluation-harness's log-likelihood request: echo, logprobs=1, one new token."""
    prompt = "The capital of France is Paris"
    response = real_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
        stream=stream, extra_headers={"X-SLA-Tier": "batch"},
    )  # fmt: skip
    choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
    text = "".join(c.text for c in choices)
    tokens = [t for c in choices for t in c.logprobs.tokens]
    scores = [lp for c in choices for lp in c.logprobs.token_logprobs]
    num_prompt = len(tokenizer.encode(prompt))
    assert text.startswith(prompt) and len(tokens) == len(scores) == num_prompt + 1
    assert "".join(tokens) == text
    assert scores[0] is None  # nothing predicts the first token
    assert all(score is not None and score <= 0 for score in scores[1:])
    offsets = [o for c in choices for o in c.logprobs.text_offset]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_token_id_prompts_answer_as_their_text_does(
    real_client: openai.OpenAI, real_app_url: str, tokenizer
) -> None:
    """lm-eval's local-completions sends prompts as token ids (a batch of them at once)."""
    texts = ["The capital of France is", "One, two, three,"]
    ids = [tokenizer.encode(text) for text in texts]
    asked = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=1, echo=True)
    by_text = real_client.completions.create(prompt=texts, **asked)
    by_ids = real_client.completions.create(prompt=ids, **asked)
    for text, tokens in zip(by_text.choices, by_ids.choices, strict=True):
        assert tokens.text == text.text
        assert tokens.logprobs.token_logprobs == text.logprobs.token_logprobs
    single = real_client.completions.create(prompt=ids[0], **asked)
    assert single.choices[0].text == by_text.choices[0].text
    too_big = {"model": MODEL, "prompt": [len(tokenizer)], "max_tokens": 1}
    response = httpx.post(f"{real_app_url}/v1/completions", json=too_big, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
