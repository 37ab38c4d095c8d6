"""Model FLOPs utilisation: the FLOPs a step's tokens need, over the time it took, against the
devices' peak.

A step's model FLOPs are PaLM's count (Chowdhery et al. 2022, appendix B): 6 N per token for the
matmuls of the forward and backward (N: the parameters used in a matmul; an embedding table that
is only looked up is left out, a tied one counts once, as the lm head; of a mixture of experts'
routed experts, the share a token uses, top_k of num_experts) plus 12 L d T per token for
attention's two matmuls (L layers of width d, a row of T tokens), summed over the step's rows. It
counts the model's work, not what the run executes: recomputation and a pipeline's idle time lower
MFU, as they should.

The peak is per rank (one device each): ``output.peak_tflops``, or by device: a CUDA GPU's dense
peak at the run's precision, from its name; on CPU an assumed 0.1 TFLOPS per thread, so an MFU
there is indicative only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from rrfp.nn.moe_layer import MoELayer

log = logging.getLogger(__name__)

CPU_TFLOPS_PER_THREAD = 0.1  # an assumed core: 2 FMA units x 8 float32 lanes x 2 FLOPs x 3 GHz
# dense TFLOPS by GPU name (the first key that is part of torch's device name), at bf16/fp16,
# tf32 and fp32; "H100 PCIe" before "H100"
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
}
LAYER_KEYS = ("n_layer", "n_layers", "num_hidden_layers", "num_layers")
WIDTH_KEYS = ("n_embd", "dim", "hidden_size", "d_model")
HEAD_KEYS = ("n_head", "n_heads", "num_attention_heads")


@dataclass(frozen=True)
class ModelFlops:
    """What one token costs to train, in FLOPs, by the count in the module doc."""

    params: int  # N: the parameters used in matmuls
    layers: int | None = None  # L, for the attention term (None: the term is left out)
    width: int | None = None  # d: attention's query width, heads x head size

    def step(self, tokens: float, attn: float) -> float:
        """The FLOPs of a step of ``tokens`` tokens whose rows have sum(rows x length^2) ``attn``
        (``token_features``' "attn", summed over the step's microbatches)."""
        attention = 12 * self.layers * self.width * attn if self.layers and self.width else 0.0
        return 6 * self.params * tokens + attention


def matmul_params(model: nn.Module) -> int:
    """Parameters some module other than an embedding uses, as many as a token uses: an embedding
    table counts only when it is tied to a linear (the lm head), routed experts by the top_k of
    num_experts a token goes to."""
    used: dict[int, float] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            used[id(p)] = p.numel()
    for moe in (m for m in model.modules() if isinstance(m, MoELayer)):
        for p in moe.experts.parameters():
            used[id(p)] = p.numel() * moe.top_k / moe.num_experts
    return round(sum(used.values()))


def attention_dims(model_cfg) -> tuple[int | None, int | None]:
    """(layers, attention width) from a model config's usual field names, or Nones."""
    layers = next((getattr(model_cfg, k) for k in LAYER_KEYS if hasattr(model_cfg, k)), None)
    heads = next((getattr(model_cfg, k) for k in HEAD_KEYS if hasattr(model_cfg, k)), None)
    head_dim = getattr(model_cfg, "head_dim", None)  # when set (> 0), heads x head_dim is d
    width = (
        heads * head_dim
        if isinstance(heads, int) and isinstance(head_dim, int) and head_dim > 0
        else next((getattr(model_cfg, k) for k in WIDTH_KEYS if hasattr(model_cfg, k)), None)
    )
    ok = isinstance(layers, int) and isinstance(width, int)
    return (layers, width) if ok else (None, None)


def model_flops(workload, model_cfg, num_stages: int = 1) -> ModelFlops | None:
    """The whole model's count, from its ``num_stages`` stages built on the meta device (no
    memory, no compute), as the run splits it; None when they do not build there (logged). A
    table tied across stages is an embedding on the first and a linear on the last: counted once."""
    from rrfp.app.train.start_checks import (
        _fork_rng,
    )  # the meta build that leaves the generator alone

    try:
        with torch.device("meta"), _fork_rng():
            stages = [
                workload.build_stage(model_cfg, s, num_stages, None) for s in range(num_stages)
            ]
    except Exception as e:  # noqa: BLE001 - a user's model: MFU is left out, the run goes on
        log.warning("MFU left out: the model does not build on the meta device: %s", e)
        return None
    layers, width = attention_dims(model_cfg)
    if layers is None:
        log.info("MFU counts 6N per token only: the model config names no layers and width")
    return ModelFlops(sum(matmul_params(m) for m in stages), layers, width)


@dataclass(frozen=True)
class Peak:
    tflops: float  # per rank
    source: str  # how it was found, as the run's report states it

    @property
    def indicative(self) -> bool:
        return self.source.startswith("cpu")


def device_peak(
    device: torch.device, autocast: str, threads: int, configured: float = 0.0
) -> Peak | None:
    """The peak a rank's MFU is against: ``configured`` (output.peak_tflops) when > 0, else by
    device; None for a GPU not in ``GPU_PEAKS`` (set output.peak_tflops)."""
    if configured > 0:
        return Peak(configured, "output.peak_tflops")
    if device.type == "cpu":
        return Peak(
            threads * CPU_TFLOPS_PER_THREAD,
            f"cpu, assumed {CPU_TFLOPS_PER_THREAD:g} TFLOPS per thread x {threads}: indicative",
        )
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    precision = (
        "bf16" if autocast != "off" else "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    )
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return Peak(peaks[precision], f"{name}, dense {precision}")
    return None
