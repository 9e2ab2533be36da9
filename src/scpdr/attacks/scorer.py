"""The one interface every attack talks to — a :class:`Scorer` — and the one way attacks query it:
the protocol of the black-box TDE game (Def. 4.2).

A scorer is a ``scpdr.ProtectedLM`` under any method, or a single model wrapped as the "No CP"
scorer (``ProtectedLM.from_model``). Attacks use only its black-box surface — teacher-forced
``score`` and ``next_token_logprobs`` (plus ``generate``) — and never reach into constituents;
the bound analysis (``scpdr.attacks.bounds_analysis``) is the one in-process exception, through
``score(..., components=True)``.

**The protocol.** In the TDE game the adversary *queries* the model with a prefix and reads the
next-token distribution a fresh API request returns. Every attack reads the model through
:func:`score_requests` (and the batching helpers built on it), never through ``scorer.score``:

- by default every position is a **fresh request** of its prefix: ``prompt_lengths`` = each row's
  real length, so a stateful method's path is empty at every position (CP-Fuse is then CP-ΔKL
  at every step: "the fusing mechanism of CP-Fuse has no effect on the first generated token",
  §5.3) — TTE, LiRA, the MIA suite and utility;
- with ``prompt_lengths`` given, row ``b``'s tokens after its first ``prompt_lengths[b]`` are a
  **continuation** of that prompt, scored as ``generate`` would have produced them (CP-Fuse's
  path starts at the prompt's end) — canary exposure (the secret given its prefix).

``next_token_logprobs`` is always a fresh request (PII extraction).

The batching helpers pad, sort by length, and undo the sort, so the attacks can hand over ragged
token lists: right padding for teacher-forced ``score`` (position ``t`` of the output is the
log-prob of token ``t + 1``), left padding for ``next_token_logprobs`` (the next token follows the
last column). :class:`scpdr.attacks.logits_scorer.LogitsScorer` turns any function of the input
ids into a scorer (tests use it with hand-written distributions).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "FULL_CHUNK_ELEMENTS",
    "PositionStats",
    "Scorer",
    "batched_greedy",
    "batched_next_token",
    "batched_position_stats",
    "batched_token_logprobs",
    "encode",
    "pad_batch",
    "pad_token_id",
    "score_requests",
    "scorer_name",
    "split_components",
    "token_moments",
]


@runtime_checkable
class Scorer(Protocol):
    """What an attack needs from a model (``scpdr.ProtectedLM`` satisfies it).

    - ``next_token_logprobs(input_ids[B, T], attention_mask[B, T]) -> Tensor[B, V]``: the
      normalized log-distribution of the token after the last real position of each row, as a
      fresh request of that row.
    - ``score(input_ids[B, T], attention_mask[B, T], *, prompt_lengths, **flags)``:
      ``Tensor[B, T-1]`` log-prob of each actual next token, each row's tokens after its first
      ``prompt_lengths[b]`` scored as a continuation of that prompt (a stateless rule ignores
      it); with flags an object with ``token_logprobs``, ``logprobs`` (``[B, T-1, V]`` when
      ``full=True``), ``top_ids``/``top_logprobs`` (``[B, T-1, n]`` when ``top_logprobs=n``),
      ``components`` (raw constituent/base log-probs).
    - ``generate(prompts, *, max_new_tokens, temperature=0.0, ...) -> list[Generation]``.
    """

    tokenizer: Any
    name: str

    def next_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor: ...

    def score(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, **flags: Any
    ) -> Any: ...

    def generate(self, prompts: Any, **kwargs: Any) -> list[Any]: ...


def scorer_name(scorer: Any, default: str = "scorer") -> str:
    return str(getattr(scorer, "name", None) or default)


# ---------------------------------------------------------------------------- tokenization


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token IDs of ``text``: the one place attacks tokenize. A text that starts a document
    (a prompt, a training example) gets the tokenizer's special tokens as in training
    (``scpdr.training`` tokenizes with the default); a continuation (a canary's secret) passes
    ``add_special_tokens=False``."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # minimal tokenizers without the keyword
        return list(tokenizer.encode(text))


def pad_token_id(tokenizer: Any) -> int:
    """The pad ID used for masked positions (its value never matters: it is masked)."""
    for attr in ("pad_token_id", "eos_token_id"):
        val = getattr(tokenizer, attr, None)
        if val is not None:
            return int(val)
    return 0


def pad_batch(
    seqs: Sequence[Sequence[int]], *, pad_id: int = 0, side: str = "right"
) -> tuple[Tensor, Tensor]:
    """Pad ragged ID lists to ``(input_ids[B, T], attention_mask[B, T])`` (int64)."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        row = torch.as_tensor(list(s), dtype=torch.long)
        if side == "right":
            ids[i, : len(s)] = row
            mask[i, : len(s)] = 1
        else:
            ids[i, width - len(s) :] = row
            mask[i, width - len(s) :] = 1
    return ids, mask


def _length_batches(seqs: Sequence[Sequence[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of the sequences of at least 2 tokens (the others have nothing to score), in
    batches of similar length (less padding, same results)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted((i for i in range(len(seqs)) if len(seqs[i]) >= 2), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


# ---------------------------------------------------------------------------- the protocol


def score_requests(
    scorer: Scorer,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    prompt_lengths: Sequence[int] | Tensor | None = None,
    **flags: Any,
) -> Any:
    """``scorer.score`` under the TDE game's protocol (Def. 4.2): the one call of every attack.

    ``input_ids``/``attention_mask``: ``(B, T)``, right-padded. ``prompt_lengths`` None: every
    position is read as a fresh request of its prefix (``prompt_lengths`` = each row's real
    length: a stateful rule's path is empty everywhere). Given: row ``b``'s tokens after its first
    ``prompt_lengths[b]`` are the continuation of that prompt (CP-Fuse's path starts there, as in
    ``generate``). ``flags`` go to ``score`` (``full``, ``top_logprobs``, ...)."""
    if prompt_lengths is None:
        lengths = attention_mask.sum(-1)  # (B,): the whole row is the prompt
    else:
        lengths = torch.as_tensor(prompt_lengths, dtype=torch.long)
    return scorer.score(input_ids, attention_mask, prompt_lengths=lengths, **flags)


def _field(out: Any, name: str) -> Any:
    return out.get(name) if isinstance(out, dict) else getattr(out, name, None)


def _token_logprobs_of(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    tl = _field(out, "token_logprobs")
    if tl is None:
        raise TypeError("score(...) output has no 'token_logprobs'")
    return tl


# ---------------------------------------------------------------------------- batched calls


def batched_token_logprobs(
    scorer: Scorer,
    seqs: Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
    prompt_lengths: Sequence[int] | None = None,
) -> list[Tensor]:
    """Teacher-forced log-prob of every actual next token: one ``Tensor[len(s) - 1]`` per
    sequence (float32, CPU), in the order given. Every prefix is a fresh request, unless
    ``prompt_lengths`` (one per sequence) makes the rest of each sequence the continuation of
    its prompt (:func:`score_requests`)."""
    if prompt_lengths is not None and len(prompt_lengths) != len(seqs):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(seqs)} sequences")
    out = [torch.empty(0) for _ in seqs]
    pid = pad_token_id(scorer.tokenizer)
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        pl = None if prompt_lengths is None else [prompt_lengths[i] for i in idx]
        res = score_requests(scorer, ids, mask, prompt_lengths=pl)
        tl = _token_logprobs_of(res).detach().float().cpu()  # (B, T-1)
        for row, i in enumerate(idx):
            out[i] = tl[row, : len(seqs[i]) - 1].clone()
    return out


#: Bound on the floats of a ``full=True`` score output held at once (128 MiB of float32).
FULL_CHUNK_ELEMENTS = 1 << 25


def _vocab_size(scorer: Scorer) -> int:
    v = getattr(scorer, "vocab_size", None)
    if v is None:
        try:
            v = len(scorer.tokenizer)
        except TypeError:
            return 1
    return int(v)


def batched_greedy(
    scorer: Scorer, seqs: Sequence[Sequence[int]], *, batch_size: int = 16
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every prefix as a fresh request: for each sequence ``(greedy_ids[L], greedy_logprobs[L],
    token_logprobs[L])`` with ``L = len(s) - 1`` — at every prefix the argmax next token, its
    log-prob, and the log-prob of the true next token. One ``score(..., top_logprobs=1)`` pass
    per batch."""
    out: list[Any] = [(torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0))] * len(
        seqs
    )
    pid = pad_token_id(scorer.tokenizer)
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        res = score_requests(scorer, ids, mask, top_logprobs=1)
        g_ids = _field(res, "top_ids")[..., 0].detach().cpu()  # (B, T-1)
        g_lp = _field(res, "top_logprobs")[..., 0].detach().float().cpu()
        tl = _token_logprobs_of(res).detach().float().cpu()
        for row, i in enumerate(idx):
            n = len(seqs[i]) - 1
            out[i] = (g_ids[row, :n].long().clone(), g_lp[row, :n].clone(), tl[row, :n].clone())
    return out


@dataclass(frozen=True)
class PositionStats:
    """What a fresh request of every prefix of one sequence reveals (``[L]`` float64 arrays,
    ``L = len(s) - 1``, entry ``t`` about token ``t + 1``): the log-prob of the actual token,
    and the mean ``mu`` and standard deviation ``sigma`` of ``log r(z)`` for ``z`` drawn from the
    same next-token distribution ``r`` (Min-K%++, Zhang et al. 2024)."""

    token_logprobs: Any
    mu: Any
    sigma: Any


def token_moments(logp: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and std of ``log r(z)``, ``z ~ r``, over the last axis of log-probs ``(..., V)``
    (zero-probability tokens contribute nothing)."""
    p = logp.exp()
    finite = torch.isfinite(logp)
    lp = torch.where(finite, logp, torch.zeros((), dtype=logp.dtype))
    mu = (p * lp).sum(-1)
    var = (p * lp * lp).sum(-1) - mu * mu
    return mu, var.clamp_min(0.0).sqrt()


def batched_position_stats(
    scorer: Scorer, seqs: Sequence[Sequence[int]], *, batch_size: int = 16
) -> list[PositionStats]:
    """:class:`PositionStats` of every sequence, every prefix a fresh request: one
    ``score(..., full=True)`` call per row chunk that holds at most :data:`FULL_CHUNK_ELEMENTS`
    floats of distributions, reduced to two numbers per position before the next chunk."""
    import numpy as np

    empty = np.zeros(0)
    out = [PositionStats(empty, empty, empty) for _ in seqs]
    pid = pad_token_id(scorer.tokenizer)
    v = _vocab_size(scorer)
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        rows = max(1, FULL_CHUNK_ELEMENTS // max(1, ids.shape[1] * v))
        for s in range(0, len(idx), rows):
            res = score_requests(scorer, ids[s : s + rows], mask[s : s + rows], full=True)
            full = _field(res, "logprobs").detach().float()  # (b, T-1, V)
            mu, sd = (t.cpu().double().numpy() for t in token_moments(full))
            tl = _token_logprobs_of(res).detach().cpu().double().numpy()
            del full, res
            for row, i in enumerate(idx[s : s + rows]):
                n = len(seqs[i]) - 1
                out[i] = PositionStats(tl[row, :n].copy(), mu[row, :n].copy(), sd[row, :n].copy())
    return out


def batched_next_token(
    scorer: Scorer,
    seqs: Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
    allowed: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Greedy next token after each sequence, each a fresh request: ``(ids[N], logprobs[N])``
    (the log-prob under the scorer's full distribution). ``allowed`` restricts the argmax to those
    token IDs (an attacker who knows the secret's alphabet, e.g. digits)."""
    ids_out = torch.empty(len(seqs), dtype=torch.long)
    lp_out = torch.empty(len(seqs), dtype=torch.float32)
    pid = pad_token_id(scorer.tokenizer)
    allowed_t = None if allowed is None else torch.as_tensor(list(allowed), dtype=torch.long)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="left")
        logp = scorer.next_token_logprobs(ids, mask).detach().float().cpu()  # (B, V)
        if allowed_t is None:
            lp, tok = logp.max(dim=-1)
        else:
            sub = logp.index_select(-1, allowed_t)
            lp, j = sub.max(dim=-1)
            tok = allowed_t[j]
        ids_out[idx] = tok
        lp_out[idx] = lp
    return ids_out, lp_out


def split_components(comp: Any) -> tuple[Tensor, Tensor | None]:
    """``(constituent log-probs[K', B, T-1, V], base[B, T-1, V] | None)`` of a
    ``score(..., components=True)`` output's ``components``: ``(logps, base)``, an object/dict
    with ``logps`` (or ``constituents``) and ``base``, or a bare tensor."""
    if isinstance(comp, Tensor):
        return comp, None
    if isinstance(comp, (tuple, list)) and len(comp) == 2 and isinstance(comp[0], Tensor):
        return comp[0], comp[1]
    for name in ("logps", "constituents"):
        val = _field(comp, name)
        if val is not None:
            if isinstance(val, (list, tuple)):
                val = torch.stack(list(val))
            return val, _field(comp, "base")
    raise TypeError(f"cannot read components from {type(comp).__name__}")
