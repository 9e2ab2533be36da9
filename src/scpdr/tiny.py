"""Tiny random-weight Llamas with the real SmolLM2 tokenizer: the ``base: tiny`` of smoke configs
(``configs/tiny.yaml``) and ``scpdr train --base tiny``, and the building block of
:mod:`scpdr.testing` (which re-exports these names for tests and benchmarks).

The models are 2-layer Llamas with a small hidden size and the real 49152-token vocabulary, so
token ids, special tokens and chat templates are those of the embedded base model. Only the
tokenizer is taken from the embedded GGUF (once, cached under ``$SCPDR_HOME``); the 25 s model
conversion is never needed here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["seeded", "tiny_config", "tiny_model", "tiny_tokenizer"]


@functools.lru_cache(maxsize=1)
def _tokenizer_dir() -> str:
    from scpdr.models import embedded_tokenizer_dir

    return str(embedded_tokenizer_dir())


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The real SmolLM2 tokenizer (49152 tokens; bos 1, eos = pad 2), from the cached copy under
    ``$SCPDR_HOME`` (extracted from the GGUF once, ~10 s). A fresh object per call."""
    from scpdr.models import load_tokenizer

    return load_tokenizer(_tokenizer_dir())


def tiny_config(
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 49152,
    init_std: float = 0.5,
    max_position_embeddings: int = 1024,
) -> LlamaConfig:
    """A tiny ``LlamaConfig`` with SmolLM2's vocabulary and special tokens (tied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    )


def tiny_model(seed: int = 0, **config_kwargs: Any) -> PreTrainedModel:
    """A random-weight tiny Llama (``tiny_config(**config_kwargs)``), deterministic in ``seed``,
    float32, eval mode."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config(**config_kwargs)
    with seeded(seed):
        model = LlamaForCausalLM(cfg)
    return model.float().eval()


class seeded:
    """Seed torch's CPU RNG inside the block and restore the previous state afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        import torch

        self._state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.random.set_rng_state(self._state)
