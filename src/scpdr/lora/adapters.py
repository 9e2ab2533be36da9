"""Reading PEFT LoRA adapters for the shared-base runner (:mod:`scpdr.lora`; paper App. E,
Table 6: LoRA fine-tunes), and writing random ones (tests, benchmarks, smoke runs).

Only a plain LoRA (``ΔW = s·B A``, s = α/r or α/√r with rsLoRA) can be stacked: anything else
(DoRA, biases, ``modules_to_save``, embedding LoRA, trainable tokens, ...) raises
:class:`UnsupportedAdapterError` naming the feature, and the runtime uses the general path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

__all__ = ["LoraAdapter", "UnsupportedAdapterError", "read_lora_adapter", "save_random_lora"]

_PREFIX = "base_model.model."
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: adapter_config.json fields that do not change the inference forward of a plain LoRA (init
#: schemes, target selection, bookkeeping). Any other field with a non-empty value means a
#: variant this module does not implement (DoRA, biases, modules_to_save, ...): fall back.
_NEUTRAL_FIELDS = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "r",
        "target_modules",
        "exclude_modules",
        "lora_alpha",
        "lora_dropout",  # identity at inference
        "use_rslora",
        "init_lora_weights",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",  # ranks are read from the weight shapes
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "runtime_config",
        "qalora_group_size",
        "bias",  # checked separately: only "none"
    }
)


class UnsupportedAdapterError(ValueError):
    """The models cannot share one stacked forward; the message says why (logged, then the
    general path is used)."""


# --------------------------------------------------------------------------------------------
# reading adapters


@dataclass(frozen=True)
class LoraAdapter:
    """One PEFT LoRA adapter read from disk.

    ``modules`` maps a module path of the base model (e.g. ``model.layers.0.self_attn.q_proj``)
    to ``(A (r, in), B (out, r), scaling)``; ``extra`` holds full tensors the adapter stores
    besides A/B (PEFT saves ``lm_head``/``embed_tokens`` weights when they are targets), which
    must equal the base's; ``base_ref`` is the resolved base ref (``scpdr.models`` kinds).
    """

    path: Path
    base_ref: str
    modules: dict[str, tuple[Tensor, Tensor, float]]
    extra: dict[str, Tensor]


def read_lora_adapter(path: str | os.PathLike[str]) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.*``).

    Raises :class:`UnsupportedAdapterError` naming the feature when the adapter is not a plain
    LoRA this module can stack (see the module docstring), FileNotFoundError when files are
    missing.
    """
    from scpdr.models import adapter_base_ref

    d = Path(os.fspath(path))
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise UnsupportedAdapterError(f"{d} is not a PEFT adapter (no adapter_config.json)")
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    peft_type = str(cfg.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"{d} is a {peft_type or 'unknown'} adapter, not LoRA")
    if cfg.get("bias", "none") != "none":
        raise UnsupportedAdapterError(f"{d} trains biases (bias={cfg['bias']!r})")
    odd = sorted(
        k for k, v in cfg.items() if k not in _NEUTRAL_FIELDS and v not in (None, False, {}, [])
    )
    if odd:
        raise UnsupportedAdapterError(
            f"{d} uses LoRA options the fast path does not implement: "
            + ", ".join(f"{k}={cfg[k]!r}" for k in odd)
        )
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _load_adapter_tensors(d)
    a: dict[str, Tensor] = {}
    b: dict[str, Tensor] = {}
    extra: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if not key.startswith(_PREFIX):
            raise UnsupportedAdapterError(f"{d}: unexpected tensor {key!r}")
        name = key[len(_PREFIX) :]
        if name.endswith(".lora_A.weight"):
            a[name[: -len(".lora_A.weight")]] = t
        elif name.endswith(".lora_B.weight"):
            b[name[: -len(".lora_B.weight")]] = t
        elif name.endswith(".weight") and ".lora_" not in name and t.ndim == 2:
            # a full base weight PEFT saves for lm_head / embed_tokens targets
            extra[name[: -len(".weight")].removesuffix(".base_layer")] = t
        else:
            raise UnsupportedAdapterError(
                f"{d}: tensor {key!r} is not a LoRA A/B matrix (DoRA magnitude, embedding LoRA, "
                "bias or trainable tokens)"
            )
    if set(a) != set(b):
        raise UnsupportedAdapterError(f"{d}: unpaired LoRA matrices {sorted(set(a) ^ set(b))}")
    modules: dict[str, tuple[Tensor, Tensor, float]] = {}
    for name in sorted(a):
        ma, mb = a[name], b[name]
        if ma.ndim != 2 or mb.ndim != 2 or ma.shape[0] != mb.shape[1]:
            raise UnsupportedAdapterError(
                f"{d}: {name} has A {tuple(ma.shape)} and B {tuple(mb.shape)}, not a LoRA pair"
            )
        r = ma.shape[0]
        modules[name] = (ma, mb, alpha / math.sqrt(r) if rslora else alpha / r)
    if not modules:
        raise UnsupportedAdapterError(f"{d} holds no LoRA matrices")
    return LoraAdapter(d, adapter_base_ref(d), modules, extra)


def _load_adapter_tensors(d: Path) -> dict[str, Tensor]:
    for fname in _WEIGHT_FILES:
        f = d / fname
        if f.is_file():
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(f))
            return torch.load(str(f), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{d} has no adapter weights ({' or '.join(_WEIGHT_FILES)})")


def save_random_lora(
    base_model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    *,
    base_ref: str,
    r: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    std: float = 0.05,
    use_rslora: bool = False,
) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B over ``base_model`` into
    ``out_dir`` (a real ``PeftModel.save_pretrained`` directory), and return it.

    ``base_ref`` is written as ``base_model_name_or_path`` (a path relative to ``out_dir``, an
    absolute path, or "embedded"). Every A and B entry is drawn from N(0, ``std``²) with
    ``seed`` (PEFT initializes B to zero, which would make the delta vanish); dropout is 0.
    ``base_model`` is not modified (a deep copy is adapted).
    """
    import copy
    import warnings

    from peft import LoraConfig, get_peft_model

    out = Path(os.fspath(out_dir))
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # PEFT warns about tied lm_head targets
        warnings.simplefilter("ignore")
        pm = get_peft_model(copy.deepcopy(base_model), cfg)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
                if ".lora_A." in name or ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        pm.save_pretrained(str(out))
    cfg_file = out / "adapter_config.json"
    data = json.loads(cfg_file.read_text(encoding="utf-8"))
    data["base_model_name_or_path"] = base_ref
    from scpdr.io import atomic_write_json

    atomic_write_json(cfg_file, data)
    return out
