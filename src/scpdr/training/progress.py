"""Training progress per constituent, instead of the Trainer's tqdm bar and log lines.

On a terminal (stderr is a TTY): one rich progress bar per constituent — the steps done of the
plan's total, the epoch, the latest loss and the time left. Elsewhere (stderr redirected to a file,
a batch job, ``nohup``): a bar would only be drawn at the end, so :mod:`logging` gets one INFO line
at the first step, every :data:`LOG_EVERY_FRACTION` of the run or :data:`LOG_EVERY_SECONDS`
(whichever comes first) and at the last step::

    constituent-0: step 40/87 (46%), epoch 1.4, loss 2.317, elapsed 0:01:02, ETA 0:01:13
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["LOG_EVERY_FRACTION", "LOG_EVERY_SECONDS", "progress_callback"]

logger = logging.getLogger(__name__)

#: Without a terminal: a progress line at least every this share of the run's steps ...
LOG_EVERY_FRACTION = 0.05
#: ... and at least every this many seconds (checked at the end of each step).
LOG_EVERY_SECONDS = 30.0


def progress_callback(label: str, *, tty: bool | None = None) -> Any:
    """A ``transformers.TrainerCallback`` that reports the progress of the run named ``label``
    (on the main process only): a rich bar on stderr when ``tty`` (default: whether stderr is a
    terminal), INFO log lines otherwise (see the module docstring)."""
    if tty is None:
        tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return _rich_callback(label) if tty else _log_callback(label)


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _log_callback(label: str) -> Any:
    from transformers import TrainerCallback

    class _LogProgress(TrainerCallback):
        def __init__(self) -> None:
            self.loss: float | None = None
            self.t0 = 0.0
            self.start_step = 0
            self.last_step = -1
            self.last_time = 0.0
            self.pending: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = self.last_time = time.monotonic()
            self.start_step = state.global_step  # > 0 when resumed from a checkpoint
            self.last_step = state.global_step
            if state.is_world_process_zero and state.global_step:
                logger.info("%s: resumed at step %d/%d", label, state.global_step, state.max_steps)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])
            if self.pending == state.global_step:  # the line waited for this step's loss
                self._emit(state)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not state.is_world_process_zero:
                return
            step, total, now = state.global_step, max(int(state.max_steps), 1), time.monotonic()
            every = max(1, round(LOG_EVERY_FRACTION * total))
            if not (
                step == self.start_step + 1
                or step >= total
                or step - self.last_step >= every
                or now - self.last_time >= LOG_EVERY_SECONDS
            ):
                return
            self.last_step, self.last_time = step, now
            logs_now = args.logging_strategy == "steps" and (
                step % args.logging_steps == 0 or (step == 1 and args.logging_first_step)
            )
            if logs_now:  # the Trainer logs this step's loss right after: report it
                self.pending = step
            else:
                self._emit(state)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.pending is not None:
                self._emit(state)

        def _emit(self, state: Any) -> None:
            self.pending = None
            step, total = state.global_step, max(int(state.max_steps), 1)
            elapsed = time.monotonic() - self.t0
            done = step - self.start_step
            parts = [f"step {step}/{total} ({step / total:.0%})"]
            if state.epoch is not None:
                parts.append(f"epoch {state.epoch:.1f}")
            if self.loss is not None:
                parts.append(f"loss {self.loss:.3f}")
            parts.append(f"elapsed {_clock(elapsed)}")
            eta = _clock(elapsed / done * (total - step)) if done > 0 else "?"
            parts.append(f"ETA {eta}")
            logger.info("%s: %s", label, ", ".join(parts))

    return _LogProgress()


def _rich_callback(label: str) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers import TrainerCallback

    class _RichProgress(TrainerCallback):
        def __init__(self) -> None:
            self.progress: Progress | None = None
            self.task: Any = None
            self.loss = ""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not state.is_world_process_zero:
                return
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps {task.fields[loss]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.progress.start()
            self.task = self.progress.add_task(
                label, total=state.max_steps, completed=state.global_step, loss=""
            )

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.progress is not None:
                epoch = f"epoch {state.epoch:.1f}" if state.epoch is not None else ""
                self.progress.update(
                    self.task, completed=state.global_step, loss=f"{epoch}{self.loss}"
                )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.loss = f", loss {float(logs['loss']):.3f}"

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.progress is not None:
                self.progress.update(self.task, completed=state.global_step)
                self.progress.stop()
                self.progress = None

    return _RichProgress()
