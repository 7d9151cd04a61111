"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities.

Sampling uses the exponential-race trick: with E_i ~ Exp(1), argmax_i p_i / E_i is distributed
as p. Requests with a seed draw their noise from their own generator, so a seeded request
samples the same tokens whatever else shares its batch. Log-probabilities are those of the
model's distribution (log_softmax of the raw logits, before temperature and filters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.ops import native
from hybridkv.sampling_params import SamplingParams


@dataclass(frozen=True)
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of [n, vocab] logits, on the CPU."""
    tokens = native.argmax_rows(logits)  # float32 on the CPU
    return tokens if tokens is not None else logits.argmax(dim=-1).cpu()


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[Sample]:
        """logits: [n, vocab] float32, one row per sampling request."""
        n = logits.shape[0]
        tokens = torch.empty(n, dtype=torch.int64)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == n:  # all greedy: no row gather
            tokens = _argmax(logits)
        elif greedy:
            tokens[greedy] = _argmax(logits[greedy])
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits, params, generators, random_rows)
        return self._with_logprobs(logits, params, tokens)

    def _sample(self, logits, params, generators, rows: list[int]) -> torch.Tensor:
        sub = [params[i] for i in rows]
        temp = torch.tensor([p.temperature for p in sub], dtype=torch.float32)
        x = logits[rows].cpu() / temp[:, None]
        top_k = torch.tensor([p.top_k for p in sub])
        top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            x = _filter_top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        # One noise row per request: a seeded request draws from its own generator (a loop over
        # requests, not tokens, because each generator is a separate stream).
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=generators[i] or self.generator)
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
