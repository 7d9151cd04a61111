"""One step's verification: the logits of every request that carried drafts -> its new tokens.

A request with d drafts has d + 1 logits rows (its last known token's, then each draft's):

    rows     r_0        r_1        ...  r_d
    predict  draft x_1  draft x_2  ...  the token after x_d (the bonus when all are accepted)

Greedy requests keep the drafts that equal the target's argmax, then the target's token at the
first mismatch (`greedy_verify`: exactly the tokens greedy decoding would produce from these
logits). Requests that sample keep drafts by rejection sampling against their processed
distribution (temperature, min-p, top-k, top-p; `rejection_sample`), with their own generator
when seeded: the output follows the target's distribution. Only requests whose sampling reads
nothing but the logits carry drafts (no penalties, logit bias, grammar or log-probs: the
engine's `speculable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.sampling_params import SamplingParams
from hybridkv.spec_decode.rejection import greedy_verify, rejection_sample
from hybridkv.worker.sampler import SamplingRow, probabilities


def speculable(params: SamplingParams, has_matcher: bool) -> bool:
    """Whether a request may carry drafts: any without a grammar (its matcher would have to
    advance through the drafts and roll back). Penalties and logit bias apply row by row with
    the drafts before each row counted (the engine's `_processed_rows`); log-probs come from
    each verified token's own row (`logprob_entries`)."""
    del params  # every sampling parameter but the grammar is verified row by row
    return not has_matcher


def logprob_entries(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[dict[int, float]]:
    """logits: [n, vocab] the rows that chose `tokens` (row j chose token j) -> per token its
    top-k log-probs and its own, as the sampler gives a sampled token's (raw distribution)."""
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    entries = []
    top_v, top_i = lp.topk(max(k, 1), dim=-1)
    for j, token in enumerate(tokens):
        entry = {int(a): float(b) for a, b in zip(top_i[j, :k], top_v[j, :k], strict=True)}
        entry[int(token)] = float(lp[j, token])
        entries.append(entry)
    return entries


def greedy_tokens(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """target: the argmax of a request's d + 1 rows, drafts: its d drafts -> the drafts equal
    to the target's token at their position, then the target's token at the first mismatch
    (what `greedy_verify` gives, on host lists: no tensors for one request's few tokens)."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return [*drafts[:a], target[a]]


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    row: SamplingRow,
    generator: torch.Generator,
) -> list[int]:
    """logits: [d + 1, vocab] float32 of one request, drafts: its d drafts -> its new tokens
    (the accepted drafts, then one token from the target)."""
    d = len(drafts)
    assert logits.shape[0] == d + 1, (logits.shape, d)
    draft_tokens = torch.tensor([list(drafts)], dtype=torch.int64)
    num_drafts = torch.tensor([d], dtype=torch.int64)
    if row.params.greedy:
        target = logits.argmax(dim=-1).cpu()[None]  # [1, d + 1]
        result = greedy_verify(target, draft_tokens, num_drafts)
    else:
        probs = probabilities(logits, [row.params] * (d + 1))[None]  # [1, d + 1, vocab]
        result = rejection_sample(
            probs, draft_tokens, num_drafts, generators=[row.generator], generator=generator
        )
    return result.token_lists()[0]
