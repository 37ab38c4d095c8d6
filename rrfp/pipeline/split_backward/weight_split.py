"""B/W split for any module, with torch.autograd on the stage's own graph.

*B nodes* are the graph nodes on a path from an output to a stage input; B asks
autograd for the inputs' gradients only, so it runs exactly these, and keeps
the graph. A *frontier edge* leaves a B node for a node that leads only to
parameters: the gradient along it is weight work that B skipped. A pre-hook
captures the whole gradient arriving at each B node with frontier edges (from
every output, so a root that another output also feeds gets the sum). W
restarts autograd at that node with that gradient and asks only for what lies
behind its frontier edges, so nothing of B runs twice.

A restart must not run another B node, or that node's part would count twice:

- a parameter behind the frontier of one B node only is asked for directly:
  no other B node leads to it, so the engine cannot reach one on the way;
- a parameter behind several (a recurrent weight used at every step, a weight
  used twice) is gathered per use: each restart asks for the gradient arriving
  on its own frontier edges, and a second call carries that through the
  parameter-only part of the graph, which holds no B node. Every use adds in.
  This fails only where a B node *below* the restarted one feeds the same
  frontier node (an RNN bias added at every step straight into its one
  accumulator), or one node feeds it twice: that parameter's gradient is
  computed in B, and its module is named once with that reason.

Outputs whose node is not a B node (every output of the first stage, whose
input needs no gradient) are restarted from the output with the gradient
handed in. Parameters of split-aware layers (``defers_weight_grad``, mode
"layers") are left to their own W queue.

A non-reentrant checkpoint recomputes its region once per autograd call, and
W makes one call per restart; W's calls therefore share one
``torch.utils.checkpoint.GraphExecGroup``, which recomputes each region once
for all of them. The group needs the calls to run disjoint parts of the graph
where checkpointed saved tensors live: restarts of parameters with one owner
are disjoint, gathering is not (a frontier node runs once per use, and B nodes
may run again). A stage whose gathering would run a checkpointed node runs its
backward unsplit. B stays outside the group: a restart node runs in B and again
in W.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn
from torch.autograd import _make_grads
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

from rrfp.nn.grad_accumulation import accumulate_grad
from rrfp.nn.split_functions import QUEUEING_NODES
from rrfp.pipeline.split_backward.checkpointed_nodes import is_checkpointed

log = logging.getLogger(__name__)
_warned: set[str] = set()
_OUTPUTS = "outputs"  # the owner of work reached from outputs that are not B nodes


@dataclass
class Restart:
    """W's work at one B node: parameters asked for directly, and frontier edges whose
    gradient a second call carries to parameters that other B nodes also reach."""

    params: list = field(default_factory=list)
    edges: list = field(default_factory=list)  # (node, input number) behind this node's frontier
    shared: list = field(default_factory=list)  # parameters the second call asks for


@dataclass
class WeightWork:
    """What W computes for one microbatch; ``captured`` is filled in B."""

    points: dict = field(default_factory=dict)  # B node -> Restart
    captured: dict = field(default_factory=dict)  # B node -> gradients arriving at it, filled in B
    from_outputs: list = field(default_factory=list)  # parameters W computes from non-B outputs
    output_nodes: set = field(default_factory=set)  # nodes of the outputs that are not B nodes
    outputs: list = field(default_factory=list)  # (edge, gradient) of those outputs, set in B
    in_b: list = field(default_factory=list)  # parameters whose gradient B computes
    reasons: dict = field(default_factory=dict)  # id(parameter in in_b) -> why it is in B
    whole: str | None = None  # why B runs the whole backward (and W nothing), if it must
    # no input wants a gradient (a first stage): B has nothing to compute, and W runs the plain
    # backward from the (output, gradient) pairs B keeps in ``plain``
    in_w: bool = False
    plain: list = field(default_factory=list)


def queued_parameters(module: nn.Module) -> frozenset[int]:
    """Ids of parameters whose split-aware layers queue their own W (computed once per stage)."""
    return frozenset(
        id(p)
        for m in module.modules()
        if getattr(m, "defers_weight_grad", False)
        for p in m.parameters(recurse=False)
    )


class _Graph:
    """One microbatch's autograd graph, walked once from the outputs."""

    def __init__(self, wanted: set[int], input_nodes: set, roots: list) -> None:
        # AccumulateGrad node -> parameter, for the parameters (ids in ``wanted``) the graph
        # reaches: read off the nodes, where get_gradient_edge would make a view per parameter
        self.params: dict = {}
        self._wanted = wanted
        self.in_b: dict = {}  # node -> whether it lies on a path to an input
        # node off every input's path -> {id: parameter} it leads to; only W asks these nodes for
        # parameters, and a B node's set (nearly every parameter) would cost a copy per node
        self.below: dict = {}
        for r in roots:
            self._visit(r, input_nodes)

    def _visit(
        self, node, input_nodes
    ) -> None:  # iterative post-order: graphs can outgrow the recursion limit
        stack = [(node, False)]
        pending: dict = {}  # node -> its children, from its first visit to its second
        while stack:
            n, done = stack.pop()
            if n in self.in_b:
                continue
            if not done:
                children = pending[n] = self.children(n)
                stack.append((n, True))
                stack.extend((c, False) for c in children if c not in self.in_b)
                continue
            children = pending.pop(n)
            self.in_b[n] = n in input_nodes or any(self.in_b[c] for c in children)
            if self.in_b[n]:
                continue
            if not children and id(var := getattr(n, "variable", None)) in self._wanted:
                self.params[n] = var
            found = {id(self.params[n]): self.params[n]} if n in self.params else {}
            for c in children:
                found.update(self.below[c])
            self.below[n] = found

    @staticmethod
    def children(node) -> list:
        return [c for c, _ in node.next_functions if c is not None]

    def between(self, start, targets: set) -> int:
        """Count of B nodes below ``start`` on a path to one of ``targets`` (targets included)."""
        on_path: dict = {}
        stack = [(c, False) for c in self.children(start) if self.in_b[c]]
        while stack:
            n, done = stack.pop()
            if n in on_path:
                continue
            kids = [c for c in self.children(n) if self.in_b[c]]
            if not done:
                stack.append((n, True))
                stack.extend((c, False) for c in kids if c not in on_path)
                continue
            on_path[n] = n in targets or any(on_path[c] for c in kids)
        return sum(on_path.values())

    def reaches_below(self, start, targets: set) -> bool:
        """Whether a B node below ``start`` (not ``start`` itself) is one of ``targets``."""
        seen, stack = set(), [c for c in self.children(start) if self.in_b[c]]
        while stack:
            n = stack.pop()
            if n in targets:
                return True
            if n not in seen:
                seen.add(n)
                stack.extend(c for c in self.children(n) if self.in_b[c])
        return False


def analyse(
    module: nn.Module,
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    deferred: frozenset[int] = frozenset(),
) -> WeightWork:
    """Analyse one microbatch's graph once its forward is done. ``deferred``: parameters
    left to their layer's own W queue (``queued_parameters``)."""
    # no input wants a gradient and no layer queues its own W: W runs the plain backward, which
    # needs no walk (torch.autograd.backward also runs a reentrant checkpoint)
    if not inputs and not deferred:
        return WeightWork(in_w=True)
    wanted = {id(p) for p in module.parameters() if p.requires_grad}
    roots = list(dict.fromkeys(get_gradient_edge(t).node for t in outputs))
    g = _Graph(wanted, {get_gradient_edge(x).node for x in inputs}, roots)
    if any(n.name() == _REENTRANT_CHECKPOINT for n in g.in_b):
        return WeightWork(whole=WHOLE_REENTRANT)
    params = g.params
    by_id = {id(p): p for p in params.values()}

    # frontier[n]: (edge, parameter ids behind it) for B node n; owners[pid]: the B nodes (or
    # _OUTPUTS) reaching pid
    frontier: dict = {}
    owners: dict[int, list] = {}
    for n, on_path in g.in_b.items():
        if not on_path:
            continue
        for c, nr in n.next_functions:
            if c is None or g.in_b[c]:
                continue
            pids = list(g.below[c])
            if not pids:
                continue
            edges = frontier.setdefault(n, {})
            if (c, nr) in edges:  # two edges into one slot: one capture there holds both
                continue
            edges[(c, nr)] = pids
            for pid in pids:
                owners.setdefault(pid, []).append(n)
    out_pids = list(dict.fromkeys(pid for r in roots if not g.in_b[r] for pid in g.below[r]))
    for pid in out_pids:
        owners.setdefault(pid, []).append(_OUTPUTS)

    result = WeightWork()
    queuing = {
        n for n in frontier if deferred and n.name() in _QUEUES_OWN_W
    }  # B ran these: they queued W
    for pid, who in owners.items():
        who = list(dict.fromkeys(who))
        if len(who) > 1 and not (
            pid in deferred and queuing.issuperset(who)
        ):  # all queued: nothing to gather
            reason = _why_not_gathered(g, frontier, who, pid, 0 if deferred else RERUN_LIMIT)
            if reason:
                result.in_b.append(by_id[pid])
                result.reasons[pid] = reason
        owners[pid] = who
    in_b = {id(p) for p in result.in_b}
    result.from_outputs = [by_id[pid] for pid in out_pids if pid not in in_b]
    result.output_nodes = {r for r in roots if not g.in_b[r]}
    for n, edges in frontier.items():
        work = Restart()
        for pid in dict.fromkeys(pid for pids in edges.values() for pid in pids):
            if pid in in_b or (n in queuing and pid in deferred):
                continue
            if owners[pid] == [n]:
                work.params.append(by_id[pid])
            else:
                work.shared.append(by_id[pid])
        if work.shared:
            wanted = {id(p) for p in work.shared}
            work.edges = [edge for edge, pids in edges.items() if wanted.intersection(pids)]
        if work.params or work.shared:
            result.points[n] = work
    if any(is_checkpointed(x) for x in _gathering_runs(g, result.points)):
        return WeightWork(whole=WHOLE_CHECKPOINT_GATHERED)
    _announce(module, result)
    return result


def _gathering_runs(g: _Graph, points: dict) -> set:
    """The nodes that W's gathering may run more than once: for each restart that gathers, those on
    a path from it to its gathered edges (B nodes run again among them) and everything below those
    edges."""
    runs: set = set()
    for n, work in points.items():
        if not work.shared:
            continue
        targets = {c for c, _ in work.edges}
        leads: dict = {}  # node below n -> whether it lies on a path to one of targets
        stack = [(c, False) for c in g.children(n)]
        while stack:
            x, done = stack.pop()
            if x in leads:
                continue
            kids = g.children(x)
            if not done:
                stack.append((x, True))
                stack.extend((c, False) for c in kids if c not in leads)
                continue
            leads[x] = x in targets or any(leads[c] for c in kids)
        runs.update(x for x, on_path in leads.items() if on_path)
        for c in targets:
            runs.update(_nodes_below(c))
    return runs


# torch.utils.checkpoint(use_reentrant=True) runs its backward with torch.autograd.backward inside
# the engine, which torch refuses under torch.autograd.grad (the split's B and W): such a graph is
# not split.
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"
WHOLE_REENTRANT = (
    "its graph holds a reentrant checkpoint (torch.utils.checkpoint with use_reentrant=True), "
    "which torch.autograd.grad cannot run: B computes every gradient and W nothing; "
    "use_reentrant=False lets it split"
)

WHOLE_CHECKPOINT_GATHERED = (
    "W would gather a parameter's uses through a non-reentrant checkpoint's region (a parameter "
    "used more than once there), running its nodes twice, which W's one recomputation per region "
    "(torch.utils.checkpoint.GraphExecGroup) cannot serve: B computes every gradient and W nothing"
)

# the nodes of rrfp.nn.split_functions and the split linear (in its two-node form, its input's: the
# product's own has no edge to a parameter), and of rrfp.nn.grouped_experts (a mixture of experts'
# grouped products): their backward queues their weights' W. W must not run them again, but their
# use of a parameter still counts when another use is gathered (a rerun would queue that W twice).
_QUEUES_OWN_W = (*QUEUEING_NODES, "_GroupedLinearFnBackward")

RERUN_LIMIT = (
    16  # B nodes a restart may run again (wasted, never counted twice) to reach a shared node
)


def _why_not_gathered(
    g: _Graph, frontier: dict, who: list, pid: int, rerun_limit: int
) -> str | None:
    """Why W cannot gather, use by use, a parameter that several B nodes reach; None if it can.

    A restart at n captures the gradient arriving on n's frontier edges toward the parameter.
    It holds n's part alone unless a B node below n feeds one of those very edges too (or one of
    n's edges lies below another). A B node below n that feeds another input of the same node is
    harmless but runs again, with the B nodes between: a few are allowed, more stay in B."""
    nodes = [n for n in who if n is not _OUTPUTS]
    walked: dict = {}  # node -> the nodes below it, each walked once

    def nodes_below(node) -> set:
        if node not in walked:
            walked[node] = _nodes_below(node)
        return walked[node]

    reach_nodes, reach_edges = {}, {}
    for m in nodes:
        starts = [(c, nr) for (c, nr), pids in frontier[m].items() if pid in pids]
        below = set().union(*({c} | nodes_below(c) for c, _ in starts))
        reach_nodes[m] = below
        reach_edges[m] = set(starts) | {
            (c, nr) for x in below for c, nr in x.next_functions if c is not None
        }
    for n in nodes:
        edges = [(c, nr) for (c, nr), pids in frontier[n].items() if pid in pids]
        targets = {c for c, _ in edges}
        if any(c2 in nodes_below(c1) for c1 in targets for c2 in targets if c1 is not c2):
            return f"{n.name()} reaches it along two of its own edges, one below the other"
        rivals = {m for m in nodes if m is not n and reach_nodes[m] & targets}
        if not rivals or not g.reaches_below(n, rivals):
            continue
        same = {m for m in rivals if reach_edges[m].intersection(edges)}
        if same and g.reaches_below(n, same):
            m = next(m for m in same if g.reaches_below(n, {m}))
            fed = next(c for c, nr in edges if (c, nr) in reach_edges[m])
            fed = (
                "its gradient accumulator" if fed in g.params else f"the same input of {fed.name()}"
            )
            return f"it is used at {n.name()} and at {m.name()} below it, and both feed {fed}"
        rerun = g.between(n, rivals)
        if rerun > rerun_limit:
            return (
                f"gathering its uses at {n.name()} would run {rerun} nodes of B again "
                f"(more than {rerun_limit})"
            )
    return None


def _nodes_below(node) -> set:
    seen, stack = set(), _Graph.children(node)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(_Graph.children(n))
    return seen


def _announce(module: nn.Module, result: WeightWork) -> None:
    """Log once per module the parameters whose gradient stays in B, and why."""
    if not result.in_b:  # the common case, on every forward: no name lookup
        return
    names = {id(q): n for n, q in module.named_parameters()}
    by_module: dict[str, list[str]] = {}
    for p in result.in_b:
        name = names.get(id(p), "?")
        if name not in _warned:
            _warned.add(name)
            by_module.setdefault(name.rpartition(".")[0] or "(root)", []).append(
                f"{name}: {result.reasons[id(p)]}"
            )
    for owner, lines in by_module.items():
        log.warning(
            "module %s computes %d weight gradient(s) in B, not W: %s",
            owner,
            len(lines),
            "; ".join(lines),
        )


def backward_input(weights: WeightWork, outputs, grads, inputs) -> list:
    """B: the inputs' gradients (and those of ``in_b``), capturing what W needs; the graph is kept
    for W. With ``whole`` set, the plain backward: every gradient, the graph freed."""
    if weights.whole:
        torch.autograd.backward(outputs, grads)
        return [x.grad for x in inputs]
    if weights.in_w:
        weights.plain = [list(outputs), list(grads)]
        return []
    handles = [
        node.register_prehook(lambda g, node=node: weights.captured.__setitem__(node, g))
        for node in weights.points
    ]
    try:
        weights.outputs = [
            (edge, g if g is not None else torch.ones_like(o))
            for o, g in zip(outputs, grads)
            if (edge := get_gradient_edge(o)).node in weights.output_nodes
        ]
        asked = list(inputs) + weights.in_b
        found = list(_grad(outputs, asked, grads)) if asked else []
        _accumulate(weights.in_b, found[len(inputs) :])
    finally:
        for h in handles:
            h.remove()
    return found[: len(inputs)]


def backward_weight(weights: WeightWork) -> None:
    """W: every restart's parameters from its captured gradient, then drop the graph. Run it in one
    ``one_pass()`` (the worker's W task) so that a parameter several restarts reach gets its
    post-accumulate-grad hooks called once. One GraphExecGroup: a checkpointed region is recomputed
    once for all of W's calls, not once per call."""
    if weights.whole:  # B ran the whole backward
        return
    if weights.in_w:
        if weights.plain:
            torch.autograd.backward(*weights.plain)  # torch's own accumulation, the graph freed
        weights.plain = []
        return
    with torch.utils.checkpoint.GraphExecGroup():
        _restart_all(weights)
    weights.points.clear()
    weights.captured.clear()
    weights.outputs.clear()


def _restart_all(weights: WeightWork) -> None:
    if weights.from_outputs:
        _grad_into(
            weights.from_outputs, [e for e, _ in weights.outputs], [g for _, g in weights.outputs]
        )
    for node, work in weights.points.items():
        captured = weights.captured.get(node)
        if captured is None or all(g is None for g in captured):
            continue  # no gradient reached this node (an output that did not matter)
        seeds = [(GradientEdge(node, k), g) for k, g in enumerate(captured) if g is not None]
        asked = work.params + [GradientEdge(c, nr) for c, nr in work.edges]
        found = _grad([e for e, _ in seeds], asked, [g for _, g in seeds])
        _accumulate(work.params, found[: len(work.params)])
        flows = [
            (GradientEdge(c, nr), f)
            for (c, nr), f in zip(work.edges, found[len(work.params) :])
            if f is not None
        ]
        if flows:  # the parameter-only part of the graph: no B node runs here
            _grad_into(work.shared, [e for e, _ in flows], [f for _, f in flows])


def _grad_into(params: list, edges: list, grads: list) -> None:
    if edges:
        _accumulate(params, _grad(edges, params, grads))


def _grad(outputs: list, inputs: list, grads: list) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)``. Under
    a torch-function mode (the split-aware functions, rrfp/nn/split_functions.py) it goes to the
    engine past torch.autograd.grad's dispatch to the mode, as torch.autograd.grad itself does when
    no mode is active: the dispatch would run the engine with the mode set aside, so a checkpointed
    region recomputed there would not run its ops as its forward did."""
    if not torch._C._is_torch_function_mode_enabled():
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    made = _make_grads(tuple(outputs), tuple(grads), is_grads_batched=False)
    return _engine_run_backward(tuple(outputs), made, True, False, tuple(inputs), True)


def _accumulate(params, grads) -> None:
    for p, g in zip(params, grads):
        if g is not None:  # torch.autograd.grad ran the parameters' tensor hooks
            accumulate_grad(p, g, hooked=True)
