"""`tierserve batch ...`: submit a JSONL file of requests as a batch job, follow it, fetch
its results, cancel it, list jobs. A thin client of the server's Batches API (through the
`openai` client), so it works against any deployment, local or on a cluster.

The server is `--base-url` or $TIERSERVE_BASE_URL (default http://localhost:8000/v1);
the key is `--api-key` or $TIERSERVE_API_KEY (a key whose default tier is batch suits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import openai
from openai.types import Batch
from tqdm import tqdm

FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
POLL_INTERVAL_S = 2.0
"""Between status calls of `--wait`: each costs the server ~40 ms of CPU (proxy, ingress,
runner), time a small machine's job would otherwise have."""


def add_commands(groups: Any) -> None:
    """Add the `batch` group and its subcommands to the top-level parser."""
    group = groups.add_parser("batch", help="OpenAI-style batch jobs on the offline pool")
    group.add_argument(
        "--base-url", default=os.environ.get("TIERSERVE_BASE_URL", "http://localhost:8000/v1")
    )
    group.add_argument("--api-key", default=os.environ.get("TIERSERVE_API_KEY", "none"))
    commands = group.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", help="upload FILE and start a batch on it")
    submit.add_argument("file", type=Path)
    submit.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        choices=["/v1/chat/completions", "/v1/completions"],
    )
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar")
    submit.set_defaults(run=_submit)

    status = commands.add_parser("status", help="print a batch as JSON")
    status.add_argument("batch_id")
    status.set_defaults(run=_status)

    results = commands.add_parser("results", help="write a batch's output (and errors)")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", type=Path, required=True)
    results.add_argument("--errors", type=Path, help="where to write the error file, if any")
    results.set_defaults(run=_results)

    cancel = commands.add_parser("cancel", help="cancel a batch")
    cancel.add_argument("batch_id")
    cancel.set_defaults(run=_cancel)

    listing = commands.add_parser("list", help="list batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(run=_list)


def _client(args: argparse.Namespace) -> openai.OpenAI:
    return openai.OpenAI(base_url=args.base_url, api_key=args.api_key)


def _submit(args: argparse.Namespace) -> int:
    client = _client(args)
    metadata = dict(item.split("=", 1) for item in args.metadata) or None
    with args.file.open("rb") as content:
        uploaded = client.files.create(file=(args.file.name, content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=args.endpoint,
        completion_window="24h",
        metadata=metadata,
    )
    print(batch.id)
    if not args.wait:
        return 0
    batch = _follow(client, batch)
    _print(batch)
    return 0 if batch.status == "completed" else 1


def _follow(client: openai.OpenAI, batch: Batch) -> Batch:
    """Poll until the batch is final, showing lines done out of the total."""
    with tqdm(desc=batch.id, unit="line") as progress:
        while batch.status not in FINAL_STATUSES:
            time.sleep(POLL_INTERVAL_S)
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            if counts is not None:
                progress.total = counts.total
                progress.n = counts.completed + counts.failed
                progress.set_postfix(status=batch.status, failed=counts.failed)
                progress.refresh()
    return batch


def _status(args: argparse.Namespace) -> int:
    _print(_client(args).batches.retrieve(args.batch_id))
    return 0


def _results(args: argparse.Namespace) -> int:
    client = _client(args)
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in FINAL_STATUSES:
        print(f"batch {batch.id} is {batch.status}; results come once it ends", file=sys.stderr)
        return 1
    for file_id, path in ((batch.output_file_id, args.output), (batch.error_file_id, args.errors)):
        if path is None:
            continue
        content = b"" if file_id is None else client.files.content(file_id).content
        path.write_bytes(content)
        print(f"{path}: {len(content.splitlines())} lines")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    _print(_client(args).batches.cancel(args.batch_id))
    return 0


def _list(args: argparse.Namespace) -> int:
    for batch in _client(args).batches.list(limit=args.limit).data:
        counts = batch.request_counts
        done = "" if counts is None else f"{counts.completed + counts.failed}/{counts.total}"
        print(f"{batch.id}  {batch.status:<11} {done:>11}  {batch.endpoint}")
    return 0


def _print(batch: Batch) -> None:
    print(json.dumps(batch.model_dump(mode="json"), indent=2))
