"""The causal LM families rrfp.hf splits, and their configs built from plain values."""

from __future__ import annotations

from rrfp.hf.extra import require

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
)  # their *ForCausalLM share one layout: embed, layers, norm, head (the last two: MoE MLPs)


def hf_config(family: str, **values):
    """A transformers config of ``family`` (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral) with
    ``values``, e.g. a
    tiny model built from nothing but numbers:
    ``hf_config("qwen3", hidden_size=32, num_hidden_layers=8)``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    return require("transformers").AutoConfig.for_model(family, **values)


def check_config(config) -> None:
    """TypeError unless ``config`` is a transformers config; NotImplementedError unless of a
    family here."""
    transformers = require("transformers")
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(
            "expected a transformers config (LlamaConfig, Qwen3Config, ...), "
            f"got {type(config).__name__}"
        )
    if config.model_type not in FAMILIES:
        raise NotImplementedError(
            f"rrfp.hf splits the {', '.join(FAMILIES)} families, not model_type "
            f"{config.model_type!r}"
        )
