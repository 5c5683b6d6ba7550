"""Batch-invariant arithmetic: a token's logits bit for bit the same whatever shares its step.

A seeded request must return the same text whether its prompt was computed
whole, chunked, or read back from the prefix cache, and whatever else runs
beside it. Its tokens' arithmetic therefore may not depend on how many rows a
step holds. Two things made it depend on them on the CPU:

- Matmuls. MKL picks a different kernel (and summation order) for a few rows
  than for many: on this project's machines rows 1-3, 5-7 and 9-11 of a
  matmul differed in the last bits from the same rows in a larger one. In
  MKL's strict reproducibility mode (`MKL_CBWR=AUTO,STRICT`, read at its first
  call) only 1-3 rows differ. oneDNN's packed layers (engine.model.packed_linear,
  the dense layers on a CPU) differ at no row count. Each layer is probed at
  start-up, so another BLAS or CPU is measured, not assumed; a layer whose
  few-row results differ (MKL's, under quantized weights) computes at least
  the first row count that agrees with every larger one, padding a short
  step with zero rows.
- Attention. torch's SDPA blocks its softmax by the query and key lengths;
  the paged-attention kernel computes every query alone, in one fixed order
  over the cache. In invariant mode every query goes through it.

Row-wise operations (norms, activations, rotary embedding, softmax) were
measured invariant as they are.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

BLAS_REPRODUCIBILITY_ENV = {"MKL_CBWR": "AUTO,STRICT"}
"""Set before the process's first matmul (engine.process.configure_process)."""
PADDED_ROW_CHOICES = (1, 2, 4, 8, 12, 16)
"""Row counts a step may be padded up to; the smallest that works is used."""
PROBE_MAX_ROWS = 32
"""Every row count from the choice up to this one must agree with the largest."""


def request_reproducible_blas() -> None:
    """Ask MKL for its strict reproducibility mode (effective before its first call; a
    value already in the environment is kept)."""
    for name, value in BLAS_REPRODUCIBILITY_ENV.items():
        os.environ.setdefault(name, value)


class RowPadded(nn.Module):
    """A linear layer that never computes fewer than `min_rows` rows: a short input is
    padded with zero rows and the padding dropped from the output."""

    def __init__(self, linear: nn.Module, min_rows: int) -> None:
        super().__init__()
        self.linear = linear
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped layer's output for `x` [M, in_features]."""
        num_rows = x.shape[0]
        if num_rows >= self.min_rows:
            return self.linear(x)
        padding = x.new_zeros(self.min_rows - num_rows, x.shape[1])
        return self.linear(torch.cat([x, padding]))[:num_rows]


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> bool:
    """Wrap every linear layer of `model` (computing in `dtype`) in `RowPadded` at the row
    count probed for its kind and shape; False when one has none (results may then vary)."""
    linears = [(name, m) for name, m in model.named_modules() if _is_linear(m)]
    probed: dict[tuple[type, int, int], int | None] = {}
    for name, linear in linears:
        key = (type(linear), linear.in_features, linear.out_features)
        if key not in probed:
            probed[key] = min_invariant_rows(linear, dtype)
        min_rows = probed[key]
        if min_rows is None:
            log.warning("no batch-invariant row count for %s: outputs may vary", name)
            return False
        if min_rows > 1:  # oneDNN's packed layers need none
            model.set_submodule(name, RowPadded(linear, min_rows))
    return True


@torch.inference_mode()
def min_invariant_rows(linear: nn.Module, dtype: torch.dtype) -> int | None:
    """The smallest row count from which `linear`'s rows agree bit for bit with the
    same rows computed among PROBE_MAX_ROWS; None when no choice does."""
    generator = torch.Generator().manual_seed(0)
    in_features = int(linear.in_features)  # type: ignore[arg-type]  # every linear names it
    x = torch.randn(PROBE_MAX_ROWS, in_features, generator=generator).to(dtype)
    reference = linear(x)
    for min_rows in PADDED_ROW_CHOICES:
        if all(
            torch.equal(linear(x[:num_rows]), reference[:num_rows])
            for num_rows in range(min_rows, PROBE_MAX_ROWS)
        ):
            return min_rows
    return None


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear and its drop-in swaps (packed, quantized) all name their features."""
    return hasattr(module, "in_features") and hasattr(module, "out_features")
