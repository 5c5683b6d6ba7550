"""The small-model router: fitting, calibration, saved models (and the student each was
fitted to), evaluation (its prompt features: test_difficulty_features.py)."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.paths import CONFIGS_DIR
from cli.distill import settings as distill_settings
from cli.main import parser
from policies.difficulty import (
    FEATURE_NAMES,
    DifficultyModel,
    StudentIdentity,
    prompt_features,
    student_recipe,
)
from small_model.router_fit import (
    auc_gain,
    calibrate_threshold,
    fit_difficulty_model,
    quality_curve,
    random_curve,
    roc_auc,
)

SHARES = [i / 20 for i in range(1, 20)]
TOPICS = ["photosynthesis", "inflation", "plate tectonics", "the halting problem", "tides"]
VOCABULARY = (
    "energy market theory evidence pressure model system history argument cause effect "
    "boundary structure process memory signal network policy growth limit proof claim"
)


def _prompt(rng: random.Random, easy: bool) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    if easy:
        return rng.choice([f"What is {a} plus {b}?", f"Compute {a} * {b}.", f"What is {a} - {b}?"])
    words = " ".join(rng.choices(VOCABULARY.split(), k=rng.randint(30, 120)))
    topic, other = rng.sample(TOPICS, 2)
    return f"Explain why {topic} matters, step by step. {words}. Compare it with {other}."


def _synthetic(seed: int, n: int) -> tuple[list[dict[str, float]], list[int]]:
    """Easy (short arithmetic) prompts the small model gets right, hard (long 'explain why')
    ones it gets wrong, each outcome flipped 5% of the time."""
    rng = random.Random(seed)
    rows, labels = [], []
    for _ in range(n):
        easy = rng.random() < 0.5
        text = _prompt(rng, easy)
        max_tokens = rng.choice([None, 64, 256, 1024])
        rows.append(prompt_features(text, len(text) // 4, max_tokens))
        labels.append(int(easy != (rng.random() < 0.05)))
    return rows, labels


@pytest.fixture(scope="module")
def trained() -> tuple[DifficultyModel, list[dict[str, float]], list[int]]:
    rows, labels = _synthetic(seed=0, n=600)
    return fit_difficulty_model(rows, labels, target_share=0.4), rows, labels


def test_router_ranks_held_out_prompts_and_beats_random(trained) -> None:
    model, _, _ = trained
    rows, labels = _synthetic(seed=1, n=400)
    scores = [model.score(row) for row in rows]
    assert roc_auc(scores, labels) > 0.85
    default = [1.0] * len(labels)
    router = quality_curve(scores, labels, default, SHARES)
    chance = random_curve(labels, default, SHARES)
    assert all(r >= c for r, c in zip(router, chance, strict=True))
    assert auc_gain(SHARES, router, chance) > 0.05


def test_fit_hits_its_target_share_and_converges(trained) -> None:
    model, rows, labels = trained
    routed = sum(model.routes_to_small(row) for row in rows)
    assert abs(routed - 0.4 * len(rows)) <= 1
    assert model.target_share == 0.4
    longer = fit_difficulty_model(rows, labels, target_share=0.4, steps=500)
    assert longer.weights == pytest.approx(model.weights, abs=1e-8)
    assert fit_difficulty_model(rows, labels, target_share=0.4) == model  # deterministic


def test_fit_is_fast_on_a_few_thousand_rows() -> None:
    rows, labels = _synthetic(seed=2, n=3000)
    start = time.perf_counter()
    fit_difficulty_model(rows, labels, target_share=0.3)
    assert time.perf_counter() - start < 1.0


def test_fit_with_share_zero_routes_nothing(trained) -> None:
    _, rows, labels = trained
    model = fit_difficulty_model(rows, labels, target_share=0.0)
    assert model.threshold == math.inf
    assert not any(model.routes_to_small(row) for row in rows)


@pytest.mark.parametrize(
    ("num_rows", "labels", "kwargs", "message"),
    [
        (1, [1], {}, "at least 2 rows"),
        (3, [1, 1, 1], {}, "nothing to learn"),
        (3, [0, 1, 2], {}, r"labels must be in \[0, 1\]"),
        (3, [0, 1], {}, "3 rows but 2 labels"),
        (3, [0, 1, 0], {"target_share": 1.5}, "share"),
        (3, [0, 1, 0], {"l2": 0.0}, "l2"),
    ],
)
def test_fit_rejects_degenerate_input(
    num_rows: int, labels: list[float], kwargs: dict, message: str
) -> None:
    rows = [prompt_features("word " * (i + 1), i + 1, None) for i in range(num_rows)]
    with pytest.raises(ValueError, match=message):
        fit_difficulty_model(rows, labels, **{"target_share": 0.5, **kwargs})


def test_fit_rejects_rows_without_a_feature() -> None:
    rows = [prompt_features("a", 1, None), {"log_words": 1.0}]
    with pytest.raises(ValueError, match="lacks feature"):
        fit_difficulty_model(rows, [0, 1], target_share=0.5)


@pytest.mark.parametrize("share", [0.01, 0.1, 0.25, 0.5, 0.73, 0.99])
def test_calibration_hits_the_share_within_one_row(share: float) -> None:
    rng = random.Random(3)
    scores = [rng.random() for _ in range(1000)]
    threshold = calibrate_threshold(scores, share)
    assert abs(sum(s >= threshold for s in scores) - share * len(scores)) <= 1


def test_calibration_moves_ties_together() -> None:
    scores = [0.5] * 4 + [0.9] * 2 + [0.1] * 4  # reachable counts: 0, 2, 6, 10
    assert calibrate_threshold(scores, 0.3) == 0.9  # 2 rows is closer to 3 than 6 is
    assert calibrate_threshold(scores, 0.5) == 0.5  # 6 rows
    assert calibrate_threshold(scores, 0.4) == 0.9  # 2 and 6 equally close: the smaller
    assert calibrate_threshold([0.7] * 5, 0.5) == math.inf  # 0 and 5 rows equally close


def test_calibration_at_zero_and_one() -> None:
    scores = [0.2, 0.4, 0.6]
    assert calibrate_threshold(scores, 0.0) == math.inf
    assert calibrate_threshold(scores, 1.0) == -math.inf  # also below every score seen


@pytest.mark.parametrize(("scores", "share"), [([], 0.5), ([0.1], -0.1), ([math.nan], 0.5)])
def test_calibration_rejects_bad_input(scores: list[float], share: float) -> None:
    with pytest.raises(ValueError):
        calibrate_threshold(scores, share)


def test_saved_model_loads_with_identical_scores(trained, tmp_path: Path) -> None:
    model, rows, _ = trained
    path = tmp_path / "router.json"
    model.save(path)
    loaded = DifficultyModel.load(path)
    assert loaded == model
    assert [loaded.score(r) for r in rows] == [model.score(r) for r in rows]


def test_infinite_threshold_is_saved_as_strict_json(trained, tmp_path: Path) -> None:
    model = replace(trained[0], threshold=math.inf, target_share=0.0)
    path = tmp_path / "router.json"
    model.save(path)

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    assert json.loads(path.read_text(), parse_constant=no_constants)["threshold"] == "inf"
    assert DifficultyModel.load(path).threshold == math.inf


def _without(data: dict, name: str) -> dict:
    i = data["feature_names"].index(name)
    return {
        **data,
        **{k: [v for j, v in enumerate(data[k]) if j != i] for k in ("weights", "means", "scales")},
        "feature_names": [n for n in data["feature_names"] if n != name],
    }


def test_a_file_with_other_features_is_rejected_naming_them(trained) -> None:
    data = trained[0].to_dict()
    with pytest.raises(ValueError, match=r"missing \['digit_share'\]"):
        DifficultyModel.from_dict(_without(data, "digit_share"))
    renamed = {**data, "feature_names": ["shiny", *data["feature_names"][1:]]}
    with pytest.raises(ValueError, match=r"missing \['log_prompt_tokens'\], unexpected \['shiny'"):
        DifficultyModel.from_dict(renamed)
    swapped = {**data, "feature_names": [*data["feature_names"][1::-1], *FEATURE_NAMES[2:]]}
    with pytest.raises(ValueError, match="another order"):
        DifficultyModel.from_dict(swapped)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 3}, r"version 3, expected one of \(1, 2\)"),
        ({"student": "student-v1"}, "malformed"),
        ({"student": {"weights_sha256": "ab"}}, "malformed"),  # no name
        ({"version": None}, "version None"),
        ({"bias": None}, "malformed"),
        ({"weights": [1.0]}, "weights, means and scales"),
        ({"threshold": "nan"}, "NaN"),
        ({"scales": [0.0] * len(FEATURE_NAMES)}, "positive"),
        ({"target_share": 2.0}, "share"),
    ],
)
def test_a_malformed_file_is_rejected(trained, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DifficultyModel.from_dict({**trained[0].to_dict(), **change})


def test_a_file_that_is_not_a_model_is_rejected(trained, tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        DifficultyModel.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        DifficultyModel.load(path)
    data = trained[0].to_dict()
    del data["bias"]
    with pytest.raises(ValueError, match="malformed"):
        DifficultyModel.from_dict(data)


STUDENT = StudentIdentity("student-v3", "a" * 64, "fp-t2")


def test_the_student_a_model_was_fitted_to_is_saved_and_read(trained, tmp_path: Path) -> None:
    model = replace(trained[0], student=STUDENT)
    path = tmp_path / "router.json"
    model.save(path)
    saved = json.loads(path.read_text())["student"]
    assert saved == {"name": "student-v3", "weights_sha256": "a" * 64, "recipe": "fp-t2"}
    assert DifficultyModel.load(path) == model


def test_a_version_1_file_loads_fitted_to_no_student(trained) -> None:
    data = {k: v for k, v in trained[0].to_dict().items() if k != "student"}
    old = DifficultyModel.from_dict({**data, "version": 1})
    assert old.student is None and old.weights == trained[0].weights
    assert not old.fits(STUDENT)


def test_a_router_fits_its_students_weights_or_else_its_recipe(trained) -> None:
    by_weights = replace(trained[0], student=STUDENT)
    assert by_weights.fits(replace(STUDENT, name="student-v1"))  # another cache's numbering
    assert not by_weights.fits(replace(STUDENT, weights_sha256="b" * 64))  # same recipe
    by_recipe = replace(trained[0], student=replace(STUDENT, weights_sha256=None))
    assert by_recipe.fits(StudentIdentity("student-v9", "c" * 64, "fp-t2"))
    assert not by_recipe.fits(StudentIdentity("student-v3", "a" * 64, "fp-t1"))
    assert not by_recipe.fits(StudentIdentity("student-v3", "a" * 64, None))


def test_a_students_identity_is_read_from_its_card() -> None:
    reproducible = {"weights_sha256": "d" * 64, "settings_fingerprint": "fp", "num_threads": 2}
    identity = StudentIdentity.from_card("student-v2", {"reproducible": reproducible})
    assert identity == StudentIdentity("student-v2", "d" * 64, "fp-t2")
    assert StudentIdentity.from_card("student-v2", {}) == StudentIdentity("student-v2")


def test_the_committed_router_is_fitted_to_the_default_distillation_recipe() -> None:
    """configs/router.json routes for every student `tierserve distill` publishes with its
    defaults (the same weights on this machine kind): a changed default fails here until
    the router is refitted (`tierserve router train --fitted-to recipe --out ...`)."""
    args = parser().parse_args(["distill"])
    committed = DifficultyModel.load(CONFIGS_DIR / "router.json")
    assert committed.student is not None and committed.student.weights_sha256 is None
    recipe = student_recipe(distill_settings(args).fingerprint(), args.threads)
    assert committed.student.recipe == recipe


def test_scoring_a_prompt_costs_well_under_2_ms(trained) -> None:
    model, _, _ = trained
    text = ("Explain why 12 + 7 = 19, step by step; (a) yes (b) no. Write it down! " * 40)[:2000]
    model.routes_to_small(prompt_features(text, 500, 256))  # warm
    calls = 1000
    start = time.perf_counter()
    for _ in range(calls):
        model.routes_to_small(prompt_features(text, 500, 256))
    assert (time.perf_counter() - start) / calls < 2e-3


def test_score_is_a_probability_even_far_from_the_data(trained) -> None:
    model = replace(trained[0], weights=tuple(1e6 for _ in FEATURE_NAMES))
    far = dict.fromkeys(FEATURE_NAMES, 1e6)
    assert model.score(far) == 1.0
    assert model.score(dict.fromkeys(FEATURE_NAMES, -1e6)) == 0.0


def test_quality_curve_by_hand() -> None:
    scores, small, default = [0.9, 0.1, 0.5], [1.0, 0.0, 0.5], [1.0, 1.0, 1.0]
    # By score: prompt 0 (loses 0), prompt 2 (loses 0.5), prompt 1 (loses 1); total 3.
    curve = quality_curve(scores, small, default, [0.0, 1 / 6, 1 / 3, 0.5, 2 / 3, 1.0])
    assert curve == pytest.approx([1.0, 1.0, 1.0, 2.75 / 3, 2.5 / 3, 1.5 / 3])
    assert random_curve(small, default, [0.0, 0.5, 1.0]) == pytest.approx([1.0, 2.25 / 3, 0.5])


def test_tied_scores_are_worth_random_routing() -> None:
    small, default = [1.0, 0.0, 0.0, 1.0, 0.5], [1.0, 1.0, 0.5, 1.0, 1.0]
    tied = quality_curve([0.3] * 5, small, default, SHARES)
    assert tied == pytest.approx(random_curve(small, default, SHARES))
    assert auc_gain(SHARES, tied, random_curve(small, default, SHARES)) == pytest.approx(0.0)


def test_quality_curves_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="sums to 0"):
        quality_curve([0.1, 0.2], [1.0, 1.0], [0.0, 0.0], [0.5])
    with pytest.raises(ValueError, match="sums to 0"):
        random_curve([], [], [0.5])
    with pytest.raises(ValueError, match="qualities"):
        quality_curve([0.1], [1.0, 1.0], [1.0, 1.0], [0.5])
    with pytest.raises(ValueError, match="share"):
        random_curve([1.0], [1.0], [1.5])


def test_auc_gain_by_hand() -> None:
    assert auc_gain([0.0, 0.5, 1.0], [1.0, 1.0, 0.5], [1.0, 0.75, 0.5]) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="increasing"):
        auc_gain([0.5, 0.0], [1.0, 1.0], [1.0, 1.0])


def test_roc_auc() -> None:
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    assert roc_auc([0.5] * 4, [0, 1, 0, 1]) == 0.5
    assert roc_auc([0.1, 0.4, 0.4, 0.8], [0, 1, 0, 1]) == pytest.approx(3.5 / 4)
    with pytest.raises(ValueError, match="both"):
        roc_auc([0.1, 0.2], [1, 1])
