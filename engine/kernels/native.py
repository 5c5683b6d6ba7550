"""C kernels built on first use: compiled once per source, flags and machine into the cache
directory, loaded through ctypes (which releases the GIL during a call).

No build step at install and no torch headers. Where no compiler is found, or the
build fails (a CPU without the instructions a kernel needs), `load` returns None and
the caller keeps to its torch path, which is also the reference its tests use.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Collection
from pathlib import Path

import torch

from engine.config import default_cache_dir

log = logging.getLogger(__name__)

OPENMP = "-fopenmp"
"""Compile flag of a kernel that splits its work with `omp parallel` (linked into every
kernel). It links libgomp.so.1, and the loader resolves that name to the copy torch has
loaded already, so the kernel runs on torch's own intra-op threads. A Python thread pool
of our own ran beside torch's threads, which keep spinning for a while after each matmul:
on two cores, two-thread attention ran no faster than one."""
LINK_FLAGS = ("-shared", "-lm", OPENMP)
"""Linked in a separate step without -ffast-math: linking with it would add crtfastmath,
whose constructor switches the whole process to flush-denormals-to-zero."""

PARALLEL_MIN_ROWS = 32
"""Rows from which a row-wise kernel (norms, SwiGLU, argmax) splits them over torch's
threads: at a 16-sequence decode each call is a few microseconds, less than waking
another thread costs; at 64 rows (the offline pool's batch) it is tens."""

Signature = tuple[list[type], type]
"""A C function's ctypes argument types and return type."""


def load(
    source: Path, compile_flags: tuple[str, ...], signatures: dict[str, Signature]
) -> ctypes.CDLL | None:
    """The library built from `source` with its entry points typed; None where it cannot be
    built here (the reason is logged once)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found: %s stays on its torch path", source.stem)
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, source, compile_flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("%s kernel unavailable (%s): using the torch path", source.stem, exc)
        return None
    for name, (argtypes, restype) in signatures.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = restype
    return library


def takes(dtypes: Collection[torch.dtype], *tensors: torch.Tensor) -> bool:
    """A kernel may take these tensors: all on the CPU, of one dtype among `dtypes`, and
    none with a gradient to track (a ctypes call is invisible to autograd).

    Asked a few hundred times a decode step, so written as plain loops: generator
    expressions made it a third of a fused norm's time."""
    dtype = tensors[0].dtype
    if dtype not in dtypes:
        return False
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_cpu:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def row_threads(rows: int) -> int:
    """torch's intra-op threads for a row-wise kernel over `rows` rows; 1 for few rows."""
    return torch.get_num_threads() if rows >= PARALLEL_MIN_ROWS else 1


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's feature flags where Linux lists them, so a
    cache shared between machines never hands an AVX-512 build to an AVX2-only CPU."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return platform.machine() + flags


def _build(compiler: str, source: Path, compile_flags: tuple[str, ...]) -> Path:
    """Compile once per source (with the headers beside it), flags and machine; later
    processes load the cached library."""
    flags = " ".join(compile_flags + LINK_FLAGS)
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = source.read_bytes() + headers + flags.encode() + _cpu_identity().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"{source.stem}-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        obj = partial.with_suffix(".o")
        for command in (
            [compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
            [compiler, str(obj), "-o", str(partial), *LINK_FLAGS],
        ):
            subprocess.run(command, check=True, capture_output=True)
        obj.unlink()
        partial.rename(target)
    return target
