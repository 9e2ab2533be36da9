"""NAF aggregation rules: pure functions of ``(K, *batch, V)`` log-probability tensors.

Modules: :mod:`~scpdr.naf.checks` (validation, constants), :mod:`~scpdr.naf.floor` (the floor,
RPDs), :mod:`~scpdr.naf.smoothing` (S_m and its kept set), :mod:`~scpdr.naf.rules` (the rules,
:data:`METHODS`, :func:`aggregate`), :mod:`~scpdr.naf.cp_fuse` (CP-Fuse). Every public name is
importable from ``scpdr.naf``.

The paper ("Provably Protecting Fine-Tuned LLMs from Training Data Extraction while Preserving
Utility") is the source of truth. Numbers below are those of the compiled paper, where
theorems, propositions, lemmas, definitions and remarks share one counter per section; the
LaTeX label is given as well so that a reader of the ``.tex`` file finds them:

- Def. 2.2 (CP-Δ), Thm. 2.3 (``thm:cp_d``, CP-Δ bound),
- Def. 2.5 (RPD), Def. 2.6 (CP-Δr), Thm. 2.7 (``thm:cp_dr``, CP-Δr bound),
- §4.1 smoothing S_m and Alg. 1 (``alg:SCP``, SCP-Δr), Remark 4.1 (``remark:2k_sparps``),
- CP-ΔKL (§2.5, after Vyas et al. 2023) and CP-Fuse (Abad et al. 2025).

Conventions (STYLE.md 1-5, after PEFT ``utils/merge_utils.py``):

- ``logps`` is ``Tensor[K, *batch, V]``: logits or log-probabilities of K constituent models on one
  vocabulary. ``base`` is ``Tensor[*batch, V]`` or a ``(V,)`` vector broadcast over the batch
  (the constant-base 'c' variant of SCP-Δr).
- Every input (each constituent and the base) first goes through :func:`normalize`: ``log_softmax``
  in float32, then ``clamp_min(LOG_FLOOR)`` (every probability at least e^-20, §2.1), then
  renormalization with ``logsumexp``. After renormalization a floored entry sits at
  ``LOG_FLOOR - log Z`` with ``0 <= log Z <= V e^-20`` (at most 1e-4 for V = 49152).
- Every rule returns normalized float32 log-probabilities ``Tensor[*batch, V]``, for float32,
  bfloat16 and float16 inputs alike, and never modifies its inputs.
- A row whose entries are all ``-inf`` has no distribution; its output is NaN. Partially masked
  rows (some ``-inf`` entries) are fine: masked tokens get the floor probability.
- The rules are for inference: they work in place on their own intermediates, so they are not
  differentiable (run them under ``torch.inference_mode()``, as the runtime does).
- S_m keeps the m tokens of largest score, ties to the smaller token id, in every
  implementation (:func:`smooth`). On CPU, SCP-Δr and CP-Fuse use C kernels
  (:mod:`scpdr.kernels`) where they are measured faster than torch on this machine.
"""

from scpdr.naf.checks import (
    DEFAULT_M,
    LOG_FLOOR,
    as_float32,
    check_base,
    check_floating,
    check_logps,
    check_m,
)
from scpdr.naf.cp_fuse import (
    CP_FUSE_CHUNK_ELEMENTS,
    CP_FUSE_GRID,
    CP_FUSE_WEIGHTS,
    cp_fuse_reference,
    cp_fuse_step,
)
from scpdr.naf.floor import SCRATCH_MAX_BYTES, normalize, rpd
from scpdr.naf.rules import (
    METHODS,
    SCP_CHUNK_ELEMENTS,
    SCP_METHODS,
    aggregate,
    aggregate_with_components,
    cp_delta,
    cp_delta_r,
    cp_kl,
    none,
    scp_delta,
    scp_delta_r,
    scp_delta_r_torch,
)
from scpdr.naf.smoothing import kept_tokens, smooth, smoothed_logps, smoothed_rpds

__all__ = [
    "CP_FUSE_CHUNK_ELEMENTS",
    "CP_FUSE_GRID",
    "CP_FUSE_WEIGHTS",
    "DEFAULT_M",
    "LOG_FLOOR",
    "METHODS",
    "SCP_CHUNK_ELEMENTS",
    "SCP_METHODS",
    "SCRATCH_MAX_BYTES",
    "aggregate",
    "aggregate_with_components",
    "as_float32",
    "check_base",
    "check_floating",
    "check_logps",
    "check_m",
    "cp_delta",
    "cp_delta_r",
    "cp_fuse_reference",
    "cp_fuse_step",
    "cp_kl",
    "kept_tokens",
    "none",
    "normalize",
    "rpd",
    "scp_delta",
    "scp_delta_r",
    "scp_delta_r_torch",
    "smooth",
    "smoothed_logps",
    "smoothed_rpds",
]
