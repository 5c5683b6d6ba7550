"""One distillation, end to end: the teacher's answers, the student's training, its card,
and the published folder. Phases that finished are kept in a work folder, so a run that
was stopped (Ctrl-C, a killed process) resumes where it was.

One distillation runs per cache at a time (a file lock on the work folder): a
pool distilling in the background and `make distill` never train twice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.model.loader import cache_lock, partial_path, resolve_model_dir
from engine.model.students import next_student_dir, students_dir
from small_model.data import DISTILL_SET
from small_model.distill.batches import Batch, make_batches
from small_model.distill.card import decode_tokens_per_s, weights_digest, write_card
from small_model.distill.student import DEFAULT_KEEP_LAYERS, init_student
from small_model.distill.teacher import Example, teacher_examples
from small_model.distill.trainer import TrainSettings, evaluate, train

DEFAULT_PROMPTS = DISTILL_SET


@dataclass(frozen=True)
class DistillSettings:
    """What to distil from, on what, into what shape."""

    teacher: str = "default"
    prompts_file: Path = DEFAULT_PROMPTS
    max_prompts: int | None = 480
    """The teacher answers ~100 tokens/s on 2 cores here: 480 prompts take ~5 minutes, which
    with 8 minutes of training keeps the whole run within ~15."""
    max_answer_tokens: int = 96
    top_k: int = 20
    """Soft targets per answer token: the teacher's k likeliest tokens."""
    keep_layers: tuple[int, ...] = DEFAULT_KEEP_LAYERS
    batch_tokens: int = 2048
    held_out_share: float = 0.05
    train: TrainSettings = field(default_factory=TrainSettings)

    def fingerprint(self) -> str:
        """Identifies a run: a checkpoint is resumed only by the run that made it, and with
        the thread count it is the student's recipe (policies.difficulty.student_recipe),
        which a committed router is checked against. The prompts count by their content,
        not their path, so every checkout of one commit gives the same fingerprint."""
        prompts = hashlib.sha256(self.prompts_file.read_bytes()).hexdigest()
        text = json.dumps({**asdict(self), "prompts_file": prompts}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def distill(settings: DistillSettings, cache_dir: Path, show_progress: bool = True) -> Path:
    """Distil a student and publish it as the cache's next student version; its folder."""
    started = time.perf_counter()
    work = students_dir(cache_dir) / "work"
    with cache_lock(work):
        _forget_other_runs(work, settings.fingerprint())
        try:
            return _distill_locked(settings, cache_dir, work, started, show_progress)
        except BaseException:  # stopped or failed: the next run resumes and counts this time
            _remember_minutes(work, started)
            raise


def _distill_locked(
    settings: DistillSettings, cache_dir: Path, work: Path, started: float, show_progress: bool
) -> Path:
    """The phases, with the work folder held: teacher data, training, card, publication."""
    teacher_dir = resolve_model_dir(settings.teacher, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    examples = _teacher_data(settings, cache_dir, tokenizer, work, show_progress)
    train_batches, eval_batches = _split(examples, settings, tokenizer)
    torch.manual_seed(settings.train.seed)  # whatever the teacher's blocks do not fill
    student = init_student(teacher_dir, settings.keep_layers)
    before = evaluate(student, eval_batches)
    progress = train(student, train_batches, settings.train, work, show_progress)
    quality = {"before": before, "after": evaluate(student, eval_batches)}
    card = _card(settings, student, teacher_dir, quality, asdict(progress))
    card["distill_minutes"] = _minutes_so_far(work, started)
    folder = _publish(student, tokenizer, card, settings, cache_dir)
    shutil.rmtree(work, ignore_errors=True)
    return folder


def _forget_other_runs(work: Path, fingerprint: str) -> None:
    """A work folder left by a run with other settings is discarded, not resumed."""
    marker = work / "run.json"
    if marker.is_file() and json.loads(marker.read_text()).get("fingerprint") != fingerprint:
        print("distill: the saved run had other settings; starting afresh")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        marker.write_text(json.dumps({"fingerprint": fingerprint, "minutes_before": 0.0}))


def _minutes_so_far(work: Path, started: float) -> float:
    """Wall time of this run plus the runs it resumed."""
    before = json.loads((work / "run.json").read_text()).get("minutes_before", 0.0)
    return before + (time.perf_counter() - started) / 60


def _remember_minutes(work: Path, started: float) -> None:
    marker = work / "run.json"
    if marker.is_file():
        run = json.loads(marker.read_text())
        marker.write_text(json.dumps({**run, "minutes_before": _minutes_so_far(work, started)}))


def _teacher_data(
    settings: DistillSettings,
    cache_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    work: Path,
    show_progress: bool,
) -> list[Example]:
    """The teacher's answers to the prompt set, generated once per run and kept."""
    saved = work / "teacher.pt"
    if saved.is_file():
        return [Example(**row) for row in torch.load(saved, weights_only=True)]
    prompts = [chat_prompt_ids(tokenizer, text) for text in _prompt_texts(settings)]
    engine = LLMEngine(EngineConfig(model=settings.teacher, cache_dir=cache_dir))
    with tqdm(total=len(prompts), desc="teacher", disable=not show_progress) as bar:
        examples = teacher_examples(
            engine, prompts, settings.max_answer_tokens, settings.top_k, lambda: bar.update(1)
        )
    torch.save([asdict(e) for e in examples], saved)
    return examples


def _prompt_texts(settings: DistillSettings) -> list[str]:
    lines = settings.prompts_file.read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return texts[: settings.max_prompts]


def _split(
    examples: Sequence[Example], settings: DistillSettings, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[Batch], list[Batch]]:
    """Training and held-out batches; every k-th example is held out (at least one)."""
    every = min(max(2, round(1 / settings.held_out_share)), len(examples))
    held_out = [e for i, e in enumerate(examples) if i % every == every - 1]
    training = [e for i, e in enumerate(examples) if i % every != every - 1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return (
        make_batches(training, settings.batch_tokens, pad),
        make_batches(held_out, settings.batch_tokens, pad),
    )


def _card(
    settings: DistillSettings,
    student: PreTrainedModel,
    teacher_dir: Path,
    quality: dict[str, dict[str, float]],
    progress: dict[str, float],
) -> dict[str, object]:
    teacher_config = json.loads((teacher_dir / "config.json").read_text())
    return {
        "teacher": teacher_dir.name,
        "teacher_num_layers": teacher_config["num_hidden_layers"],
        "num_layers": len(settings.keep_layers),
        "kept_layers": list(settings.keep_layers),
        "num_parameters": sum(p.numel() for p in student.parameters()),
        "quality": quality,
        "training": {
            "steps": progress["step"],
            "num_tokens": progress["num_tokens"],
            "minutes": progress["elapsed_s"] / 60,
            "final_loss": progress["last_loss"],
            "settings": asdict(settings.train),
        },
        "reproducible": {
            "bounded_by": "steps and tokens (max_steps, max_tokens), never time",
            "seed": settings.train.seed,
            "num_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "settings_fingerprint": settings.fingerprint(),
            "weights_sha256": weights_digest(student),
        },
        "prompts_file": settings.prompts_file.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _publish(
    student: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    card: dict[str, object],
    settings: DistillSettings,
    cache_dir: Path,
) -> Path:
    """Save the student, time it against the teacher, write its card, then rename the
    folder into place: a student folder is complete or absent."""
    target = next_student_dir(cache_dir)
    partial = partial_path(target)
    try:
        student.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        teacher_speed = decode_tokens_per_s(settings.teacher, cache_dir)
        student_speed = decode_tokens_per_s(str(partial), cache_dir)
        card["speed"] = {
            "teacher_tokens_per_s": teacher_speed,
            "student_tokens_per_s": student_speed,
            "ratio_vs_teacher": student_speed / teacher_speed,
        }
        card["name"] = target.name
        card["bytes"] = sum(f.stat().st_size for f in partial.iterdir() if f.is_file())
        write_card(partial, card)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
