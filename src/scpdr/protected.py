"""``ProtectedLM``: batched, KV-cached decoding and teacher-forced scoring of a NAF-protected model
(layer 3 of ``shared/DESIGN.md``).

At every position the K constituents (and, for the SCP methods' 'b' variant, the base model) are
run on the same prefix, and their next-token distributions are aggregated with a rule of
:mod:`scpdr.naf` (Defs. 2.2, 2.6, Alg. 1) or with the stateful CP-Fuse step. Each generated token
carries its certificate: ``k_x``, the NAF bound of the method at that position (Def. 2.1,
Thms. 2.3/2.7; for SCP-Δr on the smoothed distributions, §4.1), and ``t_x``, the LiRA bound of
Thm. 4.4 with the max over all constituents (``scpdr.bounds.t_x`` with ``ref=None``).

Variants of SCP-Δr (§5.1): 'b' runs the base model at every step; 'c' uses a constant base logit
vector stored in the bundle (no base forward). Methods without a base never run it, and "none"
(the No CP baseline) runs constituent 0 alone.

Decoding: prompts are left-padded into one batch, position ids come from the attention mask, and
each model keeps its own KV cache. Finished rows are dropped from the batch (the caches are
compacted). All aggregation is float32 under ``torch.inference_mode``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from scpdr import bounds, naf
from scpdr.errors import BundleError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "Generation",
    "ProtectedLM",
    "ScoreComponents",
    "ScoreOutput",
    "StepEvent",
]

#: Methods ProtectedLM runs: every stateless rule of :data:`scpdr.naf.METHODS` plus "cp-fuse".
METHODS: tuple[str, ...] = (*naf.METHODS, "cp-fuse")
#: Default bound on the floats held at once by :meth:`ProtectedLM.score` (the (K+1)·B·T·V logits):
#: 2^26 float32 = 256 MiB; longer batches are processed in row chunks.
SCORE_CHUNK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------------------------
# results


@dataclass
class Generation:
    """One prompt's generation. ``token_ids``, ``logprobs``, ``k_x``, ``t_x`` (and
    ``top_logprobs`` when requested) have one entry per generated token.

    ``logprobs`` are log r(y) of the aggregated distribution (before temperature/top-p/top-k);
    ``text`` is the decoded generation without special tokens, cut before a stop string when one
    matched (the token that completed it stays in ``token_ids``); ``finish_reason`` is "stop"
    (eos or a stop string) or "length".
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    k_x: list[float]
    t_x: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str = "length"
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepEvent:
    """One streamed event of :meth:`ProtectedLM.generate_stream`, for prompt ``index``.

    Each generated token gives one event (``token_id`` set); a row's last event has
    ``finish_reason`` set. ``text_delta`` is the newly safe-to-show text (text that could still
    turn into a stop string or an incomplete UTF-8 character is held back). With
    ``max_new_tokens=0`` a row's only event has ``token_id=None``.
    """

    index: int
    token_id: int | None
    text_delta: str
    logprob: float | None
    k_x: float | None
    t_x: float | None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


class ScoreComponents(NamedTuple):
    """Raw inputs of the aggregation, for in-process bound analysis (never served).

    ``logps``: ``Tensor[K', B, T-1, V]`` float32 log-softmax of the models actually run
    (K' = 1 for "none"); ``base``: ``Tensor[B, T-1, V]`` base log-probs ('b'), the constant
    ``Tensor[V]`` base logits ('c'), or None. Pass them to ``scpdr.bounds`` with the same method.
    """

    logps: Tensor
    base: Tensor | None


@dataclass
class ScoreOutput:
    """Teacher-forced outputs of :meth:`ProtectedLM.score`; position t predicts token t+1.

    ``token_logprobs`` ``(B, T-1)``; ``logprobs`` ``(B, T-1, V)`` when ``full``; ``greedy``
    ``(B, T-1)`` argmax of r (-1 where invalid); ``k_x``/``t_x`` ``(B, T-1)``; ``components``
    (see :class:`ScoreComponents`). Positions whose context or target is padding hold 0.0.
    """

    token_logprobs: Tensor
    logprobs: Tensor | None = None
    greedy: Tensor | None = None
    k_x: Tensor | None = None
    components: ScoreComponents | None = None
    t_x: Tensor | None = None


# --------------------------------------------------------------------------------------------
# helpers


def _positions(mask: Tensor) -> Tensor:
    """Position ids from a 0/1 attention mask ``(B, T)``, as HF generate makes them."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def _index_positions(logits: Tensor, keep: Tensor) -> Tensor:
    """``logits`` ``(*lead, B, T, V)`` at ``keep``: bool ``(B, T)`` → ``(*lead, N, V)``;
    long ``(B, 1)`` → ``(*lead, B, 1, V)``."""
    nb = logits.ndim - 3  # leading dims
    if keep.dtype == torch.bool:
        return logits[(slice(None),) * nb + (keep,)]
    rows = torch.arange(keep.shape[0], device=keep.device)
    return logits[(slice(None),) * nb + (rows, keep[:, 0])].unsqueeze(-2)


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    """``value`` as a list of ``n`` entries (one value shared, or a list with one per prompt)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts")
        return list(value)
    return [value] * n


def _per_row_stop(stop: Any, n: int) -> list[list[str]]:
    """Stop strings per prompt. ``None``/a str/a list of str are shared; a list with one entry
    (None, str or list of str) per prompt, containing at least one None or list, is per prompt."""
    if stop is None:
        return [[] for _ in range(n)]
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or a per-prompt list, got {stop!r}")
    per_prompt = any(s is None or isinstance(s, (list, tuple)) for s in stop)
    if not per_prompt:
        rows = [list(stop)] * n
    else:
        if len(stop) != n:
            raise ValueError(f"stop has {len(stop)} per-prompt entries but there are {n} prompts")
        rows = [[] if s is None else [s] if isinstance(s, str) else list(s) for s in stop]
    for r in rows:
        for s in r:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
    return rows


class _Certifier:
    """Aggregation plus certificate ``(log r, k_x, t_x)`` for one method (one place for the
    bound logic shared by decoding and scoring)."""

    def __init__(self, method: str, m: int) -> None:
        self.method = method
        self.m = m

    def __call__(
        self, logits: Tensor, base: Tensor | None, path: Tensor | None, *, bounds_too: bool = True
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """``logits`` ``(K, N, V)``, ``base`` ``(N, V)``/``(V,)``/None, ``path`` ``(2, N)``
        (cp-fuse). Returns ``(log_r (N, V), k_x (N,), t_x (N,), comps (K, N, V) | None)``;
        without ``bounds_too`` only ``log_r`` is computed (the rest is None)."""
        method = self.method
        if not bounds_too:
            if method == "cp-fuse":
                return naf.cp_fuse_step(logits, 0.0 if path is None else path)[0], None, None, None
            return naf.aggregate(method, logits, base=base, m=self.m), None, None, None
        if method == "none":
            log_r = naf.normalize(logits[0])
            inf = torch.full(log_r.shape[:-1], math.inf, device=log_r.device)
            return log_r, inf, inf, None
        if method == "cp-fuse":
            log_r, _ = naf.cp_fuse_step(logits, 0.0 if path is None else path)
            comps = naf.normalize(logits)
            kx = bounds.max_divergence(log_r, comps).amax(dim=0)
            return log_r, kx, kx, comps  # max_y log r/q = the max divergence: t_x = k_x
        log_r, comps = bounds.naf_components(method, logits, base=base, m=self.m)
        div = bounds.KX_DIVERGENCE[method]
        if div == "relative-max":
            kx = bounds.relative_max_divergence(log_r, comps).amax(dim=0)
            # Thm. 4.4: t_x = log(tr/tq) + k_x, max over q among the constituents.
            tx = (log_r.mean(dim=-1) - comps.mean(dim=-1)).amax(dim=0) + kx
        elif div == "max":
            kx = bounds.max_divergence(log_r, comps).amax(dim=0)
            tx = kx
        else:  # "kl" (cp-kl): no LiRA theorem, the exact max ratio
            kx = bounds.kl_divergence(log_r, comps).amax(dim=0)
            tx = bounds.max_divergence(log_r, comps).amax(dim=0)
        return log_r, kx, tx, comps


# --------------------------------------------------------------------------------------------
# the runtime


class ProtectedLM:
    """A NAF-protected language model over K constituents (and a base for the SCP methods).

    Args:
        constituents: K causal LMs sharing ``tokenizer``'s vocabulary (K >= 2; K = 1 only for
            "none"; exactly 2 for "cp-fuse").
        tokenizer: their tokenizer.
        base_model: the base model (SCP methods, variant 'b').
        base_vector: constant base logits ``Tensor[V]`` (SCP methods, variant 'c').
        method: a name of :data:`METHODS`.
        m: smoothing level of the SCP methods (Alg. 1; paper default 10).
        names: model names for error messages.
        score_chunk_elements: bound on the floats of logits held at once by :meth:`score`.
    """

    def __init__(
        self,
        constituents: Sequence[PreTrainedModel],
        tokenizer: PreTrainedTokenizerBase,
        *,
        base_model: PreTrainedModel | None = None,
        base_vector: Tensor | None = None,
        method: str = "scp-delta-r",
        m: int = naf.DEFAULT_M,
        names: Sequence[str] | None = None,
        score_chunk_elements: int = SCORE_CHUNK_ELEMENTS,
    ) -> None:
        from scpdr.models import check_model_vocab, output_size

        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
        constituents = list(constituents)
        k = len(constituents)
        if k == 0 or (k < 2 and method != "none"):
            raise ValueError(
                f"method {method!r} needs K >= 2 constituents, got {k}; use method 'none' for a "
                "single model"
            )
        if method == "cp-fuse" and k != 2:
            raise ValueError(f"cp-fuse fuses exactly 2 constituents, got {k}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"m must be a positive int (tokens kept unsmoothed), got {m!r}")
        if score_chunk_elements < 1:
            raise ValueError("score_chunk_elements must be positive")
        self.method = method
        self.m = m
        self.tokenizer = tokenizer
        self.constituents = constituents
        self.num_constituents = k
        self.score_chunk_elements = int(score_chunk_elements)
        names = list(names) if names is not None else [f"constituent {i}" for i in range(k)]
        self.vocab_size = output_size(constituents[0])
        self.device = next(constituents[0].parameters()).device
        if m >= self.vocab_size:
            raise ValueError(f"m must be < V = {self.vocab_size} (tokens kept unsmoothed), got {m}")

        self.variant: str | None = None
        self.base_model: PreTrainedModel | None = None
        self.base_vector: Tensor | None = None
        if method in naf.SCP_METHODS:
            if base_model is not None and base_vector is not None:
                raise ValueError(
                    "pass either base_model ('b' variant) or base_vector ('c'), not both"
                )
            if base_vector is not None:
                vec = base_vector.detach().to(self.device, torch.float32).reshape(-1)
                if vec.numel() != self.vocab_size:
                    raise ValueError(
                        f"base_vector has {vec.numel()} entries, the vocabulary has {self.vocab_size}"
                    )
                self.base_vector, self.variant = vec, "c"
            elif base_model is not None:
                self.base_model, self.variant = base_model, "b"
            else:
                raise ValueError(
                    f"{method} smooths against a base: pass base_model= (variant 'b') or "
                    "base_vector= (variant 'c')"
                )
        models = {n: c for n, c in zip(names, constituents, strict=True)}
        if self.base_model is not None:
            models["base"] = self.base_model
        check_model_vocab(models, vocab_size=self.vocab_size)
        for name, model in models.items():
            dev = next(model.parameters()).device
            if dev != self.device:
                raise ValueError(f"model {name!r} is on {dev}, constituent 0 on {self.device}")
            model.eval()
        # The models each forward runs: constituents (only #0 for "none"), then the base ('b').
        self._run = constituents[:1] if method == "none" else list(constituents)
        if self.base_model is not None:
            self._run.append(self.base_model)
        self._certify = _Certifier(method, m)
        self._eos_ids = self._collect_eos_ids()
        #: scpdr.lora_fast.StackedLoRA when the run models are LoRA groups over one base (set by
        #: from_bundle): one stacked forward replaces the per-model loop.
        self._stacked: Any = None
        self._full_logits_only: set[int] = set()  # models without logits_to_keep tensors

    # ------------------------------------------------------------------ construction helpers

    @property
    def name(self) -> str:
        """Result-row name: "none", "cp-delta", ..., "scp-delta-r-b", "scp-delta-r-c", "cp-fuse"."""
        return f"{self.method}-{self.variant}" if self.variant else self.method

    def __repr__(self) -> str:
        return f"ProtectedLM(name={self.name!r}, K={self.num_constituents}, m={self.m})"

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike[str],
        *,
        method: str | None = None,
        m: int | None = None,
        base: str = "model",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> ProtectedLM:
        """Load a bundle (``scpdr.models.write_bundle``) as a protected model.

        ``method``/``m`` default to the bundle's (normally "scp-delta-r", 10). ``base="model"``
        runs the base model ('b'); ``base="constant"`` uses the stored constant vector ('c').
        Only the models the method needs are loaded ("none": constituent 0; no base for
        non-SCP methods). Raises BundleError for missing/inconsistent files, ValueError for bad
        arguments.
        """
        from scpdr import models as M

        if base not in ("model", "constant"):
            raise ValueError(f"base must be 'model' or 'constant', got {base!r}")
        manifest = M.read_bundle(path)
        method = method or manifest.method
        m = manifest.m if m is None else m
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
        tok = M.load_tokenizer(manifest.resolve(path, manifest.tokenizer))
        if M.vocab_hash(tok) != manifest.vocab_hash:
            raise BundleError(
                f"bundle {path}: the tokenizer of {manifest.tokenizer!r} has vocab hash "
                f"{M.vocab_hash(tok)}, the manifest records {manifest.vocab_hash}; the models "
                "changed after bundling: rebuild the bundle with `scpdr bundle`"
            )
        refs = manifest.constituents[:1] if method == "none" else manifest.constituents
        dev = torch.device(device) if device is not None else torch.device("cpu")
        from scpdr.lora_fast import stacked_from_bundle

        stacked = stacked_from_bundle(
            path, manifest, method=method, base=base, dtype=dtype, device=dev
        )  # None: not LoRA adapters over one base (reason logged)
        if stacked is not None:
            constituents = stacked.views[: len(refs)]
        else:
            constituents = [
                M.load_model(manifest.resolve(path, r), dtype=dtype).to(dev) for r in refs
            ]
        base_model = base_vector = None
        if method in naf.SCP_METHODS:
            if base == "constant":
                base_vector = M.load_constant_base(path, manifest)
                if base_vector is None:
                    raise ValueError(
                        f"bundle {path} stores no constant base vector, so base='constant' is "
                        "unavailable; use base='model' or rebuild the bundle with held-out "
                        "prompts (`scpdr bundle --held-out FILE`)"
                    )
            else:
                if manifest.base is None:
                    raise ValueError(
                        f"bundle {path} has no base model; use base='constant' or rebuild it "
                        "with `scpdr bundle --base REF`"
                    )
                if stacked is not None:
                    base_model = stacked.views[-1]
                else:
                    base_model = M.load_model(
                        manifest.resolve(path, manifest.base), dtype=dtype
                    ).to(dev)
        lm = cls(
            constituents,
            tok,
            base_model=base_model,
            base_vector=base_vector,
            method=method,
            m=m,
            names=list(refs),
        )
        lm._stacked = stacked
        return lm

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ProtectedLM:
        """A single model as a scorer (method "none": the No CP baseline; k_x = t_x = inf)."""
        return cls([model], tokenizer, method="none")

    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gc = getattr(self.constituents[0], "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    # ------------------------------------------------------------------ forward + aggregation

    def _forward(
        self,
        input_ids: Tensor,
        mask: Tensor,
        positions: Tensor,
        caches: list[Any] | None = None,
        keep: int | Tensor = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """Run every needed model; logits float32 at the positions ``keep`` selects.

        ``keep``: an int n keeps the last n positions (0 = all) → ``(K', B, T', V)``; a bool
        ``(B, T)`` tensor keeps those positions → ``(K', N, V)``; a long ``(B, 1)`` tensor keeps
        one position per row → ``(K', B, 1, V)``. The lm head runs only where kept when the model
        supports ``logits_to_keep`` tensors (else full logits are indexed). Returns
        ``(constituents' logits, base logits | None)``.
        """
        if self._stacked is not None:  # LoRA groups over one base: one stacked forward
            cache = None if caches is None else caches[0]
            n = keep if isinstance(keep, int) else 0
            out = self._stacked(input_ids, mask, positions, cache, n)  # (G, B, T', V)
            if isinstance(keep, Tensor):
                out = _index_positions(out, keep)
            return (out[:-1], out[-1]) if self.variant == "b" else (out, None)
        outs = [
            self._model_logits(
                model, input_ids, mask, positions, keep, None if caches is None else caches[i]
            )
            for i, model in enumerate(self._run)
        ]
        base = outs.pop() if self.variant == "b" else None
        return torch.stack(outs), base

    def _model_logits(
        self,
        model: PreTrainedModel,
        input_ids: Tensor,
        mask: Tensor,
        positions: Tensor,
        keep: int | Tensor,
        cache: Any | None,
    ) -> Tensor:
        kwargs: dict[str, Any] = (
            {"past_key_values": cache, "use_cache": True}
            if cache is not None
            else {"use_cache": False}
        )

        def run(k: int | Tensor) -> Tensor:
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                logits_to_keep=k,
                **kwargs,
            )
            return out.logits.float()

        if isinstance(keep, int):
            return run(keep)
        if id(model) not in self._full_logits_only:
            if keep.dtype == torch.bool:
                expected: tuple[int, ...] = (int(keep.sum()), self.vocab_size)
            else:
                expected = (keep.shape[0], 1, self.vocab_size)
            try:
                logits = run(keep)
                if logits.shape == (1, *expected):
                    logits = logits[0]
                if tuple(logits.shape) == expected:
                    return logits
            except (TypeError, ValueError, IndexError, RuntimeError) as exc:
                logger.debug("logits_to_keep tensors unsupported (%s); indexing full logits", exc)
                if cache is not None:  # the failed call may have grown the cache: not retried
                    raise
            self._full_logits_only.add(id(model))
        return _index_positions(run(0), keep)

    def _base_for(self, base: Tensor | None) -> Tensor | None:
        return self.base_vector if self.variant == "c" else base

    def _check_inputs(
        self, input_ids: Tensor, attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
            raise ValueError("input_ids must be a LongTensor of shape (B, T)")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if (attention_mask.sum(-1) == 0).any():
            raise ValueError("a row of attention_mask is all zeros (empty prompt)")
        if int(input_ids.max()) >= self.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size})")
        return input_ids.to(self.device), attention_mask.to(self.device).long()

    @torch.inference_mode()
    def next_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Aggregated, normalized next-token log-probs after each row's last real token:
        ``Tensor[B, V]`` float32 (left- or right-padded inputs). CP-Fuse uses the path-free
        objective here (as at its first generated token)."""
        ids, mask = self._check_inputs(input_ids, attention_mask)
        if bool((mask[:, -1] == 1).all()):  # left padding / no padding: the last column
            keep: int | Tensor = 1
        else:
            last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)  # (B,)
            keep = last.unsqueeze(1)  # (B, 1)
        logits, base = self._forward(ids, mask, _positions(mask), keep=keep)  # (K', B, 1, V)
        logits, base = logits[:, :, -1], None if base is None else base[:, -1]
        log_r, _, _, _ = self._certify(logits, self._base_for(base), None, bounds_too=False)
        return log_r

    @torch.inference_mode()
    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        full: bool = False,
        greedy: bool = False,
        k_x: bool = False,
        t_x: bool = False,
        components: bool = False,
    ) -> Tensor | ScoreOutput:
        """Teacher-forced scoring: one forward per model over whole sequences, aggregated at every
        position (no token loop).

        Args:
            input_ids: ``(B, T)`` token ids, left- or right-padded.
            attention_mask: ``(B, T)`` 0/1 (default all ones).
            full / greedy / k_x / t_x / components: also return the aggregated distributions
                ``(B, T-1, V)``, argmax tokens, certificates, raw model log-probs.

        Returns ``Tensor[B, T-1]`` (log r of each actual next token; 0.0 where the target or its
        context is padding) when no flag is set, else a :class:`ScoreOutput`. For "cp-fuse" the
        path log-probs of the given prefix (a cumulative sum from the first real token) enter the
        objective at each position. Rows are processed in chunks so that at most
        ``score_chunk_elements`` logits are held at once.
        """
        ids, mask = self._check_inputs(input_ids, attention_mask)
        b, t = ids.shape
        v = self.vocab_size
        dev = ids.device
        tok_lp = torch.zeros(b, max(t - 1, 0), device=dev)
        out_full = torch.zeros(b, t - 1, v, device=dev) if full else None
        out_greedy = torch.full((b, t - 1), -1, dtype=torch.long, device=dev) if greedy else None
        out_kx = torch.zeros(b, t - 1, device=dev) if k_x else None
        out_tx = torch.zeros(b, t - 1, device=dev) if t_x else None
        comp_l = (
            torch.zeros(len(self._run) - (self.variant == "b"), b, t - 1, v) if components else None
        )
        comp_b = torch.zeros(b, t - 1, v) if components and self.variant == "b" else None
        if t >= 2:
            per_row = len(self._run) * t * v
            rows = max(1, self.score_chunk_elements // per_row)
            for s in range(0, b, rows):
                sl = slice(s, min(b, s + rows))
                self._score_chunk(
                    ids[sl],
                    mask[sl],
                    sl,
                    tok_lp,
                    out_full,
                    out_greedy,
                    out_kx,
                    out_tx,
                    comp_l,
                    comp_b,
                )
        if not (full or greedy or k_x or t_x or components):
            return tok_lp
        comps = None
        if components:
            comps = ScoreComponents(comp_l, comp_b if self.variant == "b" else self.base_vector)
        return ScoreOutput(tok_lp, out_full, out_greedy, out_kx, comps, out_tx)

    def _score_chunk(
        self, ids, mask, sl, tok_lp, out_full, out_greedy, out_kx, out_tx, comp_l, comp_b
    ):
        b, t = ids.shape
        valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)  # (b, T-1): real context and target
        if not bool(valid.any()):
            return
        keep = torch.cat([valid, valid.new_zeros(b, 1)], dim=1)  # (b, T): positions predicting
        logits, base = self._forward(ids, mask, _positions(mask), keep=keep)  # (K', N, V), (N, V)
        target = ids[:, 1:][valid]  # (N,)
        path = None
        if self.method == "cp-fuse":
            tgt = naf.normalize(logits).gather(-1, target.view(1, -1, 1).expand(2, -1, 1))
            dense = torch.zeros(2, b, t - 1, device=ids.device)
            dense[:, valid] = tgt.squeeze(-1)  # (2, b, T-1)
            path = (dense.cumsum(-1) - dense)[:, valid]  # exclusive prefix sums: (2, N)
        fbase = base if base is not None else self._base_for(None)
        need = out_kx is not None or out_tx is not None
        log_r, kx, tx, _ = self._certify(logits, fbase, path, bounds_too=need)  # (N, V)
        tok_lp[sl][valid] = log_r.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if out_full is not None:
            out_full[sl][valid] = log_r
        if out_greedy is not None:
            out_greedy[sl][valid] = log_r.argmax(-1)
        if out_kx is not None:
            out_kx[sl][valid] = kx
        if out_tx is not None:
            out_tx[sl][valid] = tx
        if comp_l is not None:
            vc = valid.cpu()
            comp_l[:, sl][:, vc] = torch.log_softmax(logits, dim=-1).cpu()
            if comp_b is not None and base is not None:
                comp_b[sl][vc] = torch.log_softmax(base, dim=-1).cpu()

    # ------------------------------------------------------------------ generation

    def _encode_prompts(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of str or a list of token-id lists")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            elif isinstance(p, Tensor):
                ids = [int(x) for x in p.reshape(-1).tolist()]
            else:
                ids = [int(x) for x in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token of context")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            out.append(ids)
        return out

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int] = 32,
        temperature: float | Sequence[float] = 0.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        stop: str | Sequence[Any] | None = None,
        seed: int | Sequence[int | None] | None = None,
        stop_at_eos: bool = True,
        top_logprobs: int = 0,
    ) -> list[Generation]:
        """Generate a continuation of each prompt: one :class:`Generation` per prompt.

        Args:
            prompts: strings (tokenized with the tokenizer's special tokens, no chat template) or
                token-id lists.
            max_new_tokens: >= 0.
            temperature: 0 = greedy (argmax of r); > 0 samples from ``r^(1/temperature)``.
            top_p: nucleus mass in (0, 1]. top_k: 0 = off, else keep the k most likely tokens.
            stop: stop strings (shared: a str or list of str; per prompt: a list with one entry,
                None / str / list of str, per prompt).
            seed: sampling seed (per prompt or shared; each row has its own generator, so its
                tokens do not depend on the rest of the batch).
            stop_at_eos: finish a row at the eos token (kept in ``token_ids``).
            top_logprobs: also return the n most likely tokens of r at each step.

        Every sampling argument may be one value or a list with one entry per prompt.
        """
        encoded = self._encode_prompts(prompts)
        gens = [
            Generation("", [], [], [], [], [] if top_logprobs else None, "length", ids)
            for ids in encoded
        ]
        texts = [""] * len(gens)
        for ev in self.generate_stream(
            encoded,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
            stop_at_eos=stop_at_eos,
            top_logprobs=top_logprobs,
        ):
            g = gens[ev.index]
            texts[ev.index] += ev.text_delta
            if ev.token_id is not None:
                g.token_ids.append(ev.token_id)
                g.logprobs.append(float(ev.logprob))
                g.k_x.append(float(ev.k_x))
                g.t_x.append(float(ev.t_x))
                if g.top_logprobs is not None:
                    g.top_logprobs.append(ev.top_logprobs or [])
            if ev.finish_reason is not None:
                g.finish_reason = ev.finish_reason
        for g, text in zip(gens, texts, strict=True):
            g.text = text
        return gens

    def generate_stream(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int] = 32,
        temperature: float | Sequence[float] = 0.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        stop: str | Sequence[Any] | None = None,
        seed: int | Sequence[int | None] | None = None,
        stop_at_eos: bool = True,
        top_logprobs: int = 0,
    ) -> Iterator[StepEvent]:
        """Like :meth:`generate`, but yields a :class:`StepEvent` per generated token as soon as
        it is produced (for the server). Arguments are validated before the first event."""
        encoded = self._encode_prompts(prompts)
        n = len(encoded)
        params = _SamplingParams.build(
            n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
            top_logprobs=top_logprobs,
        )
        return self._stream(encoded, params, stop_at_eos)

    def _stream(self, encoded: list[list[int]], params: _SamplingParams, stop_at_eos: bool):
        n = len(encoded)
        rows = [_RowText(self.tokenizer, params.stop[i]) for i in range(n)]
        active = [i for i in range(n) if params.max_new_tokens[i] > 0]
        for i in range(n):
            if params.max_new_tokens[i] == 0:
                yield StepEvent(i, None, "", None, None, None, None, "length")
        if not active:
            return
        dec = _Decoder(self, [encoded[i] for i in active], [params.generator(i) for i in active])
        counts = dict.fromkeys(active, 0)
        out = dec.prefill()
        while True:
            toks, lps, kxs, txs, tops = dec.sample(out, params, active)
            keep = []
            for j, i in enumerate(active):
                tok = toks[j]
                counts[i] += 1
                row = rows[i]
                reason = None
                delta = row.add(tok)
                if row.stopped:
                    reason = "stop"
                elif stop_at_eos and tok in self._eos_ids:
                    reason = "stop"
                    delta += row.flush()
                elif counts[i] >= params.max_new_tokens[i]:
                    reason = "length"
                    delta += row.flush()
                yield StepEvent(
                    i, tok, delta, lps[j], kxs[j], txs[j], tops[j] if tops else None, reason
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


@dataclass
class _SamplingParams:
    max_new_tokens: list[int]
    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    stop: list[list[str]]
    seed: list[int | None]
    top_logprobs: int

    @classmethod
    def build(cls, n: int, **kw: Any) -> _SamplingParams:
        mnt = _per_row(kw["max_new_tokens"], n, "max_new_tokens")
        temp = _per_row(kw["temperature"], n, "temperature")
        top_p = _per_row(kw["top_p"], n, "top_p")
        top_k = _per_row(kw["top_k"], n, "top_k")
        seed = _per_row(kw["seed"], n, "seed")
        for x in mnt:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"max_new_tokens must be an int >= 0, got {x!r}")
        for x in temp:
            if (
                isinstance(x, bool)
                or not isinstance(x, (int, float))
                or not math.isfinite(x)
                or x < 0
            ):
                raise ValueError(
                    f"temperature must be a finite number >= 0 (0 = greedy), got {x!r}"
                )
        for x in top_p:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {x!r}")
        for x in top_k:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"top_k must be an int >= 0 (0 = off), got {x!r}")
        for x in seed:
            if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
                raise ValueError(f"seed must be an int or None, got {x!r}")
        tl = kw["top_logprobs"]
        if isinstance(tl, bool) or not isinstance(tl, int) or tl < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {tl!r}")
        return cls(
            [int(x) for x in mnt],
            [float(x) for x in temp],
            [float(x) for x in top_p],
            [int(x) for x in top_k],
            _per_row_stop(kw["stop"], n),
            seed,
            tl,
        )

    def generator(self, i: int) -> torch.Generator | None:
        if self.temperature[i] == 0:
            return None
        s = self.seed[i]
        if s is None:  # drawn from torch's global RNG: torch.manual_seed makes it reproducible
            s = int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator().manual_seed(s)


class _RowText:
    """Incremental detokenization of one row with stop strings (held-back text never shown)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        full = self._decode()
        self.text = full
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [p for p in (full.find(s, start) for s in self.stop) if p >= 0]
            if hits:
                self.stopped = True
                self.text = full[: min(hits)]
                return self._emit(self.text)
        safe = full
        while safe.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for more bytes
            safe = safe[:-1]
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for j in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:j]):
                    safe = safe[: len(safe) - j]
                    break
        return self._emit(safe)

    def _emit(self, upto: str) -> str:
        if len(upto) <= self.emitted:
            return ""
        delta = upto[self.emitted :]
        self.emitted = len(upto)
        return delta

    def flush(self) -> str:
        return self._emit(self.text)


class _Decoder:
    """Incremental decoding state of one batch: a KV cache per model, the attention mask, the
    next position ids, CP-Fuse path log-probs, per-row generators."""

    def __init__(
        self, lm: ProtectedLM, prompts: list[list[int]], generators: list[torch.Generator | None]
    ) -> None:
        from transformers import DynamicCache

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
        if lm._stacked is not None:  # one cache for the stacked batch
            self.caches = lm._stacked.new_caches()
        else:
            self.caches = [DynamicCache() for _ in lm._run]
        self.generators = generators
        self.path = torch.zeros(2, len(prompts), device=dev) if lm.method == "cp-fuse" else None
        self.next_pos = self.mask.sum(-1)  # (B,)

    @torch.inference_mode()
    def prefill(self) -> tuple[Tensor, Tensor | None]:
        logits, base = self.lm._forward(
            self.ids, self.mask, _positions(self.mask), self.caches, keep=1
        )
        return logits[:, :, -1], None if base is None else base[:, -1]

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[Tensor, Tensor | None]:
        dev = self.mask.device
        ids = torch.tensor(tokens, dtype=torch.long, device=dev).unsqueeze(1)  # (B, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        pos = self.next_pos.unsqueeze(1)
        self.next_pos = self.next_pos + 1
        logits, base = self.lm._forward(ids, self.mask, pos, self.caches, keep=1)
        return logits[:, :, -1], None if base is None else base[:, -1]

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
    def sample(self, out: tuple[Tensor, Tensor | None], params: _SamplingParams, active: list[int]):
        """Aggregate the step's logits, pick one token per row; returns python lists
        ``(tokens, logprobs, k_x, t_x, top_logprobs)`` (one host transfer)."""
        lm = self.lm
        logits, base = out  # (K', B, V), (B, V) | None
        log_r, kx, tx, comps = lm._certify(logits, lm._base_for(base), self.path)
        tokens = log_r.argmax(-1)  # (B,)
        sampled = [j for j, i in enumerate(active) if params.temperature[i] > 0]
        if sampled:
            tokens = tokens.clone()
            for j in sampled:
                i = active[j]
                tokens[j] = _sample_row(
                    log_r[j],
                    temperature=params.temperature[i],
                    top_p=params.top_p[i],
                    top_k=params.top_k[i],
                    generator=self.generators[j],
                )
        lp = log_r.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if self.path is not None:
            assert comps is not None
            self.path = self.path + comps.gather(
                -1, tokens.view(1, -1, 1).expand(comps.shape[0], -1, 1)
            ).squeeze(-1)
        host = torch.stack([tokens.float(), lp, kx, tx]).cpu()
        toks = tokens.cpu().tolist()
        tops = None
        if params.top_logprobs:
            n = min(params.top_logprobs, log_r.shape[-1])
            tv, ti = torch.topk(log_r, n, dim=-1)
            tops = [
                list(zip(a, b, strict=True))
                for a, b in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)
            ]
        return toks, host[1].tolist(), host[2].tolist(), host[3].tolist(), tops


def _sample_row(
    log_r: Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> int:
    """Sample one token from ``r^(1/temperature)`` restricted to top-k and the top-p nucleus."""
    logits = log_r.float() / temperature  # (V,)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_l, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_l, dim=-1)
        cum = probs.cumsum(-1)
        drop_sorted = (cum - probs) >= top_p  # keep the smallest prefix with mass >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator).item())
