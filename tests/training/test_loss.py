"""The chunked causal-LM loss (scpdr.training.loss) is the model's own loss: the same value and the
same gradients in float64 — with padding and -100 labels, goldfish drops, a LoRA-wrapped lm_head
and NEFTune noise — also under bf16 autocast (to bf16 rounding), it never keeps a (tokens, V)
tensor for the backward pass, and inside the
Trainer it is normalized over the accumulated batch as the model's own loss is (same weights
after SGD steps with gradient accumulation)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from scpdr.data import names2ids
from scpdr.training import TRAIN_INFO, CausalCollator, TrainConfig, build_sequences, finetune
from scpdr.training.loss import ChunkedCausalLMLoss, causal_lm_loss, chunk_size


@pytest.fixture(scope="module")
def tok():
    from scpdr.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def records():
    return names2ids(n_train=12, n_val=1, seed=0).train


def _batch(tok, records, *, goldfish: bool = False) -> dict[str, torch.Tensor]:
    rows = build_sequences(records[:4], tok, seq_len=64, packing=False, shuffle=False)
    collate = CausalCollator(
        goldfish_k=3 if goldfish else None, goldfish_h=4, pad_token_id=tok.eos_token_id
    )
    batch = collate(rows)
    assert (batch["attention_mask"] == 0).any()  # rows of different lengths: padding
    batch["labels"][0, 3] = -100  # an ignored position inside a row too
    return batch


def _model(variant: str):
    from scpdr.testing import tiny_model

    model = tiny_model(0).double()
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj", "lm_head"],
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, cfg)
        with torch.no_grad():  # B = 0 at init: move it so the adapters change the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    if variant == "neftune":
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(model, 5.0)
    return model.train()


def _grads(loss, params):
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("variant", ["plain", "goldfish", "lora", "neftune"])
@pytest.mark.parametrize("num_items", [None, 97])
def test_chunked_loss_is_the_models_own_loss_with_the_same_gradients(
    tok, records, variant, num_items
):
    model = _model(variant)
    batch = _batch(tok, records, goldfish=variant == "goldfish")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    labels = batch["labels"]
    params = [p for p in model.parameters() if p.requires_grad]
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}

    # an independent float64 statement of the causal-LM loss, on the model's full logits
    torch.manual_seed(0)  # NEFTune draws its noise in the forward: the same noise for each
    logits = model(**inputs).logits  # (B, T, V)
    assert logits.dtype == torch.float64
    V = logits.shape[-1]
    n_labelled = int((labels[:, 1:] != -100).sum())
    ref_sum = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum"
    )
    ref = ref_sum / (num_items if num_items is not None else n_labelled)
    ref_grads = _grads(ref, params)

    torch.manual_seed(0)
    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    assert out.logits.shape[1] == 1  # the model computed the logits of one position only
    head = model.get_output_embeddings()
    ours = causal_lm_loss(out.hidden_states[-1], labels, head, chunk=5, **extra)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    for g_ours, g_ref in zip(_grads(ours, params), ref_grads, strict=True):
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-13)

    # the model's own loss (transformers upcasts the logits to fp32: fp32 rounding apart)
    torch.manual_seed(0)
    hf = model(**inputs, labels=labels, **extra).loss
    torch.testing.assert_close(hf.double(), ours.detach(), rtol=2e-6, atol=0)

    # the Trainer's compute_loss_func wrapper: the same loss
    torch.manual_seed(0)
    out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    fn = ChunkedCausalLMLoss(head, vocab_size=V)
    torch.testing.assert_close(fn(out, labels, num_items), ours.detach(), rtol=1e-12, atol=0)


def test_chunked_loss_keeps_no_vocabulary_sized_tensor_for_backward(tok, records):
    """What autograd saves for the backward pass: the model's own loss keeps the (B, T, V)
    logits (and more); the chunked loss keeps nothing of the vocabulary's size."""
    from scpdr.testing import tiny_model

    model = tiny_model(0).train()
    batch = _batch(tok, records)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    tokens = batch["input_ids"].numel()
    V = model.config.vocab_size
    params = {p.data_ptr() for p in model.parameters()}

    def largest_saved(fn) -> int:
        sizes = []

        def pack(t):
            if t.data_ptr() not in params:  # weights are kept anyway
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return max(sizes)

    def own():
        return model(**inputs, labels=batch["labels"]).loss

    def chunked():
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        head = model.get_output_embeddings()
        return causal_lm_loss(out.hidden_states[-1], batch["labels"], head, chunk=8)

    H = model.config.hidden_size
    assert largest_saved(own) >= tokens * V
    # the gradients of the hidden states (tokens x H) and of the head's weight (V x H, the
    # same for any batch), never anything of tokens x V
    assert largest_saved(chunked) <= max(tokens * H, V * H) < tokens * V
    assert chunk_size(49152) == 341 and chunk_size(10) == (1 << 24) // 10


def test_chunked_loss_under_bf16_autocast_is_the_models_own_to_bf16_rounding(tok, records):
    """Mixed precision (fp32 weights, bf16 matmuls): the loss runs under the same autocast as
    the forward, so it is the model's own loss under autocast, to bf16 rounding."""
    from scpdr.testing import tiny_model

    model = tiny_model(0).train()
    batch = _batch(tok, records)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = model(**inputs, labels=batch["labels"]).loss
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
    fn = ChunkedCausalLMLoss(
        model.get_output_embeddings(), vocab_size=model.config.vocab_size, autocast="cpu"
    )
    ours = fn(out, batch["labels"])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, own, rtol=1e-3, atol=0)
    for g_ours, g_own in zip(_grads(ours, params), _grads(own, params), strict=True):
        cos = F.cosine_similarity(g_ours.flatten().double(), g_own.flatten().double(), dim=0)
        assert g_ours.dtype == torch.float32 and cos > 0.999


def test_chunked_loss_without_labels_is_a_zero_that_backpropagates():
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    head = torch.nn.Linear(4, 11)
    loss = causal_lm_loss(hidden, torch.full((2, 5), -100), head)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert hidden.grad is not None and not hidden.grad.any()
    with pytest.raises(ValueError, match=r"\(B, T, H\)"):
        causal_lm_loss(hidden, torch.zeros(2, 4, dtype=torch.long), head)


def test_trainer_scales_the_chunked_loss_over_accumulated_batches_as_the_models_own(
    tmp_path, tok, records
):
    """SGD, 2 x 2 batches accumulated per step, rows of different lengths (so each batch has
    its own count of labelled tokens): both losses move the float64 weights the same way, to
    the fp32 rounding of the model's own loss (transformers computes it from fp32 logits). A
    per-batch mean, or a sum over another count, would be off by the ratio of the counts."""
    from safetensors.torch import load_file

    from scpdr.testing import tiny_model

    base = (tiny_model(0).double(), tok)
    common = dict(
        max_steps=2,
        batch_size=2,
        grad_accum=2,
        learning_rate=0.5,
        optim="sgd",
        warmup_steps=0,
        seq_len=64,
        packing=False,
        neftune_alpha=0.0,
        max_grad_norm=1e9,
        precision="fp32",
        progress=False,
    )
    weights, infos = {}, {}
    for chunked in (True, False):
        cfg = TrainConfig(chunked_loss=chunked, **common)
        out = finetune(records, base=base, config=cfg, out=tmp_path / f"c{chunked}")
        weights[chunked] = load_file(str(out / "model.safetensors"))
        infos[chunked] = json.loads((out / TRAIN_INFO).read_text())
    assert infos[True]["loss"] == "chunked" and infos[False]["loss"] == "model"
    w0 = base[0].state_dict()
    updates = {c: {k: w[k] - w0[k] for k in w} for c, w in weights.items()}  # SGD: -lr x grads
    largest = max(float(u.abs().max()) for u in updates[False].values())
    assert largest > 1e-3  # the weights did move
    for k, u in updates[True].items():
        assert u.dtype == torch.float64
        torch.testing.assert_close(u, updates[False][k], rtol=1e-4, atol=1e-5 * largest)
    for chunked in (True, False):
        losses = [h["loss"] for h in infos[chunked]["log_history"] if "loss" in h]
        assert losses
    torch.testing.assert_close(
        torch.tensor(infos[True]["train_loss"]), torch.tensor(infos[False]["train_loss"])
    )


def test_chunked_loss_stays_on_the_hidden_states_device():
    """The summed loss lives where the hidden states are (on CUDA the chunk losses are added
    to it in place): checked on torch's ``meta`` device, which a CPU machine has too."""
    from scpdr.training.loss import _chunked_ce

    head = torch.nn.Linear(8, 11, bias=False, device="meta")
    h = torch.empty(10, 8, device="meta", requires_grad=True)
    targets = torch.zeros(10, dtype=torch.long, device="meta")
    total = _chunked_ce().apply(h, targets, 3, head, head.weight)
    assert total.device == h.device
    total.backward()
    assert h.grad.device == h.device and head.weight.grad.device == h.device


def _scaled_llama():
    """A tiny Llama whose forward doubles the logits (and takes its loss on them), with no
    config attribute saying so: only comparing the head with the logits can tell."""
    from transformers import LlamaForCausalLM

    from scpdr.testing import seeded, tiny_config

    class ScaledLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kw):
            out = super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=logits_to_keep,
                **kw,
            )
            out.logits = out.logits * 2
            if labels is not None:
                out.loss = self.loss_function(out.logits, labels, vocab_size=self.config.vocab_size)
            return out

    with seeded(0):
        return ScaledLlama(tiny_config())


def _granite():
    """A tiny Granite: its logits are lm_head's output divided by ``config.logits_scaling``."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from scpdr.testing import seeded

    cfg = GraniteConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=4.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with seeded(0):
        return GraniteForCausalLM(cfg)


@pytest.mark.parametrize("variant", ["llama", "scaled", "granite"])
def test_trainer_uses_the_models_own_loss_when_logits_are_not_the_heads(
    tmp_path, tok, records, variant
):
    """A model whose logits are not lm_head(hidden_states[-1]) (Granite's logits_scaling in
    its config; a forward that scales them, seen by comparing the head with the logits on the
    first sequence) trains on its own loss; a plain Llama on the chunked one. Either way the
    Trainer's loss is the model's."""
    from transformers import TrainingArguments

    from scpdr.testing import tiny_model
    from scpdr.training.trainer import head_mismatch, logits_transform, make_trainer

    model = {"llama": lambda: tiny_model(0), "scaled": _scaled_llama, "granite": _granite}[
        variant
    ]().train()
    rows = build_sequences(records[:4], tok, seq_len=64, packing=False, shuffle=False)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False
    )
    trainer, chunked = make_trainer(
        model=model,
        args=args,
        rows=rows,
        collator=CausalCollator(pad_token_id=tok.eos_token_id),
        grouped=False,
        chunked_loss=True,
        autocast=None,
    )
    assert chunked is (variant == "llama")
    assert (logits_transform(model) is not None) is (variant == "granite")
    assert (head_mismatch(model, rows[0]["input_ids"]) is None) is (variant == "llama")
    assert model.training  # the check left the model as it was
    batch = CausalCollator(pad_token_id=tok.eos_token_id)(rows)
    torch.manual_seed(0)
    loss = trainer.compute_loss(model, batch)
    torch.manual_seed(0)
    own = model(**batch).loss
    torch.testing.assert_close(loss, own, rtol=1e-5, atol=0)


class _Wrapped(torch.nn.Module):
    """A head that is not a plain ``nn.Linear``: the chunked loss takes its gradients with
    autograd, chunk by chunk (the path a LoRA-wrapped head takes)."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("trainable", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_plain_linear_heads_written_out_gradients_are_autograds(trainable, bf16):
    """A plain ``nn.Linear`` head has its chunks' gradients written out (softmax - onehot in
    place, the weight's gradient added from the compute dtype); they are the ones autograd
    takes through the same head wrapped in a module: float64 to 1e-12, and under bf16
    autocast to the rounding of one bf16 product (the same casts and matmuls; only the
    softmax's last bits may differ)."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if bf16 else torch.float64
    head = torch.nn.Linear(16, 53, bias=True).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(53, 16, generator=gen, dtype=dtype))
        head.bias.copy_(torch.randn(53, generator=gen, dtype=dtype))
    head.weight.requires_grad_(trainable in ("both", "weight"))
    head.bias.requires_grad_(trainable in ("both", "bias"))
    params = [p for p in head.parameters() if p.requires_grad]
    hidden = torch.randn(3, 9, 16, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 53, (3, 9), generator=gen)
    labels[1, 4] = -100

    def run(h):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.enable_grad()
        with ctx:
            loss = causal_lm_loss(hidden, labels, h, chunk=5)
        return loss, torch.autograd.grad(loss, [hidden, *params])

    ours, g_ours = run(head)
    ref, g_ref = run(_Wrapped(head))
    assert ours.dtype == ref.dtype == (torch.float32 if bf16 else torch.float64)
    tol = {"rtol": 1e-6, "atol": 1e-6} if bf16 else {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(ours, ref, **tol)
    for a, b in zip(g_ours, g_ref, strict=True):
        assert a.dtype == b.dtype
        if bf16:  # one ulp of bf16 where the softmax rounded differently before the cast
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
            cos = F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
            assert cos > 0.9999
        else:
            torch.testing.assert_close(a, b, **tol)


def test_the_chunked_loss_refuses_a_second_backward_through_one_graph():
    """Its backward scales the gradients it saved in place: a second backward through the
    same graph (retain_graph) is refused by autograd, not answered with twice-scaled ones."""
    head = torch.nn.Linear(4, 11)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    loss = causal_lm_loss(hidden, torch.randint(0, 11, (2, 5)), head)
    (g1,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    assert g1.abs().sum() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, [hidden])
