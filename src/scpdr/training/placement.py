"""Where training runs: across processes (``accelerate launch``: DDP, FSDP) and on which device.

Processes. Under ``accelerate launch --num_processes N`` every process runs the same ``scpdr
train``: each prepares the same partitions (seeded) and trains every constituent together with
the others (the Trainer's DDP/FSDP), but only the main process writes files other processes could
read half-written — the tiny base, the partition files, each constituent's final directory, the
bundle — while the others wait (:func:`main_process_first`, :func:`wait_for_everyone`). Without a
launcher (one process) these are no-ops and accelerate's process group is never set up.

Device. :func:`training_device` resolves ``--device`` (:func:`scpdr.device.resolve_device`);
:func:`resolve_optim` picks the optimizer that can run there: the paper's 8-bit AdamW
(``adamw_bnb_8bit``, App. E) when bitsandbytes is importable and the device is CUDA, else
``adamw_torch`` (logged); ``adamw_torch`` runs as torch's fused kernel (``adamw_torch_fused``,
transformers' own default with torch >= 2.8) where torch has one for the device
(:func:`fused_optim`): the same update, one pass over each weight with no temporaries (one
AdamW step over the 135M model's 134.5M weights: 90 ms against 390-440 ms for the per-weight
loop, 2 threads, Intel Xeon AVX-512), and the same checkpoints, so it is the same run
(:func:`same_update`). bf16 mixed precision and gradient checkpointing are
:class:`~scpdr.training.config.TrainConfig` fields passed to the Trainer as they are.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from scpdr.device import cuda_index, device_source, is_cuda, resolve_device
from scpdr.errors import ConfigError

__all__ = [
    "FALLBACK_OPTIM",
    "full_state_dict",
    "fused_optim",
    "is_main_process",
    "launched",
    "main_process_first",
    "main_result",
    "placement_info",
    "plain_optim",
    "resolve_optim",
    "same_update",
    "select_device",
    "training_device",
    "wait_for_everyone",
    "world_size",
]

logger = logging.getLogger(__name__)

#: The optimizer used where an 8-bit (bitsandbytes) one cannot run.
FALLBACK_OPTIM = "adamw_torch"
#: transformers' names of optimizers that torch runs as one fused kernel: plain name -> fused.
FUSED = {"adamw_torch": "adamw_torch_fused"}


def world_size() -> int:
    """The number of training processes (``WORLD_SIZE``, set by ``accelerate launch`` and
    torchrun; 1 without a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched() -> bool:
    """Whether this process is one of several started by a launcher."""
    return world_size() > 1


def _on_cpu() -> bool:
    """Whether the launched processes train on CPU: ``accelerate launch --cpu``, or no CUDA."""
    import torch

    return os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" or not (
        torch.cuda.is_available()
    )


def _state():  # type: ignore[no-untyped-def]
    """accelerate's process state, set up as the Trainer sets it up (on CPU: ``cpu=True``, the
    gloo process group; the state is shared, so the first call decides)."""
    from accelerate import PartialState

    return PartialState(cpu=_on_cpu())


def is_main_process() -> bool:
    """True in the one process that writes shared files (always, without a launcher)."""
    return not launched() or bool(_state().is_main_process)


def wait_for_everyone() -> None:
    """A barrier across the training processes (nothing without a launcher)."""
    if launched():
        _state().wait_for_everyone()


T = TypeVar("T")


def main_result(fn: Callable[[], T]) -> T:
    """``fn()`` computed by the main process only and handed (pickled) to every process, so all
    of them act on the main process' decision (without a launcher: ``fn()``)."""
    if not launched():
        return fn()
    from accelerate.utils import broadcast_object_list

    box: list[Any] = [fn() if is_main_process() else None]
    broadcast_object_list(box)
    return box[0]


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (and writes), the others after it (and read what
    it wrote)."""
    if not launched():
        yield
        return
    with _state().main_process_first():
        yield


def training_device(device: str | None) -> str:
    """``device`` resolved (default: ``$SCPDR_DEVICE``, else cuda when available); under a
    launcher a pinned GPU is an error (each process trains on the GPU of its local rank).

    Raises:
        ConfigError: a bad or unavailable device, or ``cuda:N`` under several processes.
    """
    resolved = resolve_device(device)
    if not launched():
        return resolved
    _, source = device_source(device)
    if cuda_index(resolved) is not None:
        raise ConfigError(
            f"{source} {resolved}: under accelerate launch each process trains on the GPU of its "
            f"rank; set {source} to cuda (choose the GPUs with CUDA_VISIBLE_DEVICES or "
            "accelerate's --gpu_ids)"
        )
    if is_cuda(resolved) == _on_cpu():
        where = "CPU" if _on_cpu() else "GPUs"
        raise ConfigError(
            f"{source} {resolved}: the launched processes train on {where} (accelerate launch's "
            f"--cpu decides); change {source} or launch accordingly"
        )
    return resolved


def select_device(device: str) -> None:
    """Make ``cuda:N`` this process's current CUDA device (the Trainer places the model on the
    current device); nothing for ``cpu`` and ``cuda``."""
    index = cuda_index(device)
    if index is not None:
        import torch

        torch.cuda.set_device(index)


def placement_info(trainer: Any, device: str, optim: str) -> dict[str, Any]:
    """Where a finished run trained (``train_info.json``'s ``placement``): the device, the number
    of processes, how they shared the model (accelerate's distributed type: ``NO``,
    ``MULTI_CPU``/``MULTI_GPU`` for DDP, ``FSDP``) and the optimizer that ran."""
    return {
        "device": device,
        "world_size": int(trainer.args.world_size),
        "distributed": str(trainer.accelerator.distributed_type.value),
        "optim": optim,
    }


def full_state_dict(trainer: Any) -> dict[str, Any] | None:
    """Under FSDP, the trained model's full state dict, gathered from the shards (a collective:
    every process must call it; the main process then saves it); None otherwise (the main
    process saves ``trainer.model`` as it is)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return trainer.accelerator.get_state_dict(trainer.model)


def _is_8bit(optim: str) -> bool:
    return "bnb" in optim or "8bit" in optim


def resolve_optim(optim: str, device: str) -> str:
    """The optimizer that runs for ``optim`` on ``device``: :data:`FALLBACK_OPTIM` for a
    bitsandbytes optimizer where it cannot run (on CPU, or without bitsandbytes installed; the
    substitution is logged), and the fused kernel of a plain one where torch has it there
    (:func:`fused_optim`); else ``optim``."""
    if _is_8bit(optim):
        if not is_cuda(device):
            why = f"device {device}"
        elif importlib.util.find_spec("bitsandbytes") is None:
            why = "bitsandbytes is not installed (pip install bitsandbytes)"
        else:
            return optim
        logger.warning(
            "optimizer %s needs CUDA and bitsandbytes (%s); using %s", optim, why, FALLBACK_OPTIM
        )
        optim = FALLBACK_OPTIM
    return fused_optim(optim, device)


def fused_optim(optim: str, device: str) -> str:
    """``optim``'s fused kernel (:data:`FUSED`) where torch runs it on ``device``'s type (one
    AdamW step on a one-element weight there succeeds), else its plain form (logged where the
    fused one was asked for); an optimizer without a fused kernel as it is."""
    plain = plain_optim(optim)
    fused = FUSED.get(plain)
    if fused is None:
        return optim
    if _fused_adamw_runs(str(device).split(":", 1)[0]):
        return fused
    if optim == fused:
        logger.warning("%s does not run on device %s; using %s", optim, device, plain)
    return plain


@functools.cache
def _fused_adamw_runs(device_type: str) -> bool:
    import torch

    try:
        w = torch.zeros(1, device=device_type, requires_grad=True)
        w.grad = torch.ones_like(w)
        torch.optim.AdamW([w], lr=1e-3, fused=True).step()
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        logger.info("torch's fused AdamW does not run on %s (%s)", device_type, e)
        return False
    return True


def plain_optim(optim: str) -> str:
    """``optim`` without its fused kernel: the plain optimizer of a fused one (:data:`FUSED`)."""
    return {v: k for k, v in FUSED.items()}.get(optim, optim)


def same_update(a: str | None, b: str | None) -> bool:
    """Whether optimizers ``a`` and ``b`` make the same update with the same state (a plain
    one and its fused kernel: :data:`FUSED`), so one run's checkpoints continue the other's."""
    return plain_optim(a or "") == plain_optim(b or "")
