"""B/W split for any module, with torch.autograd on the stage's own graph.

B asks autograd for the stage input's gradient only, keeping the graph. On the
way it captures the gradient arriving at every *capture point*: a node that B
runs (it lies on a path to the input) with an edge into a part of the graph
that leads only to parameters. W later starts autograd at each capture point
with its captured gradient and asks for that point's parameters only, so the
work B skipped is done once, in W, and nothing B did is repeated.

On the first stage nothing leads to an input, so B does nothing and W is the
whole backward. A parameter reached from two capture points (a weight used
twice) would be counted twice this way: such parameters get their gradient in
B, and the module that owns them is logged once. Parameters of split-aware
layers (``defers_weight_grad``) are left to their own W queue.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

log = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass
class WeightPlan:
    """Where W starts, for one microbatch: capture nodes, their parameters and captured gradients."""

    points: dict = field(default_factory=dict)  # node -> list of parameters it alone leads to
    captured: dict = field(default_factory=dict)  # node -> {output number: incoming gradient}, filled in B
    in_b: list = field(default_factory=list)  # parameters whose gradient B computes (not splittable)


def queued_parameters(module: nn.Module) -> frozenset[int]:
    """Ids of the parameters whose split-aware layers queue their own W (computed once per stage)."""
    return frozenset(id(p) for m in module.modules() if getattr(m, "defers_weight_grad", False)
                     for p in m.parameters(recurse=False))


def plan(module: nn.Module, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
         deferred: frozenset[int] = frozenset()) -> WeightPlan:
    """Analyse one microbatch's graph once its forward is done. ``deferred``: parameters
    left to their layer's own W queue (``queued_parameters``)."""
    params = {get_gradient_edge(p).node: p for p in module.parameters() if p.requires_grad}
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    reaches_input: dict = {}
    below: dict = {}  # node -> parameters reachable from it

    def visit(node) -> None:  # iterative post-order: graphs can be deeper than the recursion limit
        stack = [(node, False)]
        while stack:
            n, done = stack.pop()
            if n in reaches_input:
                continue
            children = [c for c, _ in n.next_functions if c is not None]
            if not done:
                stack.append((n, True))
                stack.extend((c, False) for c in children if c not in reaches_input)
                continue
            reaches_input[n] = n in input_nodes or any(reaches_input[c] for c in children)
            found = {id(params[n]): params[n]} if n in params else {}
            for c in children:
                found.update(below[c])
            below[n] = found

    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    for r in roots:
        visit(r)
    result = WeightPlan()
    owner: dict[int, list] = {}
    for n, on_path in reaches_input.items():
        if not on_path:
            continue
        for c, _ in n.next_functions:
            if c is not None and not reaches_input[c] and below[c]:
                for p in below[c].values():
                    if id(p) not in deferred:  # B runs this layer, which queues its own W
                        owner.setdefault(id(p), []).append(n)
    for r in roots:
        if not reaches_input[r]:  # nothing of B runs here: W starts at the output itself, and runs the
            for p in below[r].values():  # split-aware layers too, which then queue their W (None here)
                owner.setdefault(id(p), []).append(r)
    by_id = {id(p): p for p in params.values()}
    for pid, nodes in owner.items():
        if len(set(nodes)) == 1:
            result.points.setdefault(nodes[0], []).append(by_id[pid])
        else:
            result.in_b.append(by_id[pid])
            name = next((n.rpartition(".")[0] or n for n, q in module.named_parameters() if id(q) == pid), "?")
            if name not in _warned:
                _warned.add(name)
                log.warning("module %s cannot split its weight gradient from B (a parameter is used %d times); "
                            "B computes it", name, len(set(nodes)))
    return result


def backward_input(weights: WeightPlan, outputs, grads, inputs) -> list:
    """B: the inputs' gradients, capturing what W needs; the graph is kept for W."""
    roots = {o.grad_fn for o in outputs}
    handles = [node.register_prehook(lambda g, node=node: weights.captured.__setitem__(node, dict(enumerate(g))))
               for node in weights.points if node not in roots]
    try:
        for o, g in zip(outputs, grads):  # an output's own node receives the gradient given here
            if o.grad_fn in weights.points:
                weights.captured.setdefault(o.grad_fn, {})[o.output_nr] = g if g is not None else torch.ones_like(o)
        if not inputs:
            result = []
        else:
            result = list(torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True))
        if weights.in_b:
            extra = torch.autograd.grad(outputs, weights.in_b, grads, retain_graph=True, allow_unused=True)
            _accumulate(weights.in_b, extra)
    finally:
        for h in handles:
            h.remove()
    return result


def backward_weight(weights: WeightPlan) -> None:
    """W: each capture point's parameters from its captured gradient, then drop the graph."""
    points = list(weights.points.items())
    for i, (node, params) in enumerate(points):
        grads = weights.captured.get(node)
        if grads is None:
            continue  # no gradient reached this point (an output that did not matter)
        edges = [(GradientEdge(node, k), g) for k, g in grads.items() if g is not None]
        out = torch.autograd.grad([e for e, _ in edges], params, [g for _, g in edges],
                                  retain_graph=i < len(points) - 1, allow_unused=True)
        _accumulate(params, out)
    weights.points.clear()
    weights.captured.clear()


def _accumulate(params, grads) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g.detach() if p.grad is None else p.grad + g
