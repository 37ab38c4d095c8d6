"""A HuggingFace causal LM (Llama, Qwen2, Qwen3, Mistral) from its config, as a workload
``rrfp train`` runs (``[run] model = "hf"``): the ``[model]`` section is the HF config's sizes.

Each stage is built alone by ``rrfp.build_hf_stage`` (only its layers materialised), from the
run's seed with rrfp.hf's per-module seeding, so ``rrfp.build_hf_model`` with the same seed is
the whole model on one process. ``checkpoint`` starts from a safetensors checkpoint instead (a
file, or a folder with a sharded index): each stage reads its own tensors. The data are
models/data.py's byte tokens (vocab 256), microbatches of varying length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import rrfp
from rrfp.models.data import DataConfig, batches, check_fits, describe
from rrfp.models.gpt import loss_fn

FAMILIES = ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# the [model] keys of a mixture of experts, and what each family calls them (None: it has none)
MOE_KEYS = {
    "num_experts": {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"},
    "num_experts_per_tok": {"qwen3_moe": "num_experts_per_tok", "mixtral": "num_experts_per_tok"},
    "moe_intermediate_size": {"qwen3_moe": "moe_intermediate_size", "mixtral": None},
    "norm_topk_prob": {"qwen3_moe": "norm_topk_prob", "mixtral": None},
    "output_router_logits": {
        "qwen3_moe": "output_router_logits",
        "mixtral": "output_router_logits",
    },
    "router_aux_loss_coef": {
        "qwen3_moe": "router_aux_loss_coef",
        "mixtral": "router_aux_loss_coef",
    },
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
NOT_HF = ("family", "dtype", "gradient_checkpointing", "stage_layers", "checkpoint", "head_dim")


@dataclass
class HFConfig:
    family: str = "llama"  # llama | qwen3 | qwen2 | mistral | qwen3_moe | mixtral
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # fewer than the attention heads: grouped-query attention
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # float32 | float64 | bfloat16
    gradient_checkpointing: bool = False  # HF's activation checkpointing on every decoder layer
    stage_layers: list = field(
        default_factory=list
    )  # decoder layers per stage, e.g. [3, 3, 2]; []: balanced
    checkpoint: str = ""  # a safetensors file or folder to start from; "": the seeded init
    # qwen3_moe and mixtral only: every decoder layer's MLP is a mixture of experts
    num_experts: int = 0  # routed experts per layer (mixtral: num_local_experts)
    num_experts_per_tok: int = 2  # experts each token goes to
    moe_intermediate_size: int = 0  # qwen3_moe: each expert's width; 0: intermediate_size
    norm_topk_prob: bool = (
        True  # qwen3_moe: the chosen experts' gates renormalised (mixtral: always)
    )
    output_router_logits: bool = True  # the balance loss on (rrfp/hf/router_aux_loss.py)
    router_aux_loss_coef: float = 0.001  # its weight

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"HFConfig.family must be one of {', '.join(FAMILIES)}, got {self.family!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"HFConfig.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"HFConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("rope_theta", "rms_norm_eps"):  # 0: NaN at the first step
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"HFConfig.{name} must be a positive number, got {getattr(self, name)}"
                )
        if self.head_dim < 0:
            raise ValueError(
                "HFConfig.head_dim must be positive (or 0: hidden_size // heads), "
                f"got {self.head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"HFConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"HFConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads}), or give head_dim"
            )
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.stage_layers
        ):
            raise ValueError(
                f"HFConfig.stage_layers must be positive layer counts, got {self.stage_layers!r}"
            )
        self._check_moe()
        if self.stage_layers and sum(self.stage_layers) != self.num_hidden_layers:
            raise ValueError(
                f"HFConfig.stage_layers {self.stage_layers} add up to {sum(self.stage_layers)} "
                f"layers, the model has num_hidden_layers = {self.num_hidden_layers}"
            )

    def _check_moe(self) -> None:
        if self.family not in MOE_FAMILIES:
            if self.num_experts:
                raise ValueError(
                    f"HFConfig.num_experts = {self.num_experts} with family {self.family!r}: "
                    f"a mixture of experts is one of {', '.join(MOE_FAMILIES)}"
                )
            return
        if self.num_experts <= 0:
            raise ValueError(f"HFConfig.num_experts must be positive for {self.family!r}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"HFConfig.num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 0 or self.router_aux_loss_coef < 0:
            raise ValueError("HFConfig.moe_intermediate_size and router_aux_loss_coef must be >= 0")

    def hf(self):
        """The transformers config (LlamaConfig, Qwen3Config, Qwen3MoeConfig, ...)."""
        values = {k: v for k, v in asdict(self).items() if k not in NOT_HF and k not in MOE_KEYS}
        if self.head_dim:
            values["head_dim"] = self.head_dim
        if self.family in MOE_FAMILIES:
            for key, names in MOE_KEYS.items():
                if names[self.family] is not None:
                    values[names[self.family]] = getattr(self, key)
            if self.family == "qwen3_moe" and not self.moe_intermediate_size:
                values["moe_intermediate_size"] = self.intermediate_size
        return rrfp.hf_config(self.family, **values)

    def ranges(self, num_stages: int) -> list[range] | None:
        if not self.stage_layers:
            return None
        starts = [sum(self.stage_layers[:s]) for s in range(len(self.stage_layers) + 1)]
        return [range(a, b) for a, b in zip(starts, starts[1:])]


def check(cfg: HFConfig, data: DataConfig, num_stages: int, tp: int) -> None:
    """Layout checks before any process group: ValueError names the mismatch."""
    if tp > 1:
        raise ValueError(
            f"parallel.tp = {tp}: rrfp.hf stages are not tensor-parallel; set parallel.tp = 1"
        )
    if cfg.stage_layers and len(cfg.stage_layers) != num_stages:
        raise ValueError(
            f"model.stage_layers has {len(cfg.stage_layers)} entries for {num_stages} "
            "pipeline stages"
        )
    if cfg.num_hidden_layers < num_stages:
        raise ValueError(
            f"model.num_hidden_layers={cfg.num_hidden_layers} is fewer than the {num_stages} "
            "pipeline stages"
        )
    check_fits(data, cfg.vocab_size)
    if data.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"data.max_seq_len={data.max_seq_len} is above model.max_position_embeddings="
            f"{cfg.max_position_embeddings}: raise it or lower data.max_seq_len"
        )
    if cfg.checkpoint and not Path(cfg.checkpoint).exists():
        raise ValueError(f"model.checkpoint {cfg.checkpoint} does not exist")
    try:
        config = cfg.hf()
    except ImportError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - transformers' own validation: the [model] values
        words = " ".join(str(e).split())
        raise ValueError(f"transformers refuses the [model] config: {words}") from None
    if cfg.checkpoint:
        try:
            rrfp.check_hf_checkpoint(config, cfg.checkpoint)
        except ValueError as e:
            raise ValueError(f"model.checkpoint {cfg.checkpoint}: {e}") from None


def build_stage(cfg: HFConfig, stage: int, num_stages: int, tp_group=None) -> torch.nn.Module:
    """This stage from the run's seed (Workload.build_stages seeds torch with it just before)."""
    return rrfp.build_hf_stage(
        cfg.hf(),
        stage,
        num_stages,
        layers=cfg.ranges(num_stages),
        seed=torch.initial_seed(),
        dtype=DTYPES[cfg.dtype],
        checkpoint=cfg.checkpoint or None,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )


def build_model(cfg: HFConfig, seed: int) -> torch.nn.Module:
    """The whole model on one process, as the stages of a run with ``run.seed = seed`` start."""
    return rrfp.build_hf_model(
        cfg.hf(),
        seed=seed,
        dtype=DTYPES[cfg.dtype],
        gradient_checkpointing=cfg.gradient_checkpointing,
    )


def tied(cfg: HFConfig, stage: int, num_stages: int) -> dict[str, str]:
    """With tie_word_embeddings: the first stage's embedding and the last stage's head are one
    weight."""
    return rrfp.hf_ties(cfg, stage, num_stages)


workload = rrfp.Workload(
    "hf",
    HFConfig,
    DataConfig,
    build_stage,
    loss_fn,
    batches,
    check,
    tied=tied,
    describe_data=describe,
)
