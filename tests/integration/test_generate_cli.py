"""`python -m engine.generate` as a user runs it, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.paths import REPO_ROOT
from engine import generate


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine.generate", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_streams_the_answer_and_a_summary():
    result = run_cli(
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--threads",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    summary = r"\d+ prompt tokens, [1-8] generated, finish_reason=(stop|length)"
    assert re.search(summary, result.stderr)


def test_cli_rejects_bad_input_before_loading_a_model():
    with pytest.raises(SystemExit, match="error: max_tokens must be >= 1"):
        generate.main(["--prompt", "Hi", "--max-tokens", "0"])
