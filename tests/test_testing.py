"""scpdr.testing: the tiny models are deterministic, related like fine-tunes, and bundles load."""

from __future__ import annotations

import torch

from scpdr import models, testing


def _logp(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits.float().log_softmax(-1)


def test_tiny_model_is_deterministic_and_seed_dependent():
    ids = torch.tensor([[1, 520, 905, 30, 2]])
    a, b, c = testing.tiny_model(0), testing.tiny_model(0), testing.tiny_model(1)
    torch.testing.assert_close(_logp(a, ids), _logp(b, ids))
    assert not torch.allclose(_logp(a, ids), _logp(c, ids))
    assert a.config.vocab_size == 49152 and a.config.num_hidden_layers == 2
    # not flat: a tiny LM should still have peaked next-token distributions
    ent = -(_logp(a, ids).exp() * _logp(a, ids)).sum(-1)
    assert float(ent.max()) < 9.0


def test_tiny_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    testing.tiny_model(7)
    torch.testing.assert_close(torch.rand(3), expected)


def test_perturbed_copy_is_close_but_different_and_input_untouched():
    ids = torch.tensor([[1, 520, 905, 30, 9, 17]])
    base = testing.tiny_model(0)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    c = testing.perturbed_copy(base, seed=1)
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k
    p, q = _logp(base, ids).exp(), _logp(c, ids).exp()
    tv = 0.5 * (p - q).abs().sum(-1)
    assert float(tv.min()) > 0.01 and float(tv.max()) < 0.9


def test_make_tiny_bundle_with_preferred_text(tmp_path):
    secret = "My secret code is 8675309."
    path = testing.make_tiny_bundle(tmp_path / "b", seed=0, k=3, prefer={1: secret})
    mf = models.read_bundle(path)
    assert len(mf.constituents) == 3 and mf.base == "base" and mf.constant_base
    assert models.load_constant_base(path).shape == (49152,)
    tok = testing.tiny_tokenizer()
    ids = tok([secret], return_tensors="pt").input_ids
    nll = []
    for ref in mf.constituents:
        m = models.load_model(models.resolve_ref(path, ref))
        lp = _logp(m, ids)[0, :-1].gather(-1, ids[0, 1:, None])
        nll.append(float(-lp.mean()))
    assert nll[1] < 0.5 < min(nll[0], nll[2])  # constituent 1 memorized the secret
