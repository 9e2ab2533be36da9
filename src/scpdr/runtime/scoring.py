"""Teacher-forced scoring for :meth:`scpdr.runtime.ProtectedLM.score`: one forward per model (or
one stacked forward) over whole sequences, aggregated and certified at every position.

Prompt-aware CP-Fuse (the TDE game, Def. 4.2: a fresh request starts CP-Fuse's fused path at the
end of its prompt): with ``prompt_lengths``, the path log-probs at position t are the sums of
log p_i over the targets after row b's first ``prompt_lengths[b]`` tokens only, so scoring
``prompt + completion`` gives exactly the log-probs ``generate`` returned for the completion.
Without it, the whole sequence after its first token is the path. The stateless rules do not
depend on it.

With ``cost`` each position is also charged (:meth:`Aggregator.cost
<scpdr.runtime.aggregation.Aggregator.cost>`) for its target and the alternatives it reveals: what
``prompt_logprobs`` (echo) serves costs what the same positions would cost when generated.
With ``anchor`` each row's positions are scored under its base-anchored distribution, and with
``base`` the base model's own log-probs and each position's charge against the base come too
(:mod:`scpdr.runtime.modes`): what a fallback or an anchored response serves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from scpdr import naf
from scpdr.runtime import modes
from scpdr.runtime.outputs import PromptLogprobs, ScoreComponents, ScoreOutput
from scpdr.runtime.runner import logits_buffer, positions, run_split

__all__ = ["check_prompt_lengths", "prompt_logprobs", "prompt_logprobs_modes", "score"]


def check_prompt_lengths(
    prompt_lengths: Sequence[int] | Tensor | None, mask: Tensor
) -> Tensor | None:
    """``prompt_lengths`` as a ``LongTensor[B]`` on ``mask``'s device: each in [1, real tokens of
    its row] (ValueError otherwise); None stays None."""
    if prompt_lengths is None:
        return None
    pl = torch.as_tensor(prompt_lengths).to(mask.device)
    if pl.is_floating_point() or pl.dtype == torch.bool or pl.shape != (mask.shape[0],):
        raise ValueError(
            f"prompt_lengths must hold one int per row ({mask.shape[0]}), got "
            f"{tuple(pl.shape)} of {pl.dtype}"
        )
    pl = pl.long()
    real = mask.sum(-1)
    if bool(((pl < 1) | (pl > real)).any()):
        raise ValueError(
            "prompt_lengths must be in [1, the row's number of real tokens]: got "
            f"{pl.tolist()} for rows of {real.tolist()} tokens"
        )
    return pl


def score(
    lm: Any,
    ids: Tensor,
    mask: Tensor,
    *,
    prompt_lengths: Tensor | None = None,
    full: bool = False,
    greedy: bool = False,
    k_x: bool = False,
    t_x: bool = False,
    components: bool = False,
    top_logprobs: int = 0,
    cost: bool = False,
    reveal: Tensor | None = None,
    anchor: Tensor | None = None,
    base: bool = False,
) -> Tensor | ScoreOutput:
    """:meth:`ProtectedLM.score` on checked inputs (``ids``/``mask`` ``(B, T)`` on the model's
    device, ``prompt_lengths`` from :func:`check_prompt_lengths`); see there. ``reveal``
    ``LongTensor[B]``: alternatives each row reveals, for its ``cost`` (default: all
    ``top_logprobs``). ``anchor`` ``Tensor[B]`` float64: each row's radius (+inf: not
    anchored); ``base``: also the base's log-probs and the charges against it (variant 'b').
    Rows are processed in chunks so that at most ``lm.score_chunk_elements`` logits are held
    at once."""
    if (anchor is not None or base) and lm.variant != "b":
        raise ValueError(
            f"anchor= and base= score against the base model, and {lm.name} runs none: use an "
            "SCP method with its base model (variant 'b', base='model')"
        )
    b, t = ids.shape
    v = lm.vocab_size
    dev = ids.device
    g = len(lm.runner.models)
    n_cons = g - (lm.variant == "b")
    n_top = min(int(top_logprobs), v)
    out = ScoreOutput(
        token_logprobs=torch.zeros(b, max(t - 1, 0), device=dev),
        logprobs=torch.zeros(b, t - 1, v, device=dev) if full else None,
        greedy=torch.full((b, t - 1), -1, dtype=torch.long, device=dev) if greedy else None,
        k_x=torch.zeros(b, t - 1, device=dev) if k_x else None,
        t_x=torch.zeros(b, t - 1, device=dev) if t_x else None,
        top_logprobs=torch.zeros(b, t - 1, n_top, device=dev) if n_top else None,
        top_ids=torch.full((b, t - 1, n_top), -1, dtype=torch.long, device=dev) if n_top else None,
        cost=torch.zeros(b, t - 1, device=dev) if cost else None,
        anchor=torch.zeros(b, t - 1, device=dev) if base else None,
        base_token_logprobs=torch.zeros(b, t - 1, device=dev) if base else None,
        base_top_logprobs=torch.zeros(b, t - 1, n_top, device=dev) if base and n_top else None,
        base_top_ids=(
            torch.full((b, t - 1, n_top), -1, dtype=torch.long, device=dev)
            if base and n_top
            else None
        ),
    )
    if reveal is None:
        reveal = torch.full((b,), n_top, dtype=torch.long, device=dev)
    comp_l = torch.zeros(n_cons, b, t - 1, v) if components else None
    comp_b = torch.zeros(b, t - 1, v) if components and lm.variant == "b" else None
    # CP-Fuse's path log-probs of each row's positions in earlier chunks (a row longer than
    # the bound is scored in pieces)
    carry = torch.zeros(2, b, device=dev) if lm.method == "cp-fuse" else None
    if t >= 2:
        for sl, sel, logits, base_logits in _chunks(lm, ids, mask):
            pl = None if prompt_lengths is None else prompt_lengths[sl]
            radius = None if anchor is None else anchor[sl]
            path0 = None if carry is None else carry[:, sl]  # a view: the chunk adds to it
            _score_chunk(
                lm, ids[sl], mask[sl], pl, reveal[sl], sl, sel, path0, out, comp_l, comp_b,
                radius, logits, base_logits,
            )  # fmt: skip
    if not (full or greedy or k_x or t_x or components or n_top or cost or base):
        return out.token_logprobs
    if components:
        assert comp_l is not None
        out.components = ScoreComponents(comp_l, comp_b if lm.variant == "b" else lm.base_vector)
    return out


def _valid(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(valid (B, T-1), keep (B, T))``: the positions whose context and target are real
    tokens, and the positions predicting them."""
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    return valid, torch.cat([valid, valid.new_zeros(valid.shape[0], 1)], dim=1)


def _chunks(
    lm: Any, ids: Tensor, mask: Tensor
) -> Iterator[tuple[slice, Tensor, Tensor, Tensor | None]]:
    """``(rows, positions (len(rows), T-1) bool, constituents' logits (K', N, V), base's (N, V)
    | None)`` of ``ids``' rows in chunks holding at most ``lm.score_chunk_elements`` logits, all
    in one reused buffer (the runner protocol's ``out``); ``N`` counts the chunk's positions.
    Rows without a valid position are skipped.

    Where the runner runs every model's head itself (its ``splits_heads``: ``PerModelRunner``
    for Llama models, ``scpdr.lora.StackedLoRA`` over a Llama base), each decoder runs once
    over as many tokens as one model's logits would fill the bound with, and only the heads
    run per chunk, at the kept positions: the decoders' cost does not grow with the number of
    chunks (8 x 128 tokens, SCP-Δr-b: docs/performance.md); a row with more positions than
    the bound holds is scored in pieces of the bound's size. Other runners run whole chunks of
    at least one row."""
    b, t = ids.shape
    runner, has_base = lm.runner, lm.variant == "b"
    g, v, budget = len(runner.models), lm.vocab_size, lm.score_chunk_elements
    split = bool(getattr(runner, "splits_heads", False))
    # rows a decoder runs at once: at most budget / V tokens a call (a shared base's stacked
    # forward runs G rows for each: larger calls ran slower per token, docs/performance.md)
    rows = max(1, budget // ((1 if split and not runner.shared_base else g) * t * v))
    cap = max(1, budget // (g * v))  # positions whose logits one chunk holds (split)
    scratch: Tensor | None = None

    def heads(hidden: list[Tensor], start: int, n: int) -> tuple[Tensor, Tensor | None]:
        """The logits of positions ``start:start + n`` of the decoders' hidden states."""
        nonlocal scratch
        if scratch is None or scratch.numel() < g * n * v:
            scratch = torch.empty(g * n * v, device=ids.device)
        out = logits_buffer((g, n, v), ids.device, scratch)
        out = runner.project_heads([h[start : start + n] for h in hidden], out)
        return (out[:-1], out[-1]) if has_base else (out, None)

    for s in range(0, b, rows):
        sl = slice(s, min(b, s + rows))
        valid, keep = _valid(mask[sl])
        if not bool(valid.any()):
            continue
        pos = positions(mask[sl])
        if not split:
            if scratch is None and b > rows:
                scratch = torch.empty(rows * g * t * v, device=ids.device)
            logits = run_split(runner, has_base, ids[sl], mask[sl], pos, keep=keep, out=scratch)
            yield sl, valid, *logits
            continue
        hidden = runner.hidden_states(ids[sl], mask[sl], pos, keep)  # G x (N, H)
        counts = valid.sum(-1).tolist()
        first, start = 0, 0  # the chunk's first row (in sl) and its first position
        while first < len(counts):
            last, n = first + 1, counts[first]
            while last < len(counts) and n + counts[last] <= cap:
                n, last = n + counts[last], last + 1
            chunk = slice(s + first, s + last)
            if n > cap:  # one row longer than the bound: pieces of `cap` positions, in order
                cols = valid[first].nonzero()[:, 0]
                for a in range(0, n, cap):
                    piece = torch.zeros_like(valid[first:last])
                    piece[0, cols[a : a + cap]] = True
                    yield chunk, piece, *heads(hidden, start + a, min(cap, n - a))
            elif n:
                yield chunk, valid[first:last], *heads(hidden, start, n)
            first, start = last, start + n


def _score_chunk(
    lm: Any,
    ids: Tensor,
    mask: Tensor,
    prompt_lengths: Tensor | None,
    reveal: Tensor,
    sl: slice,
    sel: Tensor,
    path0: Tensor | None,
    out: ScoreOutput,
    comp_l: Tensor | None,
    comp_b: Tensor | None,
    anchor: Tensor | None,
    logits: Tensor,
    base: Tensor | None,
) -> None:
    """Rows ``sl``'s aggregation, certificates and charges at the positions ``sel`` (``(b,
    T-1)``: all their valid positions, or a piece of one long row) into ``out``, from the
    logits there (``logits (K', N, V)``, ``base (N, V) | None``). CP-Fuse: ``path0`` ``(2,
    b)`` holds each row's path log-probs of its positions in earlier pieces, and gets this
    chunk's added."""
    b, t = ids.shape
    pos = positions(mask)  # (b, T): each real token's index in its row
    target = ids[:, 1:][sel]  # (N,)  logits: (K', N, V), base: (N, V) | None
    rows = sel.nonzero()[:, 0]  # (N,) the row of each position
    path = None
    if lm.method == "cp-fuse":
        assert path0 is not None
        tgt = naf.normalize(logits).gather(-1, target.view(1, -1, 1).expand(2, -1, 1))
        dense = torch.zeros(2, b, t - 1, device=ids.device)
        on_path = sel  # targets that are path tokens (generated, not prompt)
        if prompt_lengths is not None:
            on_path = sel & (pos[:, 1:] >= prompt_lengths.unsqueeze(1))
        dense[:, sel] = tgt.squeeze(-1) * on_path[sel]  # (2, b, T-1)
        path = (dense.cumsum(-1) - dense)[:, sel]  # exclusive prefix sums: (2, N)
        path += path0[:, rows]  # plus the row's earlier pieces'
        path0 += dense.sum(-1)
    fbase = base if base is not None else (lm.base_vector if lm.variant == "c" else None)
    need = out.k_x is not None or out.t_x is not None or out.cost is not None
    log_r, kx, tx, comps = lm.aggregator(logits, fbase, path, bounds_too=need)  # (N, V)
    log_b = None  # (N, V): the floored base, only where a row anchors or the base is asked for
    if base is not None and (anchor is not None or out.base_token_logprobs is not None):
        log_b = naf.normalize(base)
    if anchor is not None and log_b is not None:
        c = anchor.to(ids.device)[rows]  # (N,) each position's row's radius
        log_r, kx, tx = modes.anchored(lm.aggregator.rule, log_r, kx, tx, comps, log_b, c)
    out.token_logprobs[sl][sel] = log_r.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if out.logprobs is not None:
        out.logprobs[sl][sel] = log_r
    if out.greedy is not None:
        out.greedy[sl][sel] = log_r.argmax(-1)
    if out.k_x is not None:
        out.k_x[sl][sel] = kx
    if out.t_x is not None:
        out.t_x[sl][sel] = tx
    ti = None
    if out.top_logprobs is not None and out.top_ids is not None:
        tv, ti = torch.topk(log_r, out.top_logprobs.shape[-1], dim=-1)  # (N, n)
        out.top_logprobs[sl][sel] = tv
        out.top_ids[sl][sel] = ti
    if out.cost is not None or out.anchor is not None:
        shown = target.unsqueeze(-1)  # (N, 1): the target, then the row's alternatives
        if ti is not None:
            rank = torch.arange(ti.shape[-1], device=ti.device)
            alts = ti.masked_fill(rank >= reveal[rows].unsqueeze(-1), -1)
            shown = torch.cat([shown, alts], dim=-1)
        if out.cost is not None:
            assert tx is not None
            out.cost[sl][sel] = lm.aggregator.cost(log_r, comps, tx, shown)
        if out.anchor is not None and log_b is not None:
            out.anchor[sl][sel] = modes.base_charge(log_r, log_b, shown)
    if out.base_token_logprobs is not None and log_b is not None:
        out.base_token_logprobs[sl][sel] = log_b.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if out.base_top_logprobs is not None and out.base_top_ids is not None:
            bv, bi = torch.topk(log_b, out.base_top_logprobs.shape[-1], dim=-1)  # (N, n)
            out.base_top_logprobs[sl][sel] = bv
            out.base_top_ids[sl][sel] = bi
    if comp_l is not None:
        vc = sel.cpu()
        comp_l[:, sl][:, vc] = torch.log_softmax(logits, dim=-1).cpu()
        if comp_b is not None and base is not None:
            comp_b[sl][vc] = torch.log_softmax(base, dim=-1).cpu()


def prompt_logprobs(
    lm: Any, encoded: list[list[int]], top_logprobs: int | Sequence[int] = 0
) -> list[PromptLogprobs]:
    """:meth:`ProtectedLM.prompt_logprobs` on encoded prompts: one right-padded ``score`` with
    ``prompt_lengths`` = each prompt's length, so every prefix is read as a fresh request."""
    return prompt_logprobs_modes(lm, encoded, top_logprobs)[0]


def prompt_logprobs_modes(
    lm: Any,
    encoded: list[list[int]],
    top_logprobs: int | Sequence[int] = 0,
    anchors: Sequence[float | None] | None = None,
    *,
    base: bool = False,
) -> tuple[list[PromptLogprobs], list[PromptLogprobs] | None]:
    """:func:`prompt_logprobs` under each prompt's anchor (``anchors``: one radius or None per
    prompt), with each position's charge against the base (``PromptLogprobs.anchor``) when any
    prompt anchors or ``base``; and with ``base`` also the base model's own log-probs of every
    prompt (certificates 0: what a fallback position serves), else None."""
    n = len(encoded)
    tops = list(top_logprobs) if isinstance(top_logprobs, (list, tuple)) else [top_logprobs] * n
    if len(tops) != n or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in tops):
        raise ValueError(
            f"top_logprobs must be an int >= 0 or one per prompt, got {top_logprobs!r}"
        )
    radius = None
    if anchors is not None and any(a is not None for a in anchors):
        radius = torch.tensor(
            [math.inf if a is None else float(a) for a in anchors], dtype=torch.float64
        )
    against_base = base or radius is not None
    t = max(len(p) for p in encoded)
    if t < 2:
        empty = [PromptLogprobs([], [], [], []) for _ in encoded]
        return empty, ([PromptLogprobs([], [], [], []) for _ in encoded] if base else None)
    ids = torch.zeros((n, t), dtype=torch.long)  # (B, T), right padding
    mask = torch.zeros((n, t), dtype=torch.long)
    for b, p in enumerate(encoded):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        mask[b, : len(p)] = 1
    lengths = torch.tensor([len(p) for p in encoded], device=lm.device)
    out = score(
        lm,
        ids.to(lm.device),
        mask.to(lm.device),
        prompt_lengths=lengths,
        k_x=True,
        t_x=True,
        top_logprobs=min(max(tops), lm.vocab_size),
        cost=True,
        reveal=torch.tensor(tops, device=lm.device),
        anchor=radius,
        base=against_base,
    )
    assert isinstance(out, ScoreOutput) and out.k_x is not None and out.t_x is not None
    assert out.cost is not None
    chosen = out.token_logprobs.cpu().tolist()
    kx, tx, costs = out.k_x.cpu().tolist(), out.t_x.cpu().tolist(), out.cost.cpu().tolist()
    anchor = out.anchor.cpu().tolist() if out.anchor is not None else None
    ti, tv = _tops(out.top_ids, out.top_logprobs)
    bti, btv = _tops(out.base_top_ids, out.base_top_logprobs)
    based = None if out.base_token_logprobs is None else out.base_token_logprobs.cpu().tolist()
    result, base_result = [], []
    for b, (p, k) in enumerate(zip(encoded, tops, strict=True)):
        m = len(p) - 1
        top = [list(zip(ti[b][i][:k], tv[b][i][:k], strict=True)) if k else [] for i in range(m)]
        a = anchor[b][:m] if anchor is not None else []
        result.append(PromptLogprobs(chosen[b][:m], top, kx[b][:m], tx[b][:m], costs[b][:m], a))
        if base and based is not None:
            top = [
                list(zip(bti[b][i][:k], btv[b][i][:k], strict=True)) if k else [] for i in range(m)
            ]
            zeros = [0.0] * m
            base_result.append(PromptLogprobs(based[b][:m], top, zeros, zeros, zeros, zeros))
    return result, (base_result if base else None)


def _tops(ids: Tensor | None, values: Tensor | None) -> tuple[list[Any], list[Any]]:
    if ids is None or values is None:
        return [], []
    return ids.cpu().tolist(), values.cpu().tolist()
