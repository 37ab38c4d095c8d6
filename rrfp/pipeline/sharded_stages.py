"""Stage modules sharded with FSDP2 (``fully_shard``) over the stage's data-parallel replicas.

Each replica runs its own pipeline, and under ready dispatch two replicas of a stage may run their
tasks in different orders. FSDP's collectives (the all-gather that unshards, the reduce-scatter
of the gradients) pair up across the replicas by their order only, so none of them may run at a
point whose order readiness picks. Here they run at two points that every replica reaches in the
same program order: the iteration's start and its end (docs/fsdp.md):

- ``begin``, before the iteration's first task: every FSDP module of the rank's stages is
  unsharded once, in model order (``FSDPModule.unshard``), with ``reshard_after_forward``,
  ``reshard_after_backward`` and gradient sync off, so that no F, B or W all-gathers,
  reshards or reduce-scatters (FSDP's hooks still run; each finds nothing to do);
- ``finish``, after the rank's last task: every FSDP parameter group reduce-scatters the
  gradients the tasks accumulated on its unsharded parameters, in model order, and reshards, as
  torch's ``PipelineStage.perform_reduce_grad`` does after its schedule's last backward.

The split backward's W accumulates weight gradients on the unsharded parameters, which FSDP leaves
alone until ``finish``, so every gradient reaches the sharded parameters exactly once, after the
last W. Every parameter that requires grad takes part in the reduce-scatter, with zeros where this
replica has no gradient for it, so the replicas' reduce-scatters have one layout.

Expert parallelism borrows the replicas, as torchtitan's does the dp_shard dimension: the
expert-parallel shards (``ExpertParallel``) stay outside ``fully_shard`` (``ignored_params``), each
EP member holding its own experts whole. Their gradients already sum every member's tokens that
reached them (the all-to-alls carried them back); ``finish`` sums them over the replicas holding
the same experts (none when dp_shard = ep) and divides them by the replicas, as the reduce-scatter
averages the rest: each replica's loss counts once in the mean.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from rrfp.comm.loaded_class import FSDP_MODULE, loaded_class
from rrfp.nn.expert_parallel import expert_parameters

log = logging.getLogger("rrfp.pipeline.sharded_stages")


def fsdp_modules(modules: Sequence[nn.Module]) -> list:
    """The FSDP modules inside ``modules``, each once, in model order."""
    found, seen, fsdp_module = [], set(), loaded_class(FSDP_MODULE)
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, fsdp_module) and id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
    return found


# what begin and finish change on each FSDP parameter group, and give back after the iteration
_SETTINGS = (
    "post_forward_mesh_info",
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "reduce_scatter_unused_params",
)


def _groups(module) -> list:
    return list(module._get_fsdp_state()._fsdp_param_groups)


class ShardedStages:
    """The FSDP modules of a rank's stages, unsharded for the iteration and reduce-scattered once
    after it. ``dp_ranks``: the stage's replicas (the runtime's DP group), which must be the ranks
    FSDP shards over."""

    def __init__(
        self, modules: Sequence[nn.Module], dp_ranks: list[int], who: str, expert_group=None
    ) -> None:
        self.modules = fsdp_modules(modules)
        self.replicas, self.expert_group = len(dp_ranks), expert_group
        # the expert-parallel shards, in model order: outside fully_shard, reduced in finish
        ids = set().union(*(expert_parameters(m) for m in modules))
        self.experts = [p for m in modules for p in m.parameters() if id(p) in ids]
        self._check(modules, dp_ranks, who)
        self._saved: list[tuple] = []
        # the group FSDP's all-gathers and reduce-scatters run over: every module's (``_check``)
        infos = [g.mesh_info for m in self.modules for g in _groups(m)]
        self.group = infos[0].shard_process_group if infos else None

    @classmethod
    def of(
        cls, modules: Sequence[nn.Module], dp_ranks: list[int], who: str, expert_group=None
    ) -> ShardedStages | None:
        """None when no stage module holds an FSDP module. ``expert_group``: the replicas holding
        this rank's experts, None when it holds them alone (or without expert parallelism)."""
        return cls(modules, dp_ranks, who, expert_group) if fsdp_modules(modules) else None

    def _check(self, modules: Sequence[nn.Module], dp_ranks: list[int], who: str) -> None:
        """NotImplementedError naming what this design does not cover: HSDP, FSDP over other ranks
        than the stage's replicas, and parameters outside every ``fully_shard`` (their gradients
        would never be reduced)."""
        managed: set[int] = set()
        for module in self.modules:
            for group in _groups(module):
                info = group.mesh_info
                if getattr(info, "replicate_process_group", None) is not None:
                    raise NotImplementedError(
                        f"{who}: FSDP module {type(module).__name__} is HSDP (a 2-D mesh); rrfp "
                        "runs FSDP2 stages sharded over the stage's replicas (a 1-D mesh) only"
                    )
                ranks = sorted(dist.get_process_group_ranks(info.shard_process_group))
                if ranks != sorted(dp_ranks):
                    raise NotImplementedError(
                        f"{who}: FSDP module {type(module).__name__} shards over ranks {ranks}, "
                        f"but this stage's data-parallel replicas are ranks {sorted(dp_ranks)}: "
                        "fully_shard each stage over its replicas (the mesh's dp_shard dimension)"
                    )
                managed.update(id(p.sharded_param) for p in group.fsdp_params)
        managed.update(id(p) for p in self.experts)
        for module in modules:
            outside = [n for n, p in module.named_parameters() if id(p) not in managed]
            if outside:
                raise NotImplementedError(
                    f"{who}: parameters {outside[:3]}{' ...' if len(outside) > 3 else ''} are "
                    "outside every fully_shard while other parts of the stage are sharded: "
                    "their gradients would never be reduced; fully_shard the stage module too"
                )

    def begin(self) -> None:
        """Unshard every FSDP module for the iteration, with FSDP's own per-task all-gathers,
        reshards and reduce-scatters off. Every replica calls it at the iteration's start."""
        self._restore()  # an iteration that raised left them changed: the user's come first
        for module in self.modules:
            module.set_is_last_backward(False)
            for group in _groups(module):
                self._saved.append((group, _SETTINGS, [getattr(group, a) for a in _SETTINGS]))
                group.post_forward_mesh_info = None  # reshard_after_forward = False
                group.reduce_grads = group.all_reduce_grads = False  # no reduce-scatter in B or W
                group.reshard_after_backward = False
        for module in self.modules:
            module.unshard()

    def finish(self) -> None:
        """Reduce-scatter every gradient accumulated in the iteration into the sharded parameters
        and reshard, in model order. Every replica calls it after its last task."""
        for module in self.modules:
            module.set_is_last_backward(True)
        for group, names, values in self._saved:
            saved = dict(zip(names, values))
            group.reduce_grads, group.all_reduce_grads = (
                saved["reduce_grads"],
                saved["all_reduce_grads"],
            )
            group.reshard_after_backward = True
            group.reduce_scatter_unused_params = True  # one layout on every replica
        with torch.no_grad():
            for group, *_ in self._saved:
                group.post_backward()
            for root in self._roots():
                root._root_post_backward_final_callback()
            self._reduce_experts()
        self._restore()

    def _reduce_experts(self) -> None:
        """The experts' gradients summed over the replicas holding them and divided by all
        replicas, in model order (a missing one counts as zeros, so the all-reduces pair)."""
        for p in self.experts:
            if not p.requires_grad:
                continue
            if self.expert_group is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.expert_group)
            if p.grad is not None:
                p.grad.div_(self.replicas)

    def _restore(self) -> None:
        """The user's settings back, for what runs outside an iteration (evaluation, own calls)."""
        for group, names, values in self._saved:
            for name, value in zip(names, values):
                setattr(group, name, value)
        self._saved = []

    def _roots(self) -> list:
        """The FSDP root states (each ends its modules' backward once), in model order."""
        from torch.distributed.fsdp import fully_shard

        states = [fully_shard.state(m) for m in self.modules]
        return [s for s in states if s._is_root]


def shard_stage(module: nn.Module, group, device_type: str) -> nn.Module:
    """``fully_shard`` a stage module over ``group`` (the stage's replicas) as one unit, what
    ``rrfp train`` does with ``[parallel] dp_shard``. One unit is enough here: every unit is
    unsharded for the whole iteration anyway (``ShardedStages``), so finer ones would lower no
    peak, only add collectives. Expert-parallel shards (``rt.shard_experts`` first) stay out: the
    EP group holds them sharded already."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))
    ids = expert_parameters(module)
    experts = {p for p in module.parameters() if id(p) in ids}
    return fully_shard(module, mesh=mesh, ignored_params=experts or None)
