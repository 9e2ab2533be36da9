"""scpdr.training on tiny random Llamas with the real tokenizer: training lowers the loss and changes
the weights, an interrupted run resumes to the same weights, goldfish drops exactly the hashed
positions, LoRA outputs load back, and the `scpdr train` command builds a bundle end to end."""

from __future__ import annotations

import hashlib
import json
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
    goldfish_mask,
)

# A few steps at a large learning rate: enough to move a random tiny model, fast on 2 cores.
_FAST = dict(
    learning_rate=1e-2,
    batch_size=4,
    seq_len=32,
    warmup_steps=0,
    progress=False,
    logging_steps=1,
)


@pytest.fixture(scope="module")
def tok():
    from scpdr.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return names2ids(n_train=12, n_val=1, seed=0).train


@pytest.fixture(scope="module")
def base_dir(tiny_bundle) -> Path:
    """``tiny_model(0)`` and the tokenizer: the session bundle's (read-only) base."""
    return tiny_bundle / "base"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _mean_loss(model, rows) -> float:
    batch = CausalCollator()(rows)
    with torch.no_grad():
        return float(model(**batch).loss)


# ------------------------------------------------------------------------------------ config


def test_config_paper_defaults_and_json_round_trip():
    full, lora = TrainConfig.paper(), TrainConfig.paper(lora=True)
    assert (full.epochs, full.learning_rate, full.batch_size, full.neftune_alpha) == (
        50.0,
        5e-5,
        1,
        5.0,
    )
    assert full.packing is True and lora.packing is False
    assert (lora.epochs, lora.learning_rate, lora.batch_size, lora.neftune_alpha) == (
        20.0,
        5e-4,
        64,
        0.0,
    )
    assert (lora.lora_r, lora.lora_alpha, lora.lora_dropout) == (64, 32, 0.05)
    assert "lm_head" in lora.lora_target_modules and full.max_grad_norm == 2.0
    assert full.warmup_steps == 50 and full.optim == "adamw_torch"
    back = TrainConfig.from_json(lora.to_json())
    assert back == lora and back.fingerprint() == lora.fingerprint()
    assert TrainConfig(epochs=3).fingerprint() != full.fingerprint()
    assert TrainConfig(progress=False).fingerprint() == full.fingerprint()
    for field, info in TrainConfig.model_fields.items():
        assert info.description, f"{field} has no help text"
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainConfig.from_json('{"learning_rate": -1}')
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=-2)
    with pytest.raises(ValueError, match="extra"):
        TrainConfig(nope=1)


def test_config_keeps_paper_defaults_open_until_resolved_and_round_trips_yaml():
    cfg = TrainConfig(seq_len=64)
    assert cfg.epochs is None and cfg.resolved().epochs == 50.0
    # a copy with lora switched (an experiment sweep) gets the LoRA defaults, not full FT's
    lora = TrainConfig.model_validate({**cfg.model_dump(), "lora": True}).resolved()
    assert (lora.epochs, lora.batch_size, lora.packing, lora.seq_len) == (20.0, 64, False, 64)
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg
    assert TrainConfig.from_yaml(lora.to_yaml()) == lora
    assert TrainConfig(epochs=0.25).resolved().epochs == 0.25  # fractional epochs
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=1)
    with pytest.raises(ValueError, match="goldfish_h"):
        TrainConfig(goldfish=True, goldfish_h=13, seq_len=13)
    with pytest.raises(ConfigError, match="epochs"):
        TrainConfig.from_yaml("epochs: 0")
    # "no step limit" was -1 in saved configs: still read, now None
    assert TrainConfig.from_json('{"max_steps": -1}').max_steps is None
    # finished runs keep their fingerprint across the redesign (values of the former config)
    assert TrainConfig().fingerprint() == (
        "bc8e6df85ee8e1018778fb71e4471ef5b6ac6463dce69a4282e05d143884a195"
    )
    assert TrainConfig(lora=True, max_steps=5).fingerprint() == (
        "6be2ec3e10211bdcb72c30dcd3976d887c578657ebc6f8343d3e9a82794942e0"
    )


# ------------------------------------------------------------------------------ sequences


def test_build_sequences_packing_and_padding(tok, records):
    eos = tok.eos_token_id
    stream = []
    for r in records:
        stream += tok(r.text)["input_ids"] + [eos]
    packed = build_sequences(records, tok, seq_len=32, packing=True, shuffle=False)
    assert all(len(row["input_ids"]) == 32 for row in packed)
    flat = [
        t
        for row in packed
        for t, a in zip(row["input_ids"], row["attention_mask"], strict=True)
        if a
    ]
    assert flat == stream  # examples + EOS, concatenated, nothing lost
    last = packed[-1]
    n_real = sum(last["attention_mask"])
    assert last["labels"][n_real:] == [-100] * (32 - n_real)
    # unpacked: one example per sequence, not padded (the collator pads each batch)
    padded = build_sequences(records, tok, seq_len=64, packing=False, shuffle=False)
    for r, row in zip(records, padded, strict=True):
        ids = tok(r.text)["input_ids"] + [eos]
        assert row["input_ids"] == ids and row["labels"] == ids
        assert row["attention_mask"] == [1] * len(ids)
    assert len({len(row["input_ids"]) for row in padded}) > 1
    short = build_sequences(records, tok, seq_len=8, packing=False, shuffle=False)
    assert [row["input_ids"] for row in short] == [row["input_ids"][:8] for row in padded]
    shuffled = build_sequences(records, tok, seq_len=64, packing=False, seed=1)
    assert sorted(map(tuple, (r["input_ids"] for r in shuffled))) == sorted(
        map(tuple, (r["input_ids"] for r in padded))
    )


# ------------------------------------------------------------------------------ goldfish


def _reference_drop(ids: list[int], *, k: int, h: int) -> list[bool]:
    """Independent statement of the rule: drop t iff t >= h and the keyed BLAKE2b-64 of the h
    preceding token ids (int64 little endian) is 0 mod k."""
    out = []
    for t in range(len(ids)):
        if t < h:
            out.append(False)
            continue
        data = b"".join(int(x).to_bytes(8, "little", signed=True) for x in ids[t - h : t])
        d = hashlib.blake2b(data, digest_size=8, key=b"scpdr-goldfish").digest()
        out.append(int.from_bytes(d, "little") % k == 0)
    return out


def test_goldfish_drops_exactly_the_hashed_positions():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (3, 400), generator=g)
    k, h = 4, 13
    mask = goldfish_mask(ids, k=k, h=h)
    for b in range(3):
        assert mask[b].tolist() == _reference_drop(ids[b].tolist(), k=k, h=h)
    assert not mask[:, :h].any()
    frac = mask[:, h:].float().mean().item()
    assert 0.17 < frac < 0.33  # ≈ 1/k
    # the same context always drops the same next token (a repeated passage loses the same tokens)
    rep = torch.cat([ids[:1, :100], ids[:1, :100]], dim=1)
    m = goldfish_mask(rep, k=k, h=h)[0]
    assert torch.equal(m[100 + h : 200], m[h:100])


def test_collator_applies_goldfish_to_labels_only_and_copies(tok, records):
    rows = build_sequences(records, tok, seq_len=32, packing=True, shuffle=False)
    before = json.dumps(rows)
    plain = CausalCollator()(rows)
    gold = CausalCollator(goldfish_k=3, goldfish_h=4)(rows)
    assert json.dumps(rows) == before  # features untouched
    assert torch.equal(plain["input_ids"], gold["input_ids"])
    drop = goldfish_mask(plain["input_ids"], k=3, h=4)
    expected = plain["labels"].masked_fill(drop, -100)
    assert torch.equal(gold["labels"], expected)
    assert (gold["labels"] == -100).sum() > (plain["labels"] == -100).sum()


# ------------------------------------------------------------------------------ training


def test_training_changes_weights_lowers_loss_and_records_info(tmp_path, tok, records, base_dir):
    from scpdr.models import load_model

    cfg = TrainConfig(max_steps=8, **_FAST)
    rows = build_sequences(records, tok, seq_len=32, packing=True, shuffle=False)
    base = load_model(base_dir)
    loss0 = _mean_loss(base, rows)
    out = finetune(records, base=str(base_dir), config=cfg, out=tmp_path / "c0")
    trained = load_model(out)
    assert _mean_loss(trained, rows) < loss0 - 0.5
    w0, w1 = base.state_dict(), _weights(out)
    assert any(not torch.equal(w0[k], w1[k]) for k in w1)
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["global_step"] == 8 and info["config"] == cfg.resolved().model_dump(mode="json")
    assert info["seeds"]["seed"] == 0 and info["data"]["records"] == len(records)
    assert [h["loss"] for h in info["log_history"] if "loss" in h]
    assert TrainConfig.from_file(out / TRAIN_INFO) == cfg.resolved()  # the run's settings
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob("c0.tmp-*"))  # the temp dir is gone
    # same call again: already trained, returned as is; other settings: refused
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert finetune(records, base=str(base_dir), config=cfg, out=out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ConfigError, match="other data or settings"):
        finetune(records[:4], base=str(base_dir), config=cfg, out=out)


class _Interrupt(Exception):
    pass


def test_interrupted_run_resumes_to_the_same_weights(tmp_path, tok, records):
    from transformers import TrainerCallback

    from scpdr.testing import tiny_model

    base = (tiny_model(0), tok)
    cfg = TrainConfig(max_steps=4, save_steps=2, neftune_alpha=5.0, **_FAST)
    straight = finetune(records, base=base, config=cfg, out=tmp_path / "straight")

    class KillAfterFirstCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == 2:
                raise _Interrupt

    with pytest.raises(_Interrupt):
        finetune(
            records,
            base=base,
            config=cfg,
            out=tmp_path / "resumed",
            callbacks=[KillAfterFirstCheckpoint()],
        )
    [tmp] = tmp_path.glob("resumed.tmp-*")
    assert (tmp / "checkpoint-2").is_dir() and not (tmp_path / "resumed").exists()
    half = _weights(tmp / "checkpoint-2")
    resumed = finetune(records, base=base, config=cfg, out=tmp_path / "resumed")
    info = json.loads((resumed / TRAIN_INFO).read_text())
    assert info["resumed_from"] == "checkpoint-2" and info["global_step"] == 4
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(half[k], b[k]) for k in half)  # it did train after resuming


def test_lora_outputs_load_back(tmp_path, tok, records, base_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    from scpdr.models import load_model

    base = load_model(base_dir)
    ids = tok(records[0].text, return_tensors="pt")["input_ids"]
    common = dict(lora=True, max_steps=3, lora_r=4, **_FAST)
    # the paper's targets (all projections + lm_head) on a tied model: a PEFT adapter that
    # names its base, without the frozen embeddings, loadable (merged) by scpdr.models
    adapter = finetune(
        records, base=str(base_dir), config=TrainConfig(**common), out=tmp_path / "a"
    )
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(cfg["base_model_name_or_path"]) == base_dir.resolve()
    keys = load_file(str(adapter / "adapter_model.safetensors")).keys()
    assert any("lm_head.lora_B" in k for k in keys) and not any("embed" in k for k in keys)
    merged = load_model(adapter)
    unmerged = PeftModel.from_pretrained(load_model(base_dir), str(adapter)).eval()
    with torch.no_grad():
        want = unmerged(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(want, base(ids).logits, atol=1e-3)
    # an in-memory base cannot back an adapter: saved merged (lm_head untied, embeddings kept)
    from scpdr.testing import tiny_model

    mem = finetune(
        records, base=(tiny_model(0), tok), config=TrainConfig(**common), out=tmp_path / "m"
    )
    assert not (mem / "adapter_config.json").exists()
    mm = load_model(mem)
    assert torch.equal(mm.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not torch.equal(mm.lm_head.weight, base.lm_head.weight)
    with torch.no_grad():  # the same seed and data: the merged model equals the adapter's
        torch.testing.assert_close(mm(ids).logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="do not exist"):
        finetune(
            records,
            base=str(base_dir),
            config=TrainConfig(lora_target_modules=["nope"], **common),
            out=tmp_path / "x",
        )


# ------------------------------------------------------------------------------ CLI


def test_train_help():
    from scpdr.cli import main

    assert main(["train", "--help"]) == 0


def test_cli_train_tiny_end_to_end(tmp_path, capsys):
    from scpdr.cli import main
    from scpdr.data import load_partitions
    from scpdr.models import read_bundle

    # a TrainConfig file (YAML) under the options: the options win, the rest comes from the file
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(
        TrainConfig(seq_len=64, lora_r=8, epochs=0.5, warmup_steps=1).to_yaml(), encoding="utf-8"
    )
    out = tmp_path / "bundle"
    argv = ["train", "--data", "names2ids", "--n-train", "12", "--n-val", "2", "--partitions", "2"]
    argv += ["--base", "tiny", "--max-steps", "2", "--out", str(out), "--seq-len", "32"]
    argv += ["--batch-size", "4", "--canaries", "1,2", "--canaries-per-rep", "1", "--goldfish"]
    argv += ["--config", str(cfg_file), "--lr", "1e-3", "--seed", "3"]
    assert main(argv) == 0
    manifest = read_bundle(out)
    assert len(manifest.constituents) == 2 and manifest.audit["passed"] is True
    assert manifest.audit["overridden"] is False
    pset = load_partitions(out / "partitions")
    assert manifest.partition_manifest_hash == pset.manifest.sha256()
    assert len(pset.canaries.inserted) == 2 and pset.canaries.partition == 0
    assert pset.canaries.config.seed == 3  # --seed seeds the data, the canaries and training
    want = TrainConfig(
        seq_len=32,
        lora_r=8,
        epochs=0.5,
        warmup_steps=1,
        max_steps=2,
        batch_size=4,
        goldfish=True,
        learning_rate=1e-3,
        seed=3,
    ).resolved()
    assert manifest.extra["train_config"] == want.model_dump(mode="json")
    for i in range(2):
        info = json.loads((out / f"constituent-{i}" / TRAIN_INFO).read_text())
        assert info["global_step"] == 2 and info["config"] == want.model_dump(mode="json")
    printed = capsys.readouterr().out
    assert "wrote bundle" in printed
    # the plan: the padding share of the batches and the precision, with its reason
    assert "padding" in printed and "of the batches' tokens" in printed
    assert "  precision fp32: " in printed or "  precision bf16: " in printed


def test_cli_train_refuses_before_work_when_a_partition_dir_gets_data_options(tmp_path, capsys):
    from scpdr.cli import main

    parts = tmp_path / "p"
    assert (
        main(["partition", "names2ids", "--n-train", "8", "--n-val", "2", "--out", str(parts)]) == 0
    )
    capsys.readouterr()
    out = tmp_path / "b"
    argv = ["train", "--data", str(parts), "--out", str(out), "--base", "tiny"]
    assert main([*argv, "--text-field", "body", "--num-perm", "64", "--n-val", "3"]) == 2
    err = capsys.readouterr().err
    for flag in ("--text-field", "--num-perm", "--n-val", "partition directory"):
        assert flag in err
    assert not out.exists()


@pytest.mark.slow
def test_finetune_embedded_base_one_step(tmp_path, records):
    """The real SmolLM2-135M base: one full fine-tuning step writes a loadable model."""
    from scpdr.models import load_model

    cfg = TrainConfig(max_steps=1, batch_size=2, seq_len=32, warmup_steps=0, progress=False)
    out = finetune(records[:2], base="embedded", config=cfg, out=tmp_path / "c")
    info = json.loads((out / TRAIN_INFO).read_text())
    assert info["base"] == "embedded" and info["global_step"] == 1
    assert load_model(out).config.vocab_size == 49152
