"""lm-evaluation-harness's ``local-completions`` model against the live server (offline): a
multiple-choice task and a generate_until task from local JSONL files; its log-likelihoods equal
``ProtectedLM.score`` on the same tokens. Also lm-eval's ``RemoteTokenizer`` (the /tokenizer_info,
/tokenize and /detokenize endpoints)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

MC_DOCS = [
    {
        "question": "The weather explains",
        "choices": [" the results", " a list", " nothing"],
        "answer": 0,
    },
    {"question": "My friend asks about", "choices": [" the meeting", " an old story"], "answer": 1},
    {
        "question": "This function returns",
        "choices": [" a list of numbers", " the answer"],
        "answer": 0,
    },
]
GEN_DOCS = [
    {"question": "A small cat shows", "answer": "the answer"},
    {"question": "The report describes", "answer": "an old story"},
]


def _write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{question}}"\n'
    (root / "scpdr_tiny_mc.yaml").write_text(
        "task: scpdr_tiny_mc\n"
        + common
        + f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        + "output_type: multiple_choice\n"
        + 'doc_to_choice: "{{choices}}"\n'
        + 'doc_to_target: "{{answer}}"\n'
        + "metric_list:\n  - metric: acc\n"
    )
    (root / "scpdr_tiny_gen.yaml").write_text(
        "task: scpdr_tiny_gen\n"
        + common
        + f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        + "output_type: generate_until\n"
        + 'doc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n'
        + "  do_sample: false\n  temperature: 0\n"
        + "metric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def base_url(start_server):
    with start_server(max_batch=8) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer_dir(serve_bundle) -> str:
    from scpdr.models import read_bundle

    manifest = read_bundle(serve_bundle)
    return manifest.resolve(serve_bundle, manifest.tokenizer)


def test_lm_eval_local_completions_matches_protected_lm(
    base_url, tokenizer_dir, serve_lm, model_id, tmp_path
):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    lm = LocalCompletionsAPI(
        base_url=base_url + "/v1/completions",
        model=model_id,
        tokenizer=tokenizer_dir,
        tokenizer_backend="huggingface",
        num_concurrent=4,  # concurrent requests share the server's batches
        max_retries=1,
        max_length=1024,
        timeout=60,
    )
    out = simple_evaluate(
        model=lm,
        tasks=["scpdr_tiny_mc", "scpdr_tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    assert set(out["results"]) == {"scpdr_tiny_mc", "scpdr_tiny_gen"}
    acc = out["results"]["scpdr_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0

    mc = out["samples"]["scpdr_tiny_mc"]
    assert len(mc) == len(MC_DOCS)
    checked = 0
    for sample in mc:
        for (context, continuation), ((ll, is_greedy),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ctx, cont = lm._encode_pair(context, continuation)
            ids = torch.tensor([ctx + cont])
            ref = serve_lm.score(ids, greedy=True)
            expect = ref.token_logprobs[0, len(ctx) - 1 :].sum().item()
            assert ll == pytest.approx(expect, abs=1e-4)
            greedy = ref.greedy[0, len(ctx) - 1 :].tolist() == cont
            assert is_greedy == greedy
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)

    gen = out["samples"]["scpdr_tiny_gen"]
    for sample in gen:
        (text,) = sample["resps"][0]
        context = sample["arguments"][0][0]
        ref = serve_lm.generate([lm.tok_encode(context)], max_new_tokens=6, stop=["\n", "."])[0]
        assert text == ref.text
        assert isinstance(sample["filtered_resps"][0], str)
    assert not math.isnan(out["results"]["scpdr_tiny_gen"]["exact_match,none"])


def test_remote_tokenizer_endpoints(base_url, serve_lm):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = base_url + "/v1/completions"
    assert check_remote_tokenizer_support(url)
    tok = RemoteTokenizer(url, timeout=30)
    text = "Hello world, the weather explains."
    ids = tok.encode(text)
    assert ids == serve_lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == serve_lm.tokenizer.eos_token
    assert tok.eos_token_id == serve_lm.tokenizer.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == serve_lm.tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
