"""`tierserve distill`: make the small model (a student distilled from the default model)
and publish it into the cache as the next `student-v<N>`; `model: student` then finds it.

Bounded by `--max-steps` (and `--max-tokens`) of training, never by the clock,
so the same command publishes the same student on any machine of this kind;
the whole run (teacher answers and card included) takes ~15 minutes on 2 cores
by default, and a run slower than `--expected-minutes` warns. Progress lines go
to standard output (the background run's log). Ctrl-C stops it with a
checkpoint; the same command resumes.

It trains no router, in the foreground or when a small pool runs it in the
background: labelling the router's prompt set answers every prompt with both
models, minutes more on top of a run already held to ~15. The student of the
default command needs none: configs/router.json was fitted to that recipe
(policies.difficulty.student_recipe) and the ingress uses it for that student;
a student of any other command gets its own from `tierserve router train`,
which writes it into the student's folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine.config import default_cache_dir
from engine.model.students import read_card
from small_model.distill.run import DEFAULT_PROMPTS, DistillSettings, distill
from small_model.distill.student import DEFAULT_KEEP_LAYERS
from small_model.distill.trainer import TrainSettings

DISTILL_THREADS = 2
"""The machines this project runs on have 2 cores: the default student is made at 2."""


def add_commands(groups: Any) -> None:
    """Add the `distill` command to the top-level parser."""
    command = groups.add_parser("distill", help="distil the small model from the default one")
    command.add_argument("--max-steps", type=int, default=TrainSettings.max_steps)
    command.add_argument("--max-tokens", type=int, default=None)
    command.add_argument(
        "--expected-minutes", type=float, default=TrainSettings.expected_minutes,
        help="warn when training takes longer (it still runs every step)",
    )  # fmt: skip
    command.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    command.add_argument("--max-prompts", type=int, default=DistillSettings.max_prompts)
    command.add_argument("--max-answer-tokens", type=int, default=96)
    command.add_argument(
        "--layers",
        default=",".join(map(str, DEFAULT_KEEP_LAYERS)),
        help="teacher blocks the student keeps, comma-separated",
    )
    command.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    command.add_argument(
        "--threads", type=int, default=DISTILL_THREADS,
        help="torch threads: a matmul's last bits follow the count, so it is fixed",
    )  # fmt: skip
    command.add_argument("--quiet", action="store_true", help="no progress bars")
    command.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Distil, then print where the student went and its card."""
    import torch  # the batch client never needs it

    torch.set_num_threads(args.threads)
    folder = distill(settings(args), args.cache_dir, show_progress=not args.quiet)
    print(f"student: {folder}")
    print(json.dumps(read_card(folder), indent=2))
    return 0


def settings(args: argparse.Namespace) -> DistillSettings:
    """The run the command line asks for (with `--threads`, the student's recipe)."""
    return DistillSettings(
        prompts_file=args.prompts,
        max_prompts=args.max_prompts,
        max_answer_tokens=args.max_answer_tokens,
        keep_layers=_layers(args.layers),
        train=TrainSettings(
            max_steps=args.max_steps,
            max_tokens=args.max_tokens,
            expected_minutes=args.expected_minutes,
        ),
    )


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--layers takes comma-separated block numbers, got {text!r}") from None
