"""A short moe-tiny training run (configs/moe-tiny.toml) for the tests that train it on 4 gloo
ranks: short sequences and a few steps, enough for every MoE task and all-to-all to run."""

from harness import ROOT

CONFIG = str(ROOT / "configs" / "moe-tiny.toml")


def short_run(steps: int) -> list[str]:
    """``--set`` overrides for a ``steps``-step run of short sequences."""
    return [
        f"steps={steps}",
        "timeout_s=60",
        "model.block_size=32",
        "data.microbatch_size=2",
        "data.min_seq_len=8",
        "data.max_seq_len=32",
        "output.dir=",  # no run folder: metrics nobody reads
    ]
