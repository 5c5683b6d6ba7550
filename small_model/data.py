"""The committed prompt sets the small model is made from (written by small_model.prompts)."""

from bench.paths import DATA_DIR

ROUTE_DIR = DATA_DIR / "route"
LABELLED_SET = ROUTE_DIR / "labelled.jsonl"
"""Prompts with the teacher's and the student's answers checked: the router's training data."""
DISTILL_SET = ROUTE_DIR / "distill.jsonl"
"""Prompts the student is distilled on."""
