"""Training sized to the data: what the user set is kept, the rest fits the records, and a plan
that cannot learn says so."""

from __future__ import annotations

from scpdr.training import TrainConfig, fit_to_data
from scpdr.training.plan import MAX_WARMUP_FRACTION


def test_short_records_are_not_packed_and_the_warmup_fits_the_steps():
    cfg, plan = fit_to_data(TrainConfig(epochs=3), [40] * 113)
    assert not plan.packing and cfg.packing is False
    assert plan.batch_size == cfg.batch_size == 8
    assert plan.steps_per_epoch == 15 and plan.total_steps == 45
    assert plan.warmup_steps == cfg.warmup_steps <= MAX_WARMUP_FRACTION * plan.total_steps
    # each batch padded to its longest (40) rounded up to a multiple of 16 (pad_to_multiple_of)
    assert plan.seq_len == 48 and plan.tokens == 40 * 113 and plan.padding == 8 / 48
    assert not plan.warnings() and len(plan.changes) == 3
    assert "45 optimizer steps" in plan.summary()


def test_what_the_user_set_is_kept_and_a_plan_inside_its_warmup_is_a_warning():
    given = TrainConfig(epochs=1, batch_size=4, packing=True, warmup_steps=50, seq_len=256)
    cfg, plan = fit_to_data(given, [40] * 20)
    assert (cfg.batch_size, cfg.packing, cfg.warmup_steps) == (4, True, 50)
    assert plan.packing and plan.sequences == 4  # 800 tokens in 256-token blocks
    assert plan.total_steps == 1 and not plan.changes
    warnings = plan.warnings()
    assert any("inside the 50-step warm-up" in w for w in warnings)
    assert any("too few to learn" in w for w in warnings)
    assert "WARNING" in plan.summary()


def test_long_records_keep_the_papers_packing():
    cfg, plan = fit_to_data(TrainConfig(seq_len=512), [300] * 50)
    assert plan.packing and cfg.packing and cfg.batch_size == 1  # the paper's full FT


def test_a_resolved_lora_config_keeps_its_batch():
    cfg, plan = fit_to_data({"lora": True, "epochs": 2}, [30] * 100)
    assert cfg.lora and not plan.packing and plan.batch_size == 64  # LoRA's paper batch


def test_the_padding_multiple_follows_the_precision_unless_set():
    """Unset, bf16 runs round each batch's width up to PAD_TO_MULTIPLE_OF (oneDNN keeps kernels
    per shape) and fp32 runs pad to the longest exactly; a set multiple wins either way, and a
    DP run (fp32 whatever --precision says) pads exactly."""
    from scpdr.training.config import PAD_TO_MULTIPLE_OF
    from scpdr.training.dp import DP_PRECISION
    from scpdr.training.plan import default_pad_multiple
    from scpdr.training.precision import PrecisionChoice

    bf16 = PrecisionChoice("bf16", "auto", "avx512_bf16 and 1.9x faster")
    fp32 = PrecisionChoice("fp32", "auto", "no bf16 units")
    assert default_pad_multiple(bf16) == PAD_TO_MULTIPLE_OF == 16
    assert default_pad_multiple(fp32) == default_pad_multiple(DP_PRECISION) == 1
    assert default_pad_multiple(None) == PAD_TO_MULTIPLE_OF  # as before precision was known
    lengths = [40] * 113
    _, b = fit_to_data(TrainConfig(epochs=3), lengths, precision=bf16)
    _, f = fit_to_data(TrainConfig(epochs=3), lengths, precision=fp32)
    assert (b.pad_to_multiple_of, b.seq_len, b.padding) == (16, 48, 8 / 48)
    assert (f.pad_to_multiple_of, f.seq_len, f.padding) == (1, 40, 0.0)
    assert "rounded up to a multiple of 16" in b.summary() and "precision bf16: avx512" in (
        b.summary()
    )
    assert "rounded up" not in f.summary() and "precision fp32: no bf16 units" in f.summary()
    _, set8 = fit_to_data(TrainConfig(epochs=3, pad_to_multiple_of=8), lengths, precision=fp32)
    assert (set8.pad_to_multiple_of, set8.seq_len) == (8, 40)
    _, set1 = fit_to_data(TrainConfig(epochs=3, pad_to_multiple_of=1), lengths, precision=bf16)
    assert (set1.pad_to_multiple_of, set1.seq_len) == (1, 40)
    _, dp = fit_to_data(TrainConfig(dp_epsilon=8.0), [35] * 64, precision=DP_PRECISION)
    assert dp.pad_to_multiple_of == 1 and dp.seq_len == 35
