"""Scorers of a bundle by result-row name: the first step of the evaluation pipeline
(:mod:`scpdr.attacks.evaluation`), shared by ``scpdr eval``, ``scpdr bounds`` and every attack and
bounds stage of ``scpdr experiment``.

:func:`load_scorers` gives a :class:`BundleScorers`: one ``ProtectedLM`` per method of
:mod:`scpdr.methods` (its rule, with the base its spec names: Alg. 1's base model 'b' or constant
vector 'c', paper §5.1), built when first used over models loaded once into a :class:`ModelStore`,
plus LiRA's reference scorers (Theorems 4.4 and 4.5), the base model (the ``ref`` attack's
reference) and TTE's ``q``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.attacks.scorer import Scorer
from scpdr.errors import ConfigError

__all__ = [
    "BUNDLE_METHODS",
    "BundleScorers",
    "ModelStore",
    "bundle_bases",
    "bundle_data_dir",
    "load_scorers",
    "smoothing_method",
]

#: Result-row methods a bundle runs by itself: every NAF rule over its constituents, with the
#: base its smoothing needs (training-time baselines need their own model: ``singles``).
BUNDLE_METHODS: tuple[str, ...] = M.AGGREGATE_METHODS


class ModelStore:
    """Loads each model (per ref and dtype) and each tokenizer once.

    ``capacity``: keep at most this many models (least recently used dropped first); None keeps
    all. An experiment keeps one store for its whole run, so the attack stages of one corpus load
    its constituents once."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._models: OrderedDict[tuple[str, Any], Any] = OrderedDict()
        self._tokenizers: dict[str, Any] = {}

    def model(self, ref: str | Path, *, dtype: Any = None, device: str | None = None) -> Any:
        """The model at ``ref`` in ``dtype`` on ``device`` (default: where it loads, the CPU).

        Loaded as ``scpdr serve`` loads a model of the general path: one loaded from a GGUF
        file (the embedded base) decodes from its Q4_1 blocks where this machine measured that
        faster (:func:`scpdr.lora.pack_full_model`), so an attack reads what the served
        aggregate returns."""
        import torch

        from scpdr.lora import pack_full_model
        from scpdr.models import load_model

        key = (str(ref), dtype, device)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        with torch.inference_mode(False):  # normal tensors, whatever mode the caller is in
            model = load_model(str(ref), dtype=dtype)
            if device is not None:
                model = model.to(device)
            pack_full_model(str(ref), model)
        model.eval()
        self._models[key] = model
        while self.capacity is not None and len(self._models) > self.capacity:
            self._models.popitem(last=False)
        return model

    def tokenizer(self, ref: str | Path) -> Any:
        from scpdr.models import load_tokenizer

        if str(ref) not in self._tokenizers:
            self._tokenizers[str(ref)] = load_tokenizer(str(ref))
        return self._tokenizers[str(ref)]

    def clear(self) -> None:
        self._models.clear()
        self._tokenizers.clear()


def bundle_data_dir(
    bundle: str | Path, manifest: Any, data: str | Path | None = None, *, instead: str = ""
) -> Path:
    """The partition directory of ``bundle``: ``data`` when given, else the manifest's
    ``extra.partitions`` (relative to the bundle; ``scpdr train`` records it). ``instead``
    names another option the error suggests (``"--prompts FILE or "``)."""
    if data is not None:
        return Path(data)
    rel = manifest.extra.get("partitions")
    if not rel:
        raise ConfigError(
            f"bundle {bundle} does not say where its data is (no extra.partitions); pass "
            f"{instead}--data DIR, the partition directory written by `scpdr partition`"
        )
    return Path(bundle) / rel


def bundle_bases(bundle: str | Path, manifest: Any, sources: Iterable[str | None]) -> Any:
    """Check that ``bundle`` has the bases that methods with these base ``sources`` (``"model"``
    for the '-b' variants, ``"constant"`` for '-c', None) need; return the constant base vector
    when one needs it, else None."""
    from scpdr import models

    sources = set(sources)
    if "model" in sources and manifest.base is None:
        raise ConfigError(
            f"bundle {bundle} has no base model: drop the '-b' methods from --methods, or "
            "re-bundle with a base (`scpdr bundle --base REF`)"
        )
    if "constant" not in sources:
        return None
    base_vector = models.load_constant_base(bundle, manifest)
    if base_vector is None:
        raise ConfigError(
            f"bundle {bundle} stores no constant base vector: drop the '-c' methods from "
            "--methods, or re-bundle with `scpdr bundle --held-out PROMPTS.txt` (stores it)"
        )
    return base_vector


class BundleScorers(Mapping[str, Scorer]):
    """The scorers of one bundle, by result-row name (a read-only mapping; built on first use).

    Attributes:
        q: constituent 1 alone (TTE's "q fails" restriction; LiRA's reference without p0), or
            None for a one-constituent bundle.
        m: the smoothing level of the SCP methods.
    """

    def __init__(
        self,
        path: str | Path,
        methods: Sequence[str],
        *,
        m: int | None = None,
        dtype: Any = None,
        reference: str | Path | None = None,
        singles: Mapping[str, str | Path] | None = None,
        store: ModelStore | None = None,
        device: str | None = None,
    ) -> None:
        from scpdr import models
        from scpdr.device import model_dtype, resolve_device

        self.path = Path(path)
        self.singles = {M.resolve(k).name: str(v) for k, v in (singles or {}).items()}
        # a "retrained" row (SCP-Δr-b over DP constituents) is its rule over THIS bundle: the
        # caller passes the bundle of those constituents
        allowed = (*BUNDLE_METHODS, *M.RETRAINED_METHODS, *self.singles)
        self.methods = list(dict.fromkeys(M.resolve(n, allowed=allowed).name for n in methods))
        self.manifest = models.read_bundle(self.path)
        bases = [M.SPECS[n].base for n in self.methods if n not in self.singles]
        # a base the methods need and the bundle lacks fails before any model loads
        self._base_vector = bundle_bases(self.path, self.manifest, bases)
        self.m = self.manifest.m if m is None else int(m)
        self.device = resolve_device(device)
        self._dtype = dtype if dtype is not None else model_dtype(self.device)  # bf16 on CUDA
        self._reference = None if reference is None else str(reference)
        self.store = store if store is not None else ModelStore()
        self.tokenizer = self.store.tokenizer(self._ref(self.manifest.tokenizer))
        self._built: dict[str, Scorer] = {}
        self._refs: dict[str, Scorer | None] = {}
        self._unseen: dict[int, list[Scorer]] = {}

    # -- Mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Scorer:
        key = M.canonical(name)
        if key not in self.methods:
            raise KeyError(name)
        if key not in self._built:
            if key in self.singles:
                self._built[key] = self._single(self.singles[key])
            else:
                self._built[key] = self._build(self._constituents(key), key)
        return self._built[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.methods)

    def __len__(self) -> int:
        return len(self.methods)

    # -- models ----------------------------------------------------------------------------
    def _ref(self, ref: str) -> str:
        return self.manifest.resolve(self.path, ref)

    def _model(self, ref: str) -> Any:
        return self.store.model(ref, dtype=self._dtype, device=self.device)

    def _constituents(self, name: str) -> list[Any]:
        refs = self.manifest.constituents
        if M.SPECS[name].rule == "none":  # No CP: constituent 0 alone
            refs = refs[:1]
        return [self._model(self._ref(r)) for r in refs]

    def _single(self, ref: str) -> Scorer:
        from scpdr.runtime import ProtectedLM

        return ProtectedLM.from_model(self._model(ref), self.tokenizer)

    def _build(self, models: list[Any], name: str) -> Scorer:
        """``name``'s rule over ``models`` with the base its spec names (Alg. 1: SCP smooths
        towards the base model 'b' or the constant vector 'c', paper §5.1)."""
        from scpdr.runtime import ProtectedLM

        spec = M.SPECS[name]
        if spec.rule == "none":
            return ProtectedLM.from_model(models[0], self.tokenizer)
        base_model = base_vector = None
        if spec.smoothed and spec.base == "model":
            base_model = self._model(self._ref(self.manifest.base))
        elif spec.smoothed and spec.base == "constant":
            base_vector = self._base_vector
        return ProtectedLM(
            models,
            self.tokenizer,
            base_model=base_model,
            base_vector=base_vector,
            method=spec.rule,
            m=self.m,
        )

    @property
    def base(self) -> Scorer | None:
        """The bundle's base model alone (the ``ref`` attack's reference: it saw none of the
        fine-tuning data), or None for a bundle without a base model."""
        if "base" not in self._refs:
            ref = self.manifest.base
            self._refs["base"] = self._single(self._ref(ref)) if ref else None
        return self._refs["base"]

    @property
    def q(self) -> Scorer | None:
        if "q" not in self._refs:
            cons = self.manifest.constituents
            self._refs["q"] = self._single(self._ref(cons[1])) if len(cons) > 1 else None
        return self._refs["q"]

    def unseen(self, partition: int | None) -> list[Scorer]:
        """The constituents trained without ``partition`` (constituent i is trained on partition
        i), each alone: the secrets attack's per-record chance level
        (:func:`scpdr.attacks.secrets.counterfactual_extraction`); evaluation only, never served.
        ``partition`` None (unknown): every constituent but 0, the No CP model's."""
        cons = self.manifest.constituents
        skip = 0 if partition is None else int(partition)
        if skip not in self._unseen:
            self._unseen[skip] = [
                self._single(self._ref(r)) for i, r in enumerate(cons) if i != skip
            ]
        return self._unseen[skip]

    def reference_of(self, name: str) -> Scorer | None:
        """LiRA's reference scorer for method ``name`` (trained without the members).

        With ``reference`` (a model ref for ``p_0``, trained without them) the reference of a
        NAF method is the same method over ``(p_0, constituents 1..K-1)`` — the worst case
        ``CP(p_0, q)`` of Theorem 4.5 — and of No CP and a single-model baseline ``p_0`` alone.
        Without it the reference is ``q`` (Theorem 4.4's ``r_0 = q``), which never saw the
        target partition either; None for a one-constituent bundle."""
        key = M.canonical(name)
        if self._reference is None:
            return self.q
        if key not in self._refs:
            if key in self.singles or M.SPECS[key].rule == "none":
                self._refs[key] = self._single(self._reference)
            else:
                cons = [self._model(self._ref(r)) for r in self.manifest.constituents[1:]]
                self._refs[key] = self._build([self._model(self._reference), *cons], key)
        return self._refs[key]


def smoothing_method(base: str) -> str:
    """The result-row name of SCP-Δr (Alg. 1) smoothing towards ``base`` ("model": the base
    model, 'b'; "constant": the constant vector, 'c'): its scorer's components carry the
    constituents' and the base's log-probs, what the bound analysis reads."""
    return next(n for n, s in M.SPECS.items() if s.rule == "scp-delta-r" and s.base == base)


def load_scorers(
    path: str | Path,
    methods: Sequence[str],
    *,
    m: int | None = None,
    dtype: Any = None,
    reference: str | Path | None = None,
    singles: Mapping[str, str | Path] | None = None,
    store: ModelStore | None = None,
    device: str | None = None,
) -> BundleScorers:
    """The scorers of ``methods`` (result-row names or aliases, :mod:`scpdr.methods`) over the
    bundle at ``path``; each model is loaded once (into ``store``), when first needed.

    ``m``: the SCP smoothing level (default: the bundle's). ``reference``: p0 for LiRA
    (:meth:`BundleScorers.reference_of`). ``singles``: training-time baselines evaluated as one
    model, ``{row name: model dir}``. A "retrained" row (:data:`scpdr.methods.RETRAINED_METHODS`,
    e.g. SCP-Δr-b over DP-trained constituents) runs its rule over the bundle at ``path``: pass
    the bundle of those constituents. ``device``: cpu, cuda or cuda:N (default:
    ``$SCPDR_DEVICE``, else cuda when available; on CUDA the models load in bf16 unless ``dtype``
    says otherwise, and the aggregation stays fp32). Raises :class:`~scpdr.methods.UnknownMethodError` for an
    unknown method and :class:`ConfigError` when the bundle lacks a base a method needs — before
    any model loads."""
    return BundleScorers(
        path,
        methods,
        m=m,
        dtype=dtype,
        reference=reference,
        singles=singles,
        store=store,
        device=device,
    )
