"""The engine configurations every model family must run token-for-token like transformers.

A family test module defines a module-scoped `checkpoint` fixture, (folder, transformers model),
and imports `family` and `test_greedy_matches_transformers` from here, which runs every case:
allocation page and block; kernel-block ratios 1, 2 and 3; prefix caching on and off with
shared prefixes (one shorter than a page); a second turn whose prompts extend the first turn's
prompts and answers (prefix hits on the state snapshots the first turn left); chunked prefill
split at unaligned positions; a pool so small that requests are preempted and resumed. The
"block", two-turn and preemption cases compare 32 answer tokens per request with
transformers', the other settings the first 16 (`SETTING_TOKENS`). Every case runs on the
native CPU kernels where they build (hybridkv.ops.native); one case runs on the PyTorch ops
instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.layers.linear import native_small_linear

from .utils import (
    engine_greedy,
    engine_prefill_logits,
    max_rel_error,
    prompts,
    reference_greedy,
    reference_logits,
)

NEW_TOKENS = 32
# What a cache-setting case generates: the settings differ in where tokens are stored and
# found, which the prompts (2 to 64 tokens, shared prefixes, chunks of 13) and the first 16
# answer tokens already cross (kernel blocks of 4 to 48 tokens, pages of 32 and 48); the
# decode arithmetic of the remaining 16 tokens is the "block" case's. The reference's first
# SETTING_TOKENS tokens are compared (a token flip can only come from a bug, see MIN_MARGIN).
SETTING_TOKENS = 16
# The smallest top-2 logit gap along the reference tokens must dwarf float32 noise: hybridkv and
# transformers differ by at most ~2e-6 in the logits of these float32 models, so with a gap of
# 1e-4 or more a token flip can only come from a bug.
MIN_MARGIN = 1e-4
LENGTHS = [5, 17, 33, 48, 9, 64, 2, 40]
TURNS = 4  # conversations continued in a second turn


@dataclass(frozen=True)
class Case:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    shared_prefix: bool = False  # run a first round, then prompts that share its prefixes
    multi_turn: bool = False  # a first turn, then prompts = its prompt + answer + more
    expect_preemption: bool = False
    env: dict[str, str] = field(default_factory=dict)  # environment for the engine run
    new_tokens: int = SETTING_TOKENS  # answer tokens per request, compared to the reference's


CASES = [
    Case("block", new_tokens=NEW_TOKENS),
    Case("page", {"allocation": "page"}),
    Case("ratio1", {"page_tokens": 48, "kernel_block_size": 48}),
    Case("ratio2", {"page_tokens": 48, "kernel_block_size": 24}),
    Case("ratio3", {"page_tokens": 48, "kernel_block_size": 16}),
    Case("prefix-block", {"kernel_block_size": 4}, shared_prefix=True),
    Case("prefix-page", {"allocation": "page"}, shared_prefix=True),
    Case("no-prefix-cache", {"enable_prefix_caching": False}, shared_prefix=True),
    # (the second turn extends the first turn's prompts by their whole reference answers)
    Case("multi-turn", {"kernel_block_size": 4}, multi_turn=True, new_tokens=NEW_TOKENS),
    Case(
        "multi-turn-page",
        {"allocation": "page", "page_tokens": 32},
        multi_turn=True,
        new_tokens=NEW_TOKENS,
    ),
    Case("chunked", {"max_num_batched_tokens": 13, "kernel_block_size": 8}),
    # (a pool of 14 pages is small enough to preempt every family's 32-token answers, and big
    # enough to hold each 64-token prompt's request)
    Case(
        "preempt",
        {"num_pages": 14, "kernel_block_size": 8},
        expect_preemption=True,
        new_tokens=NEW_TOKENS,
    ),
    Case(
        "torch-ops-chunked",
        {"max_num_batched_tokens": 13, "kernel_block_size": 8},
        env={"HYBRIDKV_NATIVE": "0"},
    ),
]


@dataclass
class Family:
    folder: Path
    vocab: int
    plain: list[list[int]]
    plain_ref: list[list[int]]
    shared: list[list[int]]
    shared_ref: list[list[int]]
    turns: list[list[int]]  # second-turn prompts: plain[i] + plain_ref[i] + new tokens
    turn_ref: list[list[int]]


_REFERENCES: dict[str, dict[str, Any]] = {}  # this process's, by `_reference_key`
# where the workers of a pytest-xdist run share them (tests/conftest.py sets it under the run's
# temporary folder); None: this process's dict only
SHARED_REFERENCES: Path | None = None


def _reference_key(folder: Path, vocab: int) -> str:
    """The saved checkpoint's bytes (config and weights) and how the references are made."""
    key = hashlib.sha256(repr((vocab, LENGTHS, NEW_TOKENS, TURNS)).encode())
    for path in sorted(folder.iterdir()):
        if path.is_file():
            key.update(path.name.encode() + path.read_bytes())
    return key.hexdigest()[:32]


def _references(folder: Path, hf_model, vocab: int, plain, shared) -> dict[str, Any]:
    """transformers' greedy tokens for the family's prompts, computed once per checkpoint and
    test run: several modules build the same seeded checkpoint (a family's tests, its
    speculation and tensor-parallel tests), and the reference of one (Kimi-Linear: ~8 s) is
    most of its set-up."""
    key = _reference_key(folder, vocab)
    stored = None if SHARED_REFERENCES is None else SHARED_REFERENCES / f"{key}.json"
    if key not in _REFERENCES and stored is not None and stored.is_file():
        _REFERENCES[key] = json.loads(stored.read_text())
    if key not in _REFERENCES:
        # the plain and shared prompts in one batch: one forward per token serves both
        both, m12 = reference_greedy(hf_model, plain + shared, NEW_TOKENS)
        plain_ref, shared_ref = both[: len(plain)], both[len(plain) :]
        more = prompts(vocab, [5, 9, 3, 6], seed=7)
        turns = [plain[i] + plain_ref[i] + more[i] for i in range(TURNS)]
        turn_ref, m3 = reference_greedy(hf_model, turns, NEW_TOKENS)
        _REFERENCES[key] = {"plain_ref": plain_ref, "shared_ref": shared_ref, "turns": turns,
                            "turn_ref": turn_ref, "margin": min(m12, m3)}  # fmt: skip
        if stored is not None:  # written whole, then renamed: a reader never sees a part
            stored.parent.mkdir(parents=True, exist_ok=True)
            partial = stored.with_suffix(f".{os.getpid()}.part")
            partial.write_text(json.dumps(_REFERENCES[key]))
            partial.replace(stored)
    return _REFERENCES[key]


def make_family(folder: Path, hf_model, vocab: int) -> Family:
    plain = prompts(vocab, LENGTHS, seed=1)
    # 20 shared tokens: shorter than any page the tiny models get (>= 32 tokens)
    shared = prompts(vocab, [24, 30, 45, 21, 60, 33, 26, 52], seed=2, shared=20)
    ref = _references(folder, hf_model, vocab, plain, shared)
    margin = ref["margin"]
    assert margin > MIN_MARGIN, f"random weights too flat to compare (margin {margin})"
    return Family(folder, vocab, plain, ref["plain_ref"], shared, ref["shared_ref"],
                  ref["turns"], ref["turn_ref"])  # fmt: skip


def check_case(family: Family, case: Case, **engine_kwargs: Any) -> None:
    """One conformance case; `engine_kwargs` override the case's (tensor_parallel_size=2 runs
    it over two ranks, which are stopped at the end whatever happens)."""
    engine = Engine(str(family.folder), dtype="float32", **{**case.kwargs, **engine_kwargs})
    try:
        if case.expect_preemption and not engine.plan.attention_groups:
            engine.shutdown()
            check_small_state_pool(family, case, len(engine.plan.groups), **engine_kwargs)
            return
        _check_engine(family, case, engine)
    finally:
        engine.shutdown()


def _check_engine(family: Family, case: Case, engine: Engine) -> None:
    n = case.new_tokens
    if case.shared_prefix:
        first = engine_greedy(engine, family.shared[:3], n)
        assert first == _first(family.shared_ref[:3], n)
        got = engine_greedy(engine, family.shared, n)
        assert got == _first(family.shared_ref, n)
        if engine.cache_config.enable_prefix_caching and case.kwargs.get("allocation") != "page":
            assert engine.cache.stats.hit_tokens > 0, "the prefix cache was never hit"
        if not engine.cache_config.enable_prefix_caching:
            assert engine.cache.stats.hit_tokens == 0
    elif case.multi_turn:
        assert n == NEW_TOKENS, "the second turn extends the whole first-turn answers"
        assert engine_greedy(engine, family.plain[:TURNS], n) == family.plain_ref[:TURNS]
        hits = engine.cache.stats.hit_tokens
        assert engine_greedy(engine, family.turns, n) == family.turn_ref
        # every turn hit at least its first prompt: blocks, and the first turn's final rolling
        # state snapshots where the model has state groups
        assert engine.cache.stats.hit_tokens - hits >= sum(map(len, family.plain[:TURNS]))
    else:
        got = engine_greedy(engine, family.plain, n)
        assert got == _first(family.plain_ref, n)
    if case.expect_preemption:
        assert engine.scheduler.num_preemptions > 0, "the small pool never preempted"


def _first(answers: list[list[int]], n: int) -> list[list[int]]:
    return [a[:n] for a in answers]


def check_small_state_pool(
    family: Family, case: Case, num_groups: int, **engine_kwargs: Any
) -> None:
    """A model without attention holds one fixed page per request and state group (snapshots
    are optional), so nothing grows and nothing is preempted: a pool with room for three
    requests runs them three at a time, the others wait, and every answer stays the same."""
    kwargs = {**case.kwargs, **engine_kwargs, "num_pages": 3 * num_groups + 1}
    engine = Engine(str(family.folder), dtype="float32", **kwargs)
    peak = 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal peak
        out = schedule()
        peak = max(peak, len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = counting_schedule
    n = case.new_tokens
    assert engine_greedy(engine, family.plain, n) == _first(family.plain_ref, n)
    assert peak == 3, f"expected 3 requests at once in a pool of 3 states, saw {peak}"
    assert engine.scheduler.num_preemptions == 0


def check_prefill_logits(folder: Path, hf_model, length: int = 37) -> Engine:
    """Prefill logits at every position within 1e-4 relative of transformers'; returns the
    engine for family-specific checks."""
    engine = Engine(str(folder), dtype="float32", kernel_block_size=4, enable_prefix_caching=False)
    ids = prompts(hf_model.config.vocab_size, [length])[0]
    ours, ref = engine_prefill_logits(engine, ids), reference_logits(hf_model, ids)
    assert max_rel_error(ours, ref) <= 1e-4
    return engine


@pytest.fixture(scope="module")
def family(checkpoint) -> Family:
    folder, hf = checkpoint
    return make_family(folder, hf, hf.config.vocab_size)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_matches_transformers(family: Family, case: Case, monkeypatch) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    check_case(family, case)


@pytest.mark.parametrize("blocks_per_page", [1, 2, 3])
def test_kernel_blocks_of_64(family: Family, blocks_per_page: int) -> None:
    """Kernel blocks of 64 tokens (the size FlashMLA takes) with pages of one, two and three of
    them, on this machine's backend: the prompts and answers span several kernel blocks."""
    engine = Engine(
        str(family.folder), dtype="float32", kernel_block_size=64, page_tokens=64 * blocks_per_page
    )
    groups = engine.plan.attention_groups
    assert {(g.kernel_block_size, g.blocks_per_page) for g in groups} == {(64, blocks_per_page)}
    new = NEW_TOKENS // 2
    assert engine_greedy(engine, family.plain, new) == [t[:new] for t in family.plain_ref]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_decode_equals_eager(family: Family, dtype: str, request) -> None:
    """Decode steps replayed from their capture (hybridkv.worker.graphs) compute the eager
    steps' numbers: the same tokens and log-probabilities, bit for bit, as the batch shrinks
    from 4 requests to 1 (each size: an eager step, its capture, a replay at least), in
    float32 and bfloat16. Checkpoints named in their module's CAPTURED (float32) and
    CAPTURED_BF16 (bfloat16) must capture; the others must equal their eager steps too."""
    from hybridkv import LLM, SamplingParams

    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0, logprobs=1, ignore_eos=True)
        for i in range(4)
    ]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(family.folder), dtype=dtype, enforce_eager=eager)
        outs = llm.generate(family.plain[:4], params)
        runs[eager] = [(o.token_ids, o.logprobs) for o in outs]
        graphs = llm.engine.runner.graphs
    assert runs[False] == runs[True]
    checkpoint = request.node.callspec.params.get("checkpoint")
    listed = "CAPTURED" if dtype == "float32" else "CAPTURED_BF16"
    captured = checkpoint is not None and checkpoint in getattr(request.module, listed, ())
    # (a build without AVX-512 has no native small-batch linears: every step stays eager)
    if captured and native_small_linear(getattr(torch, dtype)):
        assert graphs.disabled is None, graphs.disabled
        assert graphs.replays > 0
