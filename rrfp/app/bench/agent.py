"""torchrun's agent for the bench's job, with what every rank imports imported first.

The bench's ranks are forks of this agent (``--start-method fork``, rrfp/app/job/forked_rank.py).
Imported here once, before any fork, torch._dynamo (each rank's first optimizer imports it), rrfp's
bench modules and the workloads' models cost their CPU once per job instead of once per rank:
about 2.5 CPU-s a rank. Imports start no thread, so the agent still forks a single-threaded
process. The rank module itself is left to the ranks, which run it as ``__main__``.
"""

from __future__ import annotations

import importlib

# what a bench rank imports before its first run, the workloads' models included
PRELOAD = (
    "torch._dynamo",
    "torch.distributed.pipelining",
    "rrfp.app.bench.runners",
    "rrfp.app.bench.torch_schedules",
    "rrfp.app.bench.dropin",
    "rrfp.app.bench.threads",
    "rrfp.loop",
    "rrfp.nn.moe_layer",
    "rrfp.pipeline.runtime",
    "rrfp.models.gpt",
    "rrfp.models.vlm",
)


def main() -> None:
    """``python -m torch.distributed.run ARGS`` after PRELOAD."""
    for name in PRELOAD:
        importlib.import_module(name)
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
