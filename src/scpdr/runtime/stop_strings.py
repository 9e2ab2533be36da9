"""Stop strings: their validation, per-prompt parsing, and incremental detokenization that never
shows text a stop string or an incomplete UTF-8 character could still take back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = ["RowText", "check_stop", "per_prompt_stop"]


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """One sequence's stop strings as a tuple: ``None`` → ``()``, a str → one; each a non-empty
    str (ValueError otherwise)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or a per-prompt list, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty str, got {s!r}")
    return tuple(stop)


def per_prompt_stop(stop: Any, n: int) -> list[tuple[str, ...]]:
    """Stop strings per prompt. ``None``/a str/a list of str are shared; a list with one entry
    (None, str or list of str) per prompt, containing at least one None or list, is per prompt."""
    if stop is None or isinstance(stop, str):
        return [check_stop(stop)] * n
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or a per-prompt list, got {stop!r}")
    if not any(s is None or isinstance(s, (list, tuple)) for s in stop):
        return [check_stop(stop)] * n
    if len(stop) != n:
        raise ValueError(f"stop has {len(stop)} per-prompt entries but there are {n} prompts")
    return [check_stop(s) for s in stop]


class RowText:
    """Incremental detokenization of one row with stop strings (held-back text never shown).

    :meth:`add` takes the next token and returns the text newly safe to show; :attr:`stopped`
    turns true when a stop string appeared (``text`` is then cut before it); :meth:`flush`
    releases what was held back when the row ends for another reason.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self.tok = tokenizer
        self.stop = list(stop)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        full = self._decode()
        self.text = full
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [p for p in (full.find(s, start) for s in self.stop) if p >= 0]
            if hits:
                self.stopped = True
                self.text = full[: min(hits)]
                return self._emit(self.text)
        safe = full
        while safe.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for more bytes
            safe = safe[:-1]
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for j in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:j]):
                    safe = safe[: len(safe) - j]
                    break
        return self._emit(safe)

    def _emit(self, upto: str) -> str:
        if len(upto) <= self.emitted:
            return ""
        delta = upto[self.emitted :]
        self.emitted = len(upto)
        return delta

    def flush(self) -> str:
        return self._emit(self.text)
