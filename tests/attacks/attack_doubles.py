"""Hand-written inputs for the attack tests: a character tokenizer and scorers whose attack
results are known in closed form (a model that memorized its texts exactly, a uniform model, a
random bigram model). They are test doubles of the *input* (the model under attack), built on
the library's own ``LogitsScorer``; the attacks under test run for real."""

from __future__ import annotations

import torch

from scpdr.attacks.logits_scorer import LogitsScorer


class CharTokenizer:
    """One token per printable ASCII character; 0 = pad, 1 = eos (V = 97)."""

    pad_token_id = 0
    eos_token_id = 1
    vocab_size = 97

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for ch in text:
            code = ord(ch)
            if not 32 <= code < 127:
                raise ValueError(f"CharTokenizer cannot encode {ch!r}")
            out.append(code - 32 + 2)
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        parts = []
        for i in ids:
            i = int(i)
            if i == 0:
                parts.append("" if skip_special_tokens else "<pad>")
            elif i == 1:
                parts.append("" if skip_special_tokens else "</s>")
            else:
                parts.append(chr(i - 2 + 32))
        return "".join(parts)

    def __len__(self) -> int:
        return self.vocab_size


TOK = CharTokenizer()
V = TOK.vocab_size


def _real_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(row, positions of real tokens, their ids) for each row (left or right padding)."""
    for b in range(input_ids.shape[0]):
        pos = torch.nonzero(attention_mask[b], as_tuple=False).flatten()
        yield b, pos, input_ids[b, pos].tolist()


def memorizing_scorer(texts, *, name: str = "memorizer", peak: float = 40.0) -> LogitsScorer:
    """All mass on the memorized continuation whenever the context (from its start) is a prefix
    of a memorized text; uniform elsewhere."""
    table: dict[tuple[int, ...], int] = {}
    for t in texts:
        ids = TOK.encode(t)
        for k in range(1, len(ids)):
            table.setdefault(tuple(ids[:k]), ids[k])

    def logits_fn(input_ids, attention_mask):
        out = torch.zeros(*input_ids.shape, V)
        for b, pos, ids in _real_rows(input_ids, attention_mask):
            for j, p in enumerate(pos.tolist()):
                nxt = table.get(tuple(ids[: j + 1]))
                if nxt is not None:
                    out[b, p, nxt] = peak
        return out

    return LogitsScorer(logits_fn, TOK, name=name)


def uniform_scorer(name: str = "uniform") -> LogitsScorer:
    return LogitsScorer(lambda ids, mask: torch.zeros(*ids.shape, V), TOK, name=name)


def bigram_scorer(*, seed: int = 0, scale: float = 2.0, name: str = "bigram") -> LogitsScorer:
    """Random but fixed next-token logits given the current token (knows nothing about any
    canary: canaries are typical draws under it)."""
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale
    return LogitsScorer(lambda ids, mask: table[ids], TOK, name=name)
