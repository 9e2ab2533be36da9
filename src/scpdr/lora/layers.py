"""The layers of the shared-base LoRA fast path (:mod:`scpdr.lora`; paper App. E); the choice of
their matmul kernel (measured per instruction set) is :mod:`scpdr.lora.gemm_choice`.

Every ``nn.Linear`` of the shared base becomes a :class:`StackedLoraLinear`: the base matmul of
all stacked rows plus the LoRA deltas of the groups with adapters, either

- on CPU in float32 in one call of the packed C kernel (:mod:`scpdr.kernels.gemm`) on weights
  re-laid out once in panels of its ISA's tile width — where
  :func:`scpdr.lora.gemm_choice.choose_gemm` measured it faster than torch on this machine for
  the model's shapes at the decode row counts (once, in a fraction of a second, remembered in
  ``$SCPDR_HOME/kernels``; ``SCPDR_GEMM_KERNEL=0``/``1`` forces a side) — with a tied input
  embedding looked up in the packed head
  (:class:`PackedEmbedding`); or
- with torch's matmuls (:meth:`StackedLoraLinear._base_forward`, ``docs/lora_fast_path.md``).

Results equal torch's up to the order of the float additions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from scpdr import kernels
from scpdr.kernels.gemm import (
    PANEL_DTYPES,
    GemmLibrary,
    LinearCall,
    linear_call,
    lora_linear_reference,
    lora_linear_torch,
    pack_panels,
    unpack_panels,
)
from scpdr.kernels.q4 import is_q4_panels, pack_q4_panels, q4_exact

logger = logging.getLogger(__name__)

__all__ = [
    "CHUNK_IN_FEATURES",
    "TRANSPOSED_MAX_ROWS",
    "GroupMode",
    "PackedEmbedding",
    "StackedLoraLinear",
    "in_chunks",
    "matching_source",
    "packable",
    "source_weight",
]

#: Row counts (stacked batch x tokens) up to which the base matmul of a wrapped linear runs as
#: ``(W·xᵀ)ᵀ`` on CPU (see :meth:`StackedLoraLinear._base_forward`).
TRANSPOSED_MAX_ROWS = 6
#: Input width of one weight chunk in the few-rows CPU kernel (wider linears are split).
CHUNK_IN_FEATURES = 576


class GroupMode:
    """Which rows the wrapped linears see: ``stacked`` = G groups stacked along the batch;
    ``single`` = one group's rows only (None: the plain base, no delta)."""

    def __init__(self) -> None:
        self.stacked: int | None = None
        self.single: int | None = None


def in_chunks(in_features: int) -> int:
    """Chunks for the CPU base matmul of a wide linear: the smallest ``c`` dividing
    ``in_features`` with chunks of at most :data:`CHUNK_IN_FEATURES` (1: no split)."""
    if in_features <= CHUNK_IN_FEATURES:
        return 1
    for c in range(2, in_features // 64 + 1):
        if in_features % c == 0 and in_features // c <= CHUNK_IN_FEATURES:
            return c
    return 1


def packable(w: Tensor) -> bool:
    """Whether the packed CPU kernel can run a linear with weight ``w`` (float32 on CPU)."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def source_weight(
    source: Callable[[str], Tensor | None] | None, name: str, layer: nn.Linear, *, packed: bool
) -> Tensor | None:
    """``layer``'s weight from ``source`` when it will be re-laid out (``packed``, or a wide
    linear chunked on CPU; else None). Checked against the module (shape, dtype kind, first,
    middle and last rows): anything odd, e.g. weights converted at load time, means None (the
    module's own weight is used)."""
    w = layer.weight
    relaid = packed or (packable(w) and in_chunks(layer.in_features) > 1)
    if w.device.type != "cpu" or not relaid:
        return None
    return matching_source(source, name, w)


def matching_source(
    source: Callable[[str], Tensor | None] | None, name: str, w: Tensor
) -> Tensor | None:
    """The weight ``source`` reads for module ``name`` where it is ``w``'s, else None: anything
    odd, e.g. weights converted at load time or a broken checkpoint, means the module's own
    weight ``w`` is to be used. Where ``source`` can tell (its ``holds(name, w)``,
    :class:`scpdr.lora.CheckpointWeights` on Linux) that ``w`` is the checkpoint's own mapped
    bytes, unwritten, that settles it without reading ``w`` (which would page in its mapping:
    :mod:`scpdr.lora.mapped`); a view of them written since means None. Otherwise the shape,
    dtype kind and first, middle and last rows are compared."""
    if source is None:
        return None
    try:
        src = source(name)
        same = getattr(source, "holds", lambda _n, _w: None)(name, w)
    except Exception as exc:  # a broken checkpoint: the module's weight is correct anyway
        logger.debug("weight source failed for %s: %s", name, exc)
        return None
    if src is None or src.shape != w.shape or not src.dtype.is_floating_point or same is False:
        return None
    if same:
        return src
    rows = [0, w.shape[0] // 2, w.shape[0] - 1]
    if not torch.equal(src[rows].to(w.dtype), w.detach()[rows]):
        return None
    return src


class PackedEmbedding(nn.Module):
    """Input embeddings looked up in the packed output head they were tied to (SmolLM2 ties
    them): row v of ``W`` is column ``v % width`` of panel ``v // width``. Replaces a tied
    ``nn.Embedding`` in the fast path so that the model's original matrix, a second
    vocab x hidden copy, is never paged in."""

    def __init__(self, head: StackedLoraLinear, like: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "_head", head)  # not a submodule: registered once, as the head
        self.num_embeddings, self.embedding_dim = like.num_embeddings, like.embedding_dim
        self.padding_idx = like.padding_idx

    @property
    def head(self) -> StackedLoraLinear:
        """The packed output head the embeddings are read from."""
        return self._head

    @property
    def weight(self) -> Tensor:
        """The embedding matrix ``(vocab, hidden)`` (a copy)."""
        return self._head.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.numel():
            lo, hi = torch.aminmax(input_ids)
            if lo < 0 or hi >= self.num_embeddings:  # nn.Embedding's error, not a padded panel
                raise IndexError(
                    f"token ids must be in [0, {self.num_embeddings}), got {int(lo)}..{int(hi)}"
                )
        packed = self._head.weight_packed
        if packed.dim() == 4:  # bf16 panels (p, ceil(k / 2), width, 2): widened exactly
            width = packed.shape[2]
            rows = packed[input_ids // width, :, input_ids % width]  # (..., ceil(k / 2), 2)
            rows = rows.reshape(*input_ids.shape, -1)[..., : self.embedding_dim]
            return rows.to(torch.float32)
        width = packed.shape[-1]
        return packed[input_ids // width, :, input_ids % width]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed (tied to the output head)"


class StackedLoraLinear(nn.Module):
    """An ``nn.Linear`` of the shared base plus the LoRA deltas of L groups.

    Stacked mode (G groups, input ``(G·B, T, in)``): the base output ``y = x·Wᵀ (+ bias)`` for all
    rows, then for the first L groups ``y_g += (x_g·A_gᵀ)·(s_g·B_g)ᵀ`` with two batched matmuls.
    Single mode (group g): ``y + (x·A_gᵀ)·(s_g·B_g)ᵀ``. Groups ``>= L`` have no delta.

    With ``gemm`` (a :class:`scpdr.kernels.gemm.GemmLibrary`) and a float32 CPU weight,
    everything runs in the C kernel on panels of ``w = gemm.panel_width`` columns
    (:func:`scpdr.kernels.gemm.pack_panels`): buffers ``weight_packed`` ``(ceil(out/w), in,
    w)``, ``lora_a_packed`` ``(L, ceil(r/w), in, w)`` (A) and ``lora_b_packed`` ``(L,
    ceil(out/w), r, w)`` (s·B), given already packed with ``lora_packed=True``;
    ``base_layer`` is dropped. Otherwise (torch's matmuls): ``lora_a`` ``(L, in, r)`` (= Aᵀ),
    ``lora_b`` ``(L, r, out)`` (= s·Bᵀ), and on CPU a float32 linear wider than
    :data:`CHUNK_IN_FEATURES` inputs keeps its weight as ``c`` input chunks ``weight_chunks``
    ``(c, out, in/c)`` instead of ``base_layer`` (see :meth:`_base_forward`). The LoRA buffers
    are None (L = 0) for a linear no adapter targets (wrapped for the stacked base matmul only).
    None of the buffers is persistent. ``source``: the weight read from the checkpoint, used for
    the re-laid-out copy so that the model's own (memory-mapped) one is never paged in.
    ``weight_dtype``: ``torch.bfloat16`` packs the base weight in bf16 panels (the kernel
    widens them exactly and computes in float32: the layer is then the bf16-rounded weight's,
    half the bytes per step); only with ``gemm``. ``q4``: the weight's GGUF Q4_1 blocks ``(out,
    in / 32, 20)`` (:class:`scpdr.kernels.q4.Q4Source`): with ``gemm`` and float32 panels, where
    they dequantize to the weight exactly, the panels are q4 ones (``weight_packed`` uint8; the
    kernel rebuilds the same float32 values: bit for bit the float32 layer, from ~3/16 of the
    bytes); otherwise they are ignored (:attr:`weight_format` says which). ``keep_original``
    (a layer without adapters only): the packed layer keeps ``base_layer`` too, and the calls
    that :attr:`torch_rows` hands to torch run it, bit for bit the plain layer (a full model of
    the general path, :func:`scpdr.lora.pack_full_model`: its prefill and scoring unchanged).
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        a: Tensor | None,
        b: Tensor | None,
        mode: GroupMode,
        *,
        source: Tensor | None = None,
        gemm: GemmLibrary | None = None,
        lora_packed: bool = False,
        weight_dtype: torch.dtype = torch.float32,
        q4: Tensor | None = None,
        keep_original: bool = False,
    ) -> None:
        super().__init__()
        if keep_original and a is not None:
            raise ValueError("keep_original is for a layer without adapters (a plain model's)")
        self._in, self._out = base_layer.in_features, base_layer.out_features
        w = base_layer.weight
        packs = gemm is not None and packable(w)
        if lora_packed and not packs:
            raise ValueError("packed LoRA matrices need the packed kernel and a float32 CPU layer")
        if weight_dtype != torch.float32 and not packs:
            raise ValueError(
                f"{weight_dtype} weights need the packed kernel and a float32 CPU layer"
            )
        # only the build's target, not the library: a module holding a ctypes handle could not
        # be copied or pickled (the library is looked up at each call, a dict lookup)
        self.kernel_target = gemm.lib.target if packs and gemm is not None else None
        self.rank = 0 if b is None else int(b.shape[-2])  # b: (L, r, out) or (L, ., r, w)
        self.num_lora = 0 if a is None else int(a.shape[0])
        self._mode = mode
        #: Calls of at least this many rows run torch's matmuls instead of the kernel: on the
        #: kept original, else on the panels (:func:`scpdr.kernels.gemm.lora_linear_torch`);
        #: prefill and scoring, where torch's sgemm is faster on some machines. Set from
        #: :func:`scpdr.lora.gemm_choice.choose_torch_rows`; None: the kernel at every size.
        self.torch_rows: int | None = None
        # kernels.gemm.LinearCall per (group mode, input shape, weight dtype): see _packed_forward
        self._calls: dict[tuple, LinearCall] = {}
        c = in_chunks(self._in) if packable(w) else 1  # float32 on CPU only (_base_forward)
        src = (w if source is None else source.to(w.dtype)).detach()
        packed = chunks = None
        if packs and gemm is not None:  # panels for kernels/packed_gemm.c, built once
            width = gemm.panel_width
            if weight_dtype == torch.float32 and q4 is not None and q4_exact(q4, src):
                packed = pack_q4_panels(q4, width)
            else:
                packed = pack_panels(src, width, dtype=weight_dtype)
            if a is not None and not lora_packed:  # a (L, in, r) = A_gᵀ, b (L, r, out) = s·B_gᵀ
                a = torch.stack([pack_panels(t.t(), width) for t in a])
                b = torch.stack([pack_panels(t.t(), width) for t in b])
        elif c > 1:  # (c, out, in/c) chunks
            chunks = src.view(self._out, c, self._in // c).permute(1, 0, 2).contiguous()
        relaid = packed is not None or chunks is not None
        # a re-laid-out original is dropped, unless kept for the calls of many rows
        self.base_layer = base_layer if not relaid or keep_original else None
        bias = None if not relaid or base_layer.bias is None else base_layer.bias.detach()
        for name, t in (
            ("weight_packed", packed),
            ("weight_chunks", chunks),
            ("bias", bias),
            ("lora_a_packed", a if packs else None),
            ("lora_b_packed", b if packs else None),
            ("lora_a", None if packs else a),
            ("lora_b", None if packs else b),
        ):
            self.register_buffer(name, t, persistent=False)

    @property
    def weight(self) -> Tensor:
        """The base weight ``(out, in)`` (so ``get_output_embeddings().weight`` still works; a
        copy for a re-laid-out weight)."""
        if self.base_layer is not None:
            return self.base_layer.weight
        if self.weight_packed is not None:  # bf16 panels: widened (exactly)
            return unpack_panels(self.weight_packed, self._out, self._in).to(torch.float32)
        return self.weight_chunks.permute(1, 0, 2).reshape(self._out, self._in)

    @property
    def weight_format(self) -> str:
        """How the base weight is held: ``"float32"``, ``"bf16"`` (bf16 panels) or ``"q4_1"``
        (GGUF Q4_1 blocks in q4 panels)."""
        w = self.weight_packed
        if w is None or w.dtype == torch.float32:
            return "float32"
        return "q4_1" if is_q4_panels(w) else "bf16"

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def out_features(self) -> int:
        return self._out

    def _base_forward(self, x: Tensor) -> Tensor:
        """``x·Wᵀ + bias`` ``(N, ..., out)``, a fresh contiguous tensor.

        CPU kernels (MKL, measured in ``docs/lora_fast_path.md``): for 2..TRANSPOSED_MAX_ROWS
        rows ``F.linear`` picks a small-M sgemm costing ~2x one row, while ``(W·xᵀ)ᵀ`` streams W
        once for all rows, as fast as one row when W has at most ~576 inputs; wider weights are
        split into input chunks of that size (one bmm, summed). With many rows, ``F.linear``.
        Both forms are float32 only: with bf16 weights plain ``F.linear`` was faster at 3 to 24
        rows on AMD Zen 4 and on an Intel Xeon with AMX alike (``docs/lora_fast_path.md``).
        """
        rows = x.numel() // x.shape[-1]
        few = (
            1 < rows <= TRANSPOSED_MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
        )
        w3 = self.weight_chunks
        if w3 is None:
            layer = self.base_layer
            if not few:
                return layer(x)
            y = torch.mm(layer.weight, x.reshape(rows, -1).t()).t()  # (rows, out), a view
            bias = layer.bias
        else:
            c, _, k = w3.shape
            x2 = x.reshape(rows, c * k)
            if rows == 1 or few:  # (c, out, k) @ (c, k, rows), summed over the chunks
                y = torch.bmm(w3, x2.t().reshape(c, k, rows)).sum(0).t()
            else:  # (c, rows, k) @ (c, k, out)
                y = torch.bmm(x2.view(rows, c, k).transpose(0, 1), w3.transpose(1, 2)).sum(0)
            bias = self.bias
        if bias is not None:
            y = y + bias
        return y.contiguous().view(*x.shape[:-1], self._out)

    def _groups(self) -> tuple[int, int, int]:
        """``(G, first, L)``: the input holds G groups of rows; groups ``first .. first + L - 1``
        of the adapters apply to the first L of them."""
        mode, n = self._mode, self.num_lora
        if mode.stacked is not None:
            return mode.stacked, 0, min(n, mode.stacked)
        if mode.single is not None and mode.single < n:
            return 1, mode.single, 1
        return 1, 0, 0

    def _packed_args(self, x: Tensor) -> tuple[Tensor, dict]:
        rows = x.numel() // self._in
        g, first, lora = self._groups()
        if rows % g:
            raise ValueError(f"{rows} input rows do not split into {g} stacked groups")
        buffers = self._buffers  # (nn.Module.__getattr__ costs ~1 µs a buffer, per call)
        kw = {"groups": g, "first": first, "lora": lora, "rank": self.rank,
              "lora_a": buffers["lora_a_packed"], "lora_b": buffers["lora_b_packed"]}  # fmt: skip
        return x.reshape(rows, self._in), kw

    def reference_forward(self, x: Tensor) -> Tensor:
        """:meth:`forward` of a packed layer computed by torch ops on the same layout
        (:func:`scpdr.kernels.gemm.lora_linear_reference`; differentiable): the slow reference
        the kernel is tested against, also used when autograd needs a graph, the input is not
        float32 on CPU (e.g. autocast, or a model moved after packing), or the kernel's
        library is gone."""
        if self.weight_packed is None:
            raise ValueError("reference_forward is the reference of a packed layer")
        w = self.weight_packed
        x2, kw = self._packed_args(x)
        dtype = (
            w.dtype if w.dtype.is_floating_point and w.dtype != torch.bfloat16 else torch.float32
        )
        # (bf16 and q4 panels are widened to float32)
        y = lora_linear_reference(x2.to(w.device, dtype), w, self._out, **kw)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.device, x.dtype).view(*x.shape[:-1], self._out)

    def _packed_forward(self, x: Tensor) -> Tensor:
        """:meth:`forward` on the packed layout: one call of the C kernel for the base matmul of
        all rows and the deltas of the groups with adapters, or :meth:`reference_forward`."""
        # per call, ~200 times a decoding step: attribute reads kept cheap (``is_cpu``, not
        # ``device.type``; the buffers dict, not nn.Module.__getattr__) and the call's fixed
        # arguments made once per input shape and group mode (kernels.gemm.LinearCall)
        buffers = self._buffers
        w = buffers["weight_packed"]
        lib = kernels.gemm.library(self.kernel_target)  # cached: a dict lookup
        if (
            lib is None
            or x.dtype is not torch.float32
            or not x.is_cpu
            or not w.is_cpu
            or w.dtype not in PANEL_DTYPES
            or (x.requires_grad and torch.is_grad_enabled())
        ):
            return self.reference_forward(x)
        mode = self._mode
        many = self.torch_rows
        if many is not None and x.numel() >= many * self._in:  # many rows: torch's sgemm
            original = self.base_layer
            if original is not None:  # kept (keep_original): the plain layer's own result
                return original(x)
            x2, kw = self._packed_args(x)
            y = lora_linear_torch(x2, w, self._out, **kw)
            if buffers["bias"] is not None:
                y = y + buffers["bias"]
            return y.view(*x.shape[:-1], self._out)
        key = (mode.stacked, mode.single, x.shape, w.dtype)
        call = self._calls.get(key)
        if call is None:
            g, first, lora = self._groups()
            call = linear_call(
                tuple(x.shape), w, self._out, groups=g, lora_a=buffers["lora_a_packed"],
                lora_b=buffers["lora_b_packed"], first=first, lora=lora, rank=self.rank,
            )  # fmt: skip
            self._calls[key] = call
        if not x.is_contiguous():
            x = x.contiguous()
        y = call(
            lib, x, w, buffers["lora_a_packed"], buffers["lora_b_packed"], torch.get_num_threads()
        )
        bias = buffers["bias"]
        if bias is not None:
            y += bias
        return y

    def forward(self, x: Tensor) -> Tensor:
        if self._buffers["weight_packed"] is not None:
            return self._packed_forward(x)
        y = self._base_forward(x)  # (N, ..., out), a fresh tensor
        mode, n = self._mode, self.num_lora
        if n == 0:
            return y
        if mode.stacked is not None:
            g = mode.stacked
            xs = x.reshape(g, -1, x.shape[-1])[:n]  # (L, B·T, in)
            ys = y.view(g, -1, y.shape[-1])  # (G, B·T, out), aliases y
            ys[:n].baddbmm_(torch.bmm(xs, self.lora_a), self.lora_b)
            return y
        if mode.single is not None and mode.single < n:
            i = mode.single
            return y + (x @ self.lora_a[i]) @ self.lora_b[i]
        return y

    def extra_repr(self) -> str:
        w = self.weight_packed
        kernel = "torch" if w is None else f"packed ({self.kernel_target})"
        if w is not None and w.dtype != torch.float32:
            kernel += f", {self.weight_format} weights"
        return f"groups_with_lora={self.num_lora}, rank={self.rank}, kernel={kernel}"
