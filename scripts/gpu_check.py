"""`make gpu-check`: the CUDA/NCCL path on a real device, with a line for every
check saying whether it ran, passed or was skipped (and why).

It is a script, not part of `make test`: CI machines have no GPU, and a test
that only ever skips proves nothing. Exit status is non-zero when a check that
ran failed.

    .venv/bin/python scripts/gpu_check.py [--steps 20]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "gpt-tiny.toml")
results: list[tuple[str, str, str]] = []  # (check, RAN-ok | FAILED | SKIPPED, detail)


def report(name: str, status: str, detail: str) -> None:
    results.append((name, status, detail))
    print(f"[{status:>7}] {name}: {detail}", flush=True)


def check(name: str, fn) -> None:
    try:
        report(name, "ok", fn())
    except Exception as e:  # a failed check is reported, and the others still run
        report(name, "FAILED", f"{type(e).__name__}: {e}")


def lane_and_poller() -> str:
    """A CUDA lane's task completes through an event the poller watches, while the loop keeps running.
    The lane is the one rrfp train gets: a one-rank NCCL PipelineRuntime's, 50 ms per unit."""
    import socket

    import torch

    import rrfp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}

    async def main():
        async with rrfp.PipelineRuntime.start(pp=1, backend="nccl", unit_ms=50.0) as rt:
            lane = rt.lane
            ticks = 0

            async def heartbeat():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            beat = asyncio.ensure_future(heartbeat())
            a = torch.randn(512, 512, device=rt.device)
            t0 = time.perf_counter()
            out = await lane.run(lambda: a @ a, units=1.0)  # 50 ms of emulated device time after the matmul
            enqueued = time.perf_counter() - t0
            await lane.drain()
            took = time.perf_counter() - t0
            beat.cancel()
            torch.cuda.synchronize()
            assert type(lane).__name__ == "CudaComputeLane", f"a {type(lane).__name__} on {rt.device}"
            assert torch.allclose(out, a @ a, atol=1e-3), "lane result differs"
            assert took >= 0.04, f"the task finished after {took * 1e3:.1f} ms, before its emulated 50 ms"
            assert ticks >= 10, f"the loop ticked {ticks} times during a 50 ms task: it was blocked"
            for _ in range(20):  # 10 ms tasks with 2 ms of "deciding" between them
                await lane.run(lambda: a @ a, units=0.2)
                await asyncio.sleep(0.002)
            await lane.drain()
            gap = sorted(lane.gaps_s)[len(lane.gaps_s) // 2]
            assert gap < 1e-3, f"the GPU idled a median {gap * 1e6:.0f} us between tasks"
            return (f"run() returned after {enqueued * 1e3:.2f} ms (enqueued), the task ended after "
                    f"{took * 1e3:.1f} ms (50 ms emulated), loop ticked {ticks} times; median device gap "
                    f"between tasks with 2 ms decisions: {gap * 1e6:.0f} us")

    saved = {k: os.environ.get(k) for k in one_rank}
    os.environ.update(one_rank)
    try:
        return asyncio.run(main())
    finally:  # the rrfp train checks below start their own ranks under torchrun
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(nproc: int, steps: int, *sets: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "rrfp",
           "train", "--config", CONFIG, "--set", f"steps={steps}", "--set", "log_every=1"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        print("\n".join(p.stderr.strip().splitlines()[-40:]), flush=True)  # the whole story, for a one-shot device run
        raise RuntimeError(f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}")
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)][:steps]


def reference_losses(steps: int) -> list[float]:
    """The same model, data and optimizer in one process on cuda:0."""
    import torch

    from rrfp import TrainConfig

    cfg = TrainConfig.load(CONFIG, [f"steps={steps}"], world_size=1)
    wl = cfg.workload
    torch.manual_seed(cfg.run.seed)
    model = wl.build_stage(cfg.model, 0, 1, None).to("cuda:0")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.run.lr, weight_decay=cfg.run.weight_decay)
    losses = []
    for step in range(steps):
        batch = wl.batches(cfg.data, step, cfg.run.microbatches)
        loss = sum(wl.loss_fn(model(x.cuda()), y.cuda()) for x, y in batch) / len(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compare(got: list[float], want: list[float]) -> str:
    assert len(got) == len(want), f"{len(got)} losses printed, expected {len(want)}"
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst < 2e-3, f"losses differ from the single-process reference by up to {worst:.2e}"
    return f"{len(got)} steps, loss {got[0]:.4f} -> {got[-1]:.4f}, max |diff| vs reference {worst:.1e}"


def checkpoint_resume() -> str:
    """pp=1 on CUDA with dropout: 3 steps, a checkpoint, 3 more after --resume, against 6 in one go.
    The CUDA RNG state must be saved and restored for the dropout masks to repeat."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    sets = ("backend=nccl", "pp=1", "model.dropout=0.1")
    whole = train(1, 6, *sets)
    with tempfile.TemporaryDirectory() as d:
        first = train(1, 3, *sets, f"checkpoint_dir={d}")
        second = train(1, 6, *sets, f"checkpoint_dir={d}", "resume=required")[:3]  # steps 4-6
        keys = dcp.FileSystemReader(f"{d}/step-00000006").read_metadata().state_dict_metadata
    assert any(k.startswith("rank0.rng.cuda") for k in keys), "no CUDA RNG state in the checkpoint"
    worst = max(abs(a - b) for a, b in zip(first + second, whole))
    assert len(first + second) == 6 and worst < 2e-4, f"resumed {first + second} vs uninterrupted {whole}"
    return f"6 steps with dropout 0.1, resumed after 3: max |diff| of the printed losses {worst:.1e}"


def calibrate_on_cuda() -> str:
    """`rrfp calibrate` of a CUDA run measures on the GPU (each task synchronized), not on the CPU."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cost.json"
        p = subprocess.run([sys.executable, "-m", "rrfp", "calibrate", "--config", CONFIG, "--pp", "2", "--samples",
                            "4", "--set", "backend=nccl", "--out", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        if p.returncode != 0 or "real compute on cuda" not in p.stdout or not out.exists():
            raise RuntimeError(f"exit {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
        return p.stdout.splitlines()[0]


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--steps", type=int, default=20)
    args = a.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {gpus}", flush=True)
    if gpus == 0:
        for name in ("CUDA lane + poller", "rrfp train pp=1 on CUDA", "checkpoint resume on CUDA",
                     "rrfp calibrate on CUDA", "rrfp train pp=2 over NCCL"):
            report(name, "SKIPPED", "no GPU on this machine")
        return 0
    check("CUDA lane + poller", lane_and_poller)
    reference = reference_losses(args.steps)
    check("rrfp train pp=1 on CUDA",
          lambda: compare(train(1, args.steps, "backend=nccl", "pp=1"), reference))
    check("checkpoint resume on CUDA", checkpoint_resume)
    check("rrfp calibrate on CUDA", calibrate_on_cuda)
    if gpus >= 2:
        check("rrfp train pp=2 over NCCL",
              lambda: compare(train(2, args.steps, "backend=nccl", "pp=2"), reference))
    else:
        report("rrfp train pp=2 over NCCL", "SKIPPED", "needs 2 GPUs, this machine has 1")
    failed = [r for r in results if r[1] == "FAILED"]
    print(f"gpu-check: {sum(r[1] == 'ok' for r in results)} ok, {len(failed)} failed, "
          f"{sum(r[1] == 'SKIPPED' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
