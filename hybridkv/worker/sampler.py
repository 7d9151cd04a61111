"""Token sampling: logits processing, greedy, temperature, min-p, top-k, top-p, per-request
seeds, log-probabilities.

One call, for the rows of one step:

    raw logits [n, vocab] ---> log-probs (of the raw distribution, for rows that ask)
        |
        +-- rows that process logits (copied first, the raw rows stay for the log-probs):
        |     logit_bias -> repetition / frequency / presence penalties -> grammar mask
        v
    greedy rows: argmax          random rows: / temperature -> min_p, top_k, top_p -> race

Sampling uses the exponential-race trick: with E_i ~ Exp(1), argmax_i p_i / E_i is distributed
as p. Requests with a seed draw their noise from their own generator, so a seeded request
samples the same tokens whatever else shares its batch. Rows without any processing (the
common case) pay nothing for the others': each stage runs on the rows that ask for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.ops.registry import OpImpl, declare
from hybridkv.sampling_params import SamplingParams


@dataclass(frozen=True)
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(frozen=True)
class SamplingRow:
    """What sampling one request's row needs: its params, its own generator (seeded requests),
    the tokens the penalties count, and its grammar matcher (structured outputs)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    matcher: Any = None  # hybridkv.structured.GrammarMatcher


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: [n, vocab] scaled logits; top_k: [n] (0 = off); top_p: [n] (1 = off)."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    ranks = torch.arange(vocab, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _filter_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x: [n, vocab] scaled logits; min_p: [n] (0 = off). Drops tokens whose probability is
    below min_p times the most likely token's: log p_i < log min_p + max_j log p_j."""
    logp = torch.log_softmax(x, dim=-1)
    floor = logp.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return x.masked_fill(logp < floor, float("-inf"))


# greedy tokens: one vectorised, parallel pass over float32 rows on the CPU (the first index
# of a tie, as torch.argmax)
ARGMAX = declare(
    "argmax",
    (
        OpImpl(
            "native",
            f"{__name__}:_native_argmax",
            frozenset({"cpu"}),
            frozenset({"float32"}),
            ("native",),
            strict=True,
        ),  # fmt: skip
        OpImpl("torch", f"{__name__}:torch_argmax"),
    ),
)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of [n, vocab] logits, on the CPU: [n] int64."""
    return ARGMAX.of(logits).first(logits)


def _native_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    if logits.shape[-1] == 0:
        return None
    return elementwise.argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).cpu()


def _token_counts(rows: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[len(rows), vocab] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32)
    for j, ids in enumerate(rows):
        if ids:
            t = torch.as_tensor(list(ids), dtype=torch.int64).clamp_(0, vocab - 1)
            counts[j].index_add_(0, t, torch.ones(t.shape[0]))
    return counts


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of [n, vocab] float32 logits: [n] int64 (the declared argmax op)."""
        return _argmax(logits)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> list[Sample]:
        """logits: [n, vocab] float32, one row per sampling request (left unchanged).
        `bitmask`: the grammar rows' masks, filled already (int32 [n, words], row i for logits
        row i; the engine fills them while the forward runs); None: filled here."""
        n = logits.shape[0]
        x = self._process(logits, rows, bitmask)
        tokens = torch.empty(n, dtype=torch.int64)
        params = [r.params for r in rows]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == n:  # all greedy: no row gather
            tokens = _argmax(x)
        elif greedy:
            tokens[greedy] = _argmax(x[greedy])
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(x, rows, random_rows)
        return self._with_logprobs(logits, params, tokens)

    # -- logits processing ---------------------------------------------------------------------

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Logit bias and penalties of rows without a grammar (speculative verification: a
        verify chunk's rows, each with the output it follows)."""
        return self._process(logits, rows, None)

    def _process(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None
    ) -> torch.Tensor:
        """The logits to sample from: a processed copy when any row asks for processing."""
        todo = [i for i, r in enumerate(rows) if r.params.processes_logits]
        if not todo:
            return logits
        x = logits.clone()
        vocab = x.shape[-1]
        for i in todo:
            bias = rows[i].params.logit_bias
            if bias:
                ids = torch.tensor([t for t, _ in bias if t < vocab], dtype=torch.int64)
                vals = torch.tensor([v for t, v in bias if t < vocab], dtype=x.dtype)
                x[i].index_add_(0, ids, vals)
        penalised = [i for i in todo if rows[i].params.has_penalties]
        if penalised:
            x[penalised] = self._penalise(x[penalised], [rows[i] for i in penalised])
        grammar = [i for i in todo if rows[i].matcher is not None]
        if grammar:
            self._mask_grammar(x, rows, grammar, bitmask)
        return x

    @staticmethod
    def _penalise(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """x: [k, vocab] logits of the rows with penalties (OpenAI's and vLLM's formulas)."""
        vocab = x.shape[-1]
        out_counts = _token_counts([r.output_token_ids for r in rows], vocab)
        rep = torch.tensor([r.params.repetition_penalty for r in rows])[:, None]
        if bool((rep != 1).any()):
            seen = _token_counts([r.prompt_token_ids for r in rows], vocab) + out_counts > 0
            scaled = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen, scaled, x)
        freq = torch.tensor([r.params.frequency_penalty for r in rows])[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows])[:, None]
        return x - freq * out_counts - pres * (out_counts > 0).float()

    def _mask_grammar(
        self,
        x: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar: list[int],
        bitmask: torch.Tensor | None,
    ) -> None:
        """Disallowed tokens of each grammar row -> -inf (the structured-outputs mask)."""
        from hybridkv.structured import apply_bitmask

        if bitmask is None:
            bitmask = fill_bitmasks([rows[i].matcher for i in grammar], grammar, *x.shape)
        apply_bitmask(x, bitmask, grammar)

    # -- sampling ------------------------------------------------------------------------------

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow], which: list[int]):
        probs = probabilities(x[which], [rows[i].params for i in which])
        noise = torch.empty_like(probs)
        # One noise row per request: a seeded request draws from its own generator (a loop over
        # requests, not tokens, because each generator is a separate stream).
        for j, i in enumerate(which):
            noise[j].exponential_(generator=rows[i].generator or self.generator)
        return (probs / noise).argmax(dim=-1)

    def _with_logprobs(self, logits, params, tokens: torch.Tensor) -> list[Sample]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return [Sample(int(t)) for t in tokens.tolist()]
        lp = torch.log_softmax(logits[wanted].cpu().float(), dim=-1)
        most = max(params[i].logprobs or 0 for i in wanted)
        top_v, top_i = lp.topk(max(most, 1), dim=-1)
        out = [Sample(int(t)) for t in tokens.tolist()]
        for j, i in enumerate(wanted):
            k = params[i].logprobs or 0
            top = {int(a): float(b) for a, b in zip(top_i[j, :k], top_v[j, :k], strict=True)}
            out[i] = Sample(int(tokens[i]), float(lp[j, tokens[i]]), top)
        return out


def probabilities(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each random row samples from: x [n, vocab] logits (processed), one
    params per row -> [n, vocab] float32 after temperature, min-p, top-k and top-p (what
    speculative decoding's rejection sampling takes as the target's distribution)."""
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    x = x.cpu() / temp[:, None]
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    if bool((min_p > 0).any()):
        x = _filter_min_p(x, min_p)
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        x = _filter_top_k_top_p(x, top_k, top_p)
    return torch.softmax(x, dim=-1)


def fill_bitmasks(matchers: Sequence[Any], rows: Sequence[int], n: int, vocab: int) -> torch.Tensor:
    """A bitmask [n, words] with row rows[j] filled by matchers[j] (grammar matchers); the
    other rows stay zero (unused). Runs in the engine's mask thread during the forward, or
    in the sampler; the matchers are not touched elsewhere meanwhile."""
    from hybridkv.structured import allocate_bitmask

    bitmask = allocate_bitmask(n, vocab)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_bitmask(bitmask, row)
    return bitmask


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[list[float], list[dict[int, float]]]:
    """The log-prob of each target token under its row, and each row's top k.
    logits: [m, vocab] float32; targets: [m] int64 (the prompt token that follows each row)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    if k == 0:
        return chosen, [{} for _ in chosen]
    top_v, top_i = lp.topk(k, dim=-1)
    tops = [
        dict(zip(ids, vals, strict=True))
        for ids, vals in zip(top_i.tolist(), top_v.tolist(), strict=True)
    ]
    return chosen, tops
