"""The distillation loop: the student learns the teacher's top-k distribution at every
answer token, in a time budget, checkpointing so it can be stopped and resumed.

The loss is the cross-entropy of the student's log-probabilities against the
teacher's top-k probabilities (renormalised over those k): the KL divergence
up to a constant, on the part of the distribution that carries nearly all its
mass. The learning rate follows a cosine over the budget (time or steps,
whichever ends first), so a bounded run still anneals.
"""

from __future__ import annotations

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

from engine.distill.batches import Batch, epoch_order

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    """How long and how hard the student trains."""

    minutes: float = 8.0
    """Training time, summed over resumed runs."""
    max_steps: int | None = None
    """Stop after this many steps even with time left (tests, quick runs)."""
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
    bar = tqdm(desc="distill", unit="step", initial=progress.step, disable=not show_progress)
    try:
        while not _spent(progress, settings):
            started = time.perf_counter()
            batch = batches[_batch_index(progress.step, len(batches), settings.seed)]
            _set_lr(optimizer, _lr(progress, settings))
            progress.last_loss = _step(student, optimizer, batch)
            progress.step += 1
            progress.num_tokens += batch.num_tokens
            progress.elapsed_s += time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(loss=f"{progress.last_loss:.3f}", min=f"{progress.elapsed_s / 60:.1f}")
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
    out_of_steps = settings.max_steps is not None and progress.step >= settings.max_steps
    return out_of_steps or progress.elapsed_s >= settings.minutes * 60


def _lr(progress: Progress, settings: TrainSettings) -> float:
    """Linear warm-up, then a cosine to a tenth over the budget used so far."""
    if progress.step < settings.warmup_steps:
        return settings.lr * (progress.step + 1) / settings.warmup_steps
    done = progress.elapsed_s / (settings.minutes * 60)
    if settings.max_steps is not None:
        done = max(done, progress.step / settings.max_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _batch_index(step: int, num_batches: int, seed: int) -> int:
    epoch, offset = divmod(step, num_batches)
    return epoch_order(num_batches, epoch, seed)[offset]
