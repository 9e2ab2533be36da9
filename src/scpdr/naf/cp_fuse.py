"""CP-Fuse (Abad et al. 2025): one decoding step's grid search over the fusion weights.

Per batch row, ``(b1, b2)`` on a grid minimizing ``max_i KL(r_b || p_i) - path_i`` with
``log r_b = b1 log p1 + b2 log p2 - A(b)``. With ``KL(r||p_i) = b1 E_r[l1] + b2 E_r[l2] - A -
E_r[l_i]`` every grid point needs three sums over the vocabulary: ``Z(b) = sum e^(b1 l1 + b2
l2)`` and the same weighted by ``l1`` and by ``l2``. Two ways to get them:

- :func:`cp_fuse_reference` (and the torch path): materialize ``r_b`` for every grid point,
  in chunks — one exponential per token and grid point (120 with the default grid: ~1 decode
  step of the 135M model at batch 8);
- on a lattice grid ``b = step·(i, j)`` (the default one), ``e^(b·l) = u^i w^j`` with ``u =
  e^(step l1)``, ``w = e^(step l2)``: all sums are the per-row *sufficient statistics*
  ``sum_t u^i w^j (1, l1, l2)``, which the C kernel (:mod:`scpdr.kernels.cp_fuse`) computes
  in one pass with two exponentials per token (~0.05 of a decode step at batch 8). It reads
  the rows floored but not renormalized (0.8 instead of 2.1 ms at batch 8): each path log-prob
  is lowered by its row's log floored mass instead (:func:`_log_masses`).

Both choose the argmin with the first grid point winning exact ties; their objectives agree to
float rounding (~1e-6), so they choose the same weights except between grid points whose
objectives are that close (tested against a float64 brute force).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from scpdr import kernels
from scpdr.naf.checks import check_logps
from scpdr.naf.floor import floored, normalized, scratch

__all__ = [
    "CP_FUSE_CHUNK_ELEMENTS",
    "CP_FUSE_GRID",
    "CP_FUSE_WEIGHTS",
    "cp_fuse_reference",
    "cp_fuse_step",
    "lattice",
]

#: CP-Fuse: the values each of the two weights (b1, b2) takes on the default grid.
CP_FUSE_WEIGHTS: tuple[float, ...] = tuple(round(0.2 * i, 1) for i in range(11))
#: CP-Fuse default grid: every pair of :data:`CP_FUSE_WEIGHTS` except (0, 0) (120 points).
CP_FUSE_GRID: tuple[tuple[float, float], ...] = tuple(
    (a, b) for a in CP_FUSE_WEIGHTS for b in CP_FUSE_WEIGHTS if (a, b) != (0.0, 0.0)
)
#: The reference evaluates the grid in chunks of at most this many (grid point x batch x
#: vocab) elements, so (batch, G, V) is never materialized at once (8 MiB of float32).
CP_FUSE_CHUNK_ELEMENTS = 1 << 21
#: A lattice grid's weights sum to at most this: e^(b·l) >= e^(-20 · 4) stays a normal float32.
_LATTICE_MAX_WEIGHT = 4.0


def _as_grid(grid: Tensor | Sequence[Sequence[float]] | None) -> Tensor:
    if isinstance(grid, Tensor):
        g = grid.detach().to(torch.float32)
    else:
        g = torch.tensor(CP_FUSE_GRID if grid is None else grid, dtype=torch.float32)
    if g.ndim != 2 or g.shape[1] != 2 or g.shape[0] < 1:
        raise ValueError(
            f"cp_fuse_step: grid must have shape (G, 2) of weight pairs (b1, b2), got "
            f"{tuple(g.shape)}"
        )
    if not torch.isfinite(g).all() or (g < 0).any() or (g.sum(dim=1) <= 0).any():
        raise ValueError(
            "cp_fuse_step: grid weights must be finite and >= 0, and no pair may be (0, 0)"
        )
    return g


def lattice(grid: Tensor) -> tuple[float, Tensor] | None:
    """``(step, exponents LongTensor[G, 2])`` when every weight of ``grid`` ``(G, 2)`` is an
    integer multiple of its smallest positive weight (``b = step·(i, j)``, i, j below
    :data:`scpdr.kernels.cp_fuse.MAX_POWER`) and no pair sums above 4, else None. The default
    grid is the lattice of step 0.2, i, j in 0..10."""
    step = float(grid[grid > 0].min())
    q = grid.double() / step
    exps = q.round()
    if float((q - exps).abs().max()) > 1e-4 or float(exps.max()) >= kernels.cp_fuse.MAX_POWER:
        return None
    if float(grid.sum(dim=1).max()) > _LATTICE_MAX_WEIGHT:
        return None
    return step, exps.long()


def _check(
    logps: Tensor | Sequence[Tensor],
    path_logprobs: Tensor | float,
    *,
    use_scratch: bool = False,
    floor_only: bool = False,
) -> tuple[Tensor, Tensor, tuple[int, ...], int]:
    """``(lp (2, B, V) floored normalized, path (B, 2), batch shape, V)``; with
    ``use_scratch`` lp is a scratch view (no fresh tensor: its page faults cost more than the
    arithmetic here), which no other scratch user may overwrite before it is used up. With
    ``floor_only`` lp is floored but not renormalized (:func:`scpdr.naf.floor.floored`: each
    row short of the normalized one by its log floored mass, :func:`_log_masses`)."""
    x = check_logps(logps, "cp-fuse", min_k=2)
    if x.shape[0] != 2:
        raise ValueError(f"cp_fuse_step fuses exactly K = 2 constituents, got K = {x.shape[0]}")
    batch, vocab = tuple(x.shape[1:-1]), x.shape[-1]
    path = torch.as_tensor(path_logprobs, dtype=torch.float32, device=x.device)
    try:
        path = path.expand((2, *batch))
    except RuntimeError:
        raise ValueError(
            f"cp_fuse_step: path_logprobs shape {tuple(path.shape)} does not broadcast to "
            f"(2, *batch) = {(2, *batch)}"
        ) from None
    if floor_only:
        out = scratch([x.shape], x)[0] if use_scratch else None
        lp = floored(x, out=out).reshape(2, -1, vocab)  # (2, B, V)
    else:
        lp = normalized(x, use_scratch=use_scratch).reshape(2, -1, vocab)  # (2, B, V)
    return lp, path.reshape(2, -1).t(), batch, vocab


def _log_masses(y: Tensor, stats: Tensor | None, step: float) -> Tensor:
    """``log sum_t e^(y_i)`` ``(B, 2)`` float64 of floored, not renormalized rows ``y`` ``(2, B,
    V)``: the normalized rows are ``l_i = y_i - kappa_i``. CP-Fuse's objective from ``y`` is
    the one from ``l`` with each path log-prob lowered by ``kappa_i``: ``r_b`` is unchanged
    (a per-row shift), ``sum r log r`` too, and ``E_r[y_i] = E_r[l_i] + kappa_i``. Read off
    the lattice statistics ``stats`` (:func:`scpdr.kernels.cp_fuse.run`) where ``1 / step`` is
    a lattice power of both weights (``e^y1 = u^k``, ``e^y2 = w^k``: ``S[k, 0]`` and ``S[0,
    k]``; the default grid: k = 5), else summed here."""
    k = round(1.0 / step)
    ni_nj = (stats.shape[1], stats.shape[2] // 3) if stats is not None else (0, 0)
    if abs(k * step - 1.0) < 1e-6 and k < min(ni_nj):  # a lattice power of both weights
        return torch.stack([stats[:, k, 0], stats[:, 0, k]], dim=1).log()
    return torch.logsumexp(y.double(), dim=-1).t()


def _fused(
    lp: Tensor, weights: Tensor, batch: tuple[int, ...], *, in_place: bool = False
) -> tuple[Tensor, Tensor]:
    """``(log r, weights)`` reshaped to the batch: ``log r = log_softmax(b1 l1 + b2 l2)``
    (``in_place``: ``b1 l1 + b2 l2`` written over ``lp[0]``)."""
    vocab = lp.shape[-1]
    w1, w2 = weights[:, 0:1].to(lp.dtype), weights[:, 1:2].to(lp.dtype)
    if in_place:
        z = lp[0].mul_(w1).addcmul_(lp[1], w2)  # (B, V)
    else:
        z = w1 * lp[0] + w2 * lp[1]
    return torch.log_softmax(z, dim=-1).reshape(*batch, vocab), weights.reshape(*batch, 2)


def _grid_argmin(
    lp: Tensor, path_b: Tensor, g: Tensor, chunk_elements: int | None, *, use_scratch: bool = True
) -> Tensor:
    """Index of the best grid point per row by materializing each point's distribution (in the
    scratch buffer with ``use_scratch``, which ``lp`` must then not be a view of)."""
    nb, vocab = lp.shape[1], lp.shape[2]
    lpb = lp.transpose(0, 1).contiguous()  # (B, 2, V)
    lpt = lpb.transpose(1, 2)  # (B, V, 2)
    path_b = path_b.unsqueeze(1)  # (B, 1, 2)
    per = max(1, (chunk_elements or CP_FUSE_CHUNK_ELEMENTS) // max(1, nb * vocab))
    chunk = min(g.shape[0], per)
    (buf,) = scratch([(nb * chunk * vocab,)], lp) if use_scratch else (None,)
    if buf is None:
        buf = torch.empty(nb * chunk * vocab, device=lp.device)
    best_obj = torch.full((nb,), math.inf, device=lp.device)
    best_idx = torch.zeros((nb,), dtype=torch.long, device=lp.device)
    for start in range(0, g.shape[0], chunk):
        w = g[start : start + chunk]  # (n, 2)
        z = buf[: nb * w.shape[0] * vocab].view(nb, w.shape[0], vocab)  # (B, n, V)
        torch.matmul(w, lpb, out=z)  # b1 log p1 + b2 log p2
        z_max = z.amax(dim=-1, keepdim=True)  # (B, n, 1)
        r = z.sub_(z_max).exp_()  # (B, n, V): r times its normalizer, in place
        total = r.sum(dim=-1)  # (B, n)
        a = total.log() + z_max.squeeze(-1)  # (B, n): log normalizer A(b)
        e = torch.bmm(r, lpt).div_(total.unsqueeze(-1))  # (B, n, 2): E_r[log p_k]
        cross = (e * w).sum(dim=-1) - a  # (B, n): sum_y r log r
        obj = (cross.unsqueeze(-1) - e - path_b).amax(dim=-1)  # (B, n)
        val, arg = obj.min(dim=1)  # (B,)
        better = val < best_obj
        best_obj = torch.where(better, val, best_obj)
        best_idx = torch.where(better, arg + start, best_idx)
    return best_idx


def _lattice_argmin(stats: Tensor, path_b: Tensor, step: float, exps: Tensor) -> Tensor:
    """Index of the best grid point per row from the sufficient statistics ``stats`` ``(B, ni,
    3 nj)`` float64 (:func:`scpdr.kernels.cp_fuse.run`)."""
    nj = stats.shape[-1] // 3
    i, j = exps[:, 0], exps[:, 1]
    z = stats[:, i, j]  # (B, G)
    e1 = stats[:, i, nj + j] / z  # E_r[l1]
    e2 = stats[:, i, 2 * nj + j] / z  # E_r[l2]
    b = exps.double() * step  # (G, 2)
    cross = b[:, 0] * e1 + b[:, 1] * e2 - z.log()  # sum_y r log r
    path = path_b.double()
    obj = torch.maximum(cross - e1 - path[:, 0:1], cross - e2 - path[:, 1:2])  # (B, G)
    return obj.argmin(dim=1)  # the first of equal minima


def cp_fuse_reference(
    logps: Tensor | Sequence[Tensor],
    path_logprobs: Tensor | float,
    *,
    grid: Tensor | Sequence[Sequence[float]] | None = None,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`cp_fuse_step` by materializing every grid point's distribution (in chunks of at
    most ``chunk_elements``, default :data:`CP_FUSE_CHUNK_ELEMENTS`, with a running argmin):
    the slow reference, and the path for grids that are no lattice, other devices, or machines
    without the kernel."""
    lp, path_b, batch, _ = _check(logps, path_logprobs)
    g = _as_grid(grid).to(lp.device)
    return _fused(lp, g[_grid_argmin(lp, path_b, g, chunk_elements)], batch)


def cp_fuse_step(
    logps: Tensor | Sequence[Tensor],
    path_logprobs: Tensor | float,
    *,
    grid: Tensor | Sequence[Sequence[float]] | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoding step of CP-Fuse (Abad et al. 2025) for K = 2.

    Chooses ``(b1, b2)`` on ``grid`` (default :data:`CP_FUSE_GRID`) minimizing, per batch row,
    ``max_i KL(r || p_i) - path_logprob_i`` with ``log r = b1 log p1 + b2 log p2 - A(b)``, where
    ``path_logprob_i = log p_i(prefix generated so far)`` (0 at the first step, where this is
    the path-free objective). On a lattice grid (:func:`lattice`) on CPU the objective comes
    from per-row sufficient statistics (the C kernel, where it is measured faster); otherwise
    from :func:`cp_fuse_reference`. The first grid point wins exact ties.

    Args:
        logps: ``(2, *batch, V)`` logits or log-probs of the two constituents (floored first).
        path_logprobs: ``(2, *batch)`` (or broadcastable, e.g. ``0.0``) prefix log-probs.
        grid: ``(G, 2)`` non-negative weight pairs, no ``(0, 0)``.

    Returns ``(log_r, weights)``: ``Tensor[*batch, V]`` normalized log-probs and the chosen
    ``Tensor[*batch, 2]`` weights.
    """
    x = check_logps(logps, "cp-fuse", min_k=2)
    g = _as_grid(grid).to(x.device)
    found = lattice(g) if x.device.type == "cpu" else None
    if found is not None:
        step, exps = found
        ni, nj = int(exps[:, 0].max()) + 1, int(exps[:, 1].max()) + 1
        # floored rows, not renormalized (0.8 instead of 2.1 ms at batch 8): the objective takes
        # each row's log floored mass off its path instead (_log_masses)
        lp, path_b, batch, _ = _check(x, path_logprobs, use_scratch=True, floor_only=True)

        def by_stats(rows: Tensor, lib: kernels.Library) -> Tensor:
            stats = kernels.cp_fuse.run(lib, rows, step, ni, nj)
            path = path_b[: rows.shape[1]].double() - _log_masses(rows, stats, step)
            return _lattice_argmin(stats, path, step, exps)

        def by_grid(rows: Tensor) -> Tensor:  # the first call's measurement: lp is scratch
            path = path_b[: rows.shape[1]] - _log_masses(rows, None, step).float()
            return _grid_argmin(rows, path, g, None, use_scratch=False)

        lib = kernels.cp_fuse.chosen(lp, ni, nj, kernel_impl=by_stats, torch_impl=by_grid)
        if lib is not None:
            return _fused(lp, g[by_stats(lp, lib)], batch, in_place=True)
    lp, path_b, batch, _ = _check(x, path_logprobs)
    return _fused(lp, g[_grid_argmin(lp, path_b, g, None)], batch)
