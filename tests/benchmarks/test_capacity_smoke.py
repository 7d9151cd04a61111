"""`benchmarks/capacity.py --quick` runs, prints every row and keeps its promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "capacity.py"
KEYS = {
    "model",
    "workload",
    "mode",
    "peak_concurrency",
    "unused_pinned_tokens_per_request",
    "hit_rate",
    "snapshot_pages",
    "manager_us_per_request_step",
}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def test_quick_capacity_run(capsys):
    """Every row of `--quick`, in this process (the default runs each model in a fresh
    process for its timings, which this test does not read: that path is the next test's)."""
    module = _module("capacity_bench")
    assert module.main(["--quick", "--json", "--in-process"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["model"], r["workload"], r["mode"]) for r in rows} == {
        (m, w, mode) for m in module.QUICK_MODELS for w in module.WORKLOADS for mode in module.MODES
    }
    assert all(set(r) >= KEYS for r in rows)
    by = {(r["model"], r["workload"], r["mode"]): r for r in rows}
    hybrid = "ibm-granite/granite-4.0-h-small"
    for workload in module.WORKLOADS:
        page, block = by[(hybrid, workload, "page")], by[(hybrid, workload, "block")]
        assert block["peak_concurrency"] >= page["peak_concurrency"]
        # block mode pins less than one kernel block (16 tokens) per attention group
        assert block["unused_pinned_tokens_per_request"] < 16
    assert by[(hybrid, "multi_turn", "block")]["hit_rate"] > 0.8
    assert by[(hybrid, "multi_turn", "page")]["hit_rate"] < 0.7
    # a pure state model (no attention) still hits the prefix cache, on state snapshots
    mamba = "mistralai/Mamba-Codestral-7B-v0.1"
    assert by[(mamba, "multi_turn", "block")]["hit_rate"] > 0.5
    assert by[(mamba, "short_chat", "block")]["unused_pinned_tokens_per_request"] == 0


def test_a_model_in_its_own_process_gives_the_in_process_rows(capsys):
    """The default run: each model replayed by a fresh Python process (`run_isolated`); its
    rows are the in-process rows but for the manager's timing."""
    module = _module("capacity_bench_isolated")
    argv = ["--quick", "--json", "--models", "mistralai/Mamba-Codestral-7B-v0.1",
            "--workloads", "short_chat"]  # fmt: skip
    assert module.main(argv) == 0
    isolated = json.loads(capsys.readouterr().out)
    assert module.main([*argv, "--in-process"]) == 0
    here = json.loads(capsys.readouterr().out)
    timing = "manager_us_per_request_step"
    assert len(isolated) == len(module.MODES) and all(r[timing] > 0 for r in isolated)
    assert [{**r, timing: 0} for r in isolated] == [{**r, timing: 0} for r in here]


def test_speculative_replay_keeps_hits_and_snapshots():
    """`--speculative`: the same requests with drafts verified (some rejected: state rewinds
    on the hybrid) hit the same prefix tokens and take the same snapshots as without."""
    spec = importlib.util.spec_from_file_location("capacity_bench_spec", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for model in ("ibm-granite/granite-4.0-h-small", "meta-llama/Llama-3.1-8B"):
        plain, drafted = (
            module.replay(model, "multi_turn", "block", 0, module.QUICK, k) for k in (0, 4)
        )
        assert 0.3 < drafted["accept"] < 0.9, drafted["accept"]
        for key in ("hit_rate", "snapshots_taken", "snapshot_pages", "preemptions"):
            assert drafted[key] == plain[key], (model, key, plain[key], drafted[key])
        assert plain["hit_rate"] > 0.5
