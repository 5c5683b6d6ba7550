"""A small pool waiting for its student says how far the background distillation is."""

from __future__ import annotations

from pathlib import Path

from engine.model.students import students_dir
from serving.pools.student_wait import latest_progress, waiting_reason


def test_the_waiting_reason_carries_the_latest_progress_line(tmp_path: Path) -> None:
    log_file = students_dir(tmp_path) / "distill.log"
    assert waiting_reason(tmp_path, distilling=True).endswith(f"(log: {log_file})")
    log_file.parent.mkdir(parents=True)
    noise = "".join(f"teacher: {i}/480 prompts\n" for i in range(400))  # more than the tail
    log_file.write_text(
        noise
        + "distill: step 5/150, 10,240 tokens, loss 3.214, ~7.9 min left\n"
        + "distill: step 10/150, 20,480 tokens, loss 2.871, ~7.6 min left\n"
        + "some warning\n"
    )
    reason = waiting_reason(tmp_path, distilling=True)
    assert reason.endswith("; step 10/150, 20,480 tokens, loss 2.871, ~7.6 min left")
    assert "make distill" in waiting_reason(tmp_path, distilling=False)


def test_no_log_no_progress(tmp_path: Path) -> None:
    assert latest_progress(tmp_path / "missing.log") is None
