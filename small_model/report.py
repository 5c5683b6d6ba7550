"""How well a difficulty router trades quality for traffic moved, RouteLLM-style.

On labelled prompts (small_model/labels.py): for each share of traffic sent to
the small model, the quality kept when the router picks which prompts go
(those it scores most likely to be fine) against sending the same share at
random; the area between the two curves; the router's own threshold and the
share it moves. Written as JSON and, where matplotlib is installed, a PNG.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from policies.difficulty import DifficultyModel
from small_model.labels import Labelled
from small_model.router_fit import auc_gain, quality_curve, random_curve, roc_auc

SHARES = tuple(i / 10 for i in range(11))
HALF = 5
"""Index of the 50% share in SHARES."""


@dataclass(frozen=True)
class RouteReport:
    """Quality kept against share moved, for the router and for random routing."""

    num_prompts: int
    shares: tuple[float, ...]
    router: list[float]
    random: list[float]
    auc_gain: float
    """Area between the router's curve and random's: how much choosing beats chance."""
    roc_auc: float | None
    """Of the router's scores against whether the small model kept all the quality."""
    threshold: float
    share_at_threshold: float
    """The share of these prompts the router's own threshold sends to the small model."""
    quality_kept_at_threshold: float

    @property
    def router_at_half(self) -> float:
        """Quality kept with half the traffic moved by the router."""
        return self.router[HALF]

    @property
    def random_at_half(self) -> float:
        """The same with half moved at random."""
        return self.random[HALF]

    def save(self, path: Path) -> None:
        """The report as JSON (and the curve as a PNG beside it, when it can be drawn)."""
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        plot(self, path.with_suffix(".png"))


def route_report(model: DifficultyModel, labelled: Sequence[Labelled]) -> RouteReport:
    """The router's curve on `labelled` prompts, with random routing's for comparison."""
    scores = [model.score(item.features) for item in labelled]
    small = [item.quality_small for item in labelled]
    default = [item.quality_default for item in labelled]
    router = quality_curve(scores, small, default, SHARES)
    randomly = random_curve(small, default, SHARES)
    moved = [score >= model.threshold for score in scores]
    share = sum(moved) / len(moved)
    chosen = [s if m else d for s, d, m in zip(small, default, moved, strict=True)]
    kept_all = [item.label >= 1.0 for item in labelled]
    return RouteReport(
        num_prompts=len(labelled),
        shares=SHARES,
        router=router,
        random=randomly,
        auc_gain=auc_gain(SHARES, router, randomly),
        roc_auc=roc_auc(scores, kept_all) if 0 < sum(kept_all) < len(kept_all) else None,
        threshold=model.threshold,
        share_at_threshold=share,
        quality_kept_at_threshold=sum(chosen) / max(sum(default), 1e-9),
    )


def plot(report: RouteReport, path: Path) -> None:
    """Quality kept against share moved, router and random, with the router's operating
    point; skipped (with a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}")
        return
    figure, axes = plt.subplots(figsize=(5, 4))
    axes.plot(report.shares, report.router, marker="o", label="difficulty router")
    axes.plot(report.shares, report.random, linestyle="--", label="random")
    axes.scatter(
        [report.share_at_threshold], [report.quality_kept_at_threshold],
        color="black", zorder=3, label="router threshold",
    )  # fmt: skip
    axes.set_xlabel("share of traffic sent to the small model")
    axes.set_ylabel("quality kept (vs default model on all)")
    axes.set_title(f"{report.num_prompts} prompts; AUC gain {report.auc_gain:.3f}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
