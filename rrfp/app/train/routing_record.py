"""A run's routing, microbatch by microbatch, for the simulator to replay (``output.routing``).

Each MoE layer keeps its step's tokens per expert one forward at a time (rrfp.nn.moe_layer); a
layer belongs to one of the rank's stages, and that stage's forwards ran in the order of its F
tasks in the iteration's ``ran`` list, so the k-th counted forward is the k-th F of that stage.
Every rank keeps its own rows (its replica's microbatches; one TP rank of each group, the others
route the same tokens); rank 0 gathers them at the end and writes one JSON object per line:
step, stage, microbatch, layer (its index in the stage), replica (the data-parallel rank), ep
(the run's expert-parallel size) and tokens (copies per expert). ``rrfp sim --routing`` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from rrfp.core.tasks import Kind
from rrfp.nn.moe_layer import RouterStep, moe_layers


class RoutingRecord:
    """One rank's rows of the routing record."""

    def __init__(self, modules, stages, replica: int, ep: int, keep: bool) -> None:
        # each MoE layer's stage and its index among the stage's layers, in moe_layers' order
        self.where = [
            (stage, i)
            for module, stage in zip(modules, stages)
            for i, _ in enumerate(moe_layers(module))
        ]
        self.replica, self.ep, self.keep = replica, ep, keep
        for module in modules:
            for layer in moe_layers(module):
                layer.record_counts = keep
        self.rows: list[dict] = []

    def add(self, step: int, ran, layers: list[RouterStep]) -> None:
        """The rows of a step from its layers' statistics and the (stage, task) order it ran."""
        if not self.keep:
            return
        forwards: dict[int, list[int]] = {}
        for stage, task in ran:
            if task.kind == Kind.F:
                forwards.setdefault(stage, []).append(task.mb)
        for (stage, layer), st in zip(self.where, layers, strict=True):
            mbs = forwards.get(stage, [])
            if len(mbs) != len(st.per_forward):
                raise RuntimeError(
                    f"routing record, step {step + 1}: stage {stage} ran {len(mbs)} forward(s) but "
                    f"its MoE layer {layer} counted {len(st.per_forward)} (rrfp's bug)"
                )
            for mb, counts in zip(mbs, st.per_forward):
                self.rows.append(
                    {
                        "step": step,
                        "stage": stage,
                        "microbatch": mb,
                        "layer": layer,
                        "replica": self.replica,
                        "ep": self.ep,
                        "tokens": counts.tolist(),
                    }
                )


def write_routing(path: str, gathered: list[list[dict]]) -> int:
    """Every rank's rows sorted by step, stage, microbatch, layer and replica; how many."""
    rows = sorted(
        (r for rows in gathered for r in rows),
        key=lambda r: (r["step"], r["stage"], r["microbatch"], r["layer"], r["replica"]),
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)
