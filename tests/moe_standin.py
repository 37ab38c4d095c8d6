"""A minimal stand-in of the MoE layer's contract (docs/briefs: GroupedExperts, MoELayer) until
the real one is merged: a softmax top-k router, experts looped, rows sorted by expert id."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GroupedExperts(nn.Module):
    def __init__(self, num_experts, dim, hidden_dim):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)

    def forward(self, x_sorted, counts):
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):
            x = x_sorted[start : start + c]
            outs.append((F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T)
            start += c
        return torch.cat(outs) if outs else x_sorted


class MoELayer(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, top_k):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, idx = self.router(x).softmax(-1).topk(self.top_k, -1)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        y = self.experts(x[order // self.top_k], counts)
        out = torch.zeros_like(y).index_copy(0, order, y)
        out = (out.view(-1, self.top_k, shape[-1]) * gates.unsqueeze(-1)).sum(1)
        return out.view(shape)
