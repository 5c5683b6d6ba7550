"""Batch-invariant arithmetic: a token's logits bit for bit the same whatever shares its step.

A seeded request must return the same text whether its prompt was computed
whole, chunked, or read back from the prefix cache, whatever else runs beside
it, and whatever speculation guessed (a verification step computes 1 + k rows
where a plain decode computes one). Its tokens' arithmetic therefore may not
depend on how many rows a step holds, nor on where in the step a row lies.
Two things made it depend on them on the CPU:

- Matmuls. A BLAS picks its kernel, and so a row's summation order, by the
  shape of the call. MKL's few-row kernels differed from its many-row ones
  (rows 1-3, 5-7 and 9-11 on this project's machines; 1-3 in its strict
  reproducibility mode, `MKL_CBWR=AUTO,STRICT`). Where and whether oneDNN's
  packed layers (engine.model.packed_linear) switch kernels depends on the CPU
  and the dtype: in bf16 on AVX-512 BF16 CPUs speculation and busy batches
  changed greedy output while a probe that stopped at 32 rows saw no
  difference, so the probe now covers every row count a step can hold
  (`probe_row_counts`). Nothing is assumed: each layer shape is probed at
  start-up, at the process's thread count, and computed only at row counts
  that agree. Short calls are padded with zero rows up to the first count that
  agrees with every larger one (`RowBounds.min_rows`); where a kernel switch
  lies above that, long calls are cut into blocks no longer than the largest
  count that still agrees (`RowBounds.max_rows`), so every call a layer makes
  sees one kernel.
- Attention. torch's SDPA blocks its softmax by the query and key lengths;
  the paged-attention kernel computes every query alone, in one fixed order
  over the cache. In invariant mode every query goes through it.

Row-wise operations (norms, activations, rotary embedding, softmax) were
measured invariant as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

BLAS_REPRODUCIBILITY_ENV = {"MKL_CBWR": "AUTO,STRICT"}
"""Set before the process's first matmul (engine.process.configure_process)."""
PADDED_ROW_CHOICES = (1, 2, 4, 8, 12, 16, 32, 64)
"""Row counts a short call may be padded up to (see `_cost_rank` for the choice)."""
CHEAP_PADDING_ROWS = 16
"""Padding a decode up to this many rows costs little: its step reads the weights anyway."""
MIN_CHEAP_BLOCK_ROWS = 32
"""Blocks of at least this many rows keep a long prefill near a GEMM's full speed."""
EVERY_COUNT_UP_TO = 33
"""Every row count up to this one is probed: where few-row kernels differ."""
SHIFT_ROWS = 3
"""A row is also computed this many places further into a call: its place must not matter."""
PROBE_MACS = 2**32
"""Multiply-adds one probed call may cost. A layer too wide to probe up to the step's row
count within it (the 49k-wide output head) is probed to a smaller power of two and
computes longer inputs in blocks of that many rows: a few seconds of start-up per layer
shape instead of a minute (fp32 here: 10 s for the head at 512 rows, 2.9 s at 128)."""
MIN_PROBED_ROWS = 64
"""However wide the layer, row counts up to this one are probed."""


@dataclass(frozen=True)
class RowBounds:
    """The row counts a layer computes at: every call has at least `min_rows` rows (padded
    with zeros) and at most `max_rows` (longer inputs cut into blocks; None: no limit)."""

    min_rows: int
    max_rows: int | None


def request_reproducible_blas() -> None:
    """Ask MKL for its strict reproducibility mode (effective before its first call; a
    value already in the environment is kept)."""
    for name, value in BLAS_REPRODUCIBILITY_ENV.items():
        os.environ.setdefault(name, value)


class RowBounded(nn.Module):
    """A linear layer that only ever computes between `bounds.min_rows` and
    `bounds.max_rows` rows in one call: a short input is padded with zero rows (dropped
    from the output), a long one computed in blocks."""

    def __init__(self, linear: nn.Module, bounds: RowBounds) -> None:
        super().__init__()
        self.linear = linear
        self.bounds = bounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped layer's output for `x` [M, in_features]."""
        max_rows = self.bounds.max_rows
        if max_rows is None or x.shape[0] <= max_rows:
            return self._padded(x)
        return torch.cat([self._padded(block) for block in x.split(max_rows)])

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if num_rows >= self.bounds.min_rows:
            return self.linear(x)
        padding = x.new_zeros(self.bounds.min_rows - num_rows, x.shape[1])
        return self.linear(torch.cat([x, padding]))[:num_rows]

    def extra_repr(self) -> str:
        """The bounds, for printing the model."""
        return f"min_rows={self.bounds.min_rows}, max_rows={self.bounds.max_rows}"


def make_batch_invariant(model: nn.Module, dtype: torch.dtype, max_rows: int) -> bool:
    """Wrap every linear layer of `model` (computing in `dtype`, called on at most
    `max_rows` rows) in `RowBounded` at the bounds probed for its kind and shape; False
    when one has none (results may then vary)."""
    linears = [(name, m) for name, m in model.named_modules() if _is_linear(m)]
    probed: dict[tuple[type, int, int], RowBounds | None] = {}
    for name, linear in linears:
        key = (type(linear), linear.in_features, linear.out_features)
        if key not in probed:
            probed[key] = invariant_row_bounds(linear, dtype, max_rows)
            log.info("batch-invariant rows of %s %s: %s", *key[1:], probed[key])
        bounds = probed[key]
        if bounds is None:
            log.warning("no batch-invariant row count for %s: outputs may vary", name)
            return False
        if bounds != RowBounds(1, None):  # a layer that agrees everywhere runs as it is
            model.set_submodule(name, RowBounded(linear, bounds))
    return True


def probe_row_counts(max_rows: int) -> list[int]:
    """The row counts probed for calls of up to `max_rows` rows: every count up to
    EVERY_COUNT_UP_TO, then each power of two and its neighbours (where BLAS kernels
    switch blocking), and `max_rows` itself."""
    counts = set(range(1, min(EVERY_COUNT_UP_TO, max_rows) + 1)) | {max_rows}
    power = 64
    while power <= 2 * max_rows:
        counts |= {power - 1, power, power + 1, power * 3 // 4}
        power *= 2
    return sorted(c for c in counts if c <= max_rows)


@torch.inference_mode()
def invariant_row_bounds(linear: nn.Module, dtype: torch.dtype, max_rows: int) -> RowBounds | None:
    """The cheapest bounds under which every row of `linear` comes out bit for bit the same
    whatever the call holds (ranked by `_cost_rank`); None when no choice agrees."""
    probed_rows = _probed_rows(linear, max_rows)
    generator = torch.Generator().manual_seed(0)
    in_features = int(linear.in_features)  # type: ignore[arg-type]  # every linear names it
    x = torch.randn(probed_rows + SHIFT_ROWS, in_features, generator=generator).to(dtype)
    outputs = {count: linear(x[:count]) for count in probe_row_counts(probed_rows)}
    candidates: list[RowBounds] = []
    for min_rows in (m for m in PADDED_ROW_CHOICES if m <= probed_rows):
        top = _largest_agreeing(linear, x, outputs, min_rows)
        if top is not None:
            candidates.append(RowBounds(min_rows, None if top == probed_rows else top))
        if top == probed_rows and min_rows <= CHEAP_PADDING_ROWS:
            break  # no later choice ranks better
    if not candidates:
        return None
    best = min(candidates, key=_cost_rank)
    if best.max_rows is None and probed_rows < max_rows:  # agreed as far as probed
        return RowBounds(best.min_rows, probed_rows)
    return best


def _cost_rank(bounds: RowBounds) -> tuple:
    """Orders bounds by what they cost a step: heavy padding (every decode pays it) worst,
    then small blocks (a long prefill pays them), then any blocks, then padding."""
    blocks = bounds.max_rows
    return (
        bounds.min_rows > CHEAP_PADDING_ROWS,
        blocks is not None and blocks < MIN_CHEAP_BLOCK_ROWS,
        blocks is not None,
        bounds.min_rows,
        -(blocks or 0),
    )


def _probed_rows(linear: nn.Module, max_rows: int) -> int:
    """The largest row count probed: `max_rows`, or for a layer too wide to probe there
    within PROBE_MACS, a power of two (at least MIN_PROBED_ROWS) that is."""
    macs_per_row = int(linear.in_features) * int(linear.out_features)  # type: ignore[arg-type]
    rows = MIN_PROBED_ROWS
    while rows * 2 * macs_per_row <= PROBE_MACS:
        rows *= 2
    return min(max_rows, rows)


def _largest_agreeing(
    linear: nn.Module, x: torch.Tensor, outputs: dict[int, torch.Tensor], min_rows: int
) -> int | None:
    """The largest probed count `top` >= min_rows such that every probed call of
    min_rows..top rows agrees with the call of `top` rows, row by row, and a row's result
    does not depend on its place in the call; None if there is none."""
    counts = [count for count in outputs if count >= min_rows]
    for top in reversed(counts):
        reference = outputs[top]
        if (
            all(torch.equal(outputs[c], reference[:c]) for c in counts if c <= top)
            and _place_free(linear, x, reference)
            and _rows_agree_alone(linear, x, reference, min_rows)
        ):
            return top
    return None


def _place_free(linear: nn.Module, x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Rows of `reference` (the first len(reference) rows of x) come out the same computed
    SHIFT_ROWS places earlier in a call of the same size."""
    num_rows = reference.shape[0]
    if num_rows <= SHIFT_ROWS:
        return True
    shifted = linear(x[SHIFT_ROWS : SHIFT_ROWS + num_rows])
    return torch.equal(shifted[: num_rows - SHIFT_ROWS], reference[SHIFT_ROWS:])


def _rows_agree_alone(
    linear: nn.Module, x: torch.Tensor, reference: torch.Tensor, min_rows: int
) -> bool:
    """Rows of `reference` come out the same computed alone (padded with zero rows to
    `min_rows`), as a decode computes them: the rows a probed count ends on, and every row
    below EVERY_COUNT_UP_TO. Calls of several rows can agree with each other row by row and
    place by place and still not with a row alone (on AVX2 CPUs the MLP's down projection,
    1536 in and 576 out, computed a single row otherwise than inside a call of more, and a
    busy batch changed a seeded request's bf16 tokens: its bounds are now 2 rows and up)."""
    num_rows = reference.shape[0]
    padding = x.new_zeros(min_rows - 1, x.shape[1])
    for row in sorted({count - 1 for count in probe_row_counts(num_rows)}):
        alone = linear(torch.cat([x[row : row + 1], padding]))[:1]
        if not torch.equal(alone, reference[row : row + 1]):
            return False
    return True


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear and its drop-in swaps (packed, quantized) all name their features."""
    return hasattr(module, "in_features") and hasattr(module, "out_features")
