"""A committed checkpoint read back whole in one process, for tests that compare two runs'
final states bit for bit (a stopped or restarted run against one never interrupted)."""

from __future__ import annotations

from pathlib import Path


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), tree


def final_state(ckdir: Path, step: int) -> dict[str, object]:
    """Every tensor and value of ``ckdir``'s checkpoint of ``step`` (model, AdamW, RNG states),
    by dotted key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckdir.parent / "final.pt"
    dcp_to_torch_save(ckdir / f"step-{step:08d}", out)
    return dict(_flat(torch.load(out, weights_only=False)))


def differing(a: dict[str, object], b: dict[str, object]) -> list[str]:
    """The keys of ``a`` whose value in ``b`` is not exactly equal."""
    import torch

    return [
        k
        for k in a
        if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
    ]
