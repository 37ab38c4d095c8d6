"""One pipeline stage of a HuggingFace causal LM: a range of its decoder layers, with the
embedding on the first stage and the final norm and LM head on the last.

Parameter names are the whole model's (``model.layers.5.self_attn.q_proj.weight``,
``lm_head.weight``), so a stage's tensors are found in a HF checkpoint, and its gradients
compare with the whole model's, by name. Nothing but the hidden state needs to travel
between stages: each stage rebuilds the rotary cos/sin and the causal mask from the
positions (0..T-1 unless ``position_ids`` are given), with HF's own functions. Position ids
and a padding mask given to the first stage are passed on with the hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from rrfp.hf.extra import require

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_types(config) -> list[str]:
    """Each decoder layer's attention (full or sliding window), as the family's model reads it:
    ``config.layer_types`` (Qwen2, Qwen3), else sliding everywhere when ``config.sliding_window``
    is set (Mistral), else full (Llama)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None
    return [SLIDING if sliding else FULL] * config.num_hidden_layers


def hf_ties(config, stage: int, num_stages: int) -> dict[str, str]:
    """The tie ``stage`` holds, as ``tied=`` declares it (``ScheduleReady``, ``stage_executor``):
    with ``tie_word_embeddings`` the first stage's embedding and the last stage's LM head are one
    weight (nothing to declare when one stage holds both: it is one Parameter there)."""
    if not getattr(config, "tie_word_embeddings", False) or num_stages == 1:
        return {}
    if stage == 0:
        return {"embedding": "model.embed_tokens.weight"}
    return {"embedding": "lm_head.weight"} if stage == num_stages - 1 else {}


class HFStage(nn.Module):
    """Layers ``layers`` of a ``*ForCausalLM``. First stage: ``input_ids [b, T]`` in; others: the
    hidden state ``[b, T, C]``. Last stage: logits ``[b, T, vocab]`` out; others: the hidden state,
    or ``(hidden, position_ids, attention_mask)`` when either was given."""

    def __init__(
        self,
        config,
        stage: int,
        num_stages: int,
        layers: range,
        *,
        embed_tokens: nn.Module | None,
        decoder_layers: dict[int, nn.Module],
        norm: nn.Module | None,
        lm_head: nn.Module | None,
        rotary_emb: nn.Module,
    ) -> None:
        super().__init__()
        self.config, self.stage, self.num_stages, self.layers = config, stage, num_stages, layers
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self._types = layer_types(config)
        body = nn.Module()  # named `model`, as in the HF model, so parameter names match it
        if embed_tokens is not None:
            body.embed_tokens = embed_tokens
        body.layers = nn.ModuleDict({str(i): decoder_layers[i] for i in layers})
        if norm is not None:
            body.norm = norm
        body.rotary_emb = rotary_emb
        self.model = body
        if lm_head is not None:
            self.lm_head = lm_head

    @property
    def ties(self) -> dict[str, str]:
        """This stage's ``tied=`` declaration (``hf_ties``)."""
        return hf_ties(self.config, self.stage, self.num_stages)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        masking = require("transformers.masking_utils")
        hidden = self.model.embed_tokens(x) if self.is_first else x
        positions = (
            position_ids
            if position_ids is not None
            else (torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0))
        )
        mine = {self._types[i] for i in self.layers}
        build = {
            FULL: masking.create_causal_mask,
            SLIDING: masking.create_sliding_window_causal_mask,
        }
        # the given position ids only: HF looks into them for packed sequences, which 0..T-1 are
        # not (and that look needs data, which rrfp train's memory check on the meta device has
        # not)
        masks = {
            kind: build[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=None,
                position_ids=position_ids,
            )
            for kind in mine
        }
        rotary = self.model.rotary_emb(hidden, positions)
        for i, layer in self.model.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self._types[int(i)]],
                position_embeddings=rotary,
                position_ids=positions,
            )
        if self.is_last:
            return self.lm_head(self.model.norm(hidden))
        if position_ids is None and attention_mask is None:
            return hidden
        return hidden, position_ids, attention_mask
