"""A dropless token-choice mixture-of-experts layer (Qwen3-MoE, DeepSeek-V3 shaped).

Forward: the router picks ``top_k`` experts per token; the token copies are sorted by expert id
and go, with the count per expert, through ``self.experts`` (``GroupedExperts``, or expert
parallelism's stand-in with the same ``forward(x_sorted, counts)``: the only place expert compute
happens); the results are un-sorted, weighted by the gates and summed over each token's experts,
plus the shared experts' SwiGLU when there are any. Every copy is computed (dropless), so no token
is dropped.

Load balancing, either or both:

- the auxiliary loss (``aux_loss_coeff`` > 0), Switch Transformer's (Fedus et al. 2021, eq. 4) in
  Megatron-LM's top-k form: ``E / (k T^2) * sum_e count_e * sum_t p_t,e`` over a microbatch's T
  tokens, 1 when balanced. Its gradient reaches the router where the layer runs
  (rrfp/nn/moe_aux_loss.py), so under the pipeline every stage's routers learn from it;
- DeepSeek-V3's loss-free bias (``bias_update_rate`` > 0): after each optimizer step,
  ``update_bias`` moves ``router.expert_bias`` by ``rate * sign(mean load - load)``, the load
  being the tokens each expert got over the step's microbatches, summed over the data-parallel
  replicas by the caller so that every replica moves alike.

The layer keeps the step's router statistics (tokens per expert, the weighted auxiliary loss,
microbatches seen, and each forward's tokens per expert for a routing record) in non-persistent
buffers, counted in training forwards only (not in evaluation, nor in an activation-checkpointing
recomputation inside backward); ``take_step`` reads and clears them.

On the meta device (the start checks measure a stage there) nothing routes: the layer computes
as if every expert got the same number of copies, the footprint of balanced routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp.nn.grouped_experts import GroupedExperts
from rrfp.nn.moe_aux_loss import inject
from rrfp.nn.moe_router import TopKRouter
from rrfp.nn.split_linear import SplitLinear


class SharedExperts(nn.Module):
    """The experts every token goes through: one SwiGLU MLP (DeepSeek-V3's shared experts)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = SplitLinear(dim, hidden_dim, bias=False)
        self.up_proj = SplitLinear(dim, hidden_dim, bias=False)
        self.down_proj = SplitLinear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class RouterStep:
    """One layer's router statistics over a step's training microbatches."""

    tokens_per_expert: torch.Tensor  # [E] int64: token copies each expert received
    aux_loss: float  # the weighted auxiliary loss, summed over the microbatches
    microbatches: int
    dropped: int  # copies routed but not computed: 0, the layer is dropless
    # [E] int64 per training forward, in the order they ran, with ``record_counts``: one per
    # microbatch this layer saw (empty otherwise)
    per_forward: list[torch.Tensor] = field(default_factory=list)


class MoELayer(nn.Module):
    """Routed experts (and optional shared experts) over ``dim``-wide tokens."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk: bool = True,
        shared_hidden_dim: int = 0,
        aux_loss_coeff: float = 0.0,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {aux_loss_coeff}")
        if shared_hidden_dim < 0:
            raise ValueError(f"shared_hidden_dim must be >= 0, got {shared_hidden_dim}")
        self.num_experts, self.top_k, self.aux_loss_coeff = num_experts, top_k, aux_loss_coeff
        self.router = TopKRouter(dim, num_experts, top_k, score_func, norm_topk, bias_update_rate)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)
        self.shared_experts = SharedExperts(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.register_buffer(
            "step_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.register_buffer("step_aux", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer(
            "step_microbatches", torch.zeros((), dtype=torch.int64), persistent=False
        )
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        # a routing record (output.routing) sets it: then the step's counts, a tensor per forward
        self.record_counts = False
        self.step_counts: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        tokens, k = h.shape[0], self.top_k
        gates, ids, probs = self.router(h)
        flat = ids.reshape(-1)
        if h.is_meta:  # shapes only (the start checks' measurement): as if perfectly balanced
            counts = balanced_counts(tokens * k, self.num_experts)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts)
        order = flat.argsort(stable=True)  # copy slots sorted by expert
        y_sorted = self.experts(h[order // k], counts)
        y = y_sorted[order.argsort()].view(tokens, k, -1)  # back to (token, choice) order
        out = (y * gates.unsqueeze(-1)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        training = torch.is_grad_enabled()
        # an activation-checkpointing recomputation runs inside backward: the same graph, not
        # counted twice
        counting = training and not h.is_meta and torch._C._current_graph_task_id() == -1
        if self.aux_loss_coeff > 0 and training:
            balance = (counts.to(probs.device, probs.dtype) * probs.sum(dim=0)).sum()
            aux = balance * (self.aux_loss_coeff * self.num_experts / (k * tokens * tokens))
            out = inject(out, aux)
            if counting:
                self.step_aux += aux.detach().to(self.step_aux.dtype)
        if counting:
            self.step_tokens += counts.detach()
            if self.record_counts:
                self.step_counts.append(counts.detach())
            self.step_dropped += tokens * k - counts.sum()
            self.step_microbatches += 1
        return out.view(shape)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The expert bias and the step's statistics at zero (a model built on the meta device and
        given storage with ``to_empty`` has them uninitialised)."""
        for buf in (self.step_tokens, self.step_aux, self.step_microbatches, self.step_dropped):
            buf.zero_()
        self.step_counts = []
        if self.router.bias_update_rate > 0:
            self.router.expert_bias.zero_()

    def take_step(self) -> RouterStep:
        """The step's router statistics, cleared for the next step."""
        step = RouterStep(
            self.step_tokens.clone(),
            float(self.step_aux),
            int(self.step_microbatches),
            int(self.step_dropped),
            self.step_counts,
        )
        self.step_counts = []
        for buf in (self.step_tokens, self.step_aux, self.step_microbatches, self.step_dropped):
            buf.zero_()
        return step

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's bias update from ``load`` [E], the step's tokens per expert summed over
        the data-parallel replicas: ``bias += rate * sign(mean load - load)``."""
        router = self.router
        if router.bias_update_rate <= 0:
            return
        load = load.to(torch.float64)
        step = torch.sign(load.mean() - load) * router.bias_update_rate
        router.expert_bias += step.to(router.expert_bias.dtype)


def balanced_counts(copies: int, num_experts: int) -> torch.Tensor:
    """``copies`` token copies spread as evenly as can be over ``num_experts`` (a CPU tensor)."""
    even, rest = divmod(copies, num_experts)
    return torch.tensor(
        [even + (e < rest) for e in range(num_experts)], dtype=torch.int64, device="cpu"
    )


def moe_layers(modules) -> list[MoELayer]:
    """Every MoELayer in ``modules`` (an nn.Module or a list of them), in module order."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    return [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
