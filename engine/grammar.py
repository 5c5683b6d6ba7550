"""Constrained decoding: grammars compiled for the model's tokenizer, a matcher per request.

A request's `GrammarSpec` (JSON schema, any JSON object, regex, a choice of
strings, EBNF) is parsed and compiled once per content (an LRU cache), before
the request is scheduled; the step only asks each constrained request's
matcher for its next-token bitmask and applies it to that row of logits.
Unconstrained rows are never touched.

The library is xgrammar, not llguidance. Measured on the default model's
49,152-token vocabulary (SmolLM2), a three-field JSON schema walked token by
token: xgrammar's next-token mask p50 4 us / p95 13 us against llguidance's
28 us / 116 us; compile 7 ms cold, 0.08 ms cached (llguidance compiles
lazily, 2.6 ms at the matcher's creation).

JSON is compact (no free whitespace): a small model at temperature 1 could
otherwise spend its whole budget on blank lines and never close the object.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import time
from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.sampling_params import GrammarSpec

COMPILED_CACHE_SIZE = 256
"""Distinct grammars kept compiled (a JSON schema's compiled form is tens of KB)."""
_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
"""xgrammar prefixes its errors with a time and a C++ source location."""
MASK_PROBE_ROWS = 16
"""Constrained rows in the probe's step: a full batch of the offline pool's kind."""
MASK_PROBE_STEPS = 9
"""Steps the probe times; their median is kept (start-up is noisy: the engine loads)."""


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def parse(spec: GrammarSpec) -> xgr.Grammar:
    """The grammar of `spec`, without a tokenizer: cheap, so the ingress refuses a bad one
    with a 400 before any engine sees it. ValueError says what is wrong."""
    try:
        return _parse(spec)
    except (RuntimeError, ValueError) as error:
        raise ValueError(_LOCATION.sub("", str(error)).strip().splitlines()[0]) from None


def _parse(spec: GrammarSpec) -> xgr.Grammar:
    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(
            spec.source, any_whitespace=False, strict_mode=spec.strict
        )
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.source)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_choices_ebnf(spec.source))
    return xgr.Grammar.from_ebnf(spec.source)


def json_schema_ebnf(schema: str, rule: str) -> str:
    """EBNF rules of a JSON schema's (compact, strict) grammar, its root named `rule`: a
    piece of a larger EBNF grammar (a tool call's JSON between its tags). ValueError when
    the schema is refused."""
    spec = GrammarSpec("json_schema", schema, strict=True)
    return re.sub(r"^root ::=", f"{rule} ::=", str(parse(spec)), flags=re.MULTILINE)


def _choices_ebnf(source: str) -> str:
    """`root ::= "a" | "b"`: one alternative per string (JSON escapes are EBNF's too)."""
    choices = json.loads(source)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; the same spec compiles once.

    The model's EOS ids are the grammars' stop tokens: a grammar that has
    reached its end allows EOS alone, so the request stops there.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compile = functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._compile)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (ValueError when it cannot be compiled)."""
        grammar = parse(spec)
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as error:
            raise ValueError(_LOCATION.sub("", str(error)).strip()) from None


class GrammarState:
    """One request's place in its grammar: which tokens may come next, advanced by each
    token the request emits."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (int32 bits)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; a token the grammar forbids is a bug upstream."""
        if not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the request's grammar")

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): nothing may follow."""
        return self._matcher.is_terminated()


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """`logits` [N, V] with each constrained row's forbidden tokens at -inf (a copy; the
    input is returned as is when no row is constrained)."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[-1])
    for i in rows:
        states[i].fill_mask(bitmask, i)  # type: ignore[union-attr]
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask, indices=rows)
    return masked


def mask_cost_s(tokenizer: PreTrainedTokenizerBase) -> float:
    """Seconds one constrained row's mask adds to a step on this machine, measured: a step
    of MASK_PROBE_ROWS JSON rows masked as the sampler masks them (fill each row's bitmask,
    copy the logits, apply), the median of MASK_PROBE_STEPS such steps, per row.

    Placement adds it to a constrained request's predicted latency
    (policies/latency.py). It is measured, not fitted from steps, because it is the
    apply over the whole vocabulary that costs (xgrammar's CPU apply: ~0.16 ms a row at
    49,152 tokens, against ~8 us to fill the bitmask, both timed on this 2-core machine
    under load), a per-machine constant that a step fit could not tell apart from the
    per-sequence cost. The probe masks CPU logits, as CPU pools do; a GPU pool applies
    masks on the device, for which this is an upper bound.
    """
    vocab_size = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    compiled = compiler.compile(GrammarSpec("json_object"))
    states = [GrammarState(compiled) for _ in range(MASK_PROBE_ROWS)]
    logits = torch.zeros(MASK_PROBE_ROWS, vocab_size)
    times_s = []
    for _ in range(MASK_PROBE_STEPS):
        start_s = time.perf_counter()
        mask_logits(logits, states)
        times_s.append(time.perf_counter() - start_s)
    return statistics.median(times_s) / MASK_PROBE_ROWS
