"""`hybridkv generate / serve / bench`: happy paths and one-line errors with exit code 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from hybridkv.entrypoints.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys, tiny_model_dir):
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "t1 t2",
        "--prompt",
        "t3",
        "--max-tokens",
        "4",
        "--json",
        "--dtype",
        "float32",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["t1 t2", "t3"]
    assert all(len(r["token_ids"]) <= 4 for r in rows)
    assert "loading" in err and "loaded GraniteMoeHybridForCausalLM" in err


def test_generate_says_why_a_request_failed_and_exits_1(capsys, tiny_model_dir, monkeypatch):
    """A step that fails ends its requests with finish_reason "abort": the command prints the
    engine's reason (text and --json) and exits 1, not 0."""
    from hybridkv.worker.model_runner import ModelRunner

    def broken(self, out):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "t1 t2", "--dtype", "float32"]
    code, out, err = run(capsys, *args)
    assert code == 1 and "finish_reason=abort" in err
    assert "hybridkv generate: error:" in err and "kernel exploded" in err
    code, out, err = run(capsys, *args, "--json")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and row["finish_reason"] == "abort" and "kernel exploded" in row["error"]


def test_generate_text_and_prompts_file(capsys, tiny_model_dir, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("t1 t2\n\nt4 t5\n")
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompts-file",
        str(f),
        "--max-tokens",
        "3",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    )
    assert code == 0
    assert out.count("\n") >= 2 and out.startswith("t1 t2")
    assert "finish_reason=" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "/does/not/exist"], "is not a folder with config.json"),
        (["generate", "--prompts-file", "/no/such/file"], "cannot read --prompts-file"),
        (["generate", "--max-tokens", "0"], "max_tokens must be in [1, "),
        (["generate", "--temperature", "-1"], "temperature"),
        (["generate", "--dtype", "int4"], "dtype must be"),
        (["serve", "--port", "0"], "--port must be in 1..65535"),
        (["serve", "--max-request-bytes", "lots"], "--max-request-bytes"),
        (["serve", "--tool-call-parser", "nope"], "--tool-call-parser: unknown tool parser 'nope'"),
        (["serve", "--reasoning-parser", "nope"], "valid: deepseek_r1, qwen3"),
        (["bench", "--requests", "0"], "--requests and --new-tokens must be >= 1"),
        (["generate", "--quantization", "int4"], "quantization must be None or one of 'int8'"),
        (["serve", "--quantization", "fp8"], "quantization must be None or one of 'int8'"),
        (["bench", "--quantization", "q8_0"], "got 'q8_0'"),
        (["bench", "--dtype", "float8"], "dtype must be auto, float32, bfloat16 or float16"),
        (["generate", "--max-capture-size", "-1"], "max_capture_size must be an integer >= 0"),
        (["generate", "--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (["serve", "--speculative-config", '{"method": "eagle3"}'], "method 'eagle3'"),
        (["bench", "--speculative-config", '{"method": "ngram"}'], "needs num_speculative_tokens"),
        (["generate", "--speculative-config", '{"method": "mtp"}'], "needs a checkpoint with"),
        (["generate", "--max-model-len", "0"], "max_model_len must be a positive integer"),
        (["serve", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be a positive"),
        (["generate", "--kv-cache-dtype", "int4"], "unknown dtype 'int4'"),
        (["serve", "--state-dtype", "fp8"], "state_dtype must be auto or one of"),
        (["plan", "--max-model-len", "-1"], "max_model_len must be a positive integer"),
        (["generate", "--prompt", "t1 " * 40, "--max-model-len", "16"], "max_model_len is 16"),
    ],
)
def test_errors_are_one_line(capsys, tiny_model_dir, argv, message):
    if "--model" not in argv and argv[0] != "bench":
        argv = [*argv, "--model", str(tiny_model_dir)]
    code, _, err = run(capsys, *argv)
    lines = [ln for ln in err.splitlines() if not ln.startswith(("loading", "loaded"))]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_cache_and_scheduler_flags_reach_the_engine(capsys, tiny_model_dir):
    """vLLM's engine flags on generate and serve: the engine is built with them."""
    from hybridkv.entrypoints.cli import build_parser, engine_kwargs

    flags = [
        "--max-model-len", "96", "--max-num-batched-tokens", "64", "--no-enable-prefix-caching",
        "--kv-cache-dtype", "bfloat16", "--kernel-block-size", "8", "--state-dtype", "float32",
    ]  # fmt: skip
    for command in ("generate", "serve"):
        kwargs = engine_kwargs(build_parser().parse_args([command, *flags]))
        assert kwargs["max_model_len"] == 96 and kwargs["max_num_batched_tokens"] == 64
        assert kwargs["enable_prefix_caching"] is False and kwargs["kv_cache_dtype"] == "bfloat16"
        assert kwargs["kernel_block_size"] == 8 and kwargs["state_dtype"] == "float32"
        assert "page_tokens" not in kwargs and "ssm_state_dtype" not in kwargs  # the defaults
    plain = engine_kwargs(build_parser().parse_args(["generate"]))
    assert not {"max_model_len", "enable_prefix_caching", "kv_cache_dtype"} & set(plain)
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "t1 t2", "--dtype", "float32"]
    code, _, err = run(capsys, *argv, *flags)
    assert code == 0 and "finish_reason=" in err


def test_bench(capsys, tiny_model_dir):
    code, out, _ = run(
        capsys,
        "bench",
        "--model",
        str(tiny_model_dir),
        "--requests",
        "3",
        "--new-tokens",
        "4",
        "--min-prompt",
        "4",
        "--max-prompt",
        "20",
        "--json",
    )
    assert code == 0
    (row,) = json.loads(out)
    assert row["engine"] == "hybridkv" and row["output_tokens"] == 12 and row["tokens_per_s"] > 0


def test_bench_with_speculative_decoding(capsys, tiny_model_dir):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    code, out, _ = run(capsys, "bench", "--model", str(tiny_model_dir), "--requests", "2",
                       "--new-tokens", "12", "--min-prompt", "8", "--max-prompt", "20",
                       "--speculative-config", spec, "--json")  # fmt: skip
    assert code == 0
    (row,) = json.loads(out)
    assert row["output_tokens"] == 24 and row["spec_decode"]["num_speculative_tokens"] == 3
    assert row["spec_decode"]["num_draft_tokens"] >= row["spec_decode"]["num_accepted_tokens"]


def test_generate_and_bench_int8(capsys, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--quantization", "int8", "--dtype", "float32"]
    code, out, err = run(capsys, "generate", *argv, "--prompt", "t1 t2", "--max-tokens", "4")
    assert code == 0 and out.startswith("t1 t2")
    # 2 Mamba2 x 2 + 2 attention x 4 + 4 shared MLPs x 2 + the head; the 4 routers stay float
    assert "int8: 21 linears quantized" in err and "4 kept float" in err
    code, out, _ = run(capsys, "bench", *argv, "--requests", "2", "--new-tokens", "3",
                       "--min-prompt", "4", "--max-prompt", "9", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)[0]["output_tokens"] == 6


def test_generate_without_a_prompt_says_which_it_uses(capsys, tiny_model_dir):
    code, _, err = run(capsys, "generate", "--model", str(tiny_model_dir), "--max-tokens", "2")
    assert code == 0 and "no prompt given: using 'def fibonacci(n):'" in err


def test_bench_compare_transformers_without_transformers(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name)
    )
    code, _, err = run(capsys, "bench", "--compare-transformers")
    assert code == 2 and "needs the transformers package" in err and "loading" not in err


def test_help_for_every_subcommand():
    for cmd in ("generate", "serve", "plan", "bench"):
        proc = subprocess.run(
            [sys.executable, "-m", "hybridkv.entrypoints.cli", cmd, "--help"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0 and "usage: hybridkv" in proc.stdout


def test_serve_on_a_busy_port_fails_before_loading(capsys, tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run(capsys, "serve", "--model", str(tiny_model_dir), "--port", str(port))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "loading" not in err, err  # before the model loads
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_serve_subprocess(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybridkv.entrypoints.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "t1", "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "length",
            "stop",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_generate_eager_and_captured_agree(capsys, tiny_model_dir):
    """--enforce-eager runs every step in Python; the default replays captured decode steps:
    the same greedy tokens."""
    outs = []
    for flags in (["--enforce-eager"], ["--max-capture-size", "2"]):
        argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "t1 t2", "--prompt",
                "t5", "--max-tokens", "12", "--temperature", "0", "--json", *flags]  # fmt: skip
        code, out, _ = run(capsys, *argv)
        assert code == 0
        outs.append([json.loads(line)["token_ids"] for line in out.splitlines()])
    assert outs[0] == outs[1] and all(len(t) > 4 for t in outs[0])
