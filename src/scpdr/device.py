"""Where models run: the one ``--device`` / ``device:`` spelling of the library (``cpu``,
``cuda``, ``cuda:N``; default: ``$SCPDR_DEVICE``, else cuda when torch sees one), shared by
``scpdr train``, ``scpdr eval``, ``scpdr serve`` and the experiment's stages, and the precision
that goes with it.

On CUDA models are loaded in bf16 (:func:`model_dtype`); the aggregation of the constituents'
distributions (paper Def. 3.1, Alg. 1) stays in fp32 whatever the models' dtype, as on CPU. The C
kernels of the LoRA shared-base path are CPU-only; on CUDA that path runs on torch.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from scpdr.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEVICE_HELP",
    "DEVICE_PATTERN",
    "ENV_DEVICE",
    "check_device",
    "cuda_index",
    "device_source",
    "is_cuda",
    "model_dtype",
    "resolve_device",
]

#: The environment variable naming the default device (``cpu`` keeps a machine's GPU free).
ENV_DEVICE = "SCPDR_DEVICE"

#: The help text of the commands' ``--device`` option.
DEVICE_HELP = (
    f"Device: cpu, cuda or cuda:N (default: ${ENV_DEVICE} if set, else cuda when available)."
)

#: The device names the library accepts.
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: str | None, *, option: str = "--device") -> str | None:
    """``device`` when it is spelled ``cpu``, ``cuda`` or ``cuda:N`` (or None); cheap: torch is
    not asked whether the device exists (:func:`resolve_device` does).

    Raises:
        ConfigError: another spelling; the message names ``option``.
    """
    if device is None:
        return None
    device = device.strip().lower()
    if not DEVICE_PATTERN.match(device):
        raise ConfigError(f"{option} {device!r}: must be cpu, cuda or cuda:N (e.g. cuda:0)")
    return device


def resolve_device(device: str | None, *, option: str = "--device") -> str:
    """``device``; when it is None, ``$SCPDR_DEVICE`` (:data:`ENV_DEVICE`) where that is set,
    else "cuda" when CUDA is available and "cpu" otherwise.

    Raises:
        ConfigError: a bad spelling (of ``device`` or of ``$SCPDR_DEVICE``), CUDA asked for and
            not available, or a GPU index torch does not see.
    """
    import torch

    device = check_device(device, option=option)
    if device is None:
        env, source = device_source(None)
        if env is not None:
            return resolve_device(env, option=source)
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{option} {device}: no CUDA device is available to torch here; use {option} cpu"
            )
        index = cuda_index(device)
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(
                f"{option} {device}: torch sees {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    return device


def device_source(device: str | None, *, option: str = "--device") -> tuple[str | None, str]:
    """``(the device asked for, where it came from)`` for messages: ``device`` and ``option``,
    else ``$SCPDR_DEVICE`` and its name, else ``(None, "the default device")``."""
    if device is not None:
        return device, option
    env = os.environ.get(ENV_DEVICE, "").strip()
    return (env, ENV_DEVICE) if env else (None, "the default device")


def is_cuda(device: str | torch.device | None) -> bool:
    """Whether ``device`` names a CUDA device."""
    return device is not None and str(device).startswith("cuda")


def cuda_index(device: str | torch.device | None) -> int | None:
    """N of ``cuda:N``; None for ``cuda`` (the current device) and for other devices."""
    if not is_cuda(device):
        return None
    _, _, index = str(device).partition(":")
    return int(index) if index else None


def model_dtype(device: str | torch.device | None) -> Any:
    """The dtype models are loaded in on ``device``: bf16 on CUDA (the paper's precision), None
    (the checkpoint's, fp32 for scpdr's models) elsewhere."""
    if not is_cuda(device):
        return None
    import torch

    return torch.bfloat16
