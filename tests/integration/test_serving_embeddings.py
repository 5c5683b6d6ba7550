"""`/v1/embeddings` end to end: the real `openai` client, real Ray Serve, the real model's
engines (fp32 pools): the app of `real_app_url` (tests/integration/conftest.py)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
HIDDEN_SIZE = 576
TEXTS = ["What is the capital of France?", "Paris is lovely in spring.", "2 + 2 = 4", "Hi"]
TOLERANCE = 5e-4
"""fp32 engines: a vector computed in a batch of four differs from one computed alone only
in the last bits of its matmuls' sums."""


def _floats(base_url: str, **body: object) -> tuple[list[list[float]], dict]:
    response = httpx.post(
        f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=120
    ).raise_for_status()
    document = response.json()
    return [item["embedding"] for item in document["data"]], document


def test_the_openai_client_embeds_a_string_with_usage(
    real_client: openai.OpenAI, tokenizer
) -> None:
    raw = real_client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[0])
    result = raw.parse()  # the client asked for base64 and decoded it
    [item] = result.data
    vector = np.array(item.embedding)
    assert item.index == 0 and vector.shape == (HIDDEN_SIZE,)
    assert abs(np.linalg.norm(vector) - 1) < 1e-4
    assert result.usage.prompt_tokens == len(tokenizer.encode(TEXTS[0]))
    assert result.usage.total_tokens == result.usage.prompt_tokens
    assert result.model == MODEL and raw.headers["x-tierserve-tier"] == "standard"


def test_inputs_embedded_together_equal_each_embedded_alone(real_client: openai.OpenAI) -> None:
    together = real_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in together.data] == [0, 1, 2, 3]
    for text, item in zip(TEXTS, together.data, strict=True):
        alone = real_client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        np.testing.assert_allclose(item.embedding, alone.data[0].embedding, atol=TOLERANCE)
    similar = np.array(together.data[0].embedding) @ np.array(together.data[1].embedding)
    assert similar < 0.999  # different texts, different vectors


def test_token_ids_embed_as_their_text(real_client: openai.OpenAI, tokenizer) -> None:
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = real_client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    by_text = real_client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    for a, b in zip(by_ids.data, by_text.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=TOLERANCE)
    one = real_client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=TOLERANCE)


def test_base64_decodes_to_the_float_vector(real_app_url: str) -> None:
    floats, _ = _floats(real_app_url, input=TEXTS[:2], encoding_format="float")
    encoded, document = _floats(real_app_url, input=TEXTS[:2], encoding_format="base64")
    for vector, text in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        np.testing.assert_allclose(decoded, vector, atol=TOLERANCE)
    assert document["object"] == "list" and document["data"][0]["object"] == "embedding"


def test_the_batch_tier_embeds_on_the_offline_pool(real_app_url: str) -> None:
    response = httpx.post(
        f"{real_app_url}/v1/embeddings", json={"model": MODEL, "input": "Hello"},
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
def test_bad_input_is_an_openai_400_naming_the_field(
    real_app_url: str, body: dict, param: str
) -> None:
    response = httpx.post(
        f"{real_app_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_an_unknown_model_is_a_404(real_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        real_client.embeddings.create(model="no-such-model", input="a")
