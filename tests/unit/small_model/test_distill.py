"""Distillation: a tiny student is published complete, loads like any model, and a stopped
training run resumes exactly where it was."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.model.loader import resolve_model_dir
from engine.model.students import (
    CARD_FILE,
    STUDENT_MODEL,
    StudentMissing,
    latest_student,
    next_student_dir,
    student_versions,
)
from small_model.data import DISTILL_SET
from small_model.distill.batches import make_batches
from small_model.distill.card import weights_digest
from small_model.distill.run import DistillSettings, distill
from small_model.distill.student import init_student
from small_model.distill.teacher import Example
from small_model.distill.trainer import CHECKPOINT_FILE, TrainSettings, evaluate, train
from testing.engine_helpers import greedy, run_one, tiny_distill_settings

TEACHER_LAYERS = 30


def test_student_is_published_with_its_card_and_loads_by_name(tiny_student_cache, tokenizer):
    (version, folder), *_ = student_versions(tiny_student_cache)
    assert version == 1 and folder == latest_student(tiny_student_cache)
    assert next_student_dir(tiny_student_cache).name == "student-v2"
    card = json.loads((folder / CARD_FILE).read_text())
    assert card["num_layers"] == 2 and card["kept_layers"] == [0, 29]
    assert card["teacher_num_layers"] == TEACHER_LAYERS
    assert card["training"]["steps"] == 2
    assert card["speed"]["ratio_vs_teacher"] > 1.5, "2 of 30 layers should decode far faster"
    assert card["bytes"] > 4 * card["num_parameters"]  # fp32 weights are in the folder
    assert (folder / "README.md").read_text().startswith("# student-v1")
    assert not (tiny_student_cache / "students" / "work").exists(), "work folder left behind"

    engine = LLMEngine(EngineConfig(model=STUDENT_MODEL, cache_dir=tiny_student_cache))
    assert engine.model.args.num_layers == 2
    prompt = chat_prompt_ids(tokenizer, "Name a colour.")
    assert len(run_one(engine, prompt, greedy(5)).token_ids) == 5


def test_no_student_is_a_clear_error(tmp_path):
    with pytest.raises(StudentMissing, match="tierserve distill"):
        resolve_model_dir(STUDENT_MODEL, tmp_path)


def test_a_runs_fingerprint_reads_its_prompts_content_not_their_path(tmp_path):
    """Every checkout of a commit gives the default run one fingerprint: the recipe the
    committed router records (tests/unit/small_model/test_difficulty.py)."""
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(DISTILL_SET.read_bytes())
    assert DistillSettings(prompts_file=copy).fingerprint() == DistillSettings().fingerprint()
    copy.write_text('{"prompt": "another"}\n')
    assert DistillSettings(prompts_file=copy).fingerprint() != DistillSettings().fingerprint()


def test_student_keeps_the_teachers_chosen_blocks():
    teacher_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    student = init_student(teacher_dir, (0, 29))
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    pairs = [(0, 0), (1, 29)]
    for mine, theirs in pairs:
        assert torch.equal(
            student.model.layers[mine].mlp.down_proj.weight,
            teacher.model.layers[theirs].mlp.down_proj.weight,
        )
    assert student.lm_head.weight is student.get_input_embeddings().weight
    with pytest.raises(ValueError, match="increasing"):
        init_student(teacher_dir, (5, 3))


def _examples(num: int, vocab: int = 49152) -> list[Example]:
    """Synthetic soft targets: the next token is the current one plus one."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(num):
        prompt = torch.randint(100, vocab - 100, (6 + i % 3,), generator=generator).tolist()
        answer = [prompt[-1] + j + 1 for j in range(4)]
        out.append(
            Example(
                prompt_ids=prompt,
                answer_ids=answer,
                top_ids=[[t, t + 1] for t in answer],
                top_logprobs=[[-0.1, -2.4] for _ in answer],
            )
        )
    return out


def test_batches_point_each_answer_token_at_the_position_that_predicts_it():
    examples = _examples(5)
    batches = make_batches(examples, max_tokens=40, pad_id=0)
    assert sum(len(b.rows) for b in batches) == sum(len(e.answer_ids) for e in examples)
    for batch in batches:
        assert batch.input_ids.numel() <= 40 or batch.input_ids.shape[0] == 1
        # The position that predicts an answer token holds the token just before it.
        previous = batch.input_ids[batch.rows, batch.cols]
        assert torch.equal(previous + 1, batch.top_ids[:, 0])


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    teacher_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    batches = make_batches(_examples(8), max_tokens=48, pad_id=0)

    straight = init_student(teacher_dir, (0, 29))
    train(straight, batches, TrainSettings(max_steps=4), tmp_path / "a", show_progress=False)

    resumed = init_student(teacher_dir, (0, 29))
    first = train(resumed, batches, TrainSettings(max_steps=2), tmp_path / "b", show_progress=False)
    assert first.step == 2 and (tmp_path / "b" / CHECKPOINT_FILE).is_file()
    again = init_student(teacher_dir, (0, 29))  # a new process: only the checkpoint remains
    second = train(again, batches, TrainSettings(max_steps=4), tmp_path / "b", show_progress=False)
    assert second.step == 4
    for (name, a), (_, b) in zip(
        straight.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    before = evaluate(init_student(teacher_dir, (0, 29)), batches)
    after = evaluate(again, batches)
    assert after["kd_loss"] < before["kd_loss"], "four steps on the same batches must fit them"


@pytest.mark.slow  # left out of `make test-fast`; `make test` runs it
def test_the_same_command_publishes_the_same_student(tiny_student_cache, tmp_path, capsys):
    """Bounded by steps, seeded, at one thread count: a second run in another cache gives
    the same weights to the last bit, and its log says how far it got."""
    again = distill(tiny_distill_settings(), tmp_path, show_progress=False)
    first = json.loads((latest_student(tiny_student_cache) / CARD_FILE).read_text())
    second = json.loads((again / CARD_FILE).read_text())
    assert second["reproducible"]["weights_sha256"] == first["reproducible"]["weights_sha256"]
    assert second["reproducible"]["weights_sha256"] == weights_digest(
        AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32)
    )
    assert second["training"]["steps"] == 2
    assert "distill: step 2/2, " in capsys.readouterr().out


def test_training_past_the_expected_minutes_warns_and_goes_on(tmp_path, caplog):
    teacher_dir = resolve_model_dir("default", EngineConfig().cache_dir)
    batches = make_batches(_examples(4), max_tokens=48, pad_id=0)
    settings = TrainSettings(max_steps=3, expected_minutes=1e-6)
    progress = train(init_student(teacher_dir, (0, 29)), batches, settings, tmp_path, False)
    assert progress.step == 3  # the clock does not cut the run short
    warnings = [r for r in caplog.records if "past the expected" in r.getMessage()]
    assert len(warnings) == 1
