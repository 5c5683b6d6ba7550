"""The threshold's arithmetic, the committed pair set, and the config line it is written to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cli.cache import write_threshold
from serving.app_config import load_config
from serving.cache.calibration import (
    choose_threshold,
    curve,
    load_pairs,
    rates,
    separation_auc,
)


def test_the_threshold_is_the_lowest_within_the_false_hit_budget() -> None:
    paraphrase = np.array([0.90, 0.95, 0.97, 0.99])
    near_miss = np.array([0.80, 0.93, 0.96])
    threshold = choose_threshold(paraphrase, near_miss, max_false_hit_rate=0.0)
    assert 0.96 < threshold <= 0.9601
    assert rates(paraphrase, near_miss, threshold).hit_rate == 0.5
    loose = choose_threshold(paraphrase, near_miss, max_false_hit_rate=0.34)
    assert 0.93 < loose <= 0.9301 and rates(paraphrase, near_miss, loose).false_hit_rate <= 0.34
    points = curve(paraphrase, near_miss, num_points=5)
    assert points[0].hit_rate == 1.0 and points[-1].false_hit_rate == 0.0
    assert separation_auc(paraphrase, near_miss) == pytest.approx(9 / 12)


def test_the_pair_set_has_both_kinds_in_both_splits() -> None:
    pairs = load_pairs()
    counts = {(p.kind, p.split) for p in pairs}
    assert counts == {(k, s) for k in ("paraphrase", "near_miss")
                      for s in ("calibration", "held_out")}  # fmt: skip
    assert all(p.a != p.b for p in pairs)


def test_the_threshold_is_written_into_the_config_keeping_its_comments(tmp_path: Path) -> None:
    copy = tmp_path / "local.yaml"
    original = Path("configs/local.yaml").read_text()
    copy.write_text(original)
    write_threshold(copy, 0.9712)
    assert load_config(copy).semantic_cache.threshold == 0.9712
    changed = [a for a, b in zip(original.splitlines(), copy.read_text().splitlines(), strict=True)
               if a != b]  # fmt: skip
    assert len(changed) == 1 and "threshold:" in changed[0] and "#" in changed[0]
    (tmp_path / "bare.yaml").write_text("applications: []\n")
    with pytest.raises(ValueError, match="semantic_cache"):
        write_threshold(tmp_path / "bare.yaml", 0.9)
