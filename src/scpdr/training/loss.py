"""The causal-LM loss in chunks of tokens, so that the vocabulary's logits are never held twice.

A causal LM's own loss materializes the logits of the whole batch (tokens x V, fp32: 8 x 262 x
49,152 x 4 B = 412 MB for the 135M model) and keeps them, and then their gradient, for the
backward pass. :func:`causal_lm_loss` takes the final hidden states instead (the input of
``lm_head``), keeps only the positions that have a label (padding and goldfish-dropped tokens
never reach ``lm_head``), and computes ``lm_head`` + cross-entropy over chunks of
:func:`chunk_size` tokens: each chunk's logits (about :data:`CHUNK_ELEMENTS` floats) are made,
differentiated and freed right away, in the forward pass, which keeps only the gradients for the
hidden states (tokens x H) and for the head's trainable weights (V x H, whatever the batch);
the backward pass scales them by the incoming gradient. So at most one chunk's logits exist at
a time, and the arithmetic is the model's own (one ``lm_head`` forward, two matmuls for its
gradients) — the fused linear cross-entropy of Liger-Kernel, here with torch only and any
``lm_head`` module, a LoRA-wrapped head included. For a plain ``nn.Linear`` head (the usual
one, tied or not) the chunk's gradients are written out rather than taken by autograd
(``softmax - onehot`` in place in the chunk's fp32 logits, the weight cast once per loss, its
gradient added into the fp32 sum from the compute dtype): the same arithmetic at about half
the memory per chunk, which on the 135M model's CPU step was the step's peak.

It is the same loss as ``model(**batch).loss`` (transformers' ``ForCausalLMLoss``): position
``t`` predicts ``labels[t + 1]``, ``-100`` is ignored, logits are upcast to fp32 (fp64 ones stay
fp64), and the sum is divided by ``num_items_in_batch`` (the labelled tokens of all the batches
accumulated into one optimizer step, as the Trainer counts them) or, without it, by this
batch's labelled tokens.
Tested against the model's own loss and gradients in float64 (plain, goldfish, LoRA, NEFTune)
and under bf16 autocast.

:class:`ChunkedCausalLMLoss` is this loss as the Trainer's ``compute_loss_func``; the model is
then asked for its hidden states instead of logits (:mod:`scpdr.training.trainer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scpdr.training.memory import trim_step_heap

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CHUNK_ELEMENTS", "IGNORE_INDEX", "ChunkedCausalLMLoss", "causal_lm_loss", "chunk_size"]

#: Logits computed at once: ``chunk tokens x V`` is about this many floats (64 MB in fp32).
CHUNK_ELEMENTS = 1 << 24
#: The label of positions without a loss (padding, goldfish drops), as in transformers.
IGNORE_INDEX = -100


def chunk_size(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab_size``: ``CHUNK_ELEMENTS // vocab_size``
    (341 for SmolLM2's 49,152), at least 1."""
    return max(1, CHUNK_ELEMENTS // max(int(vocab_size), 1))


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, head: Callable[..., Any]) -> Any:
    import torch
    import torch.nn.functional as F

    logits = head(hidden)  # (n, V)
    up = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32; fp64 stays fp64
    return F.cross_entropy(logits.to(up), targets, reduction="sum")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes ``t`` in here: the ambient autocast's, for the tensors
    autocast casts (floating point, not float64), else ``t``'s own."""
    import torch

    dev = t.device.type
    if not t.is_floating_point() or t.dtype == torch.float64:
        return t.dtype
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except RuntimeError:  # a device without autocast (meta)
        pass
    return t.dtype


def _linear_chunks(
    h: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    head: Any,
    grads: list[torch.Tensor],
    grad_h: torch.Tensor,
) -> torch.Tensor:
    """The summed cross-entropy of a plain ``nn.Linear`` head and its gradients, chunk by chunk,
    with the gradients written out instead of taken by autograd: ``softmax - onehot`` made in
    place in the chunk's fp32 logits, one cast of the weight for the whole loss, and the
    weight's gradient added into its fp32 sum from the compute dtype (autograd would make an
    fp32 copy of it per chunk). The arithmetic is autograd's (the same casts, products and
    sums), at about half its memory: per chunk one fp32 and one compute-dtype copy of the
    logits and one of the weight's gradient. ``grads``: the sums for the head's parameters
    that require a gradient (weight, then bias), filled in place; returns the loss."""
    import torch

    w, b = head.weight, head.bias
    cdt = _compute_dtype(h)  # h, weight and bias in one dtype, as autocast casts them
    wc = w.detach().to(cdt)
    bc = None if b is None else b.detach().to(cdt)
    up = torch.promote_types(cdt, torch.float32)  # the logits' upcast (fp64 stays fp64)
    sums = iter(grads)
    gw = next(sums) if w.requires_grad else None
    gb = next(sums) if b is not None and b.requires_grad else None
    total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
    with torch.no_grad():
        for s in range(0, h.shape[0], chunk):
            hc, t = h[s : s + chunk].to(cdt), targets[s : s + chunk]
            z = torch.nn.functional.linear(hc, wc, bc).to(up)  # (n, V) logits, upcast
            picked = z.gather(1, t[:, None])  # (n, 1): the targets' logits
            top = z.amax(dim=1, keepdim=True)
            norm = z.sub_(top).exp_().sum(dim=1, keepdim=True)  # in place: no (n, V) temporary
            total += (top + norm.log() - picked).sum().to(total.dtype)  # sum of lse - z[t]
            z.div_(norm)  # softmax ...
            z[torch.arange(t.numel(), device=t.device), t] -= 1  # ... - onehot: dloss/dlogits
            g = z.to(cdt)
            del z
            grad_h[s : s + chunk] = g @ wc
            if gw is not None:
                gw.add_(g.t() @ hc)
            if gb is not None:
                gb.add_(g.sum(0))
    return total


def _autograd_chunks(
    h: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    head: Any,
    params: tuple[torch.Tensor, ...],
    grads: list[torch.Tensor],
    grad_h: torch.Tensor,
) -> torch.Tensor:
    """:func:`_linear_chunks` for any other head (a LoRA-wrapped one): each chunk's gradients
    for ``h`` and ``params`` taken by autograd, added into ``grads``; returns the loss."""
    import torch

    # on h's device: CUDA chunk losses are added to it in place
    total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
    with torch.enable_grad():
        for s in range(0, h.shape[0], chunk):
            hc = h[s : s + chunk].detach().requires_grad_()
            loss = _chunk_loss(hc, targets[s : s + chunk], head)  # logits: (n, V)
            found = torch.autograd.grad(loss, [hc, *params], allow_unused=True)
            grad_h[s : s + chunk] = found[0]
            for acc, g in zip(grads, found[1:], strict=True):
                if g is not None:
                    acc += g
            total += loss.detach()
    return total


_FUNCTION: Any = None


def _chunked_ce() -> Any:
    """The autograd function (built on first use: torch is imported lazily): the summed
    cross-entropy of ``head(h)``, chunk by chunk, each chunk's gradients (for ``h`` and the
    head's trainable parameters) taken in the forward pass and its logits freed at once; the
    backward pass only scales them by the incoming gradient, in place (a second backward
    through the same graph is refused by autograd's check of saved tensors). A plain
    ``nn.Linear`` head has its gradients written out (:func:`_linear_chunks`); any other head
    (a LoRA-wrapped one) has them taken by autograd, chunk by chunk."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    import torch

    class ChunkedCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: Any, targets: Any, chunk: int, head: Any, *params: Any) -> Any:
            grad_h = torch.zeros_like(h)  # (N, H)
            grads = [torch.zeros_like(p) for p in params]  # the head's, independent of N
            if type(head) is torch.nn.Linear:
                total = _linear_chunks(h, targets, chunk, head, grads, grad_h)
            else:
                total = _autograd_chunks(h, targets, chunk, head, params, grads, grad_h)
            ctx.save_for_backward(grad_h, *grads)
            return total

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            grad_h, *grads = ctx.saved_tensors
            return (grad_h.mul_(grad_out), None, None, None, *(g.mul_(grad_out) for g in grads))

    _FUNCTION = ChunkedCrossEntropy
    return _FUNCTION


def causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The causal-LM cross-entropy from the final hidden states, ``chunk`` tokens at a time.

    Args:
        hidden: ``(B, T, H)`` hidden states that ``head`` turns into logits (after the final
            norm: the model's ``hidden_states[-1]``).
        labels: ``(B, T)`` token ids; ``-100`` has no loss. Position ``t`` predicts
            ``labels[:, t + 1]``.
        head: the output layer, ``(n, H) -> (n, V)`` (the model's ``lm_head``, LoRA-wrapped or
            not), called once per chunk; the gradients reach ``hidden`` and the head's
            parameters that require them.
        num_items_in_batch: the divisor (labelled tokens of the accumulated batch); default:
            this batch's labelled tokens.
        chunk: tokens per chunk (default :func:`chunk_size` of ``head.out_features``, else
            1024).

    Returns a scalar fp32 tensor; with no labelled token, a zero that still backpropagates.
    """
    import torch

    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be (B, T, H) and labels (B, T), got {tuple(hidden.shape)} and "
            f"{tuple(labels.shape)}"
        )
    targets = labels[:, 1:].reshape(-1)  # (B*(T-1),)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (B*(T-1), H)
    keep = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
    h, targets = h.index_select(0, keep), targets.index_select(0, keep)  # (N, H), (N,)
    n = targets.numel()
    if chunk is None:
        out = getattr(head, "out_features", None)
        chunk = chunk_size(out) if isinstance(out, int) else 1024
    if n == 0:  # nothing labelled: a zero that keeps the graph
        total = (hidden.sum() * 0).float()
    else:
        params = [p for p in getattr(head, "parameters", list)() if p.requires_grad]
        total = _chunked_ce().apply(h, targets, int(chunk), head, *params)
    if num_items_in_batch is None:
        return total / max(n, 1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class ChunkedCausalLMLoss:
    """:func:`causal_lm_loss` as a ``transformers.Trainer`` ``compute_loss_func``:
    ``(outputs, labels, num_items_in_batch) -> loss``, from ``outputs.hidden_states[-1]``.

    ``head`` is the model's output layer (``model.get_output_embeddings()``, read once: a
    PEFT-wrapped head is the wrapper); ``autocast``: the device type whose bf16 autocast the
    head runs under (``"cpu"``/``"cuda"``; ``None``: as the caller's context), as the model's
    forward does under mixed precision (the Trainer's autocast wraps the forward only, and the
    loss runs after it). ``trim_heap``: first return the heap's free pages to the system
    (:func:`scpdr.training.memory.trim_heap`; CPU training), so that the chunks' logits do not
    add to the blocks the forward freed."""

    def __init__(
        self, head: Any, *, vocab_size: int, autocast: str | None = None, trim_heap: bool = False
    ) -> None:
        self.head = head
        self.chunk = chunk_size(vocab_size)
        self.autocast = autocast
        self.trim_heap = trim_heap

    def __call__(
        self, outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        import contextlib

        import torch

        hidden = getattr(outputs, "hidden_states", None)
        if not hidden:
            raise ValueError(
                "the chunked loss needs the model's hidden states (output_hidden_states=True); "
                "train with chunked_loss: false for a model that does not return them"
            )
        ctx = (
            torch.autocast(self.autocast, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        if self.trim_heap:
            trim_step_heap()
        with ctx:
            return causal_lm_loss(
                hidden[-1],
                labels,
                self.head,
                num_items_in_batch=num_items_in_batch,
                chunk=self.chunk,
            )
