"""A tiny HuggingFace Llama (random init from its config, no download) trained through rrfp's
ScheduleReady on N gloo ranks, one pipeline stage each:

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/hf_llama.py

Each rank builds only its stage (``rrfp.build_hf_stage``: its decoder layers, plus the embedding
on the first rank and the final norm and LM head on the last), with HF's activation
checkpointing, and trains with AdamW, the whole model's gradient norm clipped, and a linear warmup
of the learning rate. ``tied=module.ties`` declares a tied embedding and LM head (none for Llama's
default config). A step's
microbatches differ in length (17, 33, 25 and 40 tokens): only the hidden state travels, each
stage rebuilds rotary and the causal mask from the positions. The last rank prints the losses.
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import rrfp
from rrfp import ScheduleReady

LENGTHS = (17, 33, 25, 40)  # one step's microbatches, in tokens
ROWS, STEPS, LR, WARMUP, CLIP = 2, 6, 3e-3, 2, 1.0


def config():
    return rrfp.hf_config(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def microbatches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, next-token targets) per microbatch, the same on every rank: counting up from a
    random token (mod 256), a sequence the model learns within a few steps."""
    g = torch.Generator().manual_seed(step)
    out = []
    for length in LENGTHS:
        tokens = (torch.randint(0, 256, (ROWS, 1), generator=g) + torch.arange(length + 1)) % 256
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1)
    )


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = rrfp.build_hf_stage(config(), rank, world, seed=0, gradient_checkpointing=True)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    with ScheduleReady(stage, len(LENGTHS), loss_fn=loss_fn, tied=module.ties) as schedule:
        for step in range(STEPS):
            mbs = microbatches(step)
            losses: list = []
            schedule.step(
                arg_mbs=[(x,) for x, _ in mbs] if rank == 0 else None,
                target_mbs=[y for _, y in mbs] if rank == world - 1 else None,
                losses=losses,
            )
            schedule.clip_grad_norm_(CLIP)  # collective: every rank, after step
            opt.step()
            warmup.step()
            opt.zero_grad()
            if losses:
                print(f"step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
