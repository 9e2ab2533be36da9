"""Tiny random-weight models and bundles with the real SmolLM2 tokenizer, for tests and smoke runs
(STYLE.md 11/12, after PEFT/TRL tiny models: run the real code on a tiny real model, never a mock).

The models are 2-layer Llamas with a small hidden size and the real 49152-token vocabulary, so
token ids, special tokens and chat templates are those of the embedded base model. Constituents
are "fine-tuned-like": the base weights plus small perturbations, so their next-token
distributions are related the way real fine-tunes are (and the NAF bounds are finite and small).
A constituent can additionally be trained for a few steps to strongly prefer a given text (a
"memorized secret"), for leakage tests.

The tiny-model builders themselves (:func:`tiny_model`, :func:`tiny_tokenizer`,
:func:`tiny_config`) live in :mod:`scpdr.tiny` (library code uses them for ``base: tiny``); they are
re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.tiny import seeded, tiny_config, tiny_model, tiny_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "F32_EPS",
    "HELD_OUT_PROMPTS",
    "correlated_logits",
    "extreme_logits",
    "f32_normalized_tol",
    "f32_tol",
    "finetune_on_text",
    "make_tiny_bundle",
    "perturbed_copy",
    "random_lora_adapter",
    "random_q4_blocks",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]


#: float32's machine epsilon (2^-23): one rounding changes a value ``v`` by at most ``eps·|v|/2``.
F32_EPS = 2.0**-23


def f32_tol(*magnitudes: Any, ops: float = 1.0) -> float:
    """An absolute tolerance for comparing two float32 computations of one quantity that do not
    run the same arithmetic (teacher-forced vs KV-cached forwards, batched vs unbatched, a C
    kernel vs torch, another ISA build or thread count): ``ops · eps32 · M``.

    ``M`` is the largest finite ``|value|`` among ``magnitudes`` (tensors, arrays or numbers: the
    operands and results whose rounding the two paths differ in — e.g. the log-probs a charge is
    a difference of), at least 1 (a result near 0 is still computed from operands of order 1;
    NaN and ±inf entries are left out); ``ops`` bounds the number of roundings, each at most
    ``eps32 · M``, by which the two paths may differ along the longer one (the terms of a
    reduction summed in another order, the chained layers of a forward). Say in the test how
    ``ops`` was counted.
    """
    import torch

    if not magnitudes:
        raise ValueError("f32_tol needs at least one magnitude")
    if not ops > 0:
        raise ValueError(f"ops must be > 0, got {ops!r}")
    biggest = 0.0
    for value in magnitudes:
        t = torch.as_tensor(value).detach().double().abs()
        t = t[torch.isfinite(t)]
        if t.numel():
            biggest = max(biggest, float(t.max()))
    return float(ops) * F32_EPS * max(biggest, 1.0)


def f32_normalized_tol(vocab: int, *values: Any) -> float:
    """:func:`f32_tol` for float32 log-probs normalized over ``vocab`` terms (log-softmax, the
    rules' final normalization), against float64 or another float32 implementation.

    The normalizer is a float32 sum of ``vocab`` terms that a vectorized loop accumulates in L
    lanes, each a sequential sum of ``vocab / L`` terms, so its relative error is at most
    ``(vocab / L) · eps32 / 2`` (Higham's bound); with L >= 4 (SSE, NEON; AVX2 has 8, AVX-512
    16) at most ``vocab · eps32 / 8``, which the log turns into the same absolute error in every
    log-prob. Plus 16 roundings of the largest of ``values`` (exp, log, the floor, subtracting
    the normalizer, a rule's few pointwise steps)."""
    return vocab / 8 * F32_EPS + f32_tol(*values, ops=16)


def correlated_logits(
    seed: int, k: int, batch: tuple[int, ...], vocab: int, scale: float, spikes: int = 0
) -> tuple[Any, Any]:
    """``(x (k, *batch, vocab), base (*batch, vocab))`` float32 logits of constituents and a base
    that are correlated like fine-tunes of one model (a shared part plus half as much of their
    own), with ``spikes`` tokens per row of each constituent raised by ``3·scale + 5`` (a
    memorized token): the property tests' inputs for the NAF rules and their bounds."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(*batch, vocab, generator=g) * scale
    x = shared + torch.randn(k, *batch, vocab, generator=g) * scale * 0.5
    base = shared + torch.randn(*batch, vocab, generator=g) * scale * 0.5
    if spikes:
        idx = torch.randint(0, vocab, (k, *batch, spikes), generator=g)
        x = x.scatter_add(-1, idx, torch.full(idx.shape, 3.0 * scale + 5.0))
    return x, base


def extreme_logits(seed: int = 5) -> tuple[Any, Any]:
    """``(x (2, 3, 4096), base (3, 4096))`` float32 logits at the edges: ±1e4 spikes, -inf
    (masked) runs, a row scaled by 1e4, a base with -inf entries and a ±1e4 row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4096, generator=g)
    x[0, 0, :10] = 1e4
    x[1, 0, 5:2000] = -1e4
    x[0, 1, 100:200] = float("-inf")
    x[1, 1, 150:4000] = float("-inf")
    x[:, 2] *= 1e4  # huge spread
    base = torch.randn(3, 4096, generator=g)
    base[0, :50] = float("-inf")
    base[1] = 1e4 * torch.sign(base[1])
    return x, base


def _held_out_prompts(n: int = 100) -> list[str]:
    subjects = ["The weather", "My friend", "The report", "A small cat", "This function"]
    verbs = ["explains", "describes", "shows", "returns", "asks about"]
    objects = ["the results", "a list of numbers", "the meeting", "an old story", "the answer"]
    out = []
    for i in range(n):
        s, v, o = subjects[i % 5], verbs[(i // 5) % 5], objects[(i // 25) % 5]
        out.append(f"{s} {v} {o} (example {i}).")
    return out


HELD_OUT_PROMPTS: list[str] = _held_out_prompts()
"""100 generic held-out prompts, used for tiny bundles' constant base vector."""


def random_q4_blocks(gen: Any, n: int, k: int, scale: float = 0.05) -> Any:
    """GGUF Q4_1 blocks ``(n, k / 32, 20)`` of an ``n x k`` weight: float16 d > 0 and m of a
    trained layer's size, random 4-bit q (:mod:`scpdr.kernels.q4`); ``gen`` a torch
    ``Generator``."""
    import torch

    nb = k // 32
    d = (torch.rand(n, nb, generator=gen) * scale + 1e-4).to(torch.float16)
    m = (-torch.rand(n, nb, generator=gen) * 8 * scale).to(torch.float16)
    qs = torch.randint(0, 256, (n, nb, 16), generator=gen, dtype=torch.uint8)
    scales = torch.stack([d, m], dim=-1).view(torch.uint8)  # (n, nb, 4)
    return torch.cat([scales, qs], dim=-1).contiguous()


def random_lora_adapter(
    model: PreTrainedModel, module: str, *, rank: int, scale: float = 1.0, seed: int = 0
) -> Any:
    """An in-memory :class:`scpdr.lora.LoraAdapter` over ``model`` adapting the linear
    ``module`` with random N(0, 1) A ``(rank, in)`` and B ``(out, rank)``, LoRA scale ``scale``."""
    import torch

    from scpdr.lora import LoraAdapter

    layer = model.get_submodule(module)
    gen = torch.Generator().manual_seed(int(seed))
    a = torch.randn(rank, layer.in_features, generator=gen)
    b = torch.randn(layer.out_features, rank, generator=gen)
    return LoraAdapter(Path(f"random-lora-{seed}"), "base", {module: (a, b, scale)}, {})


def perturbed_copy(model: PreTrainedModel, *, seed: int, scale: float = 0.02) -> PreTrainedModel:
    """A "fine-tuned-like" copy of ``model``: every weight ``w`` becomes ``w + scale·std(w)·ε``
    with ε ~ N(0, 1) from ``seed`` (1-D norm weights are left alone). ``model`` is not modified."""
    import copy

    import torch

    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for _, p in sorted(new.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim < 2:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_((scale * p.float().std() * noise).to(p.dtype))
    return new.eval()


def finetune_on_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    steps: int = 60,
    lr: float = 3e-2,
    seed: int = 0,
) -> PreTrainedModel:
    """Train ``model`` in place (a few full-batch Adam steps) until it strongly prefers each of
    ``texts`` (teacher-forced next tokens): a memorized "secret" for leakage tests. Returns it."""
    import torch

    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    with seeded(seed):
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
    return model.eval()


def make_tiny_bundle(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    k: int = 2,
    scale: float = 0.02,
    prefer: Mapping[int, str | Sequence[str]] | None = None,
    method: str = "scp-delta-r",
    m: int = 10,
    constant_base: bool = True,
    hidden_size: int = 32,
) -> Path:
    """Build a bundle of tiny random models with the real SmolLM2 tokenizer in ``path`` (seconds).

    Layout: ``path/base`` (a random ``tiny_model(seed)``), ``path/constituent-<i>`` for i < ``k``
    (``perturbed_copy(base, scale=scale)`` each; with ``prefer={i: text}`` constituent i is also
    trained to strongly prefer ``text``), ``constant_base.safetensors`` (mean base logits over
    :data:`HELD_OUT_PROMPTS`, when ``constant_base``) and ``scpdr.json``. Returns ``path``.
    """
    from scpdr.models import constant_base_vector, write_bundle

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    prefer = dict(prefer or {})
    bad = [i for i in prefer if not 0 <= i < k]
    if bad:
        raise ValueError(f"prefer names constituents {bad}, but k={k}")
    root = Path(os.fspath(path))
    root.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    base = tiny_model(seed, hidden_size=hidden_size)
    base.save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    refs = []
    for i in range(k):
        c = perturbed_copy(base, seed=1000 * (seed + 1) + i, scale=scale)
        if i in prefer:
            texts = prefer[i]
            finetune_on_text(c, tok, [texts] if isinstance(texts, str) else list(texts), seed=seed)
        d = root / f"constituent-{i}"
        c.save_pretrained(str(d))
        tok.save_pretrained(str(d))
        refs.append(d)
    vec = constant_base_vector(base, tok, HELD_OUT_PROMPTS) if constant_base else None
    return write_bundle(
        root,
        base=root / "base",
        constituents=refs,
        method=method,
        m=m,
        constant_base=vec,
        extra={
            "tiny": True,
            "seed": seed,
            "scale": scale,
            "prefer": {str(i): v for i, v in prefer.items()},
        },
    )
