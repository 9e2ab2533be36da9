"""Engaging the shared-base runner for a bundle (:mod:`scpdr.lora`): detect whether every model a
method runs is a LoRA adapter over one common base (or that base itself), build the
:class:`~scpdr.lora.runner.StackedLoRA`, or say why not (logged at INFO; the runtime then uses
the general path). ``SCPDR_LORA_FAST=0`` turns the fast path off.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from scpdr.lora import mapped
from scpdr.lora.adapters import LoraAdapter, UnsupportedAdapterError, read_lora_adapter
from scpdr.lora.runner import StackedLoRA

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.models import BundleManifest

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_SWITCH",
    "CheckpointWeights",
    "checkpoint_weight_source",
    "fast_path_enabled",
    "fast_path_from_bundle",
    "gguf_file",
    "pack_full_model",
    "stacked_from_bundle",
]

#: Environment variable: set to "0" to turn the fast path off (the general path is then used).
ENV_SWITCH = "SCPDR_LORA_FAST"


def fast_path_enabled() -> bool:
    """Whether :data:`ENV_SWITCH` leaves the fast path on (unset, or anything but 0/false/no/off)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class CheckpointWeights:
    """``module name -> its weight`` read from the safetensors checkpoint in ``model_dir``
    (``model.safetensors`` or a sharded index), or None when absent. Each call opens its file
    with its own memory map, released once the returned tensor is dropped. :meth:`holds` tells
    whether a module's weight is still that checkpoint tensor's own mapped bytes without
    reading it (:mod:`scpdr.lora.mapped`)."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        d = Path(os.fspath(model_dir))
        index = d / "model.safetensors.index.json"
        self._dir = d
        self._files: dict[str, Path] | None = None
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            self._files = {k: d / v for k, v in weight_map.items()}

    def _file(self, key: str) -> Path | None:
        f = self._files.get(key) if self._files is not None else self._dir / "model.safetensors"
        return f if f is not None and f.is_file() else None

    def __call__(self, name: str) -> Tensor | None:
        from safetensors import safe_open

        key = f"{name}.weight"
        f = self._file(key)
        if f is None:
            return None
        with safe_open(str(f), framework="pt") as fh:
            return fh.get_tensor(key) if key in fh.keys() else None

    def holds(self, name: str, w: Tensor) -> bool | None:
        """:func:`scpdr.lora.mapped.holds` for module ``name``'s weight ``w``: True when ``w``
        is this checkpoint's unwritten mapped tensor, False when it is that view but written
        since, None when that cannot be told."""
        key = f"{name}.weight"
        f = self._file(key)
        return None if f is None else mapped.holds(w, f, key)


def checkpoint_weight_source(model_dir: str | os.PathLike[str]) -> CheckpointWeights:
    """The weights of the safetensors checkpoint in ``model_dir`` by module name
    (:class:`CheckpointWeights`)."""
    return CheckpointWeights(model_dir)


def _canonical(ref: str) -> str:
    from scpdr.models import EMBEDDED, base_model_dir

    if ref == EMBEDDED:
        return str(base_model_dir().resolve())
    return str(Path(ref).resolve())


def gguf_file(ref: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model ref is loaded from: the ref itself (a ``.gguf`` path), or the
    embedded model's for ``embedded`` and its converted directory; else None (nothing is read).
    Such a base decodes from its Q4_1 blocks in float32 where measured faster
    (:func:`pack_full_model`, ``StackedLoRA(q4_source=...)``)."""
    from scpdr.models import EMBEDDED, base_model_path, embedded_gguf_path

    ref = os.fspath(ref)
    try:
        if ref.lower().endswith(".gguf"):
            return Path(ref)
        if ref == EMBEDDED or Path(ref).resolve() == base_model_path().resolve():
            return embedded_gguf_path()
    except (FileNotFoundError, ImportError, OSError) as exc:  # no embedded package here
        logger.debug("no GGUF file for %s: %s", ref, exc)
    return None


def _q4_source(base: str, model: Any) -> Callable[[str], Tensor | None] | None:
    """The GGUF Q4_1 blocks of the base ``base`` (a canonical ref) where it was loaded from a
    GGUF file (:func:`gguf_file`; :func:`scpdr.kernels.q4.gguf_q4_source`: what they give is
    checked against each weight before use)."""
    from scpdr.kernels.q4 import gguf_q4_source

    path = gguf_file(base)
    return None if path is None else gguf_q4_source(path, model.config)


def stacked_from_bundle(
    path: str | os.PathLike[str],
    manifest: BundleManifest,
    *,
    method: str,
    base: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> StackedLoRA | None:
    """The fast path for a bundle, or None (general path) with the reason logged at INFO; see
    :func:`fast_path_from_bundle`."""
    return fast_path_from_bundle(
        path, manifest, method=method, base=base, dtype=dtype, device=device
    )[0]


def fast_path_from_bundle(
    path: str | os.PathLike[str],
    manifest: BundleManifest,
    *,
    method: str,
    base: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[StackedLoRA | None, str]:
    """``(stack, why)``: the fast path for a bundle, or ``(None, why not)`` (the general path);
    the reason is also logged at INFO.

    Groups, in the runtime's run order: the constituents (all for every method but "none"),
    then the bundle's base when the method is an SCP rule with ``base="model"`` (variant 'b').
    Each group must be a LoRA adapter over one common base or that base itself. ``dtype``
    ``torch.bfloat16`` on CPU keeps the base's linears in bf16 on the packed kernel, which
    computes in float32 (``StackedLoRA(weight_dtype=...)``).
    """
    from scpdr import methods
    from scpdr.models import load_model, ref_kind

    def off(reason: str) -> tuple[None, str]:
        logger.info("LoRA fast path off for bundle %s: %s; using the general path", path, reason)
        return None, reason

    if not fast_path_enabled():
        return off(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if method == "none":
        return off("method 'none' runs one model (the merged adapter is as fast)")
    scp_b = method in methods.SMOOTHED_RULES and base == "model"
    if scp_b and manifest.base is None:
        return off("the bundle has no base model")
    refs = [manifest.resolve(path, r) for r in manifest.constituents]
    names = list(manifest.constituents)
    if scp_b:
        refs.append(manifest.resolve(path, str(manifest.base)))
        names.append("base")
    adapters: list[LoraAdapter | None] = []
    for ref, name in zip(refs, names, strict=True):
        try:
            kind = ref_kind(ref)
        except FileNotFoundError as exc:
            return off(str(exc))
        if kind != "peft":
            adapters.append(None)  # must be the common base itself (checked below)
            continue
        try:
            adapters.append(read_lora_adapter(ref))
        except (UnsupportedAdapterError, FileNotFoundError) as exc:
            return off(f"{name}: {exc}")
    bases = {_canonical(a.base_ref) for a in adapters if a is not None}
    if not bases:
        return off("no constituent is a LoRA adapter")
    if len(bases) > 1:
        return off(f"the adapters have different base models ({', '.join(sorted(bases))})")
    common = next(iter(bases))
    for ref, name, a in zip(refs, names, adapters, strict=True):
        if a is None and _canonical(ref) != common:
            return off(f"{name} ({ref}) is a full model, not a LoRA adapter over {common}")
    # bf16 on CPU: the base loads in float32 and its linears keep bf16 weights that the packed
    # kernel widens (computing in float32); elsewhere the model loads in ``dtype``
    cpu = device is None or torch.device(device).type == "cpu"
    bf16_panels = cpu and dtype == torch.bfloat16
    model = load_model(common, dtype=None if bf16_panels else dtype)
    if device is not None:
        model = model.to(device)
    source = checkpoint_weight_source(common) if Path(common).is_dir() else None
    weight_dtype = torch.bfloat16 if bf16_panels else torch.float32
    try:
        stack = StackedLoRA(
            model, adapters, names, weight_source=source, release_adapters=True,
            weight_dtype=weight_dtype, q4_source=_q4_source(common, model),
        )  # fmt: skip
    except UnsupportedAdapterError as exc:
        return off(str(exc))
    why = (
        f"{stack.num_groups} groups ({sum(a is not None for a in adapters)} with LoRA adapters) "
        f"over {common} in one forward"
    )
    logger.info("LoRA fast path on for bundle %s: %s", path, why)
    return stack, why


def pack_full_model(
    ref: str, model: Any, *, q4_source: Callable[[str], Tensor | None] | None = None
) -> bool:
    """Decode a full model of the general path (one forward per model) from its GGUF Q4_1 blocks
    where it was loaded from a GGUF file (the embedded base, or a ``.gguf`` ref): in place, each
    float32 CPU ``nn.Linear`` whose blocks dequantize to its weight exactly becomes a
    :class:`~scpdr.lora.StackedLoraLinear` of one group without adapters on q4 panels that keeps
    the original too (``keep_original``). Decoding steps run the packed kernel on the blocks,
    bit for bit the float32 kernel on the same weights (~3/16 of the bytes streamed); calls of
    many rows (prefill, scoring) run the original ``nn.Linear`` where torch is faster
    (:func:`scpdr.lora.gemm_choice.choose_torch_rows`), so those are the plain model's. Used
    only where this machine measured the kernel on the blocks faster than on float32 panels and
    than torch at the decode steps of batch 1 and 8 (:func:`~scpdr.lora.choose_stack_kernel`,
    :func:`~scpdr.lora.choose_q4`). The original weights stay (memory-mapped from the
    checkpoint): the blocks add ~1/5 of them. ``q4_source``: ``module name -> Q4_1 blocks |
    None`` (:func:`scpdr.kernels.q4.gguf_q4_source`; default: ``ref``'s GGUF file, if any).
    Returns whether any linear was packed; False, the model untouched, on a GPU, with bf16
    weights, for a model with no GGUF file, without a kernel build, where not faster, or with
    ``SCPDR_GEMM_KERNEL=0``."""
    from torch import nn

    from scpdr.kernels.q4 import q4_exact
    from scpdr.lora.gemm_choice import choose_stack_kernel, choose_torch_rows
    from scpdr.lora.layers import GroupMode, StackedLoraLinear, packable

    linears = {name: mod for name, mod in model.named_modules()  # checked before any file I/O
               if type(mod) is nn.Linear and packable(mod.weight) and mod.in_features % 32 == 0}  # fmt: skip
    source = (q4_source or _q4_source(_canonical(ref), model)) if linears else None
    if source is None:
        return False
    blocks = {name: found for name in linears if (found := source(name)) is not None}
    shapes = [(linears[n].in_features, linears[n].out_features, 0) for n in blocks]
    stack = choose_stack_kernel(shapes, shapes, groups=1, lora=0)  # the blocks, where faster
    gemm = stack.gemm
    if gemm is None or not stack.q4:
        return False
    mode = GroupMode()  # never stacked: the plain model
    packed = []
    for name, q4 in blocks.items():
        layer = linears[name]
        if not q4_exact(q4, layer.weight):  # not these weights (a fine-tune of the GGUF's)
            continue
        wrapped = StackedLoraLinear(layer, None, None, mode, gemm=gemm, q4=q4, keep_original=True)
        model.set_submodule(name, wrapped)
        packed.append(wrapped)
    if not packed:
        return False
    many = choose_torch_rows(
        gemm, sorted(set(shapes)), groups=1, lora=0, weight_format="q4_1", keep_original=True
    )
    for lin in packed:
        lin.torch_rows = many
    logger.info(
        "%s decodes %d of its linears from their GGUF Q4_1 blocks on the packed kernel (%s)",
        ref, len(packed), "the kernel at every size" if many is None
        else f"torch's matmuls from {many} rows",
    )  # fmt: skip
    return True
