"""Parameter, gradient and optimizer bytes per rank: FSDP2-sharded stages against plain DP.

The GPT of configs/gpt-tiny.toml on pp 2 x dp 2 (4 gloo ranks on this machine), ready BFW, AdamW.
Each layout runs two steps under PipelineRuntime.stage_executor: ``dp`` (replicated stages,
rrfp's GradSync) and ``dp_shard`` (each stage fully_shard'ed over its two replicas,
rrfp/pipeline/sharded_stages.py). Bytes are read from the tensors' storages, never from RSS:
every parameter the rank holds (the module's, and under FSDP the sharded and the unsharded
copies; a storage FSDP has freed counts 0), their gradients, and the optimizer's state, each
storage once. They are read after every task of the second step, after its iteration (FSDP has
reduce-scattered and resharded), and after its optimizer step; the peak is the largest sum.
Counted, not timed: the figures do not depend on the machine.

    .venv/bin/python benchmarks/fsdp_memory.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

WORLD, PP, DP = 4, 2, 2
KINDS = ("dp", "dp_shard")


def _storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the tensors (a DTensor by its local shard)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def _held(module, opt) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now."""
    from torch.distributed.fsdp import FSDPModule

    params = list(module.parameters())
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                params.append(fp.sharded_param)
                if hasattr(fp, "_unsharded_param"):
                    params.append(fp._unsharded_param)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    p, g = _storages(params), _storages(p.grad for p in params)
    return {
        "params": sum(p.values()),
        "grads": sum(v for k, v in g.items() if k not in p),
        "optimizer": sum(_storages(state).values()),
    }


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import rrfp

    cfg = rrfp.TrainConfig.load("configs/gpt-tiny.toml", [f"pp={PP}", f"dp={DP}"], world_size=WORLD)
    wl, M = cfg.workload, cfg.schedule.n_microbatches

    async def main():
        out = {}
        async with rrfp.PipelineRuntime.start(pp=PP, dp=DP, timeout_s=120) as rt:
            for kind in KINDS:
                torch.manual_seed(0)
                module = wl.build_stage(cfg.model, rt.stage, PP, None)
                if kind == "dp_shard":
                    mesh = DeviceMesh.from_group(rt.dp_group, "cpu", mesh_dim_names=("dp_shard",))
                    module = fully_shard(module, mesh=mesh)  # one unit, as rrfp train does
                ex = rt.stage_executor(module, wl.loss_fn, cfg.schedule_settings())
                sync = rt.grad_sync(module, ex) if kind == "dp" else None
                opt = torch.optim.AdamW(module.parameters(), lr=cfg.optim.lr)
                seen: list[tuple[str, dict]] = []
                ex.on_task_done.append(
                    lambda t, seen=seen, m=module, o=opt: seen.append((f"after {t}", _held(m, o)))
                )
                for step in range(2):
                    seen.clear()
                    data = wl.batches(cfg.data, step, M * DP)
                    await ex.run_iteration(step, data[rt.dp_rank * M : (rt.dp_rank + 1) * M])
                    if sync is not None:
                        await sync.sync()
                    seen.append(("after the iteration", _held(module, opt)))
                    opt.step()
                    seen.append(("after the optimizer step", _held(module, opt)))
                    opt.zero_grad()
                where, peak = max(seen, key=lambda s: sum(s[1].values()))
                rest = seen[-1][1]
                out[kind] = (rt.stage, where, peak, rest)
        return out

    queue.put((rank, rrfp.run(main())))


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    print(
        "| rank | stage | layout | peak: params | grads | optimizer | total | at | "
        "after the step: total |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rank in sorted(results):
        for kind in KINDS:
            stage, where, peak, rest = results[rank][kind]
            kib = {k: v / 1024 for k, v in peak.items()}
            print(
                f"| {rank} | {stage} | {kind} | {kib['params']:.1f} KiB | {kib['grads']:.1f} KiB "
                f"| {kib['optimizer']:.1f} KiB | {sum(kib.values()):.1f} KiB | {where} | "
                f"{sum(rest.values()) / 1024:.1f} KiB |"
            )


if __name__ == "__main__":
    main()
