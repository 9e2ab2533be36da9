"""Loading and saving models: the embedded base, HF directories, PEFT adapters, GGUF files,
vocabulary checks and the bundle manifest (layer 2 of ``shared/DESIGN.md``).

Modules: :mod:`~scpdr.models.embedded` (the embedded SmolLM2-135M-Instruct, its one-time GGUF
conversion and the ``$SCPDR_HOME`` cache), :mod:`~scpdr.models.loading` (a ref → model /
tokenizer), :mod:`~scpdr.models.vocab` (one token space: paper §2.3, Def. 2.1 compares
distributions token by token), :mod:`~scpdr.models.bundle` (``scpdr.json``, the constant base
vector of SCP-Δr-c). Every public name is importable from ``scpdr.models``.
"""

from __future__ import annotations

from scpdr.models.bundle import (
    BUNDLE_FORMAT_VERSION,
    BUNDLE_MANIFEST,
    CONSTANT_BASE_FILE,
    CONSTANT_BASE_KEY,
    BundleManifest,
    constant_base_vector,
    load_constant_base,
    read_bundle,
    resolve_ref,
    write_bundle,
)
from scpdr.models.embedded import (
    EMBEDDED,
    EMBEDDED_GGUF,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    EMBEDDED_PIP,
    base_model_dir,
    base_model_path,
    build_dir_atomically,
    embedded_gguf_path,
    embedded_tokenizer_dir,
    fix_special_tokens,
    load_gguf_model,
    scpdr_home,
)
from scpdr.models.loading import (
    Ref,
    adapter_base_ref,
    load_base,
    load_model,
    load_tokenizer,
    ref_kind,
)
from scpdr.models.vocab import check_compatible, check_model_vocab, output_size, vocab_hash

__all__ = [
    "BUNDLE_FORMAT_VERSION",
    "BUNDLE_MANIFEST",
    "CONSTANT_BASE_FILE",
    "CONSTANT_BASE_KEY",
    "EMBEDDED",
    "EMBEDDED_GGUF",
    "EMBEDDED_NAME",
    "EMBEDDED_PACKAGE",
    "EMBEDDED_PIP",
    "BundleManifest",
    "Ref",
    "adapter_base_ref",
    "base_model_dir",
    "base_model_path",
    "build_dir_atomically",
    "check_compatible",
    "check_model_vocab",
    "constant_base_vector",
    "embedded_gguf_path",
    "embedded_tokenizer_dir",
    "fix_special_tokens",
    "load_base",
    "load_constant_base",
    "load_gguf_model",
    "load_model",
    "load_tokenizer",
    "output_size",
    "read_bundle",
    "ref_kind",
    "resolve_ref",
    "scpdr_home",
    "vocab_hash",
    "write_bundle",
]
