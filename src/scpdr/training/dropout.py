"""LoRA's dropout on CPU at the cost of its arithmetic, not of its random numbers.

PEFT applies ``nn.Dropout(lora_dropout)`` to the input of every adapter (the paper's 0.05, App.
E), so a LoRA step of the 135M model draws a Bernoulli mask over the input of 7 projections x 30
layers (twice with gradient checkpointing, which recomputes the forward). torch's CPU
``bernoulli_`` draws one Mersenne-Twister number per element: measured on AMD Zen 4, 2 threads,
a 2048 x 1536 fp32 input, ``F.dropout`` takes 28 ms where a matmul of that input by a 1536 x 576
weight takes 21, and a LoRA step at 8 x 256 tokens spent 3.2 of its 12.7 s in ``bernoulli_``.

:class:`WordDropout` is the same inverted dropout with a mask cut from random 64-bit words, four
16-bit draws per word (one generator call per four elements): an element is dropped when its
draw is below ``round(p * 65536)``, so the rate is that over 65,536 (0.050003 for 0.05), and the
kept ones are scaled by ``1 / (1 - rate)``, so the expectation is the input's. It draws from
torch's default generator, so it is seeded as everything else and gradient checkpointing's
saved RNG state recomputes the same mask. :func:`replace_lora_dropout` swaps it into a PEFT
model; ``scpdr``'s CPU training does (on a GPU, ``bernoulli_`` is fast and left alone).
``benchmarks/bench_train.py`` reports its speed-up over ``F.dropout``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["WordDropout", "replace_lora_dropout"]

#: Draws per 64-bit word and their range.
_BITS = 16
_LEVELS = 1 << _BITS


class WordDropout(nn.Module):
    """Inverted dropout of rate ``round(p * 65536) / 65536``, its mask cut from random 64-bit
    words (module docstring); the identity in eval mode or at rate 0."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self.threshold = round(p * _LEVELS)  # draws below it are dropped
        self.rate = self.threshold / _LEVELS
        self.scale = 1.0 / (1.0 - self.rate)

    def extra_repr(self) -> str:
        return f"p={self.p}, rate={self.rate:.6f}"

    def mask(self, shape: torch.Size, device: torch.device) -> Tensor:
        """A boolean keep-mask of ``shape``: each entry kept with probability ``1 - rate``."""
        n = math.prod(shape)
        info = torch.iinfo(torch.int64)
        words = torch.randint(info.min, info.max, ((n + 3) // 4,), dtype=torch.int64, device=device)
        draws = words.view(torch.int16)[:n].view(shape)  # uniform on [-32768, 32767]
        return draws >= self.threshold - _LEVELS // 2

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.threshold == 0 or x.numel() == 0:
            return x
        return x * (self.mask(x.shape, x.device) * self.scale).to(x.dtype)


def replace_lora_dropout(model: Any) -> int:
    """Replace every ``nn.Dropout`` of a PEFT model's LoRA layers (``lora_dropout``) by a
    :class:`WordDropout` of the same ``p`` (``p = 0`` layers are PEFT's ``nn.Identity`` and
    stay); the number replaced."""
    n = 0
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if not isinstance(drops, nn.ModuleDict):
            continue
        for name, drop in list(drops.items()):
            if type(drop) is nn.Dropout:
                drops[name] = WordDropout(drop.p)
                n += 1
    return n
