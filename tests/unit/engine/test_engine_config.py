"""EngineConfig: `auto` dtype resolution and the validation messages."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig


def test_auto_dtype_is_bf16_on_a_gpu():
    assert EngineConfig(dtype="auto", device="cuda").torch_dtype == torch.bfloat16


def test_auto_dtype_on_cpu_follows_native_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert EngineConfig(dtype="auto").torch_dtype == torch.float32
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert EngineConfig(dtype="auto").torch_dtype == torch.bfloat16


def test_explicit_dtype_wins_and_unknown_names_are_refused():
    assert EngineConfig(dtype="bf16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto'"):
        EngineConfig(dtype="int3")


def test_stall_timeout_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
        EngineConfig(stall_timeout_s=0)


def test_the_prefill_step_limit_is_positive_and_read_in_seconds():
    assert EngineConfig(prefill_step_limit_ms=250).prefill_step_limit_s == 0.25
    assert EngineConfig().prefill_step_limit_s is None
    with pytest.raises(ValueError, match="prefill_step_limit_ms must be > 0"):
        EngineConfig(prefill_step_limit_ms=0)
