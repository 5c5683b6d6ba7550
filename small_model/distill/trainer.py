"""The distillation loop: the student learns the teacher's top-k distribution at every
answer token, for a number of steps, checkpointing so it can be stopped and resumed.

The loss is the cross-entropy of the student's log-probabilities against the
teacher's top-k probabilities (renormalised over those k): the KL divergence
up to a constant, on the part of the distribution that carries nearly all its
mass. The learning rate follows a cosine over the steps, so a bounded run
still anneals.

A run is bounded by steps and tokens, never by the clock: a time budget made
two machines (or one machine on two days) train different numbers of steps and
publish different students, with a router fitted to neither. The clock is only
a check that warns. With the batch order seeded and every step the same
arithmetic, the same command at the same thread count publishes the same
weights, bit for bit (tests/unit/small_model/test_distill.py runs it twice).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel

from small_model.distill.batches import Batch, epoch_order

CHECKPOINT_FILE = "checkpoint.pt"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    """How long and how hard the student trains."""

    max_steps: int = 150
    """Training stops after this many steps: a step of ~2,048 tokens took ~3.3 s on 2 cores
    here, so ~8 minutes."""
    max_tokens: int | None = None
    """Or once this many tokens were trained on, whichever comes first."""
    expected_minutes: float = 12.0
    """A check, not a bound: training past it logs a warning (a slower or busier machine)
    and goes on, so the student stays the same."""
    log_every: int = 5
    """A progress line (step, tokens, loss, minutes left) every this many steps: the log of
    a background run, where no progress bar draws, says how far it is."""
    lr: float = 1e-3
    warmup_steps: int = 10
    checkpoint_every: int = 25
    seed: int = 0


@dataclass
class Progress:
    """What a checkpoint remembers besides weights: where the run is."""

    step: int = 0
    elapsed_s: float = 0.0
    last_loss: float = math.nan
    num_tokens: int = 0


def train(
    student: PreTrainedModel,
    batches: Sequence[Batch],
    settings: TrainSettings,
    work_dir: Path,
    show_progress: bool = True,
) -> Progress:
    """Train `student` in place until the budget is spent, resuming from `work_dir`'s
    checkpoint when there is one. Ctrl-C checkpoints before it stops the run."""
    student.train()
    student.get_input_embeddings().weight.requires_grad_(False)  # see _trainable
    optimizer = torch.optim.AdamW(_trainable(student), lr=settings.lr, weight_decay=0.0)
    progress = _resume(student, optimizer, work_dir)
    bar = tqdm(
        desc="distill", unit="step", initial=progress.step, total=settings.max_steps,
        disable=not show_progress,
    )  # fmt: skip
    try:
        while not _spent(progress, settings):
            started = time.perf_counter()
            batch = batches[_batch_index(progress.step, len(batches), settings.seed)]
            _set_lr(optimizer, _lr(progress, settings))
            progress.last_loss = _step(student, optimizer, batch)
            progress.step += 1
            progress.num_tokens += batch.num_tokens
            step_s = time.perf_counter() - started
            progress.elapsed_s += step_s
            bar.update(1)
            bar.set_postfix(loss=f"{progress.last_loss:.3f}", min=f"{progress.elapsed_s / 60:.1f}")
            _report(progress, settings, step_s)
            if progress.step % settings.checkpoint_every == 0:
                save_checkpoint(student, optimizer, progress, work_dir)
    finally:  # also on Ctrl-C: the next run resumes from here
        bar.close()
        save_checkpoint(student, optimizer, progress, work_dir)
    student.eval()
    return progress


def answer_logits(student: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The student's fp32 logits [N, vocab] where answer tokens are predicted: the head
    runs only there, not over the prompt."""
    hidden = student.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return student.lm_head(hidden.last_hidden_state[batch.rows, batch.cols]).float()


def kd_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Cross-entropy of the student's logits against the teacher's renormalised top-k."""
    log_q = F.log_softmax(logits, dim=-1)
    target = F.softmax(batch.top_logprobs, dim=-1)
    return -(target * log_q.gather(1, batch.top_ids)).sum(-1).mean()


@torch.no_grad()
def evaluate(student: PreTrainedModel, batches: Sequence[Batch]) -> dict[str, float]:
    """On held-out answers: the distillation loss, and how often the student's likeliest
    token is the teacher's (what greedy decoding and draft acceptance depend on)."""
    student.eval()
    total_loss, agreed, count = 0.0, 0, 0
    for batch in batches:
        logits = answer_logits(student, batch)
        num = len(batch.rows)
        total_loss += float(kd_loss(logits, batch)) * num
        agreed += int((logits.argmax(-1) == batch.top_ids[:, 0]).sum())
        count += num
    return {"kd_loss": total_loss / max(count, 1), "top1_agreement": agreed / max(count, 1)}


def save_checkpoint(
    student: PreTrainedModel, optimizer: torch.optim.Optimizer, progress: Progress, work_dir: Path
) -> None:
    """Weights, optimizer and progress, replaced atomically: a kill mid-save loses nothing."""
    work_dir.mkdir(parents=True, exist_ok=True)
    partial = work_dir / f".{CHECKPOINT_FILE}.partial"
    state = {"model": student.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**state, "progress": asdict(progress)}, partial)
    os.replace(partial, work_dir / CHECKPOINT_FILE)


def _resume(student: PreTrainedModel, optimizer: torch.optim.Optimizer, work_dir: Path) -> Progress:
    path = work_dir / CHECKPOINT_FILE
    if not path.is_file():
        return Progress()
    saved = torch.load(path, weights_only=True)
    student.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    progress = Progress(**saved["progress"])
    print(f"distill: resuming at step {progress.step} ({progress.elapsed_s / 60:.1f} min in)")
    return progress


def _step(student: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    loss = kd_loss(answer_logits(student, batch), batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(_trainable(student), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def _trainable(student: PreTrainedModel) -> list[torch.nn.Parameter]:
    """Every block and norm: `train` froze the embeddings (tied to the head), which keeps
    the student's tokens meaning what the teacher's do and saves their gradient."""
    return [p for p in student.parameters() if p.requires_grad]


def _spent(progress: Progress, settings: TrainSettings) -> bool:
    out_of_tokens = settings.max_tokens is not None and progress.num_tokens >= settings.max_tokens
    return progress.step >= settings.max_steps or out_of_tokens


def _report(progress: Progress, settings: TrainSettings, step_s: float) -> None:
    """A progress line every `log_every` steps, and a warning when the run has outlasted
    `expected_minutes` (once: at the step, of `step_s` seconds, that crossed it)."""
    if progress.step % settings.log_every == 0 or progress.step == settings.max_steps:
        left_s = (settings.max_steps - progress.step) * progress.elapsed_s / progress.step
        left_min = left_s / 60
        print(
            f"distill: step {progress.step}/{settings.max_steps}, {progress.num_tokens:,} "
            f"tokens, loss {progress.last_loss:.3f}, ~{left_min:.1f} min left", flush=True
        )  # fmt: skip
    limit_s = settings.expected_minutes * 60
    if progress.elapsed_s >= limit_s > progress.elapsed_s - step_s:
        log.warning(
            "distillation has trained %.1f min, past the expected %.1f: this machine is slower "
            "or busier than the one the defaults were measured on; it goes on to step %d",
            progress.elapsed_s / 60, settings.expected_minutes, settings.max_steps,
        )  # fmt: skip


def _lr(progress: Progress, settings: TrainSettings) -> float:
    """Linear warm-up, then a cosine to a tenth over the steps."""
    if progress.step < settings.warmup_steps:
        return settings.lr * (progress.step + 1) / settings.warmup_steps
    done = min(progress.step / settings.max_steps, 1.0)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _batch_index(step: int, num_batches: int, seed: int) -> int:
    epoch, offset = divmod(step, num_batches)
    return epoch_order(num_batches, epoch, seed)[offset]
