"""Batches that fit the data: the collator pads each batch to its own longest sequence (EOS,
attention 0, label -100, goldfish still applied), length-grouped batches pad little and are the
same for the same (seed, epoch), the plan's padding share is the share of the batches the Trainer
builds, and a grouped run interrupted in the middle of its second epoch resumes to the same
weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from scpdr.data import Record, names2ids
from scpdr.errors import ConfigError
from scpdr.training import (
    TRAIN_INFO,
    CausalCollator,
    TrainConfig,
    build_sequences,
    finetune,
    fit_to_data,
    goldfish_mask,
)
from scpdr.training.config import PAD_TO_MULTIPLE_OF
from scpdr.training.sequences import GroupedSampler, epoch_order, padding_share


@pytest.fixture(scope="module")
def tok():
    from scpdr.testing import tiny_tokenizer

    return tiny_tokenizer()


def _row(ids: list[int]) -> dict[str, list[int]]:
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}


def test_collator_pads_each_batch_to_its_longest():
    rows = [_row([5, 6, 7]), _row([8, 9, 10, 11, 12]), _row([13, 14])]
    before = json.dumps(rows)
    batch = CausalCollator(pad_token_id=2)(rows)
    assert json.dumps(rows) == before  # features untouched
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 2, 2],
        [8, 9, 10, 11, 12],
        [13, 14, 2, 2, 2],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [
        [5, 6, 7, -100, -100],
        [8, 9, 10, 11, 12],
        [13, 14, -100, -100, -100],
    ]
    # a batch of short rows is only as wide as its longest
    assert CausalCollator(pad_token_id=2)(rows[::2])["input_ids"].shape == (2, 3)
    with pytest.raises(Exception, match="pad_token_id"):
        CausalCollator()(rows)
    # goldfish on the padded batch: the labels lose exactly the hashed positions
    long_rows = [_row(list(range(100, 140))), _row(list(range(200, 220)))]
    plain = CausalCollator(pad_token_id=2)(long_rows)
    gold = CausalCollator(goldfish_k=3, goldfish_h=4, pad_token_id=2)(long_rows)
    drop = goldfish_mask(plain["input_ids"], k=3, h=4)
    assert drop[:, 4:].any()
    assert torch.equal(gold["labels"], plain["labels"].masked_fill(drop, -100))


def test_padding_share_counts_pads_of_batches_padded_to_their_longest():
    lengths = [2, 4, 4, 2]
    # batches [2, 4] and [4, 2]: 16 tokens, 6 + 6 real
    assert padding_share(lengths, [0, 1, 2, 3], 2) == pytest.approx(4 / 16)
    assert padding_share(lengths, [1, 2, 0, 3], 2) == 0.0
    # [3, 1] pads 2 of 6 tokens, the last batch [1] none
    assert padding_share([3, 1, 1], [0, 1, 2], 2) == pytest.approx(2 / 7)


def test_collator_rounds_each_batch_up_to_the_multiple_and_the_share_counts_it():
    rows = [_row([5, 6, 7]), _row([8, 9, 10, 11, 12]), _row([13, 14])]
    batch = CausalCollator(pad_token_id=2, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].shape == (3, 8)  # longest 5, rounded up to 8
    assert batch["input_ids"][1].tolist() == [8, 9, 10, 11, 12, 2, 2, 2]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5, 2]
    assert batch["labels"][1, 5:].tolist() == [-100] * 3
    assert CausalCollator(pad_token_id=2, pad_to_multiple_of=5)(rows)["input_ids"].shape[1] == 5
    assert CausalCollator(pad_token_id=2, pad_to_multiple_of=1)(rows)["input_ids"].shape[1] == 5
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        CausalCollator(pad_token_id=2, pad_to_multiple_of=0)
    # a multiple pads even rows of one length, so it needs a pad token from the start
    with pytest.raises(ConfigError, match="multiple of 4 tokens needs a pad token"):
        CausalCollator(pad_to_multiple_of=4)
    assert CausalCollator()([_row([5, 6, 7]), _row([8, 9, 10])])["input_ids"].shape == (2, 3)
    # [4, 4] -> 6 wide, [2, 2] -> 3 wide: 18 tokens, 12 real
    assert padding_share([2, 4, 4, 2], [1, 2, 0, 3], 2, 3) == pytest.approx(6 / 18)
    # the share is what the collator builds, for any lengths, order, batch size and multiple
    rng = random.Random(5)
    for _ in range(20):
        lengths = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 30))]
        order = rng.sample(range(len(lengths)), len(lengths))
        size, multiple = rng.randrange(1, 6), rng.randrange(1, 20)
        collate = CausalCollator(pad_token_id=2, pad_to_multiple_of=multiple)
        masks = [
            collate([_row([7] * lengths[i]) for i in order[s : s + size]])["attention_mask"]
            for s in range(0, len(order), size)
        ]
        built = 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
        assert padding_share(lengths, order, size, multiple) == pytest.approx(built)


def test_plan_splits_batches_by_their_rounded_width():
    """A batch of records up to 250 tokens pads to 256 at a multiple of 16: 8 of them exceed
    2000 tokens per forward pass and are split, while at the exact longest (8 x 250) they fit."""
    lengths = [250] + [200] * 63
    base = dict(batch_size=8, seq_len=512, packing=False, max_batch_tokens=2000)
    _, rounded = fit_to_data(TrainConfig(**base), lengths, device="cpu")
    _, exact = fit_to_data(TrainConfig(**base, pad_to_multiple_of=1), lengths, device="cpu")
    assert rounded.seq_len == 256 and rounded.batch_size * 256 <= 2000 < 8 * 256
    assert rounded.grad_accum * rounded.batch_size == 8
    assert exact.seq_len == 250 and (exact.batch_size, exact.grad_accum) == (8, 1)
    assert "rounded up" not in exact.summary()
    _, packed = fit_to_data(TrainConfig(packing=True, seq_len=100), [30] * 50)
    assert packed.pad_to_multiple_of == 1  # packed sequences are all seq_len long


def test_length_grouped_order_is_seeded_by_epoch_and_pads_little():
    rng = random.Random(0)
    lengths = [max(2, int(rng.lognormvariate(4.5, 0.6))) for _ in range(450)]  # skewed
    sampler = GroupedSampler(lengths, batch_size=8, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(450)) and list(sampler) == first  # a permutation, stable
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second) == list(range(450))
    again = GroupedSampler(lengths, batch_size=8, seed=3)
    again.set_epoch(1)
    assert list(again) == second  # the same (seed, epoch): the same order (a resumed run)
    grouped = padding_share(lengths, first, 8)
    shuffled = padding_share(lengths, epoch_order(lengths, batch_size=8, seed=3, grouped=False), 8)
    assert grouped <= 0.15 < 0.30 < shuffled


def test_plan_states_the_padding_of_the_batches_the_trainer_builds(tmp_path, tok):
    """The plan's share (first epoch) is what the Trainer's dataloader yields, padded by the
    collator; grouped batches pad less than shuffled ones on records of skewed lengths."""
    from transformers import TrainingArguments

    from scpdr.testing import tiny_model
    from scpdr.training.trainer import make_trainer

    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    records = [
        Record(
            id=f"r{i}",
            text=" ".join(rng.choice(words) for _ in range(int(min(rng.paretovariate(1.2), 60)))),
        )
        for i in range(96)
    ]
    lengths = [len(tok(r.text)["input_ids"]) + 1 for r in records]
    for group in (True, False):
        cfg, plan = fit_to_data(
            TrainConfig(batch_size=4, seq_len=512, packing=False, group_by_length=group, seed=7),
            lengths,
        )
        assert plan.grouped is group and not plan.packing
        assert plan.pad_to_multiple_of == PAD_TO_MULTIPLE_OF > 1  # the default
        rows = build_sequences(records, tok, seq_len=cfg.seq_len, packing=False, seed=cfg.seed)
        args = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            seed=cfg.seed,
            data_seed=cfg.seed,
            use_cpu=True,
            report_to="none",
            remove_unused_columns=False,
        )
        trainer, _ = make_trainer(
            model=tiny_model(0),
            args=args,
            rows=rows,
            collator=CausalCollator(
                pad_token_id=tok.eos_token_id, pad_to_multiple_of=plan.pad_to_multiple_of
            ),
            grouped=plan.grouped,
            chunked_loss=True,
            autocast=None,
        )
        loader = trainer.get_train_dataloader()
        loader.set_epoch(0)
        masks = [b["attention_mask"] for b in loader]
        built = 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
        assert plan.padding == pytest.approx(built)
        if group:
            assert plan.padding_ungrouped is not None and plan.padding < plan.padding_ungrouped
            assert f"padding {plan.padding:.0%}" in plan.summary()
            assert "length-grouped batches" in plan.summary()
            assert f"rounded up to a multiple of {PAD_TO_MULTIPLE_OF}" in plan.summary()
        assert all(m.shape[1] % PAD_TO_MULTIPLE_OF == 0 for m in masks)


def _resume_run(*, max_steps: int, save_steps: int) -> dict:
    """The settings of a short tiny-model run that is interrupted at a checkpoint and resumed:
    unpacked records (so length-grouped), 4 to a batch, fp32, no warmup."""
    return dict(
        max_steps=max_steps,
        save_steps=save_steps,
        batch_size=4,
        seq_len=64,
        packing=False,
        learning_rate=1e-2,
        warmup_steps=0,
        precision="fp32",
        progress=False,
    )


def test_grouped_run_interrupted_mid_epoch_resumes_to_the_same_weights(tmp_path, tok):
    from safetensors.torch import load_file

    from scpdr.testing import tiny_model

    records = names2ids(n_train=12, n_val=1, seed=0).train
    base = (tiny_model(0), tok)
    # 3 batches an epoch, checkpoints every 2 steps: step 4 is inside the second epoch
    cfg = TrainConfig(
        **_resume_run(max_steps=6, save_steps=2), save_total_limit=3, neftune_alpha=5.0
    )
    straight = finetune(records, base=base, config=cfg, out=tmp_path / "straight")
    info = json.loads((straight / TRAIN_INFO).read_text())
    assert info["plan"]["grouped"] is True and info["plan"]["packing"] is False

    _interrupted(records, base, cfg, tmp_path / "r", step=4)
    resumed = finetune(records, base=base, config=cfg, out=tmp_path / "r")
    assert json.loads((resumed / TRAIN_INFO).read_text())["resumed_from"] == "checkpoint-4"
    a = load_file(str(Path(straight) / "model.safetensors"))
    b = load_file(str(Path(resumed) / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_resumed_ddp_epoch_gets_that_epochs_grouped_order():
    """A run resumed mid-epoch under DDP iterates
    SkipBatchSampler(BatchSamplerShard(BatchSampler(GroupedSampler))): accelerate's set_epoch
    does not reach the GroupedSampler there, the Trainer-side callback does, so the resumed
    epoch's batches are that epoch's (not epoch 0's) on every process."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches
    from torch.utils.data import BatchSampler

    from scpdr.training.trainer import grouped_epoch_callback

    lengths = [random.Random(i).randint(1, 50) for i in range(48)]
    data = list(range(len(lengths)))
    batch, procs, skip = 4, 2, 2

    def loader(rank):
        sampler = GroupedSampler(lengths, batch_size=batch, seed=5)
        shard = BatchSamplerShard(
            BatchSampler(sampler, batch, drop_last=False), num_processes=procs, process_index=rank
        )
        return sampler, DataLoaderShard(data, batch_sampler=shard, collate_fn=list)

    for epoch in (1, 2):
        order = epoch_order(lengths, batch_size=batch, seed=5, epoch=epoch, grouped=True)
        batches = [order[s : s + batch] for s in range(0, len(order), batch)]
        for rank in range(procs):
            expected = batches[rank::procs][skip:]  # this rank's, past the skipped ones
            sampler, dl = loader(rank)
            resumed = skip_first_batches(dl, skip)
            resumed.set_epoch(epoch)  # what the Trainer does: it stops short of the sampler
            assert sampler.epoch == 0
            callback = grouped_epoch_callback(SimpleNamespace())
            state = SimpleNamespace(epoch=epoch + skip / len(batches))  # resumed mid-epoch
            callback.on_epoch_begin(None, state, None, train_dataloader=dl)
            assert sampler.epoch == epoch
            assert [list(b) for b in resumed] == expected


class _Stop(Exception):
    pass


def _interrupted(records, base, cfg, out: Path, step: int = 3) -> Path:
    """Run ``cfg`` until its checkpoint of ``step`` is saved, then stop it (as a kill would);
    its temporary run dir."""
    from transformers import TrainerCallback

    class KillAtStep(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == step:
                raise _Stop

    with pytest.raises(_Stop):
        finetune(records, base=base, config=cfg, out=out, callbacks=[KillAtStep()])
    [tmp] = out.parent.glob(f"{out.name}.tmp-*")
    return tmp


def test_run_interrupted_before_grouping_existed_resumes_ungrouped(tmp_path, tok, caplog):
    """An interrupted run whose run.json records no `grouped` nor `pad_to_multiple_of`
    (started before either existed: random order, batches padded to their longest exactly)
    resumes so, to the weights of a run with group_by_length false and pad_to_multiple_of 1;
    run.json and train_info record what was used."""
    import shutil

    from safetensors.torch import load_file

    from scpdr.testing import tiny_model

    records = names2ids(n_train=12, n_val=1, seed=0).train
    base = (tiny_model(0), tok)
    common = _resume_run(max_steps=5, save_steps=3)

    def interrupted(cfg, out):
        return _interrupted(records, base, cfg, out)

    unset = TrainConfig(**common)  # group_by_length unset: grouped now (unpacked records)
    random_order = TrainConfig(group_by_length=False, pad_to_multiple_of=1, **common)
    legacy = interrupted(unset, tmp_path / "legacy")
    run = json.loads((legacy / "run.json").read_text())
    # fp32 (the tests' precision) pads to the longest exactly; recorded_batching's pin of an
    # absent multiple to 1 is tested in test_forget
    assert run["grouped"] is True and run["pad_to_multiple_of"] == 1
    # as a run from before grouping: random order up to its checkpoint, no `grouped` recorded
    old = interrupted(random_order, tmp_path / "old")
    shutil.rmtree(legacy / "checkpoint-3")
    shutil.copytree(old / "checkpoint-3", legacy / "checkpoint-3")
    del run["grouped"], run["pad_to_multiple_of"]
    (legacy / "run.json").write_text(json.dumps(run))

    with caplog.at_level("INFO", logger="scpdr.training.finetune"):
        resumed = finetune(records, base=base, config=unset, out=tmp_path / "legacy")
    assert (
        "resumed with the batching it started with: batches in random order, padded to "
        "the longest exactly" in caplog.text
    )
    info = json.loads((resumed / TRAIN_INFO).read_text())
    assert info["resumed_from"] == "checkpoint-3"
    assert info["plan"]["grouped"] is False and info["config"]["group_by_length"] is False
    assert info["plan"]["pad_to_multiple_of"] == info["config"]["pad_to_multiple_of"] == 1
    straight = finetune(records, base=base, config=random_order, out=tmp_path / "straight")
    a = load_file(str(Path(straight) / "model.safetensors"))
    b = load_file(str(Path(resumed) / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_fp32_run_that_recorded_a_multiple_resumes_with_it(tmp_path, tok, caplog):
    """An fp32 run interrupted when unset meant 16 in every precision (its run.json records
    16) resumes at 16, though unset now means 1 in fp32, and says so."""
    from scpdr.testing import tiny_model

    records = names2ids(n_train=12, n_val=1, seed=0).train
    base = (tiny_model(0), tok)
    cfg = TrainConfig(**_resume_run(max_steps=5, save_steps=3))  # fp32, multiple unset
    tmp = _interrupted(records, base, cfg, tmp_path / "run")
    run = json.loads((tmp / "run.json").read_text())
    assert run["pad_to_multiple_of"] == 1  # what fp32 resolves to now
    (tmp / "run.json").write_text(json.dumps({**run, "pad_to_multiple_of": PAD_TO_MULTIPLE_OF}))
    with caplog.at_level("INFO", logger="scpdr.training.finetune"):
        out = finetune(records, base=base, config=cfg, out=tmp_path / "run")
    assert f"length-grouped batches, padded to a multiple of {PAD_TO_MULTIPLE_OF} tokens" in (
        caplog.text
    )
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["resumed_from"] == "checkpoint-3"
    assert info["plan"]["pad_to_multiple_of"] == PAD_TO_MULTIPLE_OF
