"""Process-wide settings, applied once by whoever owns the process (pool replica, CLI, bench).

An engine never changes them itself: two engines in one process (a test, a
benchmark comparing configs) must not fight over torch's global thread pool.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model.batch_invariance import request_reproducible_blas


def configure_process(config: EngineConfig) -> None:
    """Set torch's intra-op thread count from `config.num_threads` (None leaves torch's own)
    and, for a batch-invariant engine, the BLAS's reproducible mode (before any matmul)."""
    if config.batch_invariant:
        request_reproducible_blas()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
