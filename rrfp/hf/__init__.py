"""HuggingFace causal LMs (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) split into pipeline
stages.

``build_hf_stage`` builds one stage of a ``*ForCausalLM`` from its config: only the
stage's layers are materialised, their initial weights equal those of the whole model
built by ``build_hf_model`` from the same seed, and a safetensors checkpoint, when
given, is read only for the stage's tensors; ``check_hf_checkpoint`` reads only its headers, to
refuse a checkpoint that cannot start the model before any stage is built. transformers is the
optional extra ``rrfp[hf]``, imported only when a stage or model is built.
"""

from rrfp.hf.build import build_hf_model, build_hf_stage
from rrfp.hf.checkpoint_check import check_hf_checkpoint
from rrfp.hf.families import FAMILIES, hf_config
from rrfp.hf.layers import hf_layer_ranges
from rrfp.hf.stage import HFStage, hf_ties

__all__ = [
    "FAMILIES",
    "HFStage",
    "build_hf_model",
    "build_hf_stage",
    "check_hf_checkpoint",
    "hf_config",
    "hf_layer_ranges",
    "hf_ties",
]
