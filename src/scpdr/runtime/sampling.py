"""Sampling parameters (the one :class:`SamplingParams` type, per sequence) and batched sampling
from the aggregate distribution r.

Sampling draws from ``r^(1/temperature)`` restricted to the top-k tokens and the top-p nucleus;
temperature 0 is greedy (argmax of r). The served log-probs and the certificate are always those
of r itself (before temperature, top-k, top-p): the NAF guarantee is about r (Def. 2.1).

Batched: every row's temperature, top-k threshold and top-p nucleus are applied to the whole
``(B, V)`` batch at once, and the nucleus is found among the most likely candidates
(``torch.topk``, widened until it holds top_p of the mass) instead of a sort of all V logits of
every row. Only the random draw stays per row, because each row has its own ``torch.Generator``
(a row's tokens depend on its seed alone, never on the rest of its batch): it is
``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn from the row's generator, which is exactly what
``torch.multinomial(probs, 1, generator=g)`` computes. A seed therefore gives the tokens the
former per-row sampler gave (tested token for token); only a nucleus boundary within float
rounding of top_p could fall the other way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

import torch
from torch import Tensor

from scpdr.runtime.stop_strings import check_stop, per_prompt_stop

__all__ = [
    "ON_BUDGET",
    "SamplingOptions",
    "SamplingParams",
    "make_generator",
    "resolve_sampling",
    "sample",
]

#: What a response does when its budget cannot serve its next position: end ("stop") or
#: continue from the base model ("base", ``docs/accountant.md``, Proposition 3).
ON_BUDGET = ("stop", "base")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one sequence (one prompt, one choice), validated at construction.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 0).
        temperature: 0 = greedy (argmax of r); > 0 samples from ``r^(1/temperature)``.
        top_p: nucleus mass in (0, 1]: keep the smallest set of most likely tokens with at
            least this mass (1 = off).
        top_k: keep the k most likely tokens (0 = off).
        stop: stop strings (a str or a sequence of non-empty str; stored as a tuple). The text
            is cut before the first match; the token that completed it is kept.
        seed: sampling seed of this sequence (None: drawn from torch's global RNG, so
            ``torch.manual_seed`` makes it reproducible).
        logprobs: None = no alternatives; ``k >= 0`` = also the k most likely tokens of r at
            every served position (the chosen token's log-prob is always returned).
        echo: also score the prompt (teacher forcing; each prefix as a fresh request).
        stop_at_eos: finish at an eos token (kept in the output).
        budget: most nats the response may be charged (:func:`scpdr.bounds.token_cost`, summed
            over its tokens and echoed prompt positions); a token whose charge would take it
            past the budget is not emitted and the sequence ends ("budget"). None: no budget.
        on_budget: what a response does when its next position cannot be served within its
            budget: "stop" (end with finish_reason "budget", as above) or "base" (continue from
            the base model's next-token distribution, charged 0: a position is served from the
            private aggregate only while ``Σ cost + t_x <= budget``, decided before the draw;
            ``docs/accountant.md``, Proposition 3). "base" needs a base model (variant 'b').
        anchor: nats per token ``c``: serve ``q = λ r + (1 - λ) b`` with the largest λ such that
            ``|log q(y) - log b(y)| <= c`` for every y (:func:`scpdr.bounds.anchor`; the base
            model b, variant 'b'). None: serve r.
        anchor_budget: most nats of the certificate against the base (Σ of the per-token
            ``anchor`` charges, each <= ``anchor``) the response may spend: a position is served
            from the anchored aggregate only while ``Σ anchor + anchor <= anchor_budget`` (decided
            before the draw, on the worst case c), then as ``on_budget`` says. Needs ``anchor``.

    Raises:
        ValueError: naming the field and the accepted values.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    stop_at_eos: bool = True
    budget: float | None = None
    on_budget: str = "stop"
    anchor: float | None = None
    anchor_budget: float | None = None

    def __post_init__(self) -> None:
        x = self.max_new_tokens
        if not _is_int(x) or x < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {x!r}")
        x = self.temperature
        if not _is_number(x) or not math.isfinite(x) or x < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {x!r}")
        x = self.top_p
        if not _is_number(x) or not 0 < x <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {x!r}")
        x = self.top_k
        if not _is_int(x) or x < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {x!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        x = self.logprobs
        if x is not None and (not _is_int(x) or x < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {x!r}")
        for name in ("echo", "stop_at_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        x = self.budget
        if x is not None and (not _is_number(x) or not x >= 0):
            raise ValueError(f"budget must be None or a number of nats >= 0, got {x!r}")
        if x is not None:
            object.__setattr__(self, "budget", float(x))
        if self.on_budget not in ON_BUDGET:
            raise ValueError(
                f"on_budget must be one of {', '.join(map(repr, ON_BUDGET))}, got "
                f"{self.on_budget!r}"
            )
        for name in ("anchor", "anchor_budget"):
            x = getattr(self, name)
            if x is not None and (not _is_number(x) or not math.isfinite(x) or x < 0):
                raise ValueError(f"{name} must be None or a finite number of nats >= 0, got {x!r}")
            if x is not None:
                object.__setattr__(self, name, float(x))
        if self.anchor_budget is not None and self.anchor is None:
            raise ValueError(
                "anchor_budget bounds the certificate against the base of anchored serving: "
                "set anchor=c too (nats per token), or use budget= for the certificate against "
                "the constituents"
            )
        object.__setattr__(self, "stop", check_stop(self.stop))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_base(self) -> bool:
        """Whether the row needs the base model's distribution: anchored, or falling back."""
        return self.anchor is not None or self.on_budget == "base"

    @classmethod
    def per_prompt(
        cls,
        n: int,
        *,
        max_new_tokens: int | Sequence[int] = 32,
        temperature: float | Sequence[float] = 0.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        stop: str | Sequence[Any] | None = None,
        seed: int | Sequence[int | None] | None = None,
        stop_at_eos: bool | Sequence[bool] = True,
        top_logprobs: int = 0,
        echo: bool | Sequence[bool] = False,
        budget: float | Sequence[float | None] | None = None,
        on_budget: str | Sequence[str] = "stop",
        anchor: float | Sequence[float | None] | None = None,
        anchor_budget: float | Sequence[float | None] | None = None,
    ) -> list[SamplingParams]:
        """One :class:`SamplingParams` per prompt from ``generate``'s keyword arguments: each
        value is shared, or a list with one entry per prompt; ``stop`` as
        :func:`~scpdr.runtime.stop_strings.per_prompt_stop`; ``top_logprobs`` (0 = none) is
        shared."""
        if not _is_int(top_logprobs) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        cols = {
            "max_new_tokens": _per_row(max_new_tokens, n, "max_new_tokens"),
            "temperature": _per_row(temperature, n, "temperature"),
            "top_p": _per_row(top_p, n, "top_p"),
            "top_k": _per_row(top_k, n, "top_k"),
            "seed": _per_row(seed, n, "seed"),
            "stop_at_eos": _per_row(stop_at_eos, n, "stop_at_eos"),
            "echo": _per_row(echo, n, "echo"),
            "budget": _per_row(budget, n, "budget"),
            "on_budget": _per_row(on_budget, n, "on_budget"),
            "anchor": _per_row(anchor, n, "anchor"),
            "anchor_budget": _per_row(anchor_budget, n, "anchor_budget"),
            "stop": per_prompt_stop(stop, n),
        }
        lp = top_logprobs or None
        return [cls(logprobs=lp, **{k: v[i] for k, v in cols.items()}) for i in range(n)]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    """``value`` as a list of ``n`` entries (one value shared, or a list with one per prompt)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts")
        return list(value)
    return [value] * n


class SamplingOptions(TypedDict, total=False):
    """The sampling keyword arguments of ``ProtectedLM.generate``/``generate_stream``: those of
    :meth:`SamplingParams.per_prompt` (each one value, or a list with one entry per prompt)."""

    max_new_tokens: int | Sequence[int]
    temperature: float | Sequence[float]
    top_p: float | Sequence[float]
    top_k: int | Sequence[int]
    stop: str | Sequence[Any] | None
    seed: int | Sequence[int | None] | None
    stop_at_eos: bool | Sequence[bool]
    top_logprobs: int
    echo: bool | Sequence[bool]
    budget: float | Sequence[float | None] | None
    on_budget: str | Sequence[str]
    anchor: float | Sequence[float | None] | None
    anchor_budget: float | Sequence[float | None] | None


def resolve_sampling(
    n: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    options: SamplingOptions,
) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt: ``sampling`` (one shared, or one per prompt), or
    when it is None, :meth:`SamplingParams.per_prompt` of ``generate``'s keyword ``options``
    (which must then be the only way the parameters are given)."""
    unknown = sorted(set(options) - set(SamplingOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; the sampling arguments are "
            f"{', '.join(SamplingOptions.__annotations__)} (or sampling=SamplingParams(...))"
        )
    if sampling is None:
        return SamplingParams.per_prompt(n, **options)
    if options:
        raise ValueError(
            f"pass the sampling parameters either as sampling= or as keyword arguments, not "
            f"both (got sampling= and {', '.join(sorted(options))})"
        )
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    params = list(sampling)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(
            f"sampling must be one SamplingParams or one per prompt ({n}), got {sampling!r}"
        )
    return params


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The row's generator: None when greedy; seeded with ``params.seed``, or with a seed drawn
    from torch's global RNG (so ``torch.manual_seed`` makes an unseeded run reproducible)."""
    if params.greedy:
        return None
    s = params.seed
    if s is None:
        s = int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator().manual_seed(s)


def sample(
    log_r: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """One token per row of ``log_r`` ``(B, V)``: argmax for greedy rows, else a draw from
    ``r^(1/temperature)`` restricted to the row's top-k and top-p. Returns ``LongTensor[B]``;
    ``log_r`` is not modified."""
    tokens = log_r.argmax(-1)  # (B,)
    rows = [j for j, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    dev = log_r.device
    sel = torch.tensor(rows, dtype=torch.long, device=dev)
    ps = [params[j] for j in rows]
    temp = torch.tensor([p.temperature for p in ps], device=dev).unsqueeze(-1)  # (S, 1)
    logits = log_r.float().index_select(0, sel).div_(temp)  # (S, V), our own copy
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
    if any(ks):
        kt = torch.tensor(ks, device=dev).unsqueeze(-1)  # (S, 1)
        top = torch.topk(logits, max(ks), dim=-1).values  # (S, kmax), sorted
        kth = top.gather(-1, (kt - 1).clamp_min(0))  # (S, 1): the k-th largest value
        logits.masked_fill_(logits < kth.masked_fill(kt == 0, -math.inf), -math.inf)
    nucleus = [p.top_p < 1.0 for p in ps]
    if any(nucleus):
        top_p = torch.tensor([p.top_p for p in ps], device=dev).unsqueeze(-1)  # (S, 1)
        on = torch.tensor(nucleus, device=dev).unsqueeze(-1)  # (S, 1)
        _nucleus(logits, top_p, on)
    probs = torch.softmax(logits, dim=-1).cpu()  # (S, V)
    # torch.multinomial(p, 1, generator=g) is argmax(p / E), E ~ Exp(1) from g: the same draw
    # (one row at a time: each row's generator, and the row stays in cache)
    picked = torch.empty(len(rows), dtype=torch.long)  # (S,)
    for i, j in enumerate(rows):
        noise = torch.empty(vocab).exponential_(1.0, generator=generators[j])  # (V,)
        picked[i] = torch.div(probs[i], noise, out=noise).argmax()
    return tokens.index_copy(0, sel, picked.to(dev))


#: Candidates the nucleus search starts with (multiplied by 8 until every nucleus fits).
NUCLEUS_CANDIDATES = 64


def _nucleus(logits: Tensor, top_p: Tensor, on: Tensor) -> None:
    """Set every token of ``logits`` ``(S, V)`` outside its row's top-p nucleus to -inf, in
    place (rows where ``on`` ``(S, 1)`` is False are left alone).

    The nucleus is the smallest set of most likely tokens with mass >= top_p: a token is kept
    when the mass of the tokens before it (sorted by probability) is < top_p. It is searched
    among the top-n candidates (n = 64, then 8x more until each row's candidates hold top_p of
    its mass; the whole vocabulary at worst), instead of sorting all V logits of every row.
    """
    vocab = logits.shape[-1]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (S, 1)
    n = min(NUCLEUS_CANDIDATES, vocab)
    while True:
        vals, idx = torch.topk(logits, n, dim=-1)  # (S, n), most likely first
        probs = (vals - lse).exp()
        cum = probs.cumsum(-1)
        if n == vocab or bool(((cum[:, -1:] >= top_p) | ~on).all()):
            break
        n = min(n * 8, vocab)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, idx, (cum - probs) < top_p)
    logits.masked_fill_(on & ~keep, -math.inf)
