"""Speculative decoding: configuration, draft proposers, verification, metrics.

    config.py     `SpeculativeConfig`: the vLLM-spelled `speculative_config`, validated
    ngram.py      prompt-lookup drafts from a request's own tokens (incremental per-request index)
    rejection.py  greedy verification and rejection sampling over a padded batch of drafts
    metrics.py    `SpecDecodeStats`: drafts proposed / accepted, per position, Prometheus families

How a verify step composes with the paged cache and the state layers: docs/speculative-decoding.md.
"""

from hybridkv.spec_decode.config import SpeculativeConfig
from hybridkv.spec_decode.metrics import SpecDecodeStats
from hybridkv.spec_decode.ngram import NgramProposer, propose_ngram
from hybridkv.spec_decode.rejection import (
    VerifyResult,
    greedy_verify,
    pad_drafts,
    rejection_sample,
)

__all__ = [
    "NgramProposer",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "VerifyResult",
    "greedy_verify",
    "pad_drafts",
    "propose_ngram",
    "rejection_sample",
]
