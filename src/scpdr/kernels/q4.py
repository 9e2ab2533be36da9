"""4-bit weights for the packed GEMM (``packed_gemm.c``): a base model's GGUF Q4_1 blocks,
streamed as they are instead of their float32 values.

A base model loaded from a ``.gguf`` file (the embedded SmolLM2-135M: every projection of its
30 layers is Q4_1) holds the float32 values the GGUF loader made of each 32-weight block:
``w = fl(fl(d·q) + m)``, ``d`` and ``m`` the block's float16 scale and minimum widened to float32
and ``q`` in 0..15 (gguf-py's ``dequantize``: one float32 product, then one sum). The packed
kernel can stream those blocks — 6 bits a weight with the scales widened (:func:`pack_q4_panels`)
against 32 — and rebuild each weight with the same two roundings in registers before the float32
tile's arithmetic, so that its results equal the float32 kernel's on the loaded weights bit for
bit. A linear is given its blocks only where dequantizing them gives its weight exactly
(:func:`dequantize_blocks`, checked at load: a fine-tuned or otherwise changed base keeps its
float32 panels).

Panel layout (``width`` = the build's panel width, ``k`` a multiple of 32): ``(ceil(n / width),
k / 32, 24·width)`` bytes, each block of a panel holding ``d[width]`` and ``m[width]`` (float32)
then 16 rows of ``width`` bytes, byte c of row j holding the q of inputs 2j (low nibble) and
2j + 1 (high nibble) of column c; columns past n have d = m = 0 (exact zeros).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "Q4Source",
    "dequantize_blocks",
    "is_q4_panels",
    "pack_q4_panels",
    "q4_exact",
    "q4_panel_floats",
    "unpack_q4_panels",
]

logger = logging.getLogger(__name__)

#: Weights per Q4_1 block, and its bytes in a GGUF file (d, m float16; 16 bytes of nibbles).
BLOCK, BLOCK_BYTES = 32, 20
#: ggml's type number of Q4_1.
GGML_Q4_1 = 3


def _check_blocks(blocks: Tensor) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"Q4_1 blocks are uint8 (rows, k / {BLOCK}, {BLOCK_BYTES}), got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )


def _scales(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(d, m, q)``: float32 ``(n, nb)`` scales and minima, uint8 ``(n, nb, 32)`` quants in
    input order (gguf-py: byte i's low nibble is input i, its high nibble input i + 16)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].to(torch.float32)
    qs = blocks[..., 4:]
    return d, m, torch.cat([qs & 15, qs >> 4], dim=-1)


def _rebuild(q: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """The loader's float32 weights of quants ``q`` with scales ``d`` and minima ``m``
    (broadcast): ``d·q`` rounded to float32, then ``+ m`` rounded (two torch ops, no fused
    multiply-add) — what the kernel rebuilds."""
    w = q.to(torch.float32) * d
    return w + m


def dequantize_blocks(blocks: Tensor) -> Tensor:
    """The float32 weights ``(n, k)`` of Q4_1 ``blocks`` ``(n, k / 32, 20)``, exactly as the GGUF
    loader computes them (:func:`_rebuild`)."""
    _check_blocks(blocks)
    d, m, q = _scales(blocks)
    return _rebuild(q, d.unsqueeze(-1), m.unsqueeze(-1)).reshape(blocks.shape[0], -1)


def q4_exact(blocks: Tensor, w: Tensor) -> bool:
    """Whether Q4_1 ``blocks`` dequantize to ``w`` ``(n, k)`` bit for bit (float32, the same
    shape): the check before a linear streams its blocks instead of ``w``."""
    if (
        w.dtype != torch.float32
        or w.dim() != 2
        or tuple(blocks.shape[:2]) != (w.shape[0], w.shape[1] // BLOCK)
        or w.shape[1] % BLOCK
    ):
        return False
    return torch.equal(dequantize_blocks(blocks), w.detach().cpu())


def pack_q4_panels(blocks: Tensor, width: int) -> Tensor:
    """Q4_1 ``blocks`` ``(n, k / 32, 20)`` (rows in the linear's output order) as the packed
    kernel's q4 panels ``(ceil(n / width), k / 32, 24·width)`` uint8 (module docstring)."""
    _check_blocks(blocks)
    n, nb, _ = blocks.shape
    d, m, q = _scales(blocks)
    panels = -(-n // width)
    pad = panels * width - n
    if pad:
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = torch.cat([m, m.new_zeros(pad, nb)])
        q = torch.cat([q, q.new_zeros(pad, nb, BLOCK)])
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # (n', nb, 16): inputs 2j, 2j + 1

    def per_panel(t: Tensor) -> Tensor:  # (n', nb, ...) -> (panels, nb, ..., width)
        t = t.reshape(panels, width, nb, -1).permute(0, 2, 3, 1)
        return t.contiguous().view(torch.uint8).reshape(panels, nb, -1)

    return torch.cat([per_panel(d), per_panel(m), per_panel(pairs)], dim=-1).contiguous()


def is_q4_panels(packed: Tensor) -> bool:
    """Whether ``packed`` holds q4 panels (uint8), not float32 or bf16 ones."""
    return packed.dtype == torch.uint8


def q4_panel_floats(packed: Tensor) -> Tensor:
    """The float32 panels ``(p, k, width)`` of q4 panels: what the kernel's tiles compute with
    (exactly; the slow reference of the q4 kernel)."""
    p, nb, row = packed.shape
    width = row // 24
    d = packed[..., : 4 * width].contiguous().view(torch.float32)  # (p, nb, width)
    m = packed[..., 4 * width : 8 * width].contiguous().view(torch.float32)
    pairs = packed[..., 8 * width :].reshape(p, nb, 16, 1, width)
    q = torch.cat([pairs & 15, pairs >> 4], dim=3).reshape(p, nb, BLOCK, width)
    return _rebuild(q, d.unsqueeze(2), m.unsqueeze(2)).reshape(p, nb * BLOCK, width)


def unpack_q4_panels(packed: Tensor, n: int) -> Tensor:
    """``W (n, k)`` float32 of q4 panels (a copy)."""
    f = q4_panel_floats(packed)
    p, k, width = f.shape
    return f.transpose(1, 2).reshape(p * width, k)[:n]


#: GGUF tensor names of a Llama model's linears (``{i}``: the layer) and their modules.
_LLAMA = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_MODULE = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")


class Q4Source:
    """``source(module name) -> Q4_1 blocks (out, in / 32, 20) | None``: the blocks of a Llama
    GGUF file's linears (memory-mapped), in the row order of the model transformers loads from
    it: llama.cpp stores q_proj and k_proj with the rows of each head permuted for its rotary
    layout, and the loader permutes them back (the same is done here). None for a module the
    file does not hold in Q4_1. What a block gives is checked against the module's weight by
    its user (:class:`scpdr.lora.StackedLoraLinear`), so a wrong file means float32 panels, not
    a wrong model."""

    def __init__(self, path: str | Path, *, heads: int, kv_heads: int) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.heads, self.kv_heads = heads, kv_heads
        reader = GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in reader.tensors if int(t.tensor_type) == GGML_Q4_1}

    def __len__(self) -> int:
        return len(self._tensors)

    def __call__(self, name: str) -> Tensor | None:
        match = _MODULE.fullmatch(name)
        if match is None or match.group(2) not in _LLAMA:
            return None
        t = self._tensors.get(f"blk.{match.group(1)}.{_LLAMA[match.group(2)]}.weight")
        if t is None:
            return None
        k, n = (int(v) for v in t.shape[:2])  # ggml order: inputs first
        if k % BLOCK:
            return None
        with warnings.catch_warnings():  # a read-only memory map: only ever read
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(t.data.reshape(n, k // BLOCK, BLOCK_BYTES))
        heads = {"self_attn.q_proj": self.heads, "self_attn.k_proj": self.kv_heads}
        h = heads.get(match.group(2))
        if h:  # transformers' reverse_permute_weights, on whole rows of blocks
            blocks = blocks.reshape(h, n // h // 2, 2, -1).transpose(1, 2).reshape(n, -1)
            blocks = blocks.reshape(n, k // BLOCK, BLOCK_BYTES)
        return blocks


def gguf_q4_source(path: str | Path, config: object) -> Callable[[str], Tensor | None] | None:
    """A :class:`Q4Source` for the GGUF file ``path`` of a model with ``config`` (a transformers
    config: its heads), or None when the file holds no Q4_1 tensor, gguf-py is missing or the
    model is not a Llama."""
    if getattr(config, "model_type", None) != "llama":
        return None
    try:
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        source = Q4Source(path, heads=heads, kv_heads=kv)
    except (ImportError, OSError, ValueError) as exc:
        logger.info("no q4 weights from %s: %s", path, exc)
        return None
    return source if len(source) else None
