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
:func:`scpdr.bounds.within_budget`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from scpdr.runtime.aggregation import Aggregator
from scpdr.runtime.outputs import PromptLogprobs, StepEvent
from scpdr.runtime.runner import ModelRunner, positions, run_split
from scpdr.runtime.sampling import SamplingParams, make_generator, sample
from scpdr.runtime.stop_strings import RowText

__all__ = ["Decoder", "DecodingModel", "Step", "served_prefix", "stream"]


class Step(NamedTuple):
    """One decoding step of a batch, as python lists (one entry per row): the picked tokens,
    their log r, certificates and charges, and the most likely tokens of r."""

    tokens: list[int]
    logprobs: list[float]
    k_x: list[float]
    t_x: list[float]
    cost: list[float]
    top_logprobs: list[list[tuple[int, float]]]


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
        # drop columns that are padding for every remaining row
        # (only plain dynamic layers: their keys are (B, heads, T, head_dim), RoPE already applied)
        from transformers.cache_utils import DynamicLayer

        first = int((self.mask.cumsum(-1) == 0).sum(-1).min())
        layers = [layer for c in self.caches for layer in getattr(c, "layers", [None])]
        if first > 0 and all(type(x) is DynamicLayer and x.is_initialized for x in layers):
            self.mask = self.mask[:, first:]
            for layer in layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]

    @torch.inference_mode()
    def sample(self, out: tuple[Tensor, Tensor | None], params: Sequence[SamplingParams]) -> Step:
        """Aggregate the step's logits, pick one token per row and charge it (for the token and
        the row's ``params.logprobs`` alternatives); one host transfer. ``top_logprobs`` holds
        the most likely tokens of r, as many as the largest ``params.logprobs``."""
        lm = self.lm
        logits, base = out  # (K', B, V), (B, V) | None
        base = lm.base_vector if lm.variant == "c" else base
        log_r, kx, tx, comps = lm.aggregator(logits, base, self.path)
        assert kx is not None and tx is not None
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
        host = torch.stack([lp, kx, tx, cost]).cpu().tolist()
        return Step(tokens.cpu().tolist(), *host, tops)


def stream(
    lm: DecodingModel, encoded: list[list[int]], params: Sequence[SamplingParams]
) -> Iterator[StepEvent]:
    """Decode every prompt of ``encoded`` with its :class:`SamplingParams`, yielding one
    :class:`StepEvent` per generated token as soon as it exists (rows with ``echo`` first get
    their prompt's log-probs; a row's last event carries its ``finish_reason``)."""
    n = len(encoded)
    spent = [0.0] * n  # each row's running sum of charges (float64)
    spent_out = [False] * n  # the echo alone reached the budget
    echo = [i for i in range(n) if params[i].echo]
    if echo:
        scored = lm.prompt_logprobs(
            [encoded[i] for i in echo], top_logprobs=[params[i].logprobs or 0 for i in echo]
        )
        for i, pl in zip(echo, scored, strict=True):
            served = served_prefix(pl.cost, params[i].budget)
            if served < len(pl.cost):
                pl, spent_out[i] = pl.truncated(served), True
            for c in pl.cost:
                spent[i] += c
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
        toks, lps, kxs, txs, costs, tops = dec.sample(out, [params[i] for i in active])
        keep = []
        for j, i in enumerate(active):
            tok, p, row = toks[j], params[i], rows[i]
            if served_prefix(costs[j : j + 1], p.budget, spent[i]) == 0:  # withheld
                yield StepEvent(i, None, row.flush(), None, None, None, None, "budget")
                continue
            spent[i] += costs[j]
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
            yield StepEvent(i, tok, delta, lps[j], kxs[j], txs[j], top, reason, cost=costs[j])
            if reason is None:
                keep.append(j)
        if not keep:
            return
        if len(keep) < len(active):
            dec.select(keep)
            active = [active[j] for j in keep]
            toks = [toks[j] for j in keep]
        out = dec.step(toks)
