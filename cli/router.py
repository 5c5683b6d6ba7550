"""`tierserve router train`: (re)train the difficulty router and calibrate its threshold.

On the project's labelled prompt set (its `train` split; the `eval` split then
draws the report), or with `--from-logs` on a deployment's own traffic: the
request log lines of the ingress (written with `log_prompts: true`), so the
calibration and the curve come from the traffic the router will route. Both
models answer every prompt (small_model/labels.py); the router is fitted to
where the small one kept the quality, its threshold set to move `--share` of
the traffic, and a report (JSON + PNG curve) is written beside it.

The router records the student it was fitted to and, unless `--out` names
another file, is written into that student's folder in the cache
(engine.model.students.ROUTER_FILE): the ingress uses a router only for the
student it was fitted to. `--fitted-to recipe` records only the student's recipe
(its distillation command), for a router committed as the fallback of every
student that command publishes (configs/router.json: the default `tierserve
distill`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.config import default_cache_dir
from engine.model.students import ROUTER_FILE, read_card, student_folder
from policies.difficulty import StudentIdentity
from small_model.data import LABELLED_SET

LOGGED_MAX_TOKENS = 64
"""A logged request that did not set max_tokens is answered this far when labelling."""
REPORT_EVERY = 3
"""With --from-logs, every third request is held out to draw the report."""


def add_commands(groups: Any) -> None:
    """Add the `router` group and its `train` command to the top-level parser."""
    group = groups.add_parser("router", help="the difficulty router (model: auto)")
    commands = group.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="label prompts with both models and fit")
    source = train.add_mutually_exclusive_group()
    source.add_argument("--set", type=Path, default=LABELLED_SET, help="labelled JSONL")
    source.add_argument("--from-logs", type=Path, nargs="+", help="ingress request logs")
    train.add_argument("--share", type=float, default=0.5, help="traffic to move (0-1)")
    train.add_argument("--out", type=Path, help="default: router.json in the student's folder")
    train.add_argument(
        "--fitted-to", choices=("student", "recipe"), default="student",
        help="record the student's weights (only it), or its recipe (what its command makes)",
    )  # fmt: skip
    train.add_argument("--default-model", default="default")
    train.add_argument("--small-model", default="student")
    train.add_argument("--limit", type=int, default=None, help="use at most N prompts")
    train.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    train.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Label, fit, calibrate, report."""
    from small_model.labels import label_prompts
    from small_model.report import route_report
    from small_model.router_fit import calibrate_threshold, fit_difficulty_model

    student, out = fitted_student(args)
    fit_rows, report_rows = _prompts(args)
    default, small = _engine(args.default_model, args), _engine(args.small_model, args)
    fit_set = label_prompts(fit_rows, default, small)
    model = fit_difficulty_model(
        [item.features for item in fit_set], [item.label for item in fit_set], args.share
    )
    model = dataclasses.replace(model, student=student)
    report_set = label_prompts(report_rows, default, small)
    if args.from_logs:  # calibrate on the traffic it routes, as a whole
        both = fit_set + report_set
        scores = [model.score(item.features) for item in both]
        model = dataclasses.replace(model, threshold=calibrate_threshold(scores, args.share))
    model.save(out)
    report = route_report(model, report_set)
    report.save(out.with_suffix(".report.json"))
    print(f"router: {out} (fitted to {student}, threshold {model.threshold:.3f}, "
          f"target share {args.share})")  # fmt: skip
    print(json.dumps(dataclasses.asdict(report), indent=2))
    return 0


def fitted_student(args: argparse.Namespace) -> tuple[StudentIdentity | None, Path]:
    """The student the small model is (None if it is no student) and where its router goes,
    checked before any labelling: a run of minutes must not end without a place to write."""
    folder = student_folder(args.small_model, args.cache_dir)
    if folder is None and args.out is None:
        raise SystemExit(f"{args.small_model!r} is not a distilled student: name --out")
    if folder is None:
        return None, args.out
    student = StudentIdentity.from_card(folder.name, read_card(folder))
    if args.fitted_to == "recipe":
        if student.recipe is None:
            raise SystemExit(f"{folder}'s model card records no recipe: use --fitted-to student")
        student = dataclasses.replace(student, weights_sha256=None)
    return student, args.out or folder / ROUTER_FILE


def _engine(model: str, args: argparse.Namespace) -> Any:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, cache_dir=args.cache_dir))


def _prompts(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """(prompts to fit on, prompts to report on)."""
    from small_model.labels import RoutePrompt

    if args.from_logs:
        rows = list(logged_requests(args.from_logs))[: args.limit]
        if len(rows) < 2 * REPORT_EVERY:
            raise SystemExit(f"only {len(rows)} logged requests with request_text: too few")
        prompts = [RoutePrompt(text, max_tokens) for text, max_tokens in rows]
        held = [p for i, p in enumerate(prompts) if i % REPORT_EVERY == REPORT_EVERY - 1]
        return [p for i, p in enumerate(prompts) if i % REPORT_EVERY != REPORT_EVERY - 1], held
    rows = [json.loads(line) for line in args.set.read_text().splitlines() if line.strip()]
    by_split: dict[str, list[RoutePrompt]] = {"train": [], "eval": []}
    for row in rows:
        prompt = RoutePrompt(row["prompt"], row["max_tokens"], row.get("answer"))
        by_split[row.get("split", "train")].append(prompt)
    return by_split["train"][: args.limit], by_split["eval"][: args.limit]


def logged_requests(paths: list[Path]) -> Iterator[tuple[str, int]]:
    """(request text, max_tokens) of each logged request, each text once."""
    seen: set[str] = set()
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            start = line.find('{"request_id"')
            if start < 0:
                continue
            try:
                fields, _ = json.JSONDecoder().raw_decode(line[start:])
            except json.JSONDecodeError:
                continue
            text = fields.get("request_text")
            if text and text not in seen:
                seen.add(text)
                yield text, int(fields.get("max_tokens") or LOGGED_MAX_TOKENS)
