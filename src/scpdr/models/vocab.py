"""Vocabulary checks: every model of a bundle shares one token space (layer 2 of
``shared/DESIGN.md``).

NAF aggregation (paper §2.3, Def. 2.1) compares distributions token by token, so every model in a
bundle must share one token space: :func:`check_compatible` enforces it before any aggregation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scpdr.errors import VocabularyMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["check_compatible", "check_model_vocab", "output_size", "vocab_hash"]


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
    without materializing a re-laid-out weight such as :mod:`scpdr.lora`'s packed head)."""
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
