"""Expected SpaRPS curve (Def. 3.4): hand-made shifts with known B(m)."""

from __future__ import annotations

import pytest
import torch

from scpdr.attacks.sparps import expected_sparps_curve, plot_expected_sparps


def test_curve_on_planted_shifts(tmp_path):
    # X = 4 prompts, V = 64: prompt x has x+1 tokens shifted by 3.0 (in log RPD), the rest equal
    # across models up to seed noise that averages to exactly 0 (+e, -e over two seeds).
    x, v = 4, 64
    base = torch.randn(x, v, generator=torch.Generator().manual_seed(0))
    shift = torch.zeros(x, v)
    for i in range(x):
        shift[i, : i + 1] = 3.0
    noise = 0.5 * torch.randn(x, v, generator=torch.Generator().manual_seed(1))
    p = torch.stack([base + shift + noise, base + shift - noise])  # (S=2, X, V)
    q = torch.stack([base, base])
    curve = expected_sparps_curve(p, q, ms=[0, 1, 2, 4], cs=[0.5, 1.0])
    # after re-centring, off-A deviations are the constant mean shift c_x = 3 (x+1) / V
    c = [3.0 * (i + 1) / v for i in range(x)]
    # m = 4 frees every shifted token: B_x = c_x, and C = 1 needs the worst prompt
    assert curve[1.0][3] == pytest.approx(max(c), abs=1e-5)
    # m = 0: every prompt has B_x = 3 - c_x; C = 0.5 takes the 2nd smallest
    assert curve[0.5][0] == pytest.approx(sorted(3.0 - ci for ci in c)[1], abs=1e-5)
    assert all(a >= b - 1e-6 for a, b in zip(curve[1.0], curve[1.0][1:], strict=False))
    assert plot_expected_sparps(curve, [0, 1, 2, 4], tmp_path / "s.png").stat().st_size > 0
