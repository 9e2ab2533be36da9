"""``ProtectedLM``: the API of a NAF-protected model — batched, KV-cached generation and
teacher-forced scoring (layer 3 of ``shared/DESIGN.md``).

At every position the K constituents (and, for the SCP methods' 'b' variant, the base model) are
run on the same prefix by a model runner (:mod:`scpdr.runtime.runner`), and their next-token
distributions are aggregated with a rule of :mod:`scpdr.naf` (Defs. 2.2, 2.6, Alg. 1) or with the
stateful CP-Fuse step. Each generated or scored token carries its certificate
(:func:`scpdr.bounds.certify`): ``k_x``, the NAF bound of the method at that position (Def. 2.1,
Thms. 2.3/2.7; for SCP-Δr on the smoothed distributions, §4.1), and ``t_x``, the LiRA bound of
Thm. 4.4 with the max over all constituents.

Variants of SCP-Δr (§5.1): 'b' runs the base model at every step; 'c' uses a constant base logit
vector stored in the bundle (no base forward). Methods without a base never run it, and "none"
(the No CP baseline) runs constituent 0 alone. Decoding lives in :mod:`scpdr.runtime.decoding`,
scoring in :mod:`scpdr.runtime.scoring`, sampling in :mod:`scpdr.runtime.sampling`, bundle
loading in :mod:`scpdr.runtime.loading`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Unpack

import torch
from torch import Tensor

from scpdr import methods, naf
from scpdr.runtime import decoding, inputs, scoring
from scpdr.runtime.aggregation import Aggregator
from scpdr.runtime.loading import check_rule, load_bundle_parts
from scpdr.runtime.outputs import FastPath, Generation, PromptLogprobs, ScoreOutput, StepEvent
from scpdr.runtime.runner import ModelRunner, PerModelRunner, positions, run_split
from scpdr.runtime.sampling import SamplingOptions, SamplingParams, resolve_sampling

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["METHODS", "SCORE_CHUNK_ELEMENTS", "ProtectedLM"]

#: Methods ProtectedLM runs: the aggregation rules of :data:`scpdr.methods.RULES`.
METHODS: tuple[str, ...] = methods.RULES
#: Default bound on the floats of logits held at once by :meth:`ProtectedLM.score` (the G models'
#: (G, N, V) at N positions): 2^26 float32 = 256 MiB; longer batches are processed in chunks of
#: rows, all in one buffer. A runner that splits the heads off (``splits_heads``: both runners,
#: for Llama models) runs each decoder once over G times as many rows and only the heads per
#: chunk, so small chunks cost little (8 x 128 tokens, SCP-Δr-b: 0.326 of one forward's speed
#: at 2^26, 0.321 at 2^27, 0.312 at 2^25), and scores a row longer than the bound in pieces;
#: the aggregation and certificates at a chunk's positions hold a few times its logits again
#: (with k_x and t_x the score adds 630 MiB to the process at 2^26, 174 MiB at 2^25; one row of
#: 1024 tokens 769 MiB); docs/performance.md.
SCORE_CHUNK_ELEMENTS = 1 << 26

_GENERAL = (
    "models given one by one (ProtectedLM(...)): one forward per model; "
    "ProtectedLM.from_bundle uses the shared-base runner for LoRA bundles"
)
Prompts = Sequence[str] | Sequence[Sequence[int]]


class ProtectedLM:
    """A NAF-protected language model over K constituents (and a base for the SCP methods).

    Args:
        constituents: K causal LMs sharing ``tokenizer``'s vocabulary (K >= 2; K = 1 only for
            "none"; exactly 2 for "cp-fuse").
        tokenizer: their tokenizer.
        base_model: the base model (SCP methods, variant 'b').
        base_vector: constant base logits ``Tensor[V]`` (SCP methods, variant 'c').
        method: a name of :data:`METHODS`.
        m: smoothing level of the SCP methods (Alg. 1; paper default 10).
        names: model names for error messages.
        score_chunk_elements: bound on the floats of logits held at once by :meth:`score`
            (:data:`SCORE_CHUNK_ELEMENTS`; at least one position's, and at least one row's
            where the runner does not split the heads off).
        runner: what runs the models (:class:`~scpdr.runtime.runner.ModelRunner`; its
            ``models`` must be the models run here, in order); default one forward per model.
        fast_path: why this runner (:attr:`fast_path`); derived from ``runner`` when omitted.
    """

    def __init__(
        self,
        constituents: Sequence[PreTrainedModel],
        tokenizer: PreTrainedTokenizerBase,
        *,
        base_model: PreTrainedModel | None = None,
        base_vector: Tensor | None = None,
        method: str = "scp-delta-r",
        m: int = naf.DEFAULT_M,
        names: Sequence[str] | None = None,
        score_chunk_elements: int = SCORE_CHUNK_ELEMENTS,
        runner: ModelRunner | None = None,
        fast_path: FastPath | None = None,
    ) -> None:
        from scpdr.models import check_model_vocab, output_size

        check_rule(method)
        constituents = list(constituents)
        k = len(constituents)
        if k == 0 or (k < 2 and method != "none"):
            raise ValueError(
                f"method {method!r} needs K >= 2 constituents, got {k}; use method 'none' for a "
                "single model"
            )
        if method == "cp-fuse" and k != 2:
            raise ValueError(f"cp-fuse fuses exactly 2 constituents, got {k}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"m must be a positive int (tokens kept unsmoothed), got {m!r}")
        if score_chunk_elements < 1:
            raise ValueError("score_chunk_elements must be positive")
        self.method = method
        self.m = m
        self.tokenizer = tokenizer
        self.constituents = constituents
        self.num_constituents = k
        self.score_chunk_elements = int(score_chunk_elements)
        names = list(names) if names is not None else [f"constituent {i}" for i in range(k)]
        self.vocab_size = output_size(constituents[0])
        self.device = next(constituents[0].parameters()).device
        if m >= self.vocab_size:
            raise ValueError(f"m must be < V = {self.vocab_size} (tokens kept unsmoothed), got {m}")

        self.variant: str | None = None
        self.base_model: PreTrainedModel | None = None
        self.base_vector: Tensor | None = None
        if method in methods.SMOOTHED_RULES:
            if base_model is not None and base_vector is not None:
                raise ValueError(
                    "pass either base_model ('b' variant) or base_vector ('c'), not both"
                )
            if base_vector is not None:
                vec = base_vector.detach().to(self.device, torch.float32).reshape(-1)
                if vec.numel() != self.vocab_size:
                    raise ValueError(
                        f"base_vector has {vec.numel()} entries, the vocabulary has {self.vocab_size}"
                    )
                self.base_vector, self.variant = vec, "c"
            elif base_model is not None:
                self.base_model, self.variant = base_model, "b"
            else:
                raise ValueError(
                    f"{method} smooths against a base: pass base_model= (variant 'b') or "
                    "base_vector= (variant 'c')"
                )
        models = {n: c for n, c in zip(names, constituents, strict=True)}
        if self.base_model is not None:
            models["base"] = self.base_model
        check_model_vocab(models, vocab_size=self.vocab_size)
        for name, model in models.items():
            dev = next(model.parameters()).device
            if dev != self.device:
                raise ValueError(f"model {name!r} is on {dev}, constituent 0 on {self.device}")
            model.eval()
        # The models each forward runs: constituents (only #0 for "none"), then the base ('b').
        run = constituents[:1] if method == "none" else list(constituents)
        run_names = names[: len(run)]
        if self.base_model is not None:
            run, run_names = [*run, self.base_model], [*run_names, "base"]
        if runner is None:
            runner = PerModelRunner(run, run_names, vocab_size=self.vocab_size)
        elif len(runner.models) != len(run) or any(
            a is not b for a, b in zip(runner.models, run, strict=True)
        ):
            raise ValueError(
                f"the runner runs {len(runner.models)} models, not the {len(run)} this method "
                "runs (constituents, then the base for variant 'b'), in that order"
            )
        #: What runs the models (:class:`~scpdr.runtime.runner.ModelRunner`).
        self.runner: ModelRunner = runner
        if fast_path is None:
            fast_path = (
                FastPath(True, f"given a shared-base runner ({type(runner).__name__})")
                if runner.shared_base
                else FastPath(False, _GENERAL)
            )
        self._fast_path = fast_path
        #: The aggregation and certificate of one position (the rule's, :func:`bounds.certify`).
        self.aggregator = Aggregator(method, m)
        #: Token ids that end a generation (the tokenizer's eos and the generation config's).
        self.eos_ids = frozenset(self._collect_eos_ids())

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """Result-row name (``scpdr.methods``): the rule, with "-b"/"-c" for the SCP variants."""
        return f"{self.method}-{self.variant}" if self.variant else self.method

    @property
    def fast_path(self) -> FastPath:
        """Whether the shared-base LoRA fast path runs the models, and why (or why not)."""
        return self._fast_path

    @property
    def context_length(self) -> int | None:
        """Most tokens (prompt + completion) the model takes: the smallest
        ``max_position_embeddings`` of the models it runs, else the tokenizer's
        ``model_max_length`` when set, else None (unknown)."""
        sizes = [
            getattr(getattr(mdl, "config", None), "max_position_embeddings", None)
            for mdl in self.runner.models
        ]
        sizes = [v for v in sizes if isinstance(v, int) and v > 0]
        if sizes:
            return min(sizes)
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        return tok_max if isinstance(tok_max, int) and 0 < tok_max < 10**7 else None

    def __repr__(self) -> str:
        return f"ProtectedLM(name={self.name!r}, K={self.num_constituents}, m={self.m})"

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike[str],
        *,
        method: str | None = None,
        m: int | None = None,
        base: str = "model",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> ProtectedLM:
        """Load a bundle (``scpdr.models.write_bundle``) as a protected model.

        ``method``/``m`` default to the bundle's (normally "scp-delta-r", 10). ``base="model"``
        runs the base model ('b'); ``base="constant"`` uses the stored constant vector ('c').
        Only the models the method needs are loaded ("none": constituent 0; no base for
        non-SCP methods); LoRA bundles run on the shared-base fast path (:attr:`fast_path`).
        ``device``: cpu, cuda or cuda:N (default: ``$SCPDR_DEVICE``, else cuda when available;
        :mod:`scpdr.device`); on CUDA the models load in bf16 unless ``dtype`` says otherwise,
        and the aggregation stays float32; ``dtype=torch.bfloat16`` on CPU runs a LoRA bundle's
        base with bf16 weights on the packed kernel, computing in float32
        (:class:`scpdr.lora.StackedLoRA`). Raises
        BundleError for missing/inconsistent files, ValueError for bad arguments (a
        :class:`~scpdr.errors.ConfigError` for an unavailable device).
        """
        parts = load_bundle_parts(path, method=method, m=m, base=base, dtype=dtype, device=device)
        return cls(parts.constituents, parts.tokenizer, **parts.kwargs())

    @classmethod
    def from_model(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ProtectedLM:
        """A single model as a scorer (method "none": the No CP baseline; k_x = t_x = inf)."""
        return cls([model], tokenizer, method="none")

    @classmethod
    def from_runner(
        cls,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        *,
        method: str = "scp-delta-r",
        m: int = naf.DEFAULT_M,
        base_vector: Tensor | None = None,
        fast_path: FastPath | None = None,
    ) -> ProtectedLM:
        """A protected model over the models of ``runner`` (e.g. ``scpdr.lora.StackedLoRA``).

        For an SCP method without ``base_vector`` (variant 'b') the runner's last model is the
        base and the others the constituents; otherwise every model is a constituent. Raises
        ValueError when the runner's models do not match what the method runs.
        """
        check_rule(method)
        mods, names = list(runner.models), list(runner.names)
        scp_b = method in methods.SMOOTHED_RULES and base_vector is None
        if method == "none" and len(mods) != 1:
            raise ValueError(
                "method 'none' runs one model; use ProtectedLM.from_model(model, tokenizer)"
            )
        if scp_b and len(mods) < 3:
            raise ValueError(f"{method}-b needs >= 2 constituents plus the base model")
        cons = mods[:-1] if scp_b else mods
        return cls(
            cons,
            tokenizer,
            base_model=mods[-1] if scp_b else None,
            base_vector=base_vector,
            method=method,
            m=m,
            names=names[: len(cons)],
            runner=runner,
            fast_path=fast_path,
        )

    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gc = getattr(self.constituents[0], "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    # ------------------------------------------------------------------ scoring

    @torch.inference_mode()
    def next_token_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Aggregated, normalized next-token log-probs after each row's last real token:
        ``Tensor[B, V]`` float32 (left- or right-padded inputs). Each row is a fresh request:
        CP-Fuse uses the path-free objective here (as at its first generated token)."""
        ids, mask = inputs.check_inputs(input_ids, attention_mask, self.vocab_size, self.device)
        if bool((mask[:, -1] == 1).all()):  # left padding / no padding: the last column
            keep: int | Tensor = 1
        else:
            last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)  # (B,)
            keep = last.unsqueeze(1)  # (B, 1)
        logits, base = run_split(
            self.runner, self.variant == "b", ids, mask, positions(mask), keep=keep
        )  # (K', B, 1, V), (B, 1, V) | None
        logits, base = logits[:, :, -1], None if base is None else base[:, -1]
        base = self.base_vector if self.variant == "c" else base
        return self.aggregator(logits, base, None, bounds_too=False)[0]

    @torch.inference_mode()
    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        prompt_lengths: Sequence[int] | Tensor | None = None,
        full: bool = False,
        greedy: bool = False,
        k_x: bool = False,
        t_x: bool = False,
        components: bool = False,
        top_logprobs: int = 0,
        cost: bool = False,
        anchor: float | Sequence[float | None] | None = None,
        base: bool = False,
    ) -> Tensor | ScoreOutput:
        """Teacher-forced scoring: one forward per model over whole sequences, aggregated at every
        position (no token loop).

        Args:
            input_ids: ``(B, T)`` token ids, left- or right-padded.
            attention_mask: ``(B, T)`` 0/1 (default all ones).
            prompt_lengths: real tokens of each row's prompt (``[1, row length]``): CP-Fuse's
                path starts at each row's prompt end, as a fresh request's does (Def. 4.2), so
                ``score(prompt + completion, prompt_lengths=len(prompt))`` equals the log-probs
                :meth:`generate` returned, for every method. None: the path is the whole row
                after its first token.
            full / greedy / k_x / t_x / components: also return the aggregated distributions
                ``(B, T-1, V)``, argmax tokens, certificates, raw model log-probs.
            top_logprobs: also return the n most likely tokens of r at every position.
            cost: also return each position's charge (:func:`scpdr.bounds.token_cost`) when
                its target and the ``top_logprobs`` alternatives are revealed: a row's running
                sum is the certificate of serving it, and :func:`scpdr.bounds.within_budget`
                says which positions a budget serves.
            anchor: score under the base-anchored distribution (nats per token; one value, or
                one per row, None = not anchored): every returned value is that of the served
                mixture (:func:`scpdr.bounds.anchor`). Variant 'b' only.
            base: also return the base model's log-probs of each target and alternatives
                (``base_token_logprobs``, ``base_top_*``: what a fallback position serves) and
                each position's charge against the base (``anchor``). With ``cost`` and
                ``t_x`` this is the trace :func:`scpdr.bounds.private_prefix` reads the
                fallback of any budget off. Variant 'b' only.

        Returns ``Tensor[B, T-1]`` (log r of each actual next token; 0.0 where the target or its
        context is padding) when no option is set, else a :class:`ScoreOutput`. Rows are
        processed in chunks so that at most ``score_chunk_elements`` logits are held at once.
        """
        ids, mask = inputs.check_inputs(input_ids, attention_mask, self.vocab_size, self.device)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {top_logprobs!r}")
        radius = None
        if anchor is not None:
            rows = list(anchor) if isinstance(anchor, (list, tuple)) else [anchor] * len(ids)
            if len(rows) != len(ids):
                raise ValueError(f"anchor has {len(rows)} entries but there are {len(ids)} rows")
            for a in rows:
                SamplingParams(anchor=a)  # the one validation of a radius
            radius = torch.tensor(
                [float("inf") if a is None else a for a in rows], dtype=torch.float64
            )
        return scoring.score(
            self,
            ids,
            mask,
            anchor=radius,
            base=base,
            prompt_lengths=scoring.check_prompt_lengths(prompt_lengths, mask),
            full=full,
            greedy=greedy,
            k_x=k_x,
            t_x=t_x,
            components=components,
            top_logprobs=top_logprobs,
            cost=cost,
        )

    def prompt_logprobs(
        self, prompts: Prompts, *, top_logprobs: int | Sequence[int] = 0
    ) -> list[PromptLogprobs]:
        """Teacher-forced log-probs of each prompt (``echo``), every prefix read as a fresh
        request (CP-Fuse: path length 0): one :class:`PromptLogprobs` per prompt, with the
        ``top_logprobs`` (shared or per prompt) most likely tokens at each position."""
        encoded = inputs.encode_prompts(self.tokenizer, prompts, self.vocab_size)
        return scoring.prompt_logprobs(self, encoded, top_logprobs)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Prompts,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> list[Generation]:
        """Generate a continuation of each prompt: one :class:`Generation` per prompt.

        Args:
            prompts: strings (tokenized with the tokenizer's special tokens, no chat template) or
                token-id lists.
            sampling: one :class:`SamplingParams` (shared) or one per prompt (the server's
                per-sequence parameters); or instead, the keyword arguments below
                (:class:`~scpdr.runtime.sampling.SamplingOptions`, the arguments of
                :meth:`SamplingParams.per_prompt`):
            max_new_tokens: >= 0 (default 32).
            temperature: 0 = greedy (argmax of r); > 0 samples from ``r^(1/temperature)``.
            top_p: nucleus mass in (0, 1]. top_k: 0 = off, else keep the k most likely tokens.
            stop: stop strings (shared: a str or list of str; per prompt: a list with one entry,
                None / str / list of str, per prompt).
            seed: sampling seed (per prompt or shared; each row has its own generator, so its
                tokens do not depend on the rest of the batch).
            stop_at_eos: finish a row at the eos token (kept in ``token_ids``).
            top_logprobs: also return the n most likely tokens of r at each step (shared).
            echo: also return the prompt's log-probs (``Generation.prompt_logprobs``).
            budget: most nats each response may be charged (None: no budget): a token whose
                charge would take ``Σ cost`` (echoed prompt positions included) past it is not
                emitted, and the generation ends with ``finish_reason == "budget"``.
            on_budget: "stop" (the above) or "base": the response continues from the base
                model once the budget cannot cover a position's ``t_x`` (``Generation.
                fallback_at``; variant 'b' only; ``docs/accountant.md``, Proposition 3).
            anchor: nats per token c: serve the base-anchored mixture of r and the base
                (``|log q - log b| <= c`` at every token; variant 'b'; Proposition 4).
            anchor_budget: most nats of ``Σ anchor`` (the certificate against the base).

        Every sampling argument but ``top_logprobs`` may be one value or a list with one entry
        per prompt. An unknown keyword is a TypeError; ``sampling`` with keywords a ValueError.
        """
        encoded = inputs.encode_prompts(self.tokenizer, prompts, self.vocab_size)
        params = resolve_sampling(len(encoded), sampling, options)
        gens = [
            Generation("", [], [], [], [], None if p.logprobs is None else [], "length", ids)
            for ids, p in zip(encoded, params, strict=True)
        ]
        texts = [""] * len(gens)
        for ev in decoding.stream(self, encoded, params):
            g = gens[ev.index]
            texts[ev.index] += ev.text_delta
            if ev.prompt is not None:
                g.prompt_logprobs = ev.prompt
                g.fallback_at = None if ev.prompt.fallback_at is None else 0
            if ev.token_id is not None:
                if ev.anchor is not None:
                    if g.anchor is None:
                        g.anchor = []
                    g.anchor.append(float(ev.anchor))
                if ev.fallback and g.fallback_at is None:
                    g.fallback_at = len(g.token_ids)
                g.token_ids.append(ev.token_id)
                g.logprobs.append(float(ev.logprob))  # type: ignore[arg-type]
                g.k_x.append(float(ev.k_x))  # type: ignore[arg-type]
                g.t_x.append(float(ev.t_x))  # type: ignore[arg-type]
                g.cost.append(float(ev.cost))  # type: ignore[arg-type]
                if g.top_logprobs is not None:
                    g.top_logprobs.append(ev.top_logprobs or [])
            if ev.finish_reason is not None:
                g.finish_reason = ev.finish_reason
        for g, text in zip(gens, texts, strict=True):
            g.text = text
        return gens

    def generate_stream(
        self,
        prompts: Prompts,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        **options: Unpack[SamplingOptions],
    ) -> Iterator[StepEvent]:
        """Like :meth:`generate`, but yields a :class:`StepEvent` per generated token as soon as
        it is produced (for the server). Arguments are validated before the first event."""
        encoded = inputs.encode_prompts(self.tokenizer, prompts, self.vocab_size)
        params = resolve_sampling(len(encoded), sampling, options)
        return decoding.stream(self, encoded, params)
