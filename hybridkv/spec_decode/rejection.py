"""Verification of drafts: which drafts a verify pass accepts, and the token that follows them.

A verify pass feeds each request its last sampled token and its d <= k drafts (d + 1 positions)
and yields the target's distribution p_i at every position i = 0 .. d: p_i predicts the token
after draft i - 1 (p_0 predicts the first draft). Requests are batched with their drafts padded
to k: `draft_tokens` [n, k] (entries past `num_drafts[r]` are ignored), target rows [n, k + 1].

Greedy (temperature 0), exact: draft i is accepted while it equals the target's argmax at i;
the output is the accepted drafts plus the target's argmax at the first mismatch (a correction)
or after the last draft (a bonus). Accepted drafts equal the argmaxes they were compared with,
so the output is simply argmax[0 .. a]: token for token what decoding without drafts gives.

Rejection sampling (temperature > 0; Leviathan et al. 2023, Chen et al. 2023): draft x_i, drawn
from a draft distribution q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection the output token is drawn from normalize(max(p_i - q_i, 0)); after d accepted
drafts a bonus token is drawn from p_d. Every output token is then distributed exactly as
sampling from the target alone. Drafts that are not sampled (ngram copies, argmax drafts of an
MTP head) are a point mass q_i = onehot(x_i): accept with probability p_i(x_i), on rejection
draw from p_i with x_i removed and renormalised (`draft_probs=None`). A greedy request is the
limit p_i = onehot(argmax), for which both rules agree.

Randomness: per request, d uniforms then one row of `vocab` exponentials (the categorical draw
is the exponential race argmax p / E, E ~ Exp(1), as `hybridkv.worker.sampler` samples), from
the request's own `torch.Generator` when it has one: a seeded request gets the same result
whatever else shares its batch. Requests without one share `generator` (drawn in one call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD = -1  # token id of the unused entries of `VerifyResult.tokens`


@dataclass(frozen=True)
class VerifyResult:
    """num_accepted: [n] int64, drafts accepted (0 .. num_drafts[r]); tokens: [n, k + 1] int64,
    row r = its accepted drafts then the target's token, PAD after (num_accepted[r] + 1 used)."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor

    @property
    def num_tokens(self) -> torch.Tensor:
        """[n] int64: the tokens each request gains from the step (accepted + 1)."""
        return self.num_accepted + 1

    def token_lists(self) -> list[list[int]]:
        """Each request's new tokens as a list (what the scheduler appends)."""
        counts = self.num_tokens.tolist()
        return [row[:c] for row, c in zip(self.tokens.tolist(), counts, strict=True)]


def _check(draft_tokens: torch.Tensor, num_drafts: torch.Tensor, n: int, k: int) -> None:
    if draft_tokens.shape != (n, k):
        raise ValueError(f"draft_tokens must be [{n}, {k}], got {list(draft_tokens.shape)}")
    if num_drafts.shape != (n,):
        raise ValueError(f"num_drafts must be [{n}], got {list(num_drafts.shape)}")
    if n and (int(num_drafts.min()) < 0 or int(num_drafts.max()) > k):
        raise ValueError(f"num_drafts must lie in 0..{k}, got {num_drafts.tolist()}")


def _leading_run(ok: torch.Tensor) -> torch.Tensor:
    """ok: [n, k] bool -> [n] int64, the number of leading True entries of each row."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """[n, k + 1]: the accepted drafts, `last` ([n]) at column num_accepted, PAD after."""
    n, k = draft_tokens.shape
    tokens = torch.full((n, k + 1), PAD, dtype=torch.int64, device=draft_tokens.device)
    cols = torch.arange(k, device=draft_tokens.device)
    tokens[:, :k] = torch.where(cols < num_accepted[:, None], draft_tokens.to(torch.int64), PAD)
    tokens[torch.arange(n, device=tokens.device), num_accepted] = last.to(torch.int64)
    return tokens


def greedy_verify(
    target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
) -> VerifyResult:
    """target_tokens: [n, k + 1] the target's argmax at each position; draft_tokens: [n, k];
    num_drafts: [n] -> the drafts accepted and the output tokens (module docstring)."""
    n, k1 = target_tokens.shape
    k = k1 - 1
    _check(draft_tokens, num_drafts, n, k)
    cols = torch.arange(k, device=target_tokens.device)
    match = (draft_tokens == target_tokens[:, :k]) & (cols < num_drafts[:, None])  # [n, k]
    num_accepted = _leading_run(match)  # [n]
    last = target_tokens[torch.arange(n, device=target_tokens.device), num_accepted]  # [n]
    return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, last))


def _uniforms(
    num_drafts: torch.Tensor,
    k: int,
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[n, k] float32 in [0, 1): row r's first num_drafts[r] from its own generator if it has
    one (exactly that many draws), the shared rows from `generator` in one call."""
    n = num_drafts.shape[0]
    u = torch.ones(n, k)  # entries past num_drafts are never used (1.0 accepts nothing)
    shared = [r for r in range(n) if generators[r] is None]
    if shared and k:
        u[shared] = torch.rand(len(shared), k, generator=generator)
    for r, g in enumerate(generators):
        d = int(num_drafts[r])
        if g is not None and d:
            u[r, :d] = torch.rand(d, generator=g)
    return u


def _categorical(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One draw per row of probs [n, V] (rows sum to 1) by the exponential race -> [n] int64."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    shared = [r for r in range(probs.shape[0]) if generators[r] is None]
    if shared:
        rows = torch.empty(len(shared), probs.shape[1])
        rows.exponential_(generator=generator)
        noise[shared] = rows
    for r, g in enumerate(generators):
        if g is not None:
            noise[r].exponential_(generator=g)
    return (probs.float() / noise).argmax(dim=-1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Rejection sampling of a batch (module docstring), on the CPU.

    target_probs: [n, k + 1, V] the target's sampling distribution at each position (after
    temperature, top-k, top-p, min-p: whatever the request samples from); draft_tokens: [n, k]
    int64; num_drafts: [n] int64; draft_probs: [n, k, V] the distribution each draft was drawn
    from, or None for point-mass drafts; generators: per request (None entries, or None for
    all: the shared `generator`, torch's default when None)."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    _check(draft_tokens, num_drafts, n, k)
    if draft_probs is not None and draft_probs.shape != (n, k, vocab):
        raise ValueError(f"draft_probs must be [{n}, {k}, {vocab}], got {list(draft_probs.shape)}")
    gens: Sequence[torch.Generator | None] = generators if generators is not None else [None] * n
    if len(gens) != n:
        raise ValueError(f"{len(gens)} generators for {n} requests")
    draft_tokens = draft_tokens.to(torch.int64)
    rows = torch.arange(n)
    cols = torch.arange(k)
    # accept draft i when u_i * q_i(x_i) < p_i(x_i): probability min(1, p / q), no division
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0].float()  # [n, k]
    u = _uniforms(num_drafts, k, gens, generator)  # [n, k]
    if draft_probs is None:
        accept = u < p_x
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0].float()  # [n, k]
        accept = u * q_x < p_x
    num_accepted = _leading_run(accept & (cols < num_drafts[:, None]))  # [n]
    # the distribution of the last token: residual at the first rejection, else p_d (bonus)
    p_last = target_probs[rows, num_accepted].float()  # [n, V]
    rejected = num_accepted < num_drafts  # [n]
    at = num_accepted.clamp(max=max(k - 1, 0))  # the rejected draft's column (if any)
    if k == 0:
        residual = p_last
    else:
        if draft_probs is None:  # q = onehot(x): p with x removed
            q_last = torch.zeros_like(p_last)
            q_last[rows, draft_tokens[rows, at]] = 1.0
        else:
            q_last = draft_probs[rows, at].float()  # [n, V]
        residual = torch.where(rejected[:, None], (p_last - q_last).clamp(min=0.0), p_last)
        total = residual.sum(dim=-1, keepdim=True)
        # total is 0 only when p == q at a rejected position, which has probability 0; fall
        # back to p there rather than divide by zero
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_last)
    last = _categorical(residual, gens, generator)  # [n]
    return VerifyResult(num_accepted, _assemble(draft_tokens, num_accepted, last))


def pad_drafts(drafts: Sequence[Sequence[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts of several requests (lists of <= k tokens) -> (draft_tokens [n, k] int64 padded
    with 0, num_drafts [n] int64), the layout the functions above take."""
    n = len(drafts)
    tokens = torch.zeros(n, k, dtype=torch.int64)
    lengths = torch.zeros(n, dtype=torch.int64)
    for r, d in enumerate(drafts):
        if len(d) > k:
            raise ValueError(f"request {r} has {len(d)} drafts, more than k = {k}")
        if d:
            tokens[r, : len(d)] = torch.as_tensor(list(d), dtype=torch.int64)
        lengths[r] = len(d)
    return tokens, lengths
