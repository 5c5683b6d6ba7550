"""A student's model card: what it is, what it costs, how fast and how close to its teacher.

Written into the student's folder (`model_card.json`, and a README.md for people)
before the folder is published, so a student never exists without its card.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.chat import chat_prompt_ids
from engine.sampling_params import SamplingParams

SPEED_PROMPT = "Tell me a short story about a lighthouse keeper."
SPEED_TOKENS = 48


def decode_tokens_per_s(model: str, cache_dir: Path, repeats: int = 2) -> float:
    """Batch-1 decode speed of our engine on `model`: tokens after the first, per second,
    best of `repeats` (the machine is shared; the best run is the least disturbed)."""
    engine = LLMEngine(EngineConfig(model=model, cache_dir=cache_dir, num_kv_blocks=64))
    prompt = chat_prompt_ids(engine.tokenizer, SPEED_PROMPT)
    params = SamplingParams(max_tokens=SPEED_TOKENS, temperature=0.0, ignore_eos=True)
    best = 0.0
    for attempt in range(repeats):
        engine.add_request(f"speed-{attempt}", prompt, params)
        engine.step()  # prefill and first token: not decode
        started, num_tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        best = max(best, num_tokens / (time.perf_counter() - started))
    return best


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every tensor's name and bytes: two runs published the same student exactly
    when their digests match."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_card(folder: Path, card: dict[str, Any]) -> None:
    """`model_card.json` and a README.md that says the same in words."""
    (folder / "model_card.json").write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(_readme(card))


def _readme(card: dict[str, Any]) -> str:
    speed = card["speed"]
    quality = card["quality"]
    return "\n".join(
        [
            f"# {card['name']}: a student distilled from {card['teacher']}",
            "",
            f"- Layers: {card['num_layers']} of the teacher's {card['teacher_num_layers']} "
            f"(teacher blocks {card['kept_layers']}), embeddings and head shared with it.",
            f"- Parameters: {card['num_parameters']:,}; bytes on disk: {card['bytes']:,}.",
            f"- Batch-1 decode: {speed['student_tokens_per_s']:.1f} tok/s against the "
            f"teacher's {speed['teacher_tokens_per_s']:.1f} "
            f"({speed['ratio_vs_teacher']:.2f}x), same machine, same run.",
            f"- Held-out answers: top-1 agreement with the teacher "
            f"{quality['before']['top1_agreement']:.3f} before training, "
            f"{quality['after']['top1_agreement']:.3f} after; distillation loss "
            f"{quality['before']['kd_loss']:.3f} -> {quality['after']['kd_loss']:.3f}.",
            f"- Trained {card['training']['steps']} steps on "
            f"{card['training']['num_tokens']:,} tokens in "
            f"{card['training']['minutes']:.1f} min; whole distillation "
            f"{card['distill_minutes']:.1f} min.",
            f"- Reproducible: bounded by steps, seed {card['reproducible']['seed']}, "
            f"{card['reproducible']['num_threads']} threads; weights SHA-256 "
            f"{card['reproducible']['weights_sha256']}: the same command on a machine of this "
            "kind publishes these very weights.",
            "",
        ]
    )
