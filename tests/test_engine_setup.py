"""Engine set-up on the CPU: every argument validated when the engine is made, the pool fitted
to max_model_len, backends the machine cannot run refused with one line."""

from __future__ import annotations

import logging

import pytest

from hybridkv import engine as engine_module
from hybridkv.engine import Engine
from hybridkv.entrypoints.llm import LLM
from hybridkv.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "x"}, "seed must be an integer >= 0, got 'x'"),
        ({"seed": 2**64}, "seed must be at most 18446744073709551615"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
        ({"prepack": 1}, "prepack must be True or False"),
        ({"max_model_len": 10**6}, "more than the model's limit of 256 tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"state_backend": "fast"}, "state_backend='fast' is not declared for mamba2 layers"),
        ({"attention_backend": "flashinfer", "dtype": "bfloat16"}, "for planning only"),
    ],
)
def test_bad_arguments_fail_when_the_engine_is_made(tiny_model_dir, kwargs, message):
    kwargs = {"dtype": "float32", **kwargs}
    with pytest.raises(ValueError) as err:
        LLM(str(tiny_model_dir), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_backend_the_machine_cannot_run_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "_capabilities", lambda *a: frozenset())
    with pytest.raises(ValueError, match="'triton' needs triton, which this machine does not"):
        Engine(str(tiny_model_dir), dtype="float32", attention_backend="triton")


def test_sampling_params_out_of_range_fail_before_the_engine():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 18446744073709551615\]"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=2**64 - 1)  # the largest a torch generator takes


def test_a_small_pool_lowers_max_model_len_with_a_warning(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        eng = Engine(str(tiny_model_dir), dtype="float32", num_pages=6, kernel_block_size=16)
    assert "max_model_len lowered from 256" in caplog.text
    assert eng.max_model_len < 256 and eng.scheduler_config.max_model_len == eng.max_model_len
    # whatever is accepted now can finish alone: a request of max_model_len - 1 prompt tokens
    pages = eng.plan.pages_for_one_request(eng.max_model_len, 2048)
    assert pages <= eng.plan.usable_pages
    with pytest.raises(ValueError, match="max_model_len is"):
        eng.add_request([1] * eng.max_model_len)
    out = LLM.__new__(LLM)
    out.engine = eng
    (res,) = out.generate([[1] * (eng.max_model_len - 4)], SamplingParams(max_tokens=8))
    assert res.finish_reason == "length" and len(res.token_ids) == 4


def test_a_pool_too_small_for_any_request_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "MIN_REQUEST_TOKENS", 1000)  # more than 6 pages hold
    with pytest.raises(ValueError, match="cannot hold even a 1000-token request"):
        Engine(str(tiny_model_dir), dtype="float32", num_pages=6, kernel_block_size=16)


def test_plan_only_backends_run_where_they_name_a_runner():
    """A group planned on FlashMLA's layout runs on Triton's MLA kernels (`runs_on`): the
    engine takes it (a bfloat16 MLA model on CUDA plans flashmla by default); a backend
    declared for planning alone is refused with the ones that run."""
    from types import SimpleNamespace

    def plan(backend: str) -> SimpleNamespace:
        return SimpleNamespace(attention_groups=[SimpleNamespace(backend=backend)])

    engine_module._check_runnable(plan("flashmla"))
    engine_module._check_runnable(plan("triton"))
    with pytest.raises(ValueError, match="'flashinfer' is declared for planning only; this "
                       "engine runs: torch, triton"):  # fmt: skip
        engine_module._check_runnable(plan("flashinfer"))
