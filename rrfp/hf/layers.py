"""Which decoder layers each pipeline stage holds."""

from __future__ import annotations

from collections.abc import Sequence


def hf_layer_ranges(
    num_layers: int, num_stages: int, ranges: Sequence[Sequence[int] | range] | None = None
) -> list[range]:
    """Contiguous layer ranges, one per stage. ``ranges`` None: balanced by count, the first
    ``num_layers % num_stages`` stages one layer more. Given ranges (``range`` or ``(start, stop)``)
    are checked: one per stage, each non-empty, together 0..num_layers in order without gaps."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if ranges is None:
        if num_stages > num_layers:
            raise ValueError(
                f"{num_stages} stages for {num_layers} decoder layers: every stage needs one"
            )
        base, extra = divmod(num_layers, num_stages)
        out, start = [], 0
        for s in range(num_stages):
            out.append(range(start, start + base + (s < extra)))
            start = out[-1].stop
        return out
    out = []
    for r in ranges:
        if isinstance(r, range) and r.step == 1:
            out.append(r)
        elif (
            not isinstance(r, range)
            and len(r) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        ):
            out.append(range(r[0], r[1]))
        else:
            raise ValueError(
                f"layer range {r!r} is not a range or a (start, stop) pair of integers"
            )
    if len(out) != num_stages:
        raise ValueError(f"{len(out)} layer ranges for {num_stages} stages: give one per stage")
    expect = 0
    for s, r in enumerate(out):
        if r.start != expect or r.stop <= r.start:
            raise ValueError(
                f"stage {s}'s layers {r.start}..{r.stop} do not continue at layer {expect} "
                f"with at least one layer: ranges must cover 0..{num_layers} in order"
            )
        expect = r.stop
    if expect != num_layers:
        raise ValueError(f"the layer ranges end at layer {expect}, the model has {num_layers}")
    return out
