"""Tensor parallelism under the cache settings, once per kind of cache the families hold: TP=2
gives transformers' greedy tokens in page mode with a second round that extends the first
round's prompts and answers (prefix hits on kernel blocks and state snapshots), and in a pool
small enough to preempt. test_tensor_parallel.py runs every setting on Granite (Mamba2 +
attention); here each other state or attention kind gets the same two settings:

    gated delta net + gated attention   Qwen3-Next
    Mamba1 + attention (1 KV head)      Jamba
    short conv + attention              LFM2
    KDA + MLA latents                   Kimi-Linear
    MLA latents with RoPE               DeepSeek-V3
    sliding + full attention, sinks     gpt-oss
    Mamba2 (2 groups) + attention       Nemotron-H

Block mode and chunked prefill are in the family tests of the two other files."""

from __future__ import annotations

import pytest

from tests.distributed import test_tensor_parallel as dense
from tests.distributed import test_tp_mla as mla
from tests.distributed import test_tp_state_families as state
from tests.models.conformance import CASES, check_case, make_family

FAMILIES = {
    "qwen3_next": dense.qwen3_next_checkpoint,
    "jamba": state.jamba,
    "lfm2": state.lfm2,
    "kimi_linear": mla.kimi_linear,
    "deepseek_v3": mla.deepseek_v3,
    "gpt_oss": dense.gpt_oss_checkpoint,
    "nemotron_h": dense.nemotron_h_checkpoint,
}
SETTINGS = {case.name: case for case in CASES if case.name in ("multi-turn-page", "preempt")}


one_thread = state.one_thread  # one intra-op thread per process (autouse)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder, hf = FAMILIES[request.param](tmp_path_factory)
    return make_family(folder, hf, hf.config.vocab_size)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tp2_under_cache_setting(family, setting: str) -> None:
    check_case(family, SETTINGS[setting], tensor_parallel_size=2)
