"""Are forgotten records gone? The attacks of the one evaluation pipeline
(:func:`scpdr.attacks.evaluation.run_eval`) on the records a deletion removed, against the bundle
before and after it (``scpdr eval B2 --forgotten``; :mod:`scpdr.training.forget`).

The removed records of partition ``p`` were members of constituent ``p`` before and are
non-members of every constituent after. Per bundle and partition the pipeline runs:

- ``pii``: the Names2IDs extraction (full extraction rate, FER) of their IDs, with the No CP-val
  row (the validation names: what extraction reaches without memorization);
- ``secrets``: the extraction of their declared secrets, with each secret's chance level under
  the constituents that never saw the record;
- ``mia``: the membership-inference suite (LOSS, zlib, Min-K%, Min-K%++, Ref, LiRA) with the
  removed records as members and validation records as non-members; its No CP-val row attacks
  validation records no model saw as if they were members — the row a forgotten record should
  be indistinguishable from after the deletion.

"No CP" here is constituent ``p`` alone (the model that held the records; constituent 0 in
``scpdr eval``), and LiRA's reference is a constituent that never saw partition ``p`` (Theorem
4.4's ``r_0 = q``). Rows carry ``bundle`` ("before" / "after") and ``partition``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.attacks.bundle_scorers import BUNDLE_METHODS, ModelStore, bundle_data_dir, load_scorers
from scpdr.attacks.eval_data import EvalData
from scpdr.attacks.evaluation import EvalOptions, check_attacks, run_eval
from scpdr.attacks.results import ResultRow
from scpdr.errors import ConfigError

__all__ = ["FORGOTTEN_ATTACKS", "eval_forgotten", "forgotten_eval_data"]

log = logging.getLogger(__name__)

#: The attacks that say whether a record is gone (the others need the bundle's own data).
FORGOTTEN_ATTACKS: tuple[str, ...] = ("pii", "secrets", "mia")


def forgotten_eval_data(
    records: Sequence[Any], validation: Sequence[Any], *, partition: int, corpus: str
) -> EvalData:
    """The :class:`EvalData` of forgotten ``records`` of ``partition``: their IDs (Names2IDs) and
    declared secrets, and the MIA suite's "records" population (members: ``records``;
    non-members: ``validation``, the clean validation records)."""
    return EvalData.of_records(records, validation, partition=partition, corpus=corpus)


def eval_forgotten(
    after: str | Path,
    *,
    before: str | Path | None = None,
    methods: Sequence[str] | None = None,
    attacks: Sequence[str] = FORGOTTEN_ATTACKS,
    options: EvalOptions | None = None,
    device: str | None = None,
    dtype: Any = None,
) -> list[ResultRow]:
    """The rows of ``attacks`` on the records forgotten by the bundle ``after``, against
    ``before`` (default: the source its deletion log names) and ``after``, their models loaded
    in ``dtype`` (default: :func:`scpdr.device.model_dtype`).

    ``methods``: result-row names (default No CP and the bundle's method). The MIA suite draws as
    many non-members as there are forgotten records of a partition, so that the rest of the
    validation records are its No CP-val row (a warning when none are left)."""
    from scpdr.data import load_partitions
    from scpdr.models import read_bundle
    from scpdr.training.forget import load_forgotten, source_bundle

    attacks = check_attacks(attacks)
    bad = [a for a in attacks if a not in FORGOTTEN_ATTACKS]
    if bad:
        raise ConfigError(
            f"--forgotten runs {', '.join(FORGOTTEN_ATTACKS)} on the forgotten records; "
            f"{', '.join(bad)} need(s) the bundle's own data (run `scpdr eval` without --forgotten)"
        )
    manifest = read_bundle(after)
    before = Path(before) if before is not None else source_bundle(after, manifest)
    parts, _ = load_forgotten(after)
    if not parts:
        raise ConfigError(
            f"{after} forgot validation records only: no constituent trained on them, so there "
            "is nothing to check"
        )
    pset = load_partitions(bundle_data_dir(after, manifest))
    validation = pset.clean_validation()
    corpus = str(pset.manifest.dataset.get("name") or "data")
    if methods is None:
        methods = ["none", M.resolve(manifest.method, allowed=BUNDLE_METHODS).name]
    opts = options or EvalOptions()
    store = ModelStore()
    rows: list[ResultRow] = []
    for label, bundle in (("before", Path(before)), ("after", Path(after))):
        mb = read_bundle(bundle)
        for p, recs in parts.items():
            if p >= len(mb.constituents):
                raise ConfigError(f"{bundle} has no constituent {p}; is --before the right bundle?")
            if 2 * len(recs) > len(validation):
                log.warning(
                    "%d forgotten records of partition %d and %d validation records: the MIA "
                    "suite's No CP-val row needs more validation records than that (twice as many)",
                    len(recs),
                    p,
                    len(validation),
                )
            data = forgotten_eval_data(recs, validation, partition=p, corpus=corpus)
            singles = None
            if p != 0:  # No CP: the constituent that held the records
                singles = {"none": mb.resolve(bundle, mb.constituents[p])}
            scorers = load_scorers(
                bundle, methods, singles=singles, store=store, device=device, dtype=dtype
            )
            ref = scorers.unseen(p)[0]  # never saw partition p: LiRA's reference
            point = replace(opts, mia_n=len(recs), mia_population="records")
            report = run_eval(scorers, data, attacks, options=point, reference=lambda _m, r=ref: r)
            rows += [
                replace(r, extra={**r.extra, "bundle": label, "partition": p, "forgotten": True})
                for r in report.rows
            ]
    return rows
