import json
import subprocess
import sys

import pytest

from hybridkv.entrypoints.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_text_table(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "ibm-granite/granite-4.0-h-small", "--backend", "flashinfer"
    )
    assert code == 0
    assert "page_tokens         528" in out
    assert "padding 14,848 B (0.69%)" in out
    row = next(line for line in out.splitlines() if line.split()[1:2] == ["attention"])
    assert row.split()[1:7] == ["attention", "4", "flashinfer", "528", "16", "33"]


def test_plan_json(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "--backend",
        "flashinfer",
        "--memory",
        "40GiB",
        "--json",
    )
    assert code == 0
    j = json.loads(out)
    assert (j["page_tokens"], j["layers_per_group"]) == (544, 12)
    attn = [g for g in j["groups"] if g["kind"] == "attention"]
    assert [(g["kernel_block_size"], g["blocks_per_page"]) for g in attn] == [(32, 17)]
    assert {g["kind"] for g in j["groups"]} == {"attention", "gated_delta_net"}
    assert j["num_pages"] == 40 * 2**30 // (j["page_bytes"] * 12)


def test_plan_num_pages_and_options(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        "--num-pages",
        "100",
        "--platform",
        "cpu",
        "--kernel-block-size",
        "96",
        "--json",
    )
    j = json.loads(out)
    assert code == 0 and j["num_pages"] == 100 and j["platform"] == "cpu"
    assert [g["kernel_block_size"] for g in j["groups"] if g["kind"] == "attention"] == [96]


def test_plan_of_a_folder(tmp_path, capsys):
    from hybridkv.kv.presets import load_preset

    (tmp_path / "config.json").write_text(json.dumps(load_preset("ai21labs/Jamba-v0.1")))
    code, out, _ = run(capsys, "plan", "--model", str(tmp_path), "--json")
    assert code == 0 and {g["kind"] for g in json.loads(out)["groups"]} == {"attention", "mamba1"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope/nope"], "neither a folder"),
        (["--kernel-block-size", "48", "--backend", "flashinfer"], "kernel_block_size=48"),
        (["--kernel-block-size", "100"], "does not divide page_tokens=528"),
        (["--page-tokens", "64"], "page_tokens=64 is too small"),
        (["--memory", "1MiB"], "memory budget"),
        (["--memory", "lots"], "cannot read memory size 'lots'"),
        (["--backend", "warp"], "unknown attention backend 'warp'"),
        (["--platform", "tpu"], "unknown platform 'tpu'"),
        (["--kv-cache-dtype", "int4"], "unknown dtype 'int4'"),
        (["--page-tokens", "0"], "page_tokens must be a positive integer"),
    ],
)
def test_plan_errors_are_one_line_exit_2(capsys, argv, message):
    if "--model" not in argv:
        argv = ["--model", "ibm-granite/granite-4.0-h-small", *argv]
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_config(tmp_path, capsys):
    # a runnable family takes transformers' defaults for what its config leaves out ...
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    code, out, _ = run(capsys, "plan", "--model", str(tmp_path), "--json")
    groups = json.loads(out)["groups"]
    assert code == 0 and sum(len(g["layers"]) for g in groups) == 32  # LlamaConfig's default
    assert groups[0]["spec"]["num_kv_heads"] == 32 and groups[0]["spec"]["head_dim"] == 128
    # ... but a value of the wrong type is a one-line error
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": "many"}'
    )
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "'num_hidden_layers' must be int" in err and err.count("\n") == 1
    # a runnable family's typed config refuses what transformers' model cannot run
    (tmp_path / "config.json").write_text(
        '{"architectures": ["KimiLinearForCausalLM"], "num_key_value_heads": 8}'
    )
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "more than half of num_attention_heads" in err
    assert err.count("\n") == 1
    (tmp_path / "config.json").write_text("[1, 2")
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "cannot read" in err


def test_console_script_exit_code_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.entrypoints.cli", "plan", "--model", "x/y"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("hybridkv plan: error:") and "Traceback" not in proc.stderr


def test_plan_defaults_to_the_built_in_model(capsys):
    code, out, _ = run(capsys, "plan", "--json", "--platform", "cpu")
    j = json.loads(out)
    assert code == 0 and j["model"] == "the built-in default model"
    assert j["architecture"] == "GraniteMoeHybridForCausalLM"
    assert {g["kind"] for g in j["groups"]} == {"attention", "mamba2"}


def test_cpu_plan_prints_the_cpu_record_and_the_chosen_ops(capsys):
    from hybridkv.ops import registry
    from hybridkv.ops.native import cpu

    code, out, _ = run(capsys, "plan", "--platform", "cpu", "--dtype", "bfloat16")
    assert code == 0
    assert cpu.line() in out
    rows = {
        tuple(line.split()[:2]): " ".join(line.split()[2:])
        for line in out.split(cpu.line())[1].splitlines()
        if len(line.split()) >= 3
    }
    for name, dtype, text in registry.table("cpu", ["bfloat16"]):
        assert rows[(name, dtype)] == text
    code, out, _ = run(capsys, "plan", "--platform", "cpu", "--json")
    data = json.loads(out)
    assert data["cpu"] == cpu.line()
    assert {r["op"] for r in data["ops"]} == set(registry.FAMILIES)
    code, out, _ = run(capsys, "plan")  # a CUDA plan says nothing of this CPU
    assert "CPU:" not in out


def test_plan_with_mtp_layers(capsys):
    """--speculative-config with method 'mtp' plans the MTP layers' cache too: Qwen3-Next's
    gated attention MTP layer joins the attention bucket (13 layers), DeepSeek-V3's MLA one
    the MLA group; a model without MTP layers is a one-line error (exit 2)."""
    spec = '{"method": "mtp"}'
    for model, key, without, with_mtp, mtp_index in (
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "attention", 12, 13, 48),
        ("deepseek-ai/DeepSeek-V3", "mla", 61, 62, 61),
    ):
        plans = []
        for extra in ((), ("--speculative-config", spec)):
            code, out, _ = run(capsys, "plan", "--model", model, "--json", *extra)
            assert code == 0
            plans.append(json.loads(out))
        sizes = [sum(len(g["layer_ids"]) for g in p["groups"] if g["kind"] == key) for p in plans]
        assert sizes == [without, with_mtp]
        ids = [i for g in plans[1]["groups"] if g["kind"] == key for i in g["layer_ids"]]
        assert mtp_index in ids  # the MTP layer: index num_hidden_layers
    code, _, err = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B",
                       "--speculative-config", spec)  # fmt: skip
    assert code == 2
    assert "needs a checkpoint with multi-token-prediction layers" in err


def test_plan_takes_the_speculation_scratch_from_the_budget(capsys):
    """With --speculative-config, speculative decoding's state scratch comes out of the cache
    budget before the pages are counted: the engine's default 64 drafting requests x the state
    bytes of every state layer x k (the state after each draft position: native CPU ops and
    CUDA's Triton ops alike); none without state layers."""
    spec = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    model = "ibm-granite/granite-4.0-h-small"
    for platform, depth in (("cpu", 4), ("cuda", 4)):
        plans = []
        for extra in ((), spec):
            code, out, _ = run(capsys, "plan", "--model", model, "--platform", platform,
                               "--json", *extra)  # fmt: skip
            assert code == 0
            plans.append(json.loads(out))
        plain, with_spec = plans
        per_request = 36 * plain["state_bytes"]  # 36 Mamba2 layers, padding excluded
        assert plain["reserved_bytes"] == 0
        assert with_spec["reserved_bytes"] == 64 * depth * per_request
        per_page, budget = plain["page_bytes"] * plain["layers_per_group"], 40 * 2**30
        assert plain["num_pages"] == budget // per_page  # (the CLI's default budget)
        assert with_spec["num_pages"] == (budget - with_spec["reserved_bytes"]) // per_page
    code, out, _ = run(capsys, "plan", "--model", model, "--platform", "cpu", *spec)
    assert "spec. scratch" in out and "of the budget" in out and "64 drafting requests" in out
    # a budget it would take more than half of: fewer drafting requests get scratch rows
    code, out, _ = run(capsys, "plan", "--model", model, "--platform", "cpu", "--memory", "8GiB",
                       "--json", *spec)  # fmt: skip
    small = json.loads(out)
    per_row = 4 * 36 * small["state_bytes"]
    assert small["scratch_rows"] == 8 * 2**30 // 2 // per_row < 64
    assert small["reserved_bytes"] == small["scratch_rows"] * per_row <= 4 * 2**30
    code, out, _ = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--json", *spec)
    assert json.loads(out)["reserved_bytes"] == 0  # attention only: nothing to roll back
