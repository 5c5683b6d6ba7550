"""A sparse mixture-of-experts feed-forward: top-k routing, experts computed grouped.

Each token goes to its `num_experts_per_tok` best-scored experts. The routed
copies of the tokens are sorted by expert, so each expert runs one matmul (per
projection) over all its tokens at once, as a dense layer would over a batch:
the Python loop is over experts, never over tokens, and an expert no token chose
costs nothing. Each expert is a plain MLP of nn.Linear modules, so packing,
quantization and batch invariance swap them like any other linear layer.

Contributions are summed per token in expert order, whatever else shares the
step: a token's output does not depend on its batch.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.args import MoEArgs
from engine.model.mlp import MLP


class SparseMoE(nn.Module):
    """Router, routed experts and an optional sigmoid-gated shared expert (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, moe: MoEArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward's output [T, hidden] for rows x [T, hidden]."""
        weights, expert_ids = self.route(x)  # [T, k] each
        out = self._experts(x, weights, expert_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared_gate = torch.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            out = out + shared_gate * self.shared_expert(x)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]): softmax over all experts in fp32,
        the top k kept, renormalised to sum to 1 where the model does (then it is a
        softmax over the top k, Mixtral's rule)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, num_experts]
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(x), one call per chosen expert."""
        flat_ids = expert_ids.flatten()  # [T * k]
        order = flat_ids.argsort(stable=True)  # routed copies grouped by expert
        token_rows = order // self.top_k  # [T * k] token of each sorted copy
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        routed = x[token_rows]  # [T * k, hidden]
        outputs = torch.empty_like(routed)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                outputs[start : start + count] = expert(routed[start : start + count])
                start += count
        outputs.mul_(weights.flatten()[order].unsqueeze(1))  # [T * k, hidden]
        return torch.zeros_like(x).index_add_(0, token_rows, outputs)
