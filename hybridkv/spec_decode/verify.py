"""One step's verification: the logits of every request that carried drafts -> its new tokens.

A request with d drafts has d + 1 logits rows (its last known token's, then each draft's):

    rows     r_0        r_1        ...  r_d
    predict  draft x_1  draft x_2  ...  the token after x_d (the bonus when all are accepted)

Greedy requests keep the drafts that equal the target's argmax, then the target's token at the
first mismatch (`greedy_verify` / `greedy_tokens`: exactly the tokens greedy decoding would
produce from these logits). Requests that sample keep drafts by rejection sampling against
their processed distribution (temperature, min-p, top-k, top-p; `rejection_sample`), with
their own generator when seeded: the output follows the target's distribution. Penalties and
logit bias apply row by row, row j counting the first j drafts as output (`processed_rows`);
log-probs come from each verified token's own row (`logprob_entries`); a grammar masks row j
after the drafts before it, its matcher advanced through them and rolled back
(`grammar_rows`): verification never accepts a token the grammar forbids. So every request
may carry drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.spec_decode.rejection import greedy_verify, rejection_sample
from hybridkv.worker.sampler import Sampler, SamplingRow, probabilities


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


@dataclass(frozen=True)
class Verified:
    """A step's verification: each request's new tokens (accepted drafts, then the target's),
    and the log-prob entries of those tokens for requests that ask for them."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]]


def verify_step(
    logits: torch.Tensor,
    first_rows: Sequence[int],
    rows: dict[str, tuple[int, SamplingRow]],
    drafts: dict[str, Sequence[int]],
    sampler: Sampler,
) -> Verified:
    """logits: the step's [num_rows, vocab]; request r's d + 1 rows start at
    first_rows[rows[r][0]]; rows: request id -> (its index, its SamplingRow); drafts: request
    id -> its d drafts. Greedy requests without logits processing share one argmax; the others
    (penalties, logit bias: applied row by row; random sampling) verify one by one."""

    def rows_of(i: int) -> torch.Tensor:
        return logits[first_rows[i] : first_rows[i + 1]]

    processed = {
        rid: processed_rows(rows_of(i), row, drafts[rid], sampler)
        for rid, (i, row) in rows.items()
        if row.params.processes_logits
    }
    drafts = dict(drafts)
    for rid, (_, row) in rows.items():
        if row.matcher is not None:  # each row masked by the grammar after the drafts before it
            processed[rid], drafts[rid] = grammar_rows(processed[rid], row, drafts[rid])
    tokens: dict[str, list[int]] = {}
    greedy = [rid for rid, (_, row) in rows.items() if row.params.greedy and rid not in processed]
    if greedy:  # one argmax over every greedy verify row, compared on the host
        picked = [
            r
            for rid in greedy
            for r in range(first_rows[rows[rid][0]], first_rows[rows[rid][0] + 1])
        ]
        argmax = sampler.argmax(logits[picked]).tolist()
        at = 0
        for rid in greedy:
            n = len(drafts[rid]) + 1
            tokens[rid] = greedy_tokens(argmax[at : at + n], drafts[rid])
            at += n
    for rid, (i, row) in rows.items():
        if rid not in tokens:
            x = processed.get(rid, rows_of(i))
            tokens[rid] = verify(x, drafts[rid], row, sampler.generator)
    logprobs = {
        rid: logprob_entries(rows_of(i)[: len(tokens[rid])], tokens[rid], row.params.logprobs)
        for rid, (i, row) in rows.items()
        if row.params.logprobs is not None
    }
    return Verified(tokens, logprobs)


def grammar_rows(
    x: torch.Tensor, row: SamplingRow, drafts: Sequence[int]
) -> tuple[torch.Tensor, Sequence[int]]:
    """x: a grammar request's d + 1 processed rows -> the rows masked by its grammar (row j
    after drafts[:j]) and the drafts the grammar allows in a row, n of them (the rows past n
    are dropped: draft n, which the grammar forbids, cannot be accepted, so row n gives the
    last token)."""
    from hybridkv.structured import apply_bitmask

    bitmask, n = row.matcher.draft_masks(drafts)
    x = x[: n + 1].clone()
    apply_bitmask(x, bitmask, range(n + 1))
    return x, drafts[:n]


def processed_rows(
    logits: torch.Tensor, row: SamplingRow, drafts: Sequence[int], sampler: Sampler
) -> torch.Tensor:
    """A verify chunk's rows after logit bias and penalties: row j sees the request's output
    followed by its first j drafts (what decoding would have counted there)."""
    outputs = list(row.output_token_ids)
    per_row = [  # (a grammar masks the rows afterwards, each in its own state: grammar_rows)
        dataclasses.replace(row, output_token_ids=[*outputs, *drafts[:j]], matcher=None)
        for j in range(len(drafts) + 1)
    ]
    return sampler.process(logits, per_row)
