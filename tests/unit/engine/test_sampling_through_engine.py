"""Sampling through the engine: a seeded request is reproducible whatever shares its
batch, min_tokens holds back EOS, penalties and biases match transformers' generate, and
a penalised seeded request is exact under speculation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList, SequenceBiasLogitsProcessor

from engine.config import SpecDecodeConfig, default_cache_dir
from engine.model.chat import chat_prompt_ids
from engine.model.loader import resolve_model_dir
from engine.sampling_params import SamplingParams
from testing.engine_helpers import drain, greedy, run_one, run_requests
from testing.reference_sampling import OpenAIPenalties

SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)
SEEDED_PENALISED = SamplingParams(
    max_tokens=8,
    temperature=1.0,
    seed=1234,
    min_p=0.05,
    presence_penalty=1.0,
    frequency_penalty=0.5,
    logit_bias=((13, -5.0), (28, 3.0)),
)


@pytest.mark.parametrize("seeded", [SEEDED, SEEDED_PENALISED], ids=["plain", "penalised"])
def test_seeded_request_is_reproducible_whatever_shares_the_batch(engine, tokenizer, seeded):
    prompt = chat_prompt_ids(tokenizer, "Tell me a story about a dragon.")
    alone = run_requests(engine, {"seeded": (prompt, seeded)})["seeded"]

    others = {
        "greedy": (chat_prompt_ids(tokenizer, "What is 2+2?"), greedy(8)),
        "unseeded": (chat_prompt_ids(tokenizer, "Name a colour."), SamplingParams(max_tokens=8)),
        "other-seed": (prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=99)),
    }
    for request_id, (other_prompt, params) in others.items():
        engine.add_request(request_id, other_prompt, params)
    engine.step()  # the seeded request now joins mid-flight, at another batch position
    engine.add_request("seeded", prompt, seeded)
    crowded = drain(engine)

    assert crowded["seeded"].token_ids == alone.token_ids
    assert crowded["other-seed"].token_ids != alone.token_ids  # the seed matters


def test_min_tokens_holds_back_eos(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Reply with one word: yes or no?")
    short = run_requests(engine, {"free": (prompt, greedy(16))})["free"]
    assert short.finish_reason == "stop" and len(short.token_ids) < 6

    held = run_requests(engine, {"held": (prompt, greedy(16, min_tokens=6))})["held"]
    assert tokenizer.eos_token_id not in held.token_ids[:6]
    assert len(held.token_ids) >= 6


# ---- penalties and biases through the engine --------------------------------------

NEAR_TIE = 1e-3
"""fp32 logits of two implementations agree to ~1e-5; a top-2 gap below this may flip."""


def transformers_greedy(prompt: list[int], max_tokens: int, processors: list) -> tuple:
    """transformers' greedy tokens under `processors`, and its processed scores [n, V]."""
    model_dir = resolve_model_dir("default", default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList(processors),
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.scores)


def test_penalties_and_bias_through_the_engine_match_transformers(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "List the days of the week, one per line.")
    bias = {tokenizer.encode(" Monday")[0]: -100.0, tokenizer.encode("Sunday")[0]: 5.0}
    params = greedy(24, presence_penalty=0.6, frequency_penalty=0.9, logit_bias=tuple(bias.items()))
    ours = run_one(engine, prompt, params).token_ids
    theirs, scores = transformers_greedy(
        prompt,
        24,
        [
            SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
            OpenAIPenalties(len(prompt), 0.6, 0.9),
        ],
    )
    plain = run_one(engine, prompt, greedy(24)).token_ids
    assert ours != plain  # the fields changed the answer
    for i, (mine, ref) in enumerate(zip(ours, theirs, strict=False)):
        if mine != ref:  # only a near-tie of transformers' own processed scores may flip
            top2 = scores[i].topk(2)
            assert float(top2.values[0] - top2.values[1]) <= NEAR_TIE
            assert mine in top2.indices.tolist()
            return
    assert ours == theirs


NGRAM = SpecDecodeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


def test_penalised_seeded_request_is_exact_under_speculation(engine, make_engine, tokenizer):
    """Prompt lookup drafts the repeated text; verification applies the penalties with the
    accepted drafts counted, so the seeded text is what the plain engine samples."""
    text = (
        "The harbour town of Elsmere sits at the mouth of the Vell river, and its fleet lands cod."
    )
    prompt = chat_prompt_ids(tokenizer, f"Repeat exactly: {text}")
    params = SamplingParams(
        max_tokens=32,
        temperature=0.3,
        seed=5,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        logit_bias=((tokenizer.encode(" cod")[0], -2.0),),
    )
    plain = run_one(engine, prompt, params).token_ids
    speculating = make_engine(spec_decode=NGRAM)
    speculating.speculator.reset_counters()
    assert run_one(speculating, prompt, params).token_ids == plain
    assert speculating.speculator.num_accepted_tokens > 0  # drafts were accepted, then counted
