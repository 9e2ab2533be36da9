"""A progress bar per constituent (rich) instead of the Trainer's tqdm bar and log lines: the
steps done of the plan's total, the epoch, the latest loss and the time left."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_callback"]


def progress_callback(label: str) -> Any:
    """A ``transformers.TrainerCallback`` drawing one rich progress bar named ``label`` on
    stderr while the Trainer trains (on the main process only)."""
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
