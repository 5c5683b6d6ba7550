"""`/v1/embeddings` end to end: the real `openai` client, real Ray Serve, the real model's
engines (two fp32 pools), on the shared cluster."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from testing.serve_harness import exact_config, serving

MODEL = "SmolLM2-135M-Instruct"
HIDDEN_SIZE = 576
TEXTS = ["What is the capital of France?", "Paris is lovely in spring.", "2 + 2 = 4", "Hi"]
TOLERANCE = 5e-4
"""fp32 engines: a vector computed in a batch of four differs from one computed alone only
in the last bits of its matmuls' sums."""


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(exact_config()) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _floats(base_url: str, **body: object) -> tuple[list[list[float]], dict]:
    response = httpx.post(
        f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=120
    ).raise_for_status()
    document = response.json()
    return [item["embedding"] for item in document["data"]], document


def test_the_openai_client_embeds_a_string_with_usage(client: openai.OpenAI, tokenizer) -> None:
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[0])
    result = raw.parse()  # the client asked for base64 and decoded it
    [item] = result.data
    vector = np.array(item.embedding)
    assert item.index == 0 and vector.shape == (HIDDEN_SIZE,)
    assert abs(np.linalg.norm(vector) - 1) < 1e-4
    assert result.usage.prompt_tokens == len(tokenizer.encode(TEXTS[0]))
    assert result.usage.total_tokens == result.usage.prompt_tokens
    assert result.model == MODEL and raw.headers["x-tierserve-tier"] == "standard"


def test_inputs_embedded_together_equal_each_embedded_alone(client: openai.OpenAI) -> None:
    together = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in together.data] == [0, 1, 2, 3]
    for text, item in zip(TEXTS, together.data, strict=True):
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        np.testing.assert_allclose(item.embedding, alone.data[0].embedding, atol=TOLERANCE)
    similar = np.array(together.data[0].embedding) @ np.array(together.data[1].embedding)
    assert similar < 0.999  # different texts, different vectors


def test_token_ids_embed_as_their_text(client: openai.OpenAI, tokenizer) -> None:
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    for a, b in zip(by_ids.data, by_text.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=TOLERANCE)
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=TOLERANCE)


def test_base64_decodes_to_the_float_vector(base_url: str) -> None:
    floats, _ = _floats(base_url, input=TEXTS[:2], encoding_format="float")
    encoded, document = _floats(base_url, input=TEXTS[:2], encoding_format="base64")
    for vector, text in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        np.testing.assert_allclose(decoded, vector, atol=TOLERANCE)
    assert document["object"] == "list" and document["data"][0]["object"] == "embedding"


def test_the_batch_tier_embeds_on_the_offline_pool(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/embeddings", json={"model": MODEL, "input": "Hello"},
        headers={"X-SLA-Tier": "batch"}, timeout=120,
    )  # fmt: skip
    assert response.status_code == 200 and response.headers["x-tierserve-pool"] == "offline"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [""]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": ["a", [1, 2]]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[-1]]}, "input"),
        ({"input": [[10**9]]}, "input"),
        ({"input": "word " * 2000}, "input"),
        ({"input": "a", "dimensions": 64}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "temperature": 0}, "temperature"),
        ({"input": "a", "tier": "gold"}, "tier"),
    ],
)  # fmt: skip
def test_bad_input_is_an_openai_400_naming_the_field(base_url: str, body: dict, param: str) -> None:
    response = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")
