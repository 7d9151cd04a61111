"""Throughput measurement shared by `hybridkv bench` and benchmarks/throughput.py."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch


def random_prompts(vocab: int, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`n` prompts of uniform min_len..max_len random token ids (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_hybridkv(
    model: str | None,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str = "float32",
    repeat: int = 1,
    engines: list | None = None,
    **engine_kwargs,
) -> float:
    """Median seconds (over `repeat` runs, after a warm-up) to generate `new_tokens` greedy
    tokens (EOS ignored) for every prompt at once. Prefix caching is off unless asked for, so
    that repeats of the same prompts do the same work (and compare with engines that have
    none). `engines`: the engine is appended to it (its stats stay readable)."""
    from hybridkv import LLM, SamplingParams

    engine_kwargs.setdefault("max_num_seqs", len(prompts))
    engine_kwargs.setdefault("enable_prefix_caching", False)
    llm = LLM(model, dtype=dtype, **engine_kwargs)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.engine.spec_stats = type(llm.engine.spec_stats)()  # the measured runs only
    if engines is not None:
        engines.append(llm.engine)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert all(len(o.token_ids) == new_tokens for o in outs)
    llm.engine.shutdown()  # the other tensor-parallel ranks, if any
    return statistics.median(times)


@torch.inference_mode()
def run_transformers(
    model: str | Path,
    prompts: list[list[int]],
    new_tokens: int,
    batch: int = 8,
    repeat: int = 1,
) -> float:
    """Median seconds for transformers `generate`, batched as a user would: `batch` prompts at
    a time, left padding, greedy, EOS ignored (min_new_tokens)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError("comparing with transformers needs `pip install transformers`") from None
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    return statistics.median(
        _transformers_once(hf, prompts, new_tokens, batch) for _ in range(repeat)
    )


def _transformers_once(hf, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, p in enumerate(group):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start
