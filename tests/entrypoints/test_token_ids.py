"""Token-id mode: a checkpoint without tokenizer.json loads; prompts are token ids, outputs carry
token ids and empty text (like vLLM's `skip_tokenizer_init`). Engine, LLM, server and CLI."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine import Engine
from hybridkv.entrypoints.cli import main
from hybridkv.entrypoints.server import Server, build_app

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [7, 8]]
MODEL = "ids-model"


@pytest.fixture(scope="module")
def ids_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny checkpoint without its tokenizer.json."""
    folder = tmp_path_factory.mktemp("tiny-no-tokenizer") / "model"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def llm(ids_dir):
    return LLM(str(ids_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """Greedy token ids of PROMPTS from the same weights with the tokenizer present."""
    with_tok = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)
    return [o.token_ids for o in with_tok.generate(PROMPTS, GREEDY, use_tqdm=False)]


# -- engine and LLM ---------------------------------------------------------------------------


def test_token_ids_generate_as_with_a_tokenizer(llm, expected):
    assert llm.get_tokenizer() is None and llm.engine.tokenizer is None
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.text == "" and out.prompt is None and out.prompt_token_ids == prompt
        assert out.finish_reason == "length" and len(out.token_ids) == 6
    single = llm.generate([1, 2, 3], GREEDY, use_tqdm=False)  # one prompt as a flat id list
    assert single[0].token_ids == expected[0]


def test_text_prompt_is_a_one_line_error(llm, ids_dir):
    for prompt in ("t1 t2", ""):
        with pytest.raises(ValueError) as info:
            llm.engine.add_request(prompt, GREEDY)
        msg = str(info.value)
        assert "\n" not in msg and "no tokenizer" in msg and str(ids_dir) in msg
        assert "lists of token ids" in msg
    with pytest.raises(ValueError, match="lists of token ids"):
        llm.generate([[1, 2], "t3"], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished and not llm.engine.requests  # nothing was added


def test_stop_strings_refused_stop_token_ids_work(llm, expected):
    with pytest.raises(ValueError, match="stop strings") as info:
        llm.engine.add_request([1, 2, 3], SamplingParams(stop=["t5"]))
    assert "stop_token_ids" in str(info.value) and "\n" not in str(info.value)
    # validated before anything runs, also when only a later prompt has stop strings
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate(PROMPTS, [GREEDY, SamplingParams(stop="x")], use_tqdm=False)
    assert not llm.engine.has_unfinished and not llm.engine.requests
    stop_id = expected[0][2]
    want = expected[0][: expected[0].index(stop_id) + 1]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_id])
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == want and out.text == ""


def test_streaming_and_logprobs(llm, expected):
    eng = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    eng.add_request(PROMPTS[0], params, stream=True)
    updates = []
    while eng.has_unfinished:
        updates += eng.step()
    assert len(updates) == 6 and all(u.text == "" for u in updates)
    assert updates[-1].token_ids == expected[0]
    assert [len(e) >= 1 for e in updates[-1].logprobs] == [True] * 6


def test_unreadable_tokenizer_json_is_still_an_error(ids_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ids_dir, bad)
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        Engine(str(bad), dtype="float32")


# -- server -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(llm):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        build_app(Server(llm.engine, MODEL)), host="127.0.0.1", port=port, log_level="warning"
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)


def post(base_url, path, **body):
    return httpx.post(base_url + path, json={"model": MODEL, **body}, timeout=60)


def test_server_completions_with_token_ids(base_url, expected):
    kw = dict(max_tokens=6, temperature=0, ignore_eos=True)
    r = post(base_url, "/v1/completions", prompt=PROMPTS[0], **kw)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == "" and choice["token_ids"] == expected[0]
    assert choice["prompt_token_ids"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert r.json()["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    r = post(base_url, "/v1/completions", prompt=PROMPTS, **kw)
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in r.json()["choices"]] == expected


def test_server_echo_logprobs_and_stream(base_url, expected):
    kw = dict(prompt=PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True)
    r = post(base_url, "/v1/completions", echo=True, logprobs=2, **kw)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == expected[0]
    lp = choice["logprobs"]  # echo: the prompt's tokens (the first without a log-prob) first
    assert lp["tokens"] == [f"token_id:{t}" for t in PROMPTS[0] + expected[0]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    assert lp["text_offset"] == [0] * (len(PROMPTS[0]) + 6)
    body = {"model": MODEL, "stream": True, "echo": True, **kw}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :])["choices"][0] for line in lines[:-1]]
    assert all(c["text"] == "" for c in chunks)
    assert chunks[0]["prompt_token_ids"] == PROMPTS[0]
    assert sum((c.get("token_ids", []) for c in chunks), []) == expected[0]
    assert chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"prompt": "t1 t2"}, "prompt", "token-id prompts only"),
        ("/v1/completions", {"prompt": ["t1", "t2"]}, "prompt", "token-id prompts only"),
        ("/v1/completions", {"prompt": [1, 2], "stop": ["t3"]}, "stop", "stop_token_ids"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "t1"}]},
            "messages",
            "chat completions",
        ),
    ],
)
def test_server_refuses_text(base_url, path, body, param, fragment):
    r = post(base_url, path, **body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["code"] is None and fragment in err["message"] and "no tokenizer" in err["message"]


# -- CLI --------------------------------------------------------------------------------------


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_text_prompt_exits_2_with_one_line(capsys, ids_dir):
    code, out, err = cli(capsys, "generate", "--model", str(ids_dir), "--prompt", "t1 t2")
    lines = [ln for ln in err.splitlines() if not ln.startswith(("loading", "loaded"))]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "no tokenizer" in lines[0] and "--prompt-ids" in lines[0] and "Traceback" not in err
    code, _, err = cli(capsys, "generate", "--model", str(ids_dir), "--prompt-ids", "1,x")
    assert code == 2 and "--prompt-ids takes comma-separated token ids" in err


def test_cli_token_id_prompts(capsys, ids_dir, expected):
    argv = ["generate", "--model", str(ids_dir), "--dtype", "float32", "--max-tokens", "6"]
    argv += ["--prompt-ids", "1,2,3", "--prompt-ids", "7, 8"]
    code, out, _ = cli(capsys, *argv, "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS and all(r["text"] == "" for r in rows)
    # greedy without ignore_eos: the same tokens up to an eos, if one came
    for row, want in zip(rows, expected, strict=True):
        assert row["token_ids"] == want[: len(row["token_ids"])]
    code, out, err = cli(capsys, *argv)
    assert code == 0 and err.count("finish_reason=") == 2
    assert out.splitlines()[0] == "1,2,3 -> " + ",".join(str(t) for t in rows[0]["token_ids"])
