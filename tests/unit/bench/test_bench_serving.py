"""bench_serving's serving-path comparison: its workloads, config and engine side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.serving.bench_serving import (
    _sent_s,
    engine_closed_loop,
    path_config,
    serve_vs_engine_workloads,
)
from bench.serving.closed_loop import COMPLETIONS_PATH, OUTPUT_TOKENS, PROMPT_TOKENS, Prompts
from bench.serving.vllm_server import (
    SERVER_MODULE,
    server_command,
    vllm_bench_serve,
    vllm_server,
)
from serving.app_config import load_config

CONFIG = load_config("configs/local.yaml")


def test_workloads_send_the_same_prompts_to_server_and_engine(tokenizer) -> None:
    prompts = Prompts(tokenizer, CONFIG.model_name, seed=0)
    random_tokens, chat = serve_vs_engine_workloads(prompts, CONFIG.model_name, 3)

    assert random_tokens.path == COMPLETIONS_PATH
    assert [b["prompt"] for b in random_tokens.bodies] == random_tokens.prompt_ids
    assert all(len(ids) == PROMPT_TOKENS for ids in random_tokens.prompt_ids)
    assert len(set(map(tuple, random_tokens.prompt_ids))) == 3  # nothing shared to cache
    assert [prompts.prompt_ids(b) for b in chat.bodies] == chat.prompt_ids
    assert all(abs(len(ids) - PROMPT_TOKENS) <= 4 for ids in chat.prompt_ids)
    for body in random_tokens.bodies + chat.bodies:
        assert body["ignore_eos"] and body["stream"] and body["max_tokens"] == OUTPUT_TOKENS


def test_path_config_only_stops_the_interactive_tier_shedding() -> None:
    measured = path_config(CONFIG)

    interactive = {t.name: t for t in measured.tiers}["interactive"]
    assert interactive.on_slo_miss == "queue" and interactive.overflow_pool is None
    assert interactive.pool == "interactive"
    others = [t for t in measured.tiers if t.name != "interactive"]
    assert others == [t for t in CONFIG.tiers if t.name != "interactive"]
    assert measured.pools == CONFIG.pools


def test_a_closed_loop_request_is_sent_as_the_slot_it_takes_frees() -> None:
    ends_s = [2.0, 3.0]

    assert _sent_s(0.4, ends_s) == 0.0  # first wave: sent at the start
    assert _sent_s(2.3, ends_s) == 2.0
    assert _sent_s(3.5, ends_s) == 3.0


def test_engine_closed_loop_runs_every_request_to_its_tokens(make_engine) -> None:
    engine = make_engine(max_num_seqs=2)
    prompts = [[1000 + i] * 8 for i in range(3)]

    results, wall_s = engine_closed_loop(engine, prompts, max_tokens=4)

    assert len(results) == 3
    assert all(r.num_output_tokens == 4 for r in results)
    assert all(0 < r.ttft_s < r.e2e_s <= wall_s for r in results)
    # The third request waited for a slot: timed from when one freed, not from 0, its
    # first token comes sooner than any request's last.
    assert max(r.ttft_s for r in results) < min(r.e2e_s for r in results)


def test_vllm_server_command_serves_the_model_under_tierserves_name(tmp_path) -> None:
    command = server_command(Path("/v/bin/python"), tmp_path, CONFIG.model_name, 8123,
                             "float32", max_num_seqs=4)  # fmt: skip

    assert command[:3] == ["/v/bin/python", "-m", SERVER_MODULE]
    options = dict(zip(command[3::2], command[4::2], strict=True))
    assert options == {
        "--model": str(tmp_path), "--served-model-name": CONFIG.model_name,
        "--host": "127.0.0.1", "--port": "8123", "--dtype": "float32", "--max-num-seqs": "4",
    }  # fmt: skip


def test_a_vllm_server_that_cannot_start_fails_with_its_log(tmp_path) -> None:
    """This venv has no vLLM: the server exits at once, and the error says why."""
    with (
        pytest.raises(RuntimeError, match="No module named 'vllm'"),
        vllm_server(Path(sys.executable), tmp_path, "m", "float32", 4, threads=1),
    ):
        pass


def test_vllm_bench_serve_fails_with_what_its_client_said(tmp_path) -> None:
    """This venv has no vLLM: the client script cannot import it, and the error says so."""
    with pytest.raises(RuntimeError, match="No module named 'vllm'"):
        vllm_bench_serve(Path(sys.executable), "http://127.0.0.1:9", "m", tmp_path,
                         (128, 64), num_prompts=4, concurrency=4)  # fmt: skip
