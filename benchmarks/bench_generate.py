"""Throughput of ProtectedLM relative to a single model, on the embedded SmolLM2-135M.

Two "fine-tuned" constituents are copies of the base with perturbed weights (full fine-tune
size; the weights' values do not matter for timing), loaded as ``ProtectedLM.from_bundle``
loads a bundle of full models (the general path): the base, the embedded GGUF's, decodes from
its Q4_1 blocks on the packed kernel where this machine measured that faster
(``scpdr.lora.pack_full_model``; ``base_q4`` in the JSON line says whether), the fine-tunes on
torch's matmuls. Measured round-robin in one run, so that every configuration sees the same
machine load:

- greedy decoding tokens/s of each method (``ProtectedLM.generate``, no early stop) divided by
  HF ``generate`` tokens/s of one model, same prompts, B in {1, 8};
- teacher-forced ``score`` tokens/s (SCP-Δr-b) divided by one model's forward tokens/s;
- base-anchored SCP-Δr-b (``anchor=0.5``: the mixture with the base, its certificate recomputed
  and each token's charge against the base; ``scp-delta-r-b+anchor``), the same ratio;
- where ``llama-cpp-python`` is importable (not a dependency: ``pip install llama-cpp-python``),
  what CPU users run instead: the same GGUF file (the embedded model, 4-bit Q4_1) decoded
  greedily by llama.cpp with the same threads and prompt at B = 1, in the same rounds
  (``llama_cpp``: its ms per token and tokens/s, and each method's tokens/s over it; not a
  goal: llama.cpp computes on the quantized weights, where scpdr's constituents are float32
  and its base rebuilds the float32 values from the same blocks).

Goals: scp-delta-r-b >= 0.30 (the memory-bound limit with three float32 forwards is 1/3; a base
streaming its Q4_1 blocks lifts it),
scp-delta-r-c >= 0.45, cp-fuse >= 0.28, score >= 0.30.

    python benchmarks/bench_generate.py [--quick] [--threads N]

Last stdout line: ``{"bench": "generate", "ratios": {"scp-delta-r-b@B1": ..., ...}, ...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, interleaved_medians, setup

logger = logging.getLogger("scpdr.benchmarks.generate")

GOALS = {
    "scp-delta-r-b@B1": 0.30,
    "scp-delta-r-b@B8": 0.30,
    "scp-delta-r-c@B1": 0.45,
    "cp-fuse@B1": 0.28,
    "score@B8": 0.30,
}
#: The anchored mode's radius (nats per token).
ANCHOR = 0.5
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works, and when you would use one instead of a list.",
    "What are three good habits for keeping a small vegetable garden healthy?",
    "Summarize the main causes of the French Revolution in a few sentences please.",
    "Describe the water cycle to a ten year old child in simple, friendly words.",
    "Give me a recipe for a quick vegetarian dinner that uses chickpeas and rice.",
    "Why is the sky blue during the day but red and orange during the sunset?",
    "List some tips for writing clear and maintainable Python code for a team.",
]


def llama_cpp_decoder(gguf: Path, threads: int, n_new: int) -> Callable[[str], None] | None:
    """``decode(prompt)``: ``n_new`` greedy tokens of ``gguf`` with llama.cpp (its prompt cache
    reset each call, so every call prefills as HF ``generate`` does), or None when
    ``llama_cpp`` is not importable."""
    if importlib.util.find_spec("llama_cpp") is None:
        logger.info("llama-cpp-python is not installed: no llama.cpp row")
        return None
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, verbose=False)

    def decode(prompt: str) -> None:
        llm.reset()
        tokens = llm.tokenize(prompt.encode())
        for i, _ in enumerate(llm.generate(tokens, top_k=1, temp=0.0), start=1):
            if i >= n_new:  # llama.cpp's generator does not stop at EOS itself
                break

    return decode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (< 5 min)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per batch size")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args(argv)
    threads = setup(threads=args.threads)

    import torch

    from scpdr import models, testing
    from scpdr.lora import pack_full_model
    from scpdr.runtime import ProtectedLM

    n_new = args.new_tokens or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 5)
    base, tok = models.load_base()
    cons = [testing.perturbed_copy(base, seed=s, scale=0.01) for s in (1, 2)]
    vec = models.constant_base_vector(base, tok, testing.HELD_OUT_PROMPTS[:16])
    # as ProtectedLM.from_bundle loads a bundle of full models: the embedded base decodes from
    # its GGUF Q4_1 blocks where this machine measured that faster, the fine-tunes on torch
    base_q4 = pack_full_model(models.EMBEDDED, base)
    lms = {
        "none": ProtectedLM(cons[:1], tok, method="none"),
        "scp-delta-r-b": ProtectedLM(cons, tok, method="scp-delta-r", base_model=base),
        "scp-delta-r-c": ProtectedLM(cons, tok, method="scp-delta-r", base_vector=vec),
        "cp-delta-r": ProtectedLM(cons, tok, method="cp-delta-r"),
        "cp-fuse": ProtectedLM(cons, tok, method="cp-fuse"),
    }
    single = cons[0]
    tok.padding_side = "left"
    llama = llama_cpp_decoder(models.embedded_gguf_path(), threads, n_new)

    ratios: dict[str, float | None] = {}
    ms: dict[str, float] = {}
    llama_row: dict[str, float] | None = None
    for b in args.batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        enc = tok(prompts, return_tensors="pt", padding=True)

        def hf(enc=enc):
            with torch.inference_mode():
                single.generate(
                    **enc,
                    max_new_tokens=n_new,
                    min_new_tokens=n_new,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                )

        fns = {"hf-generate": hf}
        if args.quick:  # the keys the issue names
            names = ["scp-delta-r-b", "scp-delta-r-c", "cp-fuse"] if b == 1 else ["scp-delta-r-b"]
        else:
            names = list(lms) if b == 1 else ["none", "scp-delta-r-b", "scp-delta-r-c", "cp-fuse"]
        for name in names:
            lm = lms[name]
            fns[name] = lambda lm=lm, prompts=prompts: lm.generate(
                prompts, max_new_tokens=n_new, stop_at_eos=False
            )
        fns["scp-delta-r-b+anchor"] = lambda lm=lms["scp-delta-r-b"], prompts=prompts: lm.generate(
            prompts, max_new_tokens=n_new, stop_at_eos=False, anchor=ANCHOR
        )
        if llama is not None and b == 1:
            fns["llama-cpp"] = partial(llama, prompts[0])
        logger.info("B=%d: timing %s (%d rounds, %d new tokens)", b, list(fns), repeats, n_new)
        med = interleaved_medians(fns, repeats=repeats, warmup=1)
        for name, sec in med.items():
            ms[f"{name}@B{b}"] = round(1000 * sec / n_new, 2)  # ms per generated step
            if name == "llama-cpp":
                llama_row = {"ms_per_token@B1": ms["llama-cpp@B1"]}
                llama_row["tokens_per_s@B1"] = round(n_new / sec, 1)
                for other, t in med.items():
                    if other != "llama-cpp":
                        llama_row[f"{other}_vs_llama_cpp@B1"] = round(sec / t, 3)
            elif name != "hf-generate":
                ratios[f"{name}@B{b}"] = round(med["hf-generate"] / sec, 3)

    # Teacher-forced scoring: B = 8 sequences of T tokens.
    t_len = 32 if args.quick else 128
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, tok.vocab_size, (8, t_len), generator=g)
    mask = torch.ones_like(ids)

    def fwd():
        with torch.inference_mode():
            single(input_ids=ids, attention_mask=mask, use_cache=False)

    scorer = lms["scp-delta-r-b"]
    med = interleaved_medians(
        {"forward": fwd, "score": lambda: scorer.score(ids, mask)}, repeats=repeats, warmup=1
    )
    ratios["score@B8"] = round(med["forward"] / med["score"], 3)
    ms["forward@B8xT"] = round(1000 * med["forward"], 1)
    ms["score@B8xT"] = round(1000 * med["score"], 1)

    met = {k: (ratios.get(k) is not None and ratios[k] >= v) for k, v in GOALS.items()}
    for k, v in ratios.items():
        logger.info("%-20s %.3f%s", k, v, f"  (goal {GOALS[k]})" if k in GOALS else "")
    emit(
        "generate",
        ratios,
        goals=GOALS,
        goals_met=met,
        ms_per_step=ms,
        new_tokens=n_new,
        score_len=t_len,
        llama_cpp=llama_row,
        base_q4=base_q4,
        threads=threads,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
