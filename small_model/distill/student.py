"""A student's starting point: the teacher with most of its layers taken out.

Keeping the embeddings and the first and last few blocks starts the student
far closer to the teacher than random weights or the first N blocks alone: on
the default model, keeping blocks 0-4 and 27-29 (8 of 30) starts at a KL of
~10 nats per token from the teacher, the first 8 blocks at ~18.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

DEFAULT_KEEP_LAYERS = (0, 1, 2, 3, 4, 27, 28, 29)


def init_student(teacher_dir: Path, keep_layers: Sequence[int]) -> PreTrainedModel:
    """An fp32 transformers model of the teacher's architecture holding only `keep_layers`
    (renumbered in order), its embeddings, final norm and head."""
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    num_layers = teacher.config.num_hidden_layers
    if not keep_layers or sorted(set(keep_layers)) != list(keep_layers):
        raise ValueError(f"keep_layers must be increasing and distinct, got {list(keep_layers)}")
    if keep_layers[-1] >= num_layers:
        raise ValueError(f"the teacher has {num_layers} layers; cannot keep {keep_layers[-1]}")
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep_layers)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    student.load_state_dict(_kept_state(teacher.state_dict(), keep_layers), strict=False)
    student.tie_weights()
    return student


def _kept_state(state: dict[str, torch.Tensor], keep: Sequence[int]) -> dict[str, torch.Tensor]:
    """The teacher's tensors for the kept layers, renamed to the student's layer numbers."""
    kept = {}
    for name, tensor in state.items():
        if ".layers." not in name:
            kept[name] = tensor
            continue
        head, rest = name.split(".layers.", 1)
        index, tail = rest.split(".", 1)
        if int(index) in keep:
            kept[f"{head}.layers.{list(keep).index(int(index))}.{tail}"] = tensor
    return kept
