"""Labelling prompts with both models, and `tierserve router train` on a labelled set and on
an ingress request log: real engines (the default model and a tiny student). The router is
written beside the student it labelled with, recording which student that is."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli.main import main, parser
from cli.router import fitted_student, logged_requests
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.model.students import CARD_FILE, ROUTER_FILE, latest_student, read_card
from policies.difficulty import DifficultyModel, StudentIdentity
from small_model.labels import RoutePrompt, greedy_answers, label_prompts, mean_logprobs

PROMPTS = [
    RoutePrompt("What is the capital of France? Answer with just the city name.", 8, "Paris"),
    RoutePrompt("What is 2 plus 3? Answer with just the number.", 8, "5"),
    RoutePrompt("Write one sentence about the sea.", 12),
]


@pytest.fixture(scope="module")
def engines(tiny_student_cache):
    default = LLMEngine(EngineConfig(model="default", num_kv_blocks=64))
    small = LLMEngine(EngineConfig(model="student", cache_dir=tiny_student_cache, num_kv_blocks=64))
    return default, small


def test_labels_score_checkable_answers_by_match_and_open_ones_by_likelihood(engines):
    default, small = engines
    labelled = label_prompts(PROMPTS, default, small)
    paris, five, sentence = labelled
    assert paris.quality_default == 1.0 and "Paris" in paris.default_text
    for item in labelled:
        assert 0.0 <= item.quality_small <= 1.0 and 0.0 <= item.label <= 1.0
        assert item.features["log_max_tokens"] == pytest.approx(math.log1p(item.prompt.max_tokens))
    assert sentence.quality_default == 1.0
    # A 2-layer student after 2 steps writes nothing the teacher would: little is kept.
    assert sentence.quality_small < 0.5


def test_the_teacher_prefers_its_own_answer(engines):
    default, _ = engines
    prompt = chat_prompt_ids(default.tokenizer, "Name three colours.")
    own = greedy_answers(default, [prompt], [10])[0]
    garbled = list(reversed(own))
    mine, other = mean_logprobs(default, [prompt, prompt], [own, garbled])
    assert mine > other
    assert mean_logprobs(default, [prompt], [[]]) == [-math.inf]


def test_router_train_writes_the_router_and_report_beside_its_student(tmp_path, tiny_student_cache):
    rows = [
        {"split": split, "prompt": p.text, "max_tokens": p.max_tokens, "answer": p.answer}
        for split in ("train", "eval")
        for p in PROMPTS
    ]
    labelled = tmp_path / "set.jsonl"
    labelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = latest_student(tiny_student_cache)
    args = ["router", "train", "--set", str(labelled), "--small-model", str(folder)]
    assert main([*args, "--share", "0.34"]) == 0
    model = DifficultyModel.load(folder / ROUTER_FILE)
    assert model.target_share == 0.34
    digest = read_card(folder)["reproducible"]["weights_sha256"]
    assert model.student is not None and model.student.weights_sha256 == digest
    assert model.student == StudentIdentity.from_card(folder.name, read_card(folder))
    report = json.loads((folder / "router.report.json").read_text())
    assert report["num_prompts"] == len(PROMPTS)
    assert len(report["router"]) == len(report["shares"]) == 11


def test_a_router_for_a_recipe_records_no_weights_and_a_non_student_needs_out(tmp_path):
    folder = tmp_path / "student-v4"
    folder.mkdir()
    reproducible = {"weights_sha256": "e" * 64, "settings_fingerprint": "fp", "num_threads": 2}
    (folder / CARD_FILE).write_text(json.dumps({"reproducible": reproducible}))
    train = ["router", "train", "--small-model", str(folder)]
    beside = fitted_student(parser().parse_args(train))
    assert beside == (StudentIdentity("student-v4", "e" * 64, "fp-t2"), folder / ROUTER_FILE)
    out = tmp_path / "committed.json"
    recipe = parser().parse_args([*train, "--fitted-to", "recipe", "--out", str(out)])
    assert fitted_student(recipe) == (StudentIdentity("student-v4", None, "fp-t2"), out)
    with pytest.raises(SystemExit, match="not a distilled student: name --out"):
        fitted_student(parser().parse_args(["router", "train", "--small-model", "default"]))


def test_logged_requests_are_read_once_each_from_ingress_log_lines(tmp_path: Path):
    line = '{"request_id": "%s", "request_text": "%s", "max_tokens": %s}'
    log = tmp_path / "replica_tierserve_Ingress_x.log"
    log.write_text(
        "INFO 2026-12-01 ingress -- "
        + line % ("a", "What is 2+2?", 8)
        + "\nnoise line\n"
        + line % ("b", "What is 2+2?", 8)  # a repeat: once is enough
        + "\n"
        + line % ("c", "Tell me a joke.", "null")
        + '\n{"request_id": "d"}\n'  # logged without log_prompts: no text
    )
    assert list(logged_requests([log])) == [("What is 2+2?", 8), ("Tell me a joke.", 64)]
