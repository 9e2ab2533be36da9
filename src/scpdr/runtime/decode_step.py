"""A lean decoding step for Llama models: one new token per row, with a KV cache.

A decoding step of the 135M model at batch 1 spends most of what is not its matmuls in
transformers' per-module Python: ~400 ``nn.Module`` calls a step (each layer's decoder,
attention, MLP, norm and activation modules), keyword plumbing and output records (on the LoRA
stack, ~25 ms of a ~105 ms step on an Intel Xeon; docs/lora_fast_path.md).
:class:`LlamaDecodeStep` runs the computation of ``LlamaForCausalLM.forward`` for one new token
per row, calling the same submodules' ``forward`` methods, transformers' own mask builder,
rotary embedding and SDPA attention function, in the same order on the same tensors, and the
rotation in fewer ops with the same floats: its logits are *bitwise* those of the model's
forward (tested). Both runners use it for their one-token steps (:func:`is_decoding_step`;
:class:`scpdr.runtime.runner.PerModelRunner` per model, :class:`scpdr.lora.StackedLoRA` for the
stacked batch); prefill goes through the forward.

It is used only where the model is exactly transformers' Llama classes with SDPA attention
(SmolLM2, Llama and their fine-tunes): any other architecture, attention implementation or a
subclass keeps its own forward (:func:`llama_decode_step` returns None).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["LlamaDecodeStep", "is_decoding_step", "llama_decode_step"]


def is_decoding_step(input_ids: Tensor, keep: int | Tensor, cache: Any) -> bool:
    """Whether a runner call (the runner protocol's arguments) is one the lean step computes:
    one new token per row, with a KV cache, keeping every (that is, the last) position."""
    return (
        cache is not None and input_ids.shape[1] == 1 and isinstance(keep, int) and keep in (0, 1)
    )


def llama_decode_step(model: nn.Module) -> LlamaDecodeStep | None:
    """The lean step for ``model`` when it is exactly transformers' ``LlamaForCausalLM`` (its
    model, decoder layers, attention, MLP, norms and rotary embedding of the Llama classes, no
    subclass) with SDPA attention; else None, and the model's forward is used."""
    from transformers.models.llama import modeling_llama as ml

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    config = getattr(model, "config", None)
    ok = (
        type(model) is ml.LlamaForCausalLM
        and type(inner) is ml.LlamaModel
        and type(inner.norm) is ml.LlamaRMSNorm
        and type(inner.rotary_emb) is ml.LlamaRotaryEmbedding
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and layers is not None
        and len(layers) == config.num_hidden_layers
        and all(
            type(x) is ml.LlamaDecoderLayer
            and type(x.self_attn) is ml.LlamaAttention
            and type(x.mlp) is ml.LlamaMLP
            and type(x.input_layernorm) is ml.LlamaRMSNorm
            and type(x.post_attention_layernorm) is ml.LlamaRMSNorm
            for x in layers
        )
    )
    if not ok:
        logger.debug("lean decoding step: not a plain Llama model with SDPA; its forward is used")
        return None
    return LlamaDecodeStep(model)


class LlamaDecodeStep:
    """``LlamaForCausalLM.forward`` for one new token per row with a KV cache, without the
    per-module plumbing (see the module docstring).

    The submodules are read from the model at each call, so modules replaced after
    construction (the stack's packed linears) are the ones used.
    """

    def __init__(self, model: nn.Module) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import create_causal_mask

        self.model = model
        self._attention = sdpa_attention_forward
        self._mask = create_causal_mask

    def __call__(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: Any
    ) -> Tensor:
        """Logits ``(R, 1, V)`` (the head's dtype) of ``input_ids`` ``(R, 1)`` at
        ``position_ids`` ``(R, 1)``, ``attention_mask`` ``(R, L)`` covering the cache and the new
        token; appends the new keys and values to ``cache`` (a transformers ``Cache``), as
        ``model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=cache,
        use_cache=True, logits_to_keep=1).logits`` does."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"one new token per row: input_ids (R, 1), got {input_ids.shape}")
        model = self.model
        inner = model.model
        h = inner.embed_tokens(input_ids)
        mask = self._mask(
            config=model.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            past_key_values=cache,
            position_ids=position_ids,
        )
        cos, sin = inner.rotary_emb(h, position_ids=position_ids)  # (R, 1, head_dim)
        # transformers' rotation x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1), in
        # fewer ops: (x2, x1) = x.roll(half) times the sign-folded (-sin1, sin2), made once a
        # step. (-a)·b and a·(-b) are the same float, so the result is bitwise the same.
        half = cos.shape[-1] // 2
        cos_h = cos.unsqueeze(1)  # (R, 1, 1, head_dim): over the heads
        sin_h = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        rows = h.shape[:-1]
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            shape = (*rows, -1, attn.head_dim)
            x = layer.input_layernorm.forward(h)
            q = attn.q_proj.forward(x).view(shape).transpose(1, 2)
            k = attn.k_proj.forward(x).view(shape).transpose(1, 2)
            v = attn.v_proj.forward(x).view(shape).transpose(1, 2)
            q = q * cos_h + q.roll(half, -1) * sin_h
            k = k * cos_h + k.roll(half, -1) * sin_h
            k, v = cache.update(k, v, i)
            out, _ = self._attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
            h = h + attn.o_proj.forward(out.reshape(*rows, -1).contiguous())
            x = layer.post_attention_layernorm.forward(h)
            gate = mlp.act_fn(mlp.gate_proj.forward(x))
            h = h + mlp.down_proj.forward(gate * mlp.up_proj.forward(x))
        h = inner.norm.forward(h)
        return model.lm_head.forward(h)
