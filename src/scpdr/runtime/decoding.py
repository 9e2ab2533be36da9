"""The KV-cached decoding loop of :class:`scpdr.runtime.ProtectedLM`.

Prompts are left-padded into one batch, position ids come from the attention mask, and the runner
keeps the KV caches (one per model, or one for a stacked LoRA batch). At each step the runner's
logits are aggregated with the method's rule and certified (:mod:`scpdr.runtime.aggregation`),
one token per row is picked (:func:`scpdr.runtime.sampling.sample`), and CP-Fuse's path
log-probs grow by each constituent's log-prob of the token. Finished rows leave the batch (the
caches are compacted, and columns that became padding for every row are dropped). All
aggregation is float32 under ``torch.inference_mode``.

The accountant: each picked token is charged (:meth:`Aggregator.cost
<scpdr.runtime.aggregation.Aggregator.cost>`, for the token and the alternatives the row reveals)
and a row with a ``budget`` keeps a float64 running sum of its charges, echoed prompt positions
first; a token (or echoed position) whose charge would take the sum past the budget is not
served and the row ends with ``finish_reason="budget"`` — the rule of
:func:`scpdr.bounds.within_budget`. With ``on_budget="base"`` the row instead continues from the
base model once the budget cannot cover a position's worst case, and ``anchor=c`` serves the
base-anchored distribution (:mod:`scpdr.runtime.modes`; ``docs/accountant.md``, Propositions 3
and 4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from scpdr import naf
from scpdr.runtime import modes, scoring
from scpdr.runtime.aggregation import Aggregator
from scpdr.runtime.modes import Ledger
from scpdr.runtime.outputs import PromptLogprobs, StepEvent
from scpdr.runtime.runner import ModelRunner, positions, run_split
from scpdr.runtime.sampling import SamplingParams, make_generator, sample
from scpdr.runtime.stop_strings import RowText

__all__ = ["Decoder", "DecodingModel", "Step", "served_prefix", "stream"]


class Step(NamedTuple):
    """One decoding step of a batch, as python lists (one entry per row): the picked tokens,
    their log-prob under the served distribution (r, or its anchored or base replacement),
    certificates and charges, and the most likely tokens of it; ``anchor`` the charges against
    the base (None where not measured), ``fallback`` the rows served from the base, ``blocked``
    the rows whose position no budget allowed before the draw (:meth:`Ledger.private`)."""

    tokens: list[int]
    logprobs: list[float]
    k_x: list[float]
    t_x: list[float]
    cost: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    anchor: list[float | None] | None = None
    fallback: list[bool] | None = None
    blocked: list[bool] | None = None


def served_prefix(costs: Sequence[float], budget: float | None, spent: float = 0.0) -> int:
    """How many of ``costs`` a budget serves after ``spent``: the positions before the first one
    whose charge would take the running sum past ``budget`` (all of them when None)."""
    if budget is None:
        return len(costs)
    for n, c in enumerate(costs):
        if spent + c > budget:
            return n
        spent += c
    return len(costs)


class DecodingModel(Protocol):
    """What the loop needs of a protected model (:class:`scpdr.runtime.ProtectedLM`)."""

    runner: ModelRunner
    aggregator: Aggregator
    tokenizer: Any
    device: torch.device
    method: str
    variant: str | None
    base_vector: Tensor | None
    eos_ids: frozenset[int]

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], *, top_logprobs: int | Sequence[int] = 0
    ) -> list[PromptLogprobs]: ...


class Decoder:
    """Incremental decoding state of one batch: the runner's KV caches, the attention mask, the
    next position ids, CP-Fuse path log-probs and the rows' generators."""

    def __init__(
        self,
        lm: DecodingModel,
        prompts: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> None:
        self.lm = lm
        dev = lm.device
        pad = lm.tokenizer.pad_token_id
        pad = 0 if pad is None else int(pad)
        t = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), t), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), t), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, t - len(p) :] = 1
        self.ids, self.mask = ids.to(dev), mask.to(dev)
        self.caches = lm.runner.new_caches()
        self.generators = generators
        self.path = torch.zeros(2, len(prompts), device=dev) if lm.method == "cp-fuse" else None
        self.next_pos = self.mask.sum(-1)  # (B,)

    def _run(self, ids: Tensor, pos: Tensor) -> tuple[Tensor, Tensor | None]:
        lm = self.lm
        logits, base = run_split(
            lm.runner, lm.variant == "b", ids, self.mask, pos, self.caches, keep=1
        )
        return logits[:, :, -1], None if base is None else base[:, -1]  # (K', B, V), (B, V)

    @torch.inference_mode()
    def prefill(self) -> tuple[Tensor, Tensor | None]:
        return self._run(self.ids, positions(self.mask))

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[Tensor, Tensor | None]:
        dev = self.mask.device
        ids = torch.tensor(tokens, dtype=torch.long, device=dev).unsqueeze(1)  # (B, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        pos = self.next_pos.unsqueeze(1)
        self.next_pos = self.next_pos + 1
        return self._run(ids, pos)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        if self.path is not None:
            self.path = self.path.index_select(1, idx)
        for c in self.caches:
            c.batch_select_indices(idx)
        self.generators = [self.generators[j] for j in keep]
        # drop columns that are padding for every remaining row (only plain dynamic layers and
        # kv_cache's: their keys are (B, heads, T, head_dim), RoPE already applied)
        from transformers.cache_utils import DynamicLayer

        from scpdr.runtime.kv_cache import layer_class

        plain = (DynamicLayer, layer_class())
        first = int((self.mask.cumsum(-1) == 0).sum(-1).min())
        layers = [layer for c in self.caches for layer in getattr(c, "layers", [None])]
        if first > 0 and all(type(x) in plain and x.is_initialized for x in layers):
            self.mask = self.mask[:, first:]
            for layer in layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]

    @torch.inference_mode()
    def sample(
        self,
        out: tuple[Tensor, Tensor | None],
        params: Sequence[SamplingParams],
        ledgers: Sequence[Ledger] | None = None,
    ) -> Step:
        """Aggregate the step's logits, pick one token per row and charge it (for the token and
        the row's ``params.logprobs`` alternatives); one host transfer. ``top_logprobs`` holds
        the most likely tokens of the served distribution, as many as the largest
        ``params.logprobs``. With ``ledgers`` (one per row), rows that anchor or fall back are
        served as :mod:`scpdr.runtime.modes` says; without, every row is served r."""
        lm = self.lm
        logits, base = out  # (K', B, V), (B, V) | None
        base = lm.base_vector if lm.variant == "c" else base
        log_r, kx, tx, comps = lm.aggregator(logits, base, self.path)
        assert kx is not None and tx is not None
        log_b = fall = blocked = None
        if ledgers is not None and any(modes.measures_base(lm.variant, p) for p in params):
            assert base is not None
            log_b = naf.normalize(base)  # (B, V): the floored base
            c = modes.radii(params, log_r.device)
            if c is not None:
                log_r, kx, tx = modes.anchored(lm.aggregator.rule, log_r, kx, tx, comps, log_b, c)
                assert kx is not None and tx is not None
            # only a fallback or an anchor budget can block a position: the others need no
            # decision here (and no host transfer before the draw)
            decides = any(p.on_budget == "base" or p.anchor_budget is not None for p in params)
            if decides:
                txs = tx.cpu().tolist()  # the decision is taken before the draw
                blocked = [not g.private(t) for g, t in zip(ledgers, txs, strict=True)]
                fall = [b and p.on_budget == "base" for b, p in zip(blocked, params, strict=True)]
            if fall is not None and any(fall):
                on = torch.tensor(fall, device=log_r.device)  # (B,)
                log_r = torch.where(on.unsqueeze(-1), log_b, log_r)
                kx, tx = kx.masked_fill(on, 0.0), tx.masked_fill(on, 0.0)
        tokens = sample(log_r, params, self.generators)  # (B,)
        lp = log_r.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if self.path is not None:
            assert comps is not None
            self.path = self.path + comps.gather(
                -1, tokens.view(1, -1, 1).expand(comps.shape[0], -1, 1)
            ).squeeze(-1)
        n = min(max(p.logprobs or 0 for p in params), log_r.shape[-1])
        shown = tokens.unsqueeze(-1)  # (B, 1): the token, then the row's alternatives
        tops: list[list[tuple[int, float]]] = [[] for _ in params]
        if n:
            tv, ti = torch.topk(log_r, n, dim=-1)
            tops = [
                list(zip(a, b, strict=True))
                for a, b in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)
            ]
            ks = torch.tensor([p.logprobs or 0 for p in params], device=ti.device).unsqueeze(-1)
            alts = ti.masked_fill(torch.arange(n, device=ti.device) >= ks, -1)
            shown = torch.cat([shown, alts], dim=-1)
        cost = lm.aggregator.cost(log_r, comps, tx, shown)
        if log_b is None:
            host = torch.stack([lp, kx, tx, cost]).cpu().tolist()
            return Step(tokens.cpu().tolist(), *host, tops)
        against_base = modes.base_charge(log_r, log_b, shown)
        *host, anchor = torch.stack([lp, kx, tx, cost, against_base]).cpu().tolist()
        anchors = [
            a if modes.measures_base(lm.variant, p) else None
            for a, p in zip(anchor, params, strict=True)
        ]
        return Step(tokens.cpu().tolist(), *host, tops, anchors, fall, blocked)


def _echo(
    lm: DecodingModel,
    encoded: list[list[int]],
    params: Sequence[SamplingParams],
    ledgers: list[Ledger],
) -> Iterator[tuple[int, PromptLogprobs, bool]]:
    """The echoed prompts' log-probs, each held to its row's budget: ``(row, what is served,
    whether the budget stopped the row)``; a row that falls back gets the base's log-probs past
    its private positions (:meth:`PromptLogprobs.with_fallback`) and its ledger is marked."""
    echo = [i for i in range(len(encoded)) if params[i].echo]
    if not echo:
        return
    tops = [params[i].logprobs or 0 for i in echo]
    prompts = [encoded[i] for i in echo]
    modal = [params[i] for i in echo]
    if not any(modes.measures_base(lm.variant, p) for p in modal):
        scored, based = lm.prompt_logprobs(prompts, top_logprobs=tops), None
    else:
        anchors = [p.anchor for p in modal]
        scored, based = scoring.prompt_logprobs_modes(lm, prompts, tops, anchors, base=True)
    for j, (i, pl) in enumerate(zip(echo, scored, strict=True)):
        led, p = ledgers[i], params[i]
        served = led.count(pl.cost, pl.t_x, pl.anchor)
        stopped = False
        if served < len(pl.cost):
            if p.on_budget == "base" and based is not None:
                pl, led.fallen = pl.with_fallback(served, based[j]), True
            else:
                pl, stopped = pl.truncated(served), True
        yield i, pl, stopped


def stream(
    lm: DecodingModel, encoded: list[list[int]], params: Sequence[SamplingParams]
) -> Iterator[StepEvent]:
    """Decode every prompt of ``encoded`` with its :class:`SamplingParams`, yielding one
    :class:`StepEvent` per generated token as soon as it exists (rows with ``echo`` first get
    their prompt's log-probs; a row's last event carries its ``finish_reason``)."""
    n = len(encoded)
    modes.check_modes(lm.variant, getattr(lm, "name", lm.method), params)
    ledgers = [Ledger(p) for p in params]  # each row's running sums (float64)
    spent_out = [False] * n  # the echo alone reached the budget
    for i, pl, stopped in _echo(lm, encoded, params, ledgers):
        spent_out[i] = stopped
        yield StepEvent(i, None, "", None, None, None, None, None, prompt=pl)
    rows = [RowText(lm.tokenizer, params[i].stop) for i in range(n)]
    active = [i for i in range(n) if params[i].max_new_tokens > 0 and not spent_out[i]]
    for i in range(n):
        if spent_out[i]:
            yield StepEvent(i, None, "", None, None, None, None, "budget")
        elif params[i].max_new_tokens == 0:
            yield StepEvent(i, None, "", None, None, None, None, "length")
    if not active:
        return
    dec = Decoder(lm, [encoded[i] for i in active], [make_generator(params[i]) for i in active])
    counts = dict.fromkeys(active, 0)
    out = dec.prefill()
    eos = lm.eos_ids
    while True:
        step = dec.sample(out, [params[i] for i in active], [ledgers[i] for i in active])
        toks, lps, kxs, txs, costs, tops = step[:6]
        keep = []
        for j, i in enumerate(active):
            tok, p, row, led = toks[j], params[i], rows[i], ledgers[i]
            fell = bool(step.fallback and step.fallback[j])
            blocked = bool(step.blocked and step.blocked[j]) and not fell
            if blocked or (
                not fell and served_prefix(costs[j : j + 1], p.budget, led.spent) == 0
            ):  # withheld: the stop rule, or an anchor budget before the draw
                yield StepEvent(i, None, row.flush(), None, None, None, None, "budget")
                continue
            anchor = step.anchor[j] if step.anchor is not None else None
            led.fallen = led.fallen or fell
            led.spent += costs[j]
            led.spent_anchor += anchor or 0.0
            counts[i] += 1
            reason = None
            delta = row.add(tok)
            if row.stopped:
                reason = "stop"
            elif p.stop_at_eos and tok in eos:
                reason = "stop"
                delta += row.flush()
            elif counts[i] >= p.max_new_tokens:
                reason = "length"
                delta += row.flush()
            top = None if p.logprobs is None else tops[j][: p.logprobs]
            yield StepEvent(
                i,
                tok,
                delta,
                lps[j],
                kxs[j],
                txs[j],
                top,
                reason,
                cost=costs[j],
                anchor=anchor,
                fallback=fell,
            )
            if reason is None:
                keep.append(j)
        if not keep:
            return
        if len(keep) < len(active):
            dec.select(keep)
            active = [active[j] for j in keep]
            toks = [toks[j] for j in keep]
        out = dec.step(toks)
