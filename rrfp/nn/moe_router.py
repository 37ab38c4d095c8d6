"""The token-choice top-k router of a mixture-of-experts layer.

Each token scores every expert with one linear map (``gate``, split-aware like every linear in
rrfp: its weight gradient can wait for W) followed by a softmax (Qwen3-MoE, Mixtral) or a sigmoid
(DeepSeek-V3), and goes to the ``top_k`` best. Its gates are those scores, renormalised over the
chosen experts when ``norm_topk`` (the sigmoid's always are, as DeepSeek-V3's).

With ``bias_update_rate`` > 0 the router keeps DeepSeek-V3's per-expert ``expert_bias`` (auxiliary-
loss-free load balancing, arXiv 2408.15664 and the DeepSeek-V3 report, section 2.1.2): it is added
to the scores to choose the experts only, never to the gates, and it moves after each optimizer
step against the load the experts saw (``MoELayer.update_bias``). It is a persistent buffer, so it
is saved and resumed with the model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from rrfp.nn.split_linear import SplitLinear

SCORE_FUNCS = ("softmax", "sigmoid")


class TopKRouter(nn.Module):
    """Scores ``dim``-wide tokens over ``num_experts`` experts and picks ``top_k`` of them."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk: bool = True,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {bias_update_rate}")
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.norm_topk = norm_topk or score_func == "sigmoid"
        self.bias_update_rate = bias_update_rate
        self.gate = SplitLinear(dim, num_experts, bias=False)
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [T, dim] -> (gates [T, top_k] in x's dtype, expert ids [T, top_k], and each
        token's probabilities over all experts [T, E] for the auxiliary loss: the softmax, or the
        sigmoid scores normalised to sum to one)."""
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choose = scores.detach()
        if self.bias_update_rate > 0:
            choose = choose + self.expert_bias.to(choose.dtype)
        ids = choose.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, ids)
        if self.norm_topk:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return gates.to(x.dtype), ids, probs

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
            f"norm_topk={self.norm_topk}, bias_update_rate={self.bias_update_rate}"
        )
