"""The one interface every attack talks to: a :class:`Scorer`.

A scorer is a ``scpdr.ProtectedLM`` under any method, or a single model wrapped as the "No CP"
scorer (``ProtectedLM.from_model``). Attacks use only its black-box surface — teacher-forced
``score`` and ``next_token_logprobs`` (plus ``generate``) — and never reach into constituents;
the bound analysis (``scpdr.attacks.bounds_analysis``) is the one in-process exception, through
``score(..., components=True)``.

:class:`LogitsScorer` turns any ``logits_fn(input_ids, attention_mask) -> Tensor[B, T, V]`` into a
scorer. Tests use it with hand-written distributions (a model that has memorized its data
exactly, a uniform model, a random bigram model) whose attack results are known in closed form.

The batching helpers here pad, sort by length, and undo the sort, so the attacks can hand over
ragged token lists: right padding for teacher-forced ``score`` (position ``t`` of the output is
the log-prob of token ``t + 1``), left padding for ``next_token_logprobs`` (the next token follows
the last column).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "LogitsScorer",
    "ScoreResult",
    "Scorer",
    "SimpleGeneration",
    "batched_greedy",
    "batched_next_token",
    "batched_token_logprobs",
    "encode",
    "pad_batch",
    "pad_token_id",
    "scorer_name",
]


@runtime_checkable
class Scorer(Protocol):
    """What an attack needs from a model (``scpdr.ProtectedLM`` satisfies it).

    - ``next_token_logprobs(input_ids[B, T], attention_mask[B, T]) -> Tensor[B, V]``: the
      normalized log-distribution of the token after the last real position of each row.
    - ``score(input_ids[B, T], attention_mask[B, T], **flags)``: ``Tensor[B, T-1]`` log-prob of
      each actual next token; with flags an object with ``token_logprobs``, ``logprobs``
      (``[B, T-1, V]`` when ``full=True``), ``greedy`` (argmax token and its log-prob at every
      position when ``greedy=True``), ``k_x``, ``components`` (raw constituent/base log-probs).
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
    """Indices of ``seqs`` in batches of similar length (less padding, same results)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


# ---------------------------------------------------------------------------- output adapters


def _field(out: Any, name: str) -> Any:
    if isinstance(out, dict):
        return out.get(name)
    return getattr(out, name, None)


def _first_field(out: Any, *names: str) -> Any:
    """The first of ``names`` that ``out`` has (as a key or attribute) and is not None, else
    None: the output adapters accept each field under any of its usual names."""
    for name in names:
        val = _field(out, name)
        if val is not None:
            return val
    return None


def _greedy_of(out: Any) -> tuple[Tensor, Tensor | None]:
    """(greedy ids[B, T-1], their log-probs[B, T-1] or None) from a ``score(greedy=True)`` output."""
    g = _field(out, "greedy")
    if g is None:
        raise TypeError("score(..., greedy=True) returned no 'greedy' field")
    if isinstance(g, (tuple, list)) and len(g) == 2:
        return g[0], g[1]
    if isinstance(g, Tensor) and _field(out, "greedy_logprobs") is not None:
        return g, _field(out, "greedy_logprobs")
    ids = _first_field(g, "token_ids", "ids", "tokens")
    if ids is not None:
        return ids, _first_field(g, "logprobs", "token_logprobs")
    if isinstance(g, Tensor) and not g.is_floating_point():
        full = _field(out, "logprobs")
        lp = None if full is None else full.float().amax(dim=-1)
        return g, lp
    raise TypeError(f"cannot read greedy tokens from {type(g).__name__}")


def _token_logprobs_of(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    tl = _field(out, "token_logprobs")
    if tl is None:
        raise TypeError("score(...) output has no 'token_logprobs'")
    return tl


# ---------------------------------------------------------------------------- batched calls


def batched_token_logprobs(
    scorer: Scorer, seqs: Sequence[Sequence[int]], *, batch_size: int = 16
) -> list[Tensor]:
    """Teacher-forced log-prob of every actual next token: one ``Tensor[len(s) - 1]`` per
    sequence (float32, CPU), in the order given."""
    out: list[Tensor | None] = [None] * len(seqs)
    pid = pad_token_id(scorer.tokenizer)
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        tl = _token_logprobs_of(scorer.score(ids, mask)).detach().float().cpu()  # (B, T-1)
        for row, i in enumerate(idx):
            out[i] = tl[row, : max(len(seqs[i]) - 1, 0)].clone()
    return [t if t is not None else torch.empty(0) for t in out]


#: Bound on the floats of a ``full=True`` score output held at once (128 MiB of float32).
FULL_CHUNK_ELEMENTS = 1 << 25


def _vocab_size(scorer: Scorer) -> int | None:
    v = getattr(scorer, "vocab_size", None)
    if v is None:
        try:
            v = len(scorer.tokenizer)
        except TypeError:
            return None
    return int(v)


def _greedy_full(scorer: Scorer, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(greedy ids, greedy log-probs, token log-probs)`` ``[B, T-1]`` from ``full=True`` outputs,
    in row chunks of at most :data:`FULL_CHUNK_ELEMENTS` floats."""
    v = _vocab_size(scorer) or 1
    rows = max(1, FULL_CHUNK_ELEMENTS // max(1, ids.shape[1] * v))
    parts = []
    for s in range(0, ids.shape[0], rows):
        res = scorer.score(ids[s : s + rows], mask[s : s + rows], full=True)
        full = _field(res, "logprobs").detach().float()  # (b, T-1, V)
        g_lp, g_ids = full.max(dim=-1)
        parts.append((g_ids.cpu(), g_lp.cpu(), _token_logprobs_of(res).detach().float().cpu()))
        del full, res
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def batched_greedy(
    scorer: Scorer, seqs: Sequence[Sequence[int]], *, batch_size: int = 16
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Teacher-forced: for each sequence ``(greedy_ids[L], greedy_logprobs[L],
    token_logprobs[L])`` with ``L = len(s) - 1`` — at every prefix the argmax next token, its
    log-prob, and the log-prob of the true next token.

    One ``score(..., greedy=True)`` pass per batch when the scorer returns the greedy tokens'
    log-probs with them; otherwise the argmax is read off ``full=True`` distributions, in row
    chunks that bound the memory."""
    out: list[Any] = [None] * len(seqs)
    pid = pad_token_id(scorer.tokenizer)
    use_full = None
    for idx in _length_batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        if use_full is None:  # probe on two tokens: does greedy=True come with log-probs?
            use_full = _greedy_of(scorer.score(ids[:1, :2], mask[:1, :2], greedy=True))[1] is None
        if use_full:
            g_ids, g_lp, tl = _greedy_full(scorer, ids, mask)
        else:
            res = scorer.score(ids, mask, greedy=True)
            g_ids, g_lp = _greedy_of(res)
            tl = _token_logprobs_of(res)
        g_ids, g_lp, tl = (t.detach().cpu() for t in (g_ids, g_lp, tl))
        for row, i in enumerate(idx):
            n = max(len(seqs[i]) - 1, 0)
            out[i] = (
                g_ids[row, :n].long().clone(),
                g_lp[row, :n].float().clone(),
                tl[row, :n].float().clone(),
            )
    return out


def batched_next_token(
    scorer: Scorer,
    seqs: Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
    allowed: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Greedy next token after each sequence: ``(ids[N], logprobs[N])`` (the log-prob under the
    scorer's full distribution). ``allowed`` restricts the argmax to those token IDs (an
    attacker who knows the secret's alphabet, e.g. digits)."""
    ids_out = torch.empty(len(seqs), dtype=torch.long)
    lp_out = torch.empty(len(seqs), dtype=torch.float32)
    pid = pad_token_id(scorer.tokenizer)
    allowed_t = None if allowed is None else torch.as_tensor(list(allowed), dtype=torch.long)
    for idx in _length_batches(seqs, batch_size):
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


def _split_components(comp: Any) -> tuple[Tensor, Tensor | None]:
    """Accept ``(logps, base)``, an object/dict with ``constituents``/``logps`` and ``base``,
    or a bare ``Tensor[K, B, T-1, V]``."""
    if isinstance(comp, Tensor):
        return comp, None
    if isinstance(comp, (tuple, list)) and len(comp) == 2 and isinstance(comp[0], Tensor):
        return comp[0], comp[1]
    val = _first_field(comp, "constituents", "logps", "constituent_logprobs")
    if val is not None:
        if isinstance(val, (list, tuple)):
            val = torch.stack(list(val))
        return val, _first_field(comp, "base", "base_logprobs")
    raise TypeError(f"cannot read components from {type(comp).__name__}")


# ---------------------------------------------------------------------------- a generic scorer


@dataclass
class ScoreResult:
    """What :meth:`LogitsScorer.score` returns when a flag is set (the field names of
    ``scpdr.runtime.ScoreOutput``)."""

    token_logprobs: Tensor
    logprobs: Tensor | None = None
    greedy: tuple[Tensor, Tensor] | None = None
    k_x: Tensor | None = None
    components: Any = None


@dataclass
class SimpleGeneration:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    k_x: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_token_ids: list[int] = field(default_factory=list)


class LogitsScorer:
    """A :class:`Scorer` over ``logits_fn(input_ids[B, T], attention_mask[B, T]) ->
    Tensor[B, T, V]`` (next-token logits at every position; log-softmaxed here, in float32).

    Padding: ``next_token_logprobs`` reads each row's last real position (left or right padding
    both work); ``score`` expects right padding. No KV cache: meant for tests and small runs.
    """

    def __init__(
        self,
        logits_fn: Callable[[Tensor, Tensor], Tensor],
        tokenizer: Any,
        *,
        name: str = "scorer",
        components_fn: Callable[[Tensor, Tensor], Any] | None = None,
    ) -> None:
        self._logits_fn = logits_fn
        self._components_fn = components_fn
        self.tokenizer = tokenizer
        self.name = name

    def _logprobs(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self._logits_fn(input_ids, attention_mask)  # (B, T, V)
        return torch.log_softmax(logits.float(), dim=-1)

    def next_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """``Tensor[B, V]``: the distribution after each row's last real token."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logp = self._logprobs(input_ids, attention_mask)  # (B, T, V)
        pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        last = torch.where(attention_mask.bool(), pos, -1).max(dim=1).values  # (B,)
        return logp[torch.arange(input_ids.shape[0]), last]

    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        full: bool = False,
        greedy: bool = False,
        k_x: bool = False,
        components: bool = False,
    ) -> Tensor | ScoreResult:
        logp = self._logprobs(input_ids, attention_mask)[:, :-1]  # (B, T-1, V)
        tok = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        if not (full or greedy or k_x or components):
            return tok
        g = None
        if greedy:
            g_lp, g_ids = logp.max(dim=-1)
            g = (g_ids, g_lp)
        comp = None
        if components:
            if self._components_fn is None:
                raise TypeError(f"{self.name}: this scorer has no components")
            comp = self._components_fn(input_ids, attention_mask)
        return ScoreResult(tok, logp if full else None, g, None, comp)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        **_: Any,
    ) -> list[SimpleGeneration]:
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        outs = []
        for p in prompts:
            prompt = encode(self.tokenizer, p) if isinstance(p, str) else list(p)
            ids, lps, reason = list(prompt), [], "length"
            for _step in range(max_new_tokens):
                logp = self.next_token_logprobs(torch.tensor([ids]))[0]
                if temperature > 0:
                    t = int(
                        torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=gen)
                    )
                else:
                    t = int(logp.argmax())
                ids.append(t)
                lps.append(float(logp[t]))
                if stop_at_eos and eos is not None and t == eos:
                    reason = "stop"
                    break
            new = ids[len(prompt) :]
            outs.append(
                SimpleGeneration(
                    text=self.tokenizer.decode(new),
                    token_ids=new,
                    logprobs=lps,
                    finish_reason=reason,
                    prompt_token_ids=prompt,
                )
            )
        return outs
