"""KV cache formats: the model's dtype, or one-byte codes with a scale per token and head.

A quantized cache row (one token's K or V for one KV head) is `head_dim` one-byte
codes followed by the row's scale in bf16, so a block of the cache stays one run of
whole rows: the torch path gathers it with one `index_select`, as for a float
cache, and the C kernel finds each key's scale right after its codes. A row's
values are code * scale, with scale = max |x| / (largest code) over the row, rounded
to bf16 before the codes are computed with it, so its rounding costs no accuracy.
Two bytes of scale instead of four keep a row of 64 codes at 66 bytes: a bf16 cache
takes 1.94x as many (1.88x against an fp32 scale, under the 1.9x issue 31 asks for).

- `int8`: codes round(x / scale) in [-127, 127], symmetric (-128 unused);
- `fp8_e4m3`: codes are x / scale in float8 e4m3 (torch.float8_e4m3fn). With a
  scale per row the format's range is never used, only its precision, and e4m3
  has a mantissa bit more than e5m2: over the 64 quality prompts (fp32 scales)
  its top-1 agreement with the fp32 cache was 0.967 and its perplexity +0.5%;
  e5m2's 0.924 and +3.5% (int8: 0.982, +0.16%).

The cache tensor's dtype names its format, so the layers need no flag: float
caches hold values, `int8` ones int8 codes, `uint8` ones e4m3 codes.

An `int8` cache holds K and V rotated by a normalized Hadamard transform over each
head (`rotate`). Keys carry a few outlier channels (those RoPE turns slowest), and one
scale per row spends the codes' even steps on them; the rotation spreads every channel
over all of them, so the row's largest value is near its typical one. The transform is
orthogonal and its own inverse, so attention rotates its queries the same way
(q.k = Hq.Hk) and its output back (the weighted sum of rotated values is the rotated
sum). Over the 64 quality prompts (fp32 model, teacher-forced, one run) it took int8's
top-1 agreement with the fp32 cache from 0.984 to 0.993 and its perplexity change from
+0.12% to +0.01%; in bf16 (16 prompts, against the bf16 cache) from 0.974 to 0.983,
its perplexity change +0.04% to +0.3%. In bf16 that is all the figure can show: the
bf16 cache read through torch's attention instead of the C kernel agrees with itself no
better (bench/engine/bench_memory.py's floor: 0.983 against int8's 0.981, 64 prompts).
Rotating the queries and outputs in fp32 instead of bf16 did not move it (0.982).
In torch ops the rotation cost long-context decode a fifth of attention (15 of 72 ms
a step, 16 sequences x 2,000 tokens); the C kernel does it in one call per tensor
(engine/kernels/hadamard.c). e4m3 codes are not rotated: their steps grow with the
value, so an outlier costs the rest little, and rotated they lost (0.970 to 0.967,
+0.2% to +0.6%).
"""

from __future__ import annotations

import torch

from engine.config import KV_CACHE_DTYPES
from engine.kernels import hadamard as hadamard_kernel

SCALE_BYTES = 2
"""The bf16 scale closing every quantized row."""
FP8 = torch.float8_e4m3fn
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
_CODE_MAX = {torch.int8: 127.0, torch.uint8: torch.finfo(FP8).max}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for EngineConfig.kv_cache_dtype (`auto`: the model's)."""
    assert kv_cache_dtype in KV_CACHE_DTYPES, kv_cache_dtype
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def row_bytes(head_dim: int, storage: torch.dtype) -> int:
    """Bytes of one cache row (a token's K or V of one KV head), scale included."""
    if storage in _CODE_MAX:
        return head_dim + SCALE_BYTES
    return head_dim * torch.tensor([], dtype=storage).element_size()


def allocate(
    num_slots: int, num_kv_heads: int, head_dim: int, storage: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An empty cache [num_slots, num_kv_heads, row width] for one layer's K or V."""
    width = head_dim + SCALE_BYTES if storage in _CODE_MAX else head_dim
    return torch.zeros((num_slots, num_kv_heads, width), dtype=storage, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the normalized Hadamard matrix over blocks of the last dimension (the
    largest power of two dividing D: all of it for the usual 64 or 128), which is its own
    inverse. A fast Walsh-Hadamard transform in fp32: adds and subtracts within each row,
    so a row's result never depends on the other rows of its step (batch invariance); in
    the C kernel on the CPU (engine/kernels/hadamard.c), bit for bit `rotate_reference`.
    A matmul by the matrix is not invariant: its rows changed with the batch on the AVX2
    kernels."""
    if hadamard_kernel.takes(x):
        return hadamard_kernel.hadamard(x, _hadamard_block(x.shape[-1]))
    return rotate_reference(x)


def rotate_reference(x: torch.Tensor) -> torch.Tensor:
    """`rotate` in torch ops: one butterfly stage per doubling of the pair distance."""
    head_dim = x.shape[-1]
    block = _hadamard_block(head_dim)
    y = x.float().reshape(-1, head_dim // block, block)
    half = 1
    while half < block:
        pairs = y.reshape(*y.shape[:2], block // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((low + high, low - high), dim=-2)
        half *= 2
    return (y * block**-0.5).reshape(x.shape).to(x.dtype)


def _hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing the head dimension."""
    return head_dim & -head_dim


def is_rotated(cache: torch.Tensor) -> bool:
    """Whether `cache` holds K and V rotated (`rotate`): an int8 one."""
    return cache.dtype == torch.int8


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether `cache` holds codes and scales rather than values."""
    return cache.dtype in _CODE_MAX


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [T, KVH, D] at `slots`, quantized first where the cache is."""
    cache[slots] = quantize(x, cache.dtype) if is_quantized(cache) else x


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows [..., D + 2] of codes and bf16 scale for values x [..., D].

    Each row on its own, elementwise after an exact max, so a token's codes are the
    same whatever else its step computes (batch invariance holds on this cache)."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = (amax / _CODE_MAX[storage]).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale.to(torch.bfloat16)  # [..., 1]
    scaled = x32 / scale.float()
    if storage == torch.int8:
        codes = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-_CODE_MAX[storage], _CODE_MAX[storage]).to(FP8).view(storage)
    return torch.cat([codes, scale.view(storage)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., D] in `dtype` of rows [..., D + 2]; a float cache's rows as they are."""
    if not is_quantized(rows):
        return rows
    codes = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16)  # [..., 1]
    values = codes.float() if rows.dtype == torch.int8 else codes.view(FP8).float()
    return (values * scale.float()).to(dtype)
