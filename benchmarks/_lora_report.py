"""bench_lora's bookkeeping: the goals, the keys of its rows per kernel build, and what
``scpdr serve`` decodes with by default (the served default the goals judge)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("scpdr.benchmarks.lora")

#: The fast path with the base's weights in bf16 (``from_bundle(dtype=torch.bfloat16)``).
BF16 = "scp-delta-r-b-bf16w"
GOALS = {"scp-delta-r-b@B1": 0.75, "scp-delta-r-b@B8": 0.75, "memory": 1.25}


def decode_choices(targets: list[str], bundle: Any, *, no_bf16: bool = False) -> dict[str, Any]:
    """Per build, the precision ``scpdr serve --precision auto`` decodes ``bundle`` with on this
    CPU (a :class:`scpdr.training.precision.PrecisionChoice`; ``.bf16``: bf16 base weights),
    from :func:`scpdr.serve.precision.resolve_decode_precision` for the bundle's
    :func:`~scpdr.serve.precision.decode_form` (measured once per CPU model, logged with its
    reason), decided at this benchmark's thread count, which is part of the decision's key: a
    server on another thread count measures for itself. Warns where ``--no-bf16`` leaves the
    served default's speed unmeasured."""
    from scpdr import kernels
    from scpdr.serve.precision import decode_form, resolve_decode_precision

    form = decode_form(bundle)
    out = {}
    for t in targets:
        with kernels.using_target(t):
            out[t] = resolve_decode_precision("auto", form=form)
        if out[t].bf16 and no_bf16:
            logger.warning(
                "--no-bf16: the %s build is served with bf16 weights here, so its speed goals "
                "are not measured (None, not met)",
                t,
            )
    return out


def memory_key(kind: str, target: str, bf16: bool) -> str:
    """``single``, ``protected[<target>]`` or ``protected-bf16w[<target>]``."""
    if kind == "single":
        return kind
    return f"{kind}{'-bf16w' if bf16 else ''}[{target}]"


def meets(key: str, value: float | None) -> bool:
    """Whether ``value`` meets the goal of ``key`` (memory: at most; speed: at least)."""
    goal = GOALS[key.split("[")[0]]
    return value is not None and (value <= goal if key.startswith("memory") else value >= goal)


def served_default(choices, ratios, bf16w, batch_sizes, *, no_bf16: bool) -> dict:
    """Per build, what ``scpdr serve`` decodes with by default (``choices``: from
    :func:`decode_choices`), why, that precision's ratios to HF generate and to one model's
    memory (the float32 rows' or the bf16-weight rows'; a bf16 speed is None under
    ``--no-bf16``), and whether they meet :data:`GOALS`."""
    out = {}
    for t, choice in choices.items():
        bf16 = choice.bf16
        rows = {
            key: None
            if bf16 and no_bf16 and key != "memory"
            else (bf16w.get(bf16_key(key, t)) if bf16 else ratios.get(target_key(key, t)))
            for key in [*(f"scp-delta-r-b@B{b}" for b in batch_sizes), "memory"]
        }
        out[t] = {
            "precision": choice.precision,
            "reason": choice.reason,
            "ratios": rows,
            "goals_met": {k: meets(k, rows.get(k)) for k in GOALS},
        }
        logger.info("served with --precision auto (%s build): %s %s", t, choice.summary, rows)
    return out


def bf16_key(key: str, target: str) -> str:
    """The bf16-weight row of ``key`` (``scp-delta-r-b@B1`` -> ``scp-delta-r-b-bf16w@B1``,
    ``memory`` -> ``scp-delta-r-b-bf16w:memory``) for build ``target``."""
    if key == "memory":
        return target_key(f"{BF16}:memory", target)
    return target_key(key.replace("scp-delta-r-b", BF16), target)


def target_key(key: str, target: str) -> str:
    """``scp-delta-r-b@B1`` -> ``scp-delta-r-b[x86-64-v3]@B1`` (``memory`` -> ``memory[...]``)
    for a build other than native."""
    if target == "native":
        return key
    name, at, batch = key.partition("@")
    return f"{name}[{target}]{at}{batch}"


def per_target(targets, ratios, served, same_kernels, decisions, kernels) -> dict:
    """``{target: {"isa", "precision", "ratios", "goals_met", "float32_ratios",
    "same_kernel_ratios", "decisions"}}`` (``ratios``: the served default's)."""
    out = {}
    for t in targets:
        lib = kernels.gemm.library(target=t)
        out[t] = {
            "isa": None if lib is None else lib.lib.isa,
            "precision": served[t]["precision"],
            "ratios": served[t]["ratios"],
            "goals_met": served[t]["goals_met"],
            "float32_ratios": {k: ratios.get(target_key(k, t)) for k in served[t]["ratios"]},
            "same_kernel_ratios": {
                k: same_kernels.get(target_key(k, t)) for k in GOALS if k != "memory"
            },
            "decisions": {k: v for k, v in decisions.items() if f", {t} build)" in k},
        }
    return out
