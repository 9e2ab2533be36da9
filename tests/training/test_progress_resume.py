"""No silent traps in `scpdr train`: fewer than 2 partitions is refused before any work; without a
terminal the progress goes to the log (step, loss, ETA); a checkpoint is written at least once per
epoch; and an interrupted `scpdr train --out B` continues only with --resume, with the same data
and options, from its last checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainerCallback

from scpdr.cli import main
from scpdr.data import load_partitions, names2ids, prepare_partitions
from scpdr.errors import ConfigError
from scpdr.training import TRAIN_INFO, TrainConfig, finetune, train_bundle

_FAST = dict(learning_rate=1e-2, batch_size=4, seq_len=32, warmup_steps=0, progress=False)
_OPTS = ["--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "0"]


class _Interrupt(Exception):
    pass


class _KillAtCheckpoint(TrainerCallback):
    """Stop the run (as a kill would) right after the checkpoint of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise _Interrupt


class _Saves(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save(self, args, state, control, **kw):
        self.steps.append(state.global_step)


# ------------------------------------------------------------------------------ K >= 2


def test_fewer_than_two_partitions_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "b"
    argv = ["train", "--data", "names2ids", "--partitions", "1", "--base", "tiny"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "K >= 2" in err and "--partitions 2 or more" in err
    assert not out.exists()  # nothing read, written or trained
    assert main(["partition", "names2ids", "--k", "1", "--out", str(tmp_path / "p")]) == 2
    assert "--k 2 or more" in capsys.readouterr().err and not (tmp_path / "p").exists()
    # the library: a one-partition set is refused before anything is written
    one = prepare_partitions("names2ids", k=1, n_train=8, n_val=2, seed=0)
    with pytest.raises(ConfigError, match="K >= 2"):
        train_bundle(one, base="tiny-unused", config=TrainConfig(**_FAST), out=out)
    assert not out.exists()


# ------------------------------------------------------------------------- progress


def test_progress_goes_to_the_log_when_stderr_is_not_a_terminal(tmp_path):
    """The reported trap: `scpdr train ... 2> train.log` wrote no progress there."""
    out, log = tmp_path / "b", tmp_path / "train.log"
    cmd = [sys.executable, "-m", "scpdr", "train", "--data", "names2ids", "--n-train", "12"]
    cmd += ["--n-val", "2", "--base", "tiny", "--max-steps", "4", "--logging-steps", "1"]
    cmd += ["--out", str(out), *_OPTS]
    with log.open("w") as stderr:
        proc = subprocess.run(
            cmd, stderr=stderr, stdout=subprocess.PIPE, text=True, timeout=600, env=os.environ
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    for i in range(2):
        lines = [ln for ln in text.splitlines() if f"constituent-{i}: step " in ln]
        assert f"constituent-{i}: step 1/4 (25%)" in lines[0]
        assert f"constituent-{i}: step 4/4 (100%)" in lines[-1]
        for ln in lines:
            assert "INFO" in ln and "loss " in ln and "epoch " in ln
            assert "elapsed 0:00:" in ln and "ETA " in ln
        assert lines[-1].endswith("ETA 0:00:00")


# ---------------------------------------------------------------------- checkpoints


def test_a_checkpoint_every_epoch_when_save_steps_is_longer(tmp_path):
    records = names2ids(n_train=12, n_val=1, seed=0).train  # 12 records, batch 4: 3 steps/epoch
    saves = _Saves()
    cfg = TrainConfig(epochs=3, save_total_limit=5, **_FAST)  # save_steps 200 > 9 steps
    out = finetune(
        records, base=_tiny_base(tmp_path), config=cfg, out=tmp_path / "c", callbacks=[saves]
    )
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["global_step"] == 9 and info["save_steps"] == 3
    assert saves.steps == [3, 6]  # after each epoch but the last (the final model is saved)
    cfg = TrainConfig(epochs=3, save_steps=2, save_total_limit=5, seed=1, **_FAST)
    saves.steps.clear()
    finetune(records, base=_tiny_base(tmp_path), config=cfg, out=tmp_path / "d", callbacks=[saves])
    assert saves.steps == [2, 4, 6, 8]  # save_steps shorter than an epoch: kept


def _tiny_base(tmp_path: Path) -> str:
    from scpdr.tiny import tiny_model, tiny_tokenizer

    d = tmp_path / "base"
    if not (d / "config.json").is_file():
        tiny_model(0).save_pretrained(str(d))
        tiny_tokenizer().save_pretrained(str(d))
    return str(d)


# --------------------------------------------------------------------------- resume


def test_resume_continues_an_interrupted_train_from_its_checkpoint(tmp_path, capsys):
    parts, out = tmp_path / "parts", tmp_path / "b"
    argv = ["partition", "names2ids", "--n-train", "16", "--n-val", "2", "--out", str(parts)]
    assert main(argv) == 0
    train = ["train", "--data", str(parts), "--out", str(out), "--base", "tiny"]
    train += ["--max-steps", "4", "--save-steps", "2", *_OPTS]
    assert main([*train, "--resume"]) == 2  # nothing there yet
    assert "nothing to resume" in capsys.readouterr().err
    # the run `scpdr train` starts (its tiny base in B/base, the same options), killed after the
    # first checkpoint of constituent 0
    base = _tiny_base(out)
    cfg = TrainConfig(max_steps=4, save_steps=2, **{**_FAST, "progress": True}, seed=0)
    with pytest.raises(_Interrupt):
        train_bundle(
            load_partitions(parts), base=base, config=cfg, out=out, callbacks=[_KillAtCheckpoint(2)]
        )
    capsys.readouterr()

    assert main(train) == 2  # without --resume: refused, naming it
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume" in err and "constituent-0 at step 2" in err
    assert main([*train, "--lr", "2e-2", "--resume"]) == 2  # other settings: refused, named
    err = capsys.readouterr().err
    assert "learning_rate (interrupted run: 0.01, now: 0.02)" in err

    assert main([*train, "--resume"]) == 0
    # the printed plan cannot know a checkpoint's batching: it says the checkpoint's wins
    assert "(a resumed constituent keeps the batching it started with):" in capsys.readouterr().out
    c0 = json.loads((out / "constituent-0" / TRAIN_INFO).read_text())
    c1 = json.loads((out / "constituent-1" / TRAIN_INFO).read_text())
    assert c0["resumed_from"] == "checkpoint-2" and c0["global_step"] == 4
    assert c1["resumed_from"] is None and c1["global_step"] == 4  # never started: trained
    assert (out / "scpdr.json").is_file() and not list(out.glob("constituent-*.tmp-*"))
    assert main([*train, "--resume"]) == 2  # finished: nothing left to resume
    assert "finished bundle" in capsys.readouterr().err


def test_finetune_resume_flag_is_explicit(tmp_path):
    records = names2ids(n_train=12, n_val=1, seed=0).train
    base, out = _tiny_base(tmp_path), tmp_path / "c"
    cfg = TrainConfig(max_steps=4, save_steps=2, **_FAST)
    with pytest.raises(ConfigError, match="nothing to resume"):
        finetune(records, base=base, config=cfg, out=out, resume=True)
    with pytest.raises(_Interrupt):
        finetune(records, base=base, config=cfg, out=out, callbacks=[_KillAtCheckpoint(2)])
    with pytest.raises(ConfigError, match="resume=True"):
        finetune(records, base=base, config=cfg, out=out, resume=False)
    with pytest.raises(ConfigError, match="the training records"):
        finetune(records[:8], base=base, config=cfg, out=out, resume=True)
    finetune(records, base=base, config=cfg, out=out, resume=True)
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["resumed_from"] == "checkpoint-2" and info["global_step"] == 4
