"""lm-evaluation-harness against `hybridkv serve`: its `local-completions` backend scores a small
multiple-choice task through the server (echo + logprobs: prompt-token log-probs) and must give
the per-choice log-likelihoods, greedy flags and accuracy of lm-eval's own `hf` backend (the
transformers model) on the same checkpoint.

lm-eval's contract, as 0.4.13 uses it (lm_eval/models/openai_completions.py, api_models.py):
for each (context, continuation) pair it tokenizes context + continuation itself and POSTs to
base_url

    {"model": M, "prompt": [[ids...], ...], "temperature": 0, "max_tokens": 1, "logprobs": 1,
     "seed": 1234, "echo": true}

(token-id prompts, one list per pair, batch_size lists per request); it reads
choices[i].logprobs.token_logprobs[ctxlen:-1] (the continuation's tokens; the last entry is the
generated token) and top_logprobs[ctxlen:-1], with a token greedy when its log-prob equals the
largest value of its top_logprobs dict. choices are matched to prompts by their `index`.
With tokenizer_backend "auto" (the default) it first probes GET /tokenizer_info (a dict with
"eos_token") and POST /tokenize {"prompt", "add_special_tokens": false} -> {"tokens"}, and then
tokenizes every string through /tokenize (and decodes through /detokenize).

Two runs over one server: the Hugging Face tokenizer from the checkpoint's folder with several
prompts per request (batch_size 4), and the server's own tokenizer (auto-detected "remote")
with concurrent one-prompt requests.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from tests.entrypoints.server_utils import running_server

MODEL = "lm-eval-model"
TASK = "hybridkv_pycode_mc"
LL_TOL = 1e-3

# (context, choices, index of the right one): Python-like code, as the default model was trained
# on the standard library's sources. Contexts with a trailing space exercise lm-eval's moving of
# that space into the continuation; some choices are several tokens long.
DOCS: list[tuple[str, list[str], int]] = [
    ("def __init__(self", [" = 0", ", name):", "]]", " import os"], 1),
    ("import os\nimport ", ["(", "def", "sys", "+= 1"], 2),
    ("for i in range(", ["len(self)):", "import", "class", "return"], 0),
    ("        return self.", ["((", "def", " import", "_name"], 3),
    ("if __name__ == ", ["import", "'__main__':", "return", "))"], 1),
    ("class Foo(", ["import", "return x", "object):", "+="], 2),
    ("try:\n    import ", ["threading", "return", "= 1", ")"], 0),
    ("        raise ", ["import", "= =", "def", "ValueError("], 3),
    ("from collections import ", ["return", "namedtuple", "def", "(("], 1),
    ("    @", ["return", "import", "property", "= 1"], 2),
    ("x = [", ["]", "def", "class", "import"], 0),
    ("    def __repr__(self):\n        return ", ["import", "class", "def", "'<%s>' % self.x"], 3),
]


def _write_task(folder: Path) -> None:
    data = folder / "docs.jsonl"
    with data.open("w") as f:
        for context, choices, label in DOCS:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "cache")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    # JSON is YAML: no YAML writer needed
    (folder / f"{TASK}.yaml").write_text(json.dumps(config, indent=1))


def _evaluate(model: Any, model_args: dict[str, Any] | None, task_manager) -> dict[str, Any]:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
        num_fewshot=0,
    )
    assert out is not None
    return out


def _per_choice(out: dict[str, Any]) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> [(log-likelihood, is_greedy) per choice]."""
    res = {}
    for sample in out["samples"][TASK]:
        res[sample["doc_id"]] = [(float(ll), bool(g)) for ll, g in sample["filtered_resps"]]
    return res


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory):
    """Offline lm-eval with the task in a temporary folder; its TaskManager."""
    folder = tmp_path_factory.mktemp("lm_eval_task")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_DATASETS_CACHE", str(folder / "cache"))
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        mp.setenv("OPENAI_API_KEY", "")
        _write_task(folder)
        from lm_eval.tasks import TaskManager

        yield TaskManager(include_path=str(folder), include_defaults=False)


@pytest.fixture(scope="module")
def hf_reference(lm_eval_env):
    """lm-eval's own `hf` backend on the checkpoint (float32, CPU)."""
    args = {
        "pretrained": str(DEFAULT_MODEL),
        "dtype": "float32",
        "device": "cpu",
        "batch_size": 8,
    }
    return _evaluate("hf", args, lm_eval_env)


@pytest.fixture(scope="module")
def server():
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", max_num_seqs=16, max_model_len=512)
    with running_server(engine, MODEL) as srv:
        yield srv


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            {"tokenizer_backend": "huggingface", "tokenizer": str(DEFAULT_MODEL),
             "batch_size": 4, "num_concurrent": 1},
            id="hf-tokenizer-batched",
        ),
        pytest.param(
            {"tokenizer_backend": "auto", "batch_size": 1, "num_concurrent": 3},
            id="remote-tokenizer-concurrent",
        ),
    ],
)  # fmt: skip
def test_local_completions_matches_hf(server, lm_eval_env, hf_reference, mode, caplog):
    from lm_eval.api.registry import get_model

    caplog.set_level(logging.WARNING, logger="lm_eval")
    args = {
        "model": MODEL,
        "base_url": server.base_url + "/v1/completions",
        "tokenized_requests": True,
        "max_retries": 1,  # fail at once: lm-eval's retries wait seconds between tries
        "max_length": 512,
        "timeout": 60,
        **mode,
    }
    if mode["tokenizer_backend"] == "auto":
        # the server offers /tokenizer_info and /tokenize: lm-eval must find and use them (else
        # it would load a Hugging Face tokenizer named after the served model, from the Hub)
        from lm_eval.utils import check_remote_tokenizer_support

        assert check_remote_tokenizer_support(args["base_url"], max_retries=1), (
            "lm-eval does not see the server's tokenizer: GET /tokenizer_info must answer a "
            'dict with "eos_token" and POST /tokenize {"prompt", "add_special_tokens"} one '
            'with "tokens"'
        )
    lm = get_model("local-completions")(**args)
    if mode["tokenizer_backend"] == "auto":
        assert lm.tokenizer_backend == "remote"
    out = _evaluate(lm, None, lm_eval_env)

    ref, got = _per_choice(hf_reference), _per_choice(out)
    assert sorted(ref) == sorted(got) == list(range(len(DOCS)))
    bad = []
    for doc_id in sorted(ref):
        assert len(got[doc_id]) == len(ref[doc_id]) == len(DOCS[doc_id][1]), doc_id
        for k, ((ll_ref, greedy_ref), (ll, greedy)) in enumerate(
            zip(ref[doc_id], got[doc_id], strict=True)
        ):
            if not (math.isfinite(ll) and abs(ll - ll_ref) <= LL_TOL and greedy == greedy_ref):
                bad.append((doc_id, DOCS[doc_id][1][k], (ll_ref, greedy_ref), (ll, greedy)))
    assert not bad, (
        f"{len(bad)} of {sum(len(c) for _, c, _ in DOCS)} choices differ; (doc, choice, "
        f"hf (ll, greedy), server (ll, greedy)), first ones: {bad[:4]}"
    )

    # the task is not trivial for the model: log-likelihoods spread, some continuation greedy
    lls = [ll for choices in ref.values() for ll, _ in choices]
    assert max(lls) - min(lls) > 5.0 and all(ll <= 0 for ll in lls)
    assert any(g for choices in ref.values() for _, g in choices)

    for metric in ("acc,none", "acc_norm,none"):
        assert out["results"][TASK][metric] == hf_reference["results"][TASK][metric], metric


def test_lm_eval_loglikelihood_request_shape(server, lm_eval_env):
    """The body lm-eval builds for a batch of two scored prompts (of different lengths) and
    the parts of the answer it reads: one choice per prompt, by index; per prompt token a
    log-prob (None for the first) and a top-log-probs dict, plus the one generated token."""
    import requests  # as lm-eval posts (httpx refuses its header 'Authorization: Bearer ')
    from lm_eval.api.registry import get_model

    base_url = server.base_url + "/v1/completions"
    lm = get_model("local-completions")(
        model=MODEL, base_url=base_url, tokenizer_backend="huggingface",
        tokenizer=str(DEFAULT_MODEL), batch_size=2, max_retries=1,
    )  # fmt: skip
    prompts = [lm.tok_encode("import os\nimport sys\n"), lm.tok_encode("def __init__(self")]
    assert len(prompts[0]) != len(prompts[1])
    payload = lm._create_payload(lm.create_message(prompts), generate=False, seed=lm._seed)
    assert payload == {
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True,
    }  # fmt: skip
    r = requests.post(base_url, json=payload, headers=lm.header, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert lp is not None, "echo + logprobs must return log-probs"
        n = len(ids) + 1  # the prompt's tokens and the generated one
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == n, (
            f"want {len(ids)} prompt tokens + 1 generated, got {len(lp['token_logprobs'])}"
        )
        assert lp["token_logprobs"][0] is None
        for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert isinstance(chosen, float) and chosen <= 0.0
            assert isinstance(top, dict) and top
            assert max(top.values()) >= chosen - 1e-6
    # parsed as lm-eval parses it: a real (negative) log-likelihood of the last prompt token
    parsed = lm.parse_logprobs(r.json(), prompts, [len(p) - 1 for p in prompts])
    assert len(parsed) == 2 and all(ll < 0 for ll, _ in parsed)
