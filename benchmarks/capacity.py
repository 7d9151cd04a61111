"""Capacity benchmark: replay workloads through the real scheduler and cache managers (no model).

For bundled presets of real hybrid models (plus Llama-3.1-8B as the dense reference), a 40 GiB
budget planned for platform cuda with FlashInfer's kernel block sizes, `max_num_seqs` 1024, it
compares page mode (the reference behaviour: whole pages per request) with block mode (kernel
block sub-allocation) on three seeded workloads:

- short_chat: 2000 requests, prompts uniform 12..200 tokens, outputs uniform 50..300;
- multi_turn: conversations sharing one 480-token system prompt, 4 turns each, user turns
  20..80 tokens, answers 50..200, each prompt = the conversation so far + the new user turn,
  128 conversations open at a time, 2000 requests in all;
- long_docs: 200 requests with prompts 8k..32k tokens and outputs 50..300.

Models with sliding-window layers (gpt-oss, Gemma 3) also run mode "whole": the same cache with
every window widened to the whole context, as a paged cache that frees nothing until a request
ends would hold it.

Reported per (model, workload, mode): peak concurrent requests, cache bytes in use per running
request at that peak (MiB: pages in use x page bytes x layers per group), attention tokens
pinned but unused per request at that peak (summed over attention groups), prefix hit rate (hit
tokens / prompt tokens), snapshot pages held at the end, and manager CPU time per request-step
(all cache manager calls of a step / running requests; median of 3 runs). Each model runs in a
fresh process of its own (`--in-process` to run them all in one).

    python benchmarks/capacity.py            # full run, prints a table
    python benchmarks/capacity.py --json     # the same numbers as JSON rows
    python benchmarks/capacity.py --quick    # reduced version (under a minute)

Speculative decoding (issue 30): `--speculative K` replays with a deterministic stand-in for
the model (the token at position p of request r is a hash of (r, p)) twice, without drafts and
with up to K drafts per decode step (each draft right with probability 3/4, verified as greedy
verification would), through the same scheduler and cache managers. The outputs are the same
token for token, so the hit rate and the snapshots must be too (columns `spec`, `accept`).

    python benchmarks/capacity.py --workloads multi_turn --speculative 4
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.config import CacheConfig, SchedulerConfig  # noqa: E402
from hybridkv.core.coordinator import CacheManager  # noqa: E402
from hybridkv.core.request import Request  # noqa: E402
from hybridkv.core.scheduler import Scheduler  # noqa: E402
from hybridkv.kv.plan import MemoryPlan, PlanTarget, make_plan  # noqa: E402
from hybridkv.kv.presets import load_preset  # noqa: E402
from hybridkv.models.config_helpers import (  # noqa: E402
    model_dtype,
    resolve_cache_dtypes,
    text_config,
)
from hybridkv.models.registry import (  # noqa: E402
    architecture_of,
    declared_cache_layers,
    plan_for_config,
)
from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.spec_decode.verify import greedy_tokens  # noqa: E402

MODELS = [
    "ibm-granite/granite-4.0-h-small",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "Qwen/Qwen3.5-27B",
    "Qwen/Qwen3.5-35B-A3B",
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "tiiuae/Falcon-H1-7B-Instruct",
    "ai21labs/Jamba-v0.1",
    "meta-llama/Llama-3.1-8B",
    "mistralai/Mamba-Codestral-7B-v0.1",
    "openai/gpt-oss-20b",
    "google/gemma-3-27b-it",
    "moonshotai/Kimi-Linear-48B-A3B-Instruct",
]
QUICK_MODELS = [
    "ibm-granite/granite-4.0-h-small",
    "meta-llama/Llama-3.1-8B",
    "mistralai/Mamba-Codestral-7B-v0.1",
]
# FlashInfer's sizes; models whose attention is MLA use FlashInfer's MLA kernel (32 / 64)
MLA_BACKEND = {"moonshotai/Kimi-Linear-48B-A3B-Instruct": "flashinfer_mla"}
WORKLOADS = ("short_chat", "multi_turn", "long_docs")
MODES = ("page", "block")
# Models with sliding-window groups also run "whole": block mode with every window widened to
# the whole context, i.e. what a paged cache that keeps every token of every layer holds.
WHOLE = "whole"
VOCAB = 32000
GIB = 2**30
MANAGER_CALLS = ("lookup", "allocate", "commit", "free", "next_boundary", "drain_new_pages")


@dataclass(frozen=True)
class Scale:
    short_requests: int = 2000
    multi_requests: int = 2000
    open_conversations: int = 128
    long_requests: int = 200
    runs: int = 3


FULL = Scale()
QUICK = Scale(
    short_requests=300, multi_requests=240, open_conversations=32, long_requests=12, runs=1
)


def _request(rid: str, prompt: list[int], out_len: int) -> Request:
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    return Request(rid, prompt, params)


# ---------------------------------------------------------------------------------------------
# Workloads: generators of requests that may react to finished ones
# ---------------------------------------------------------------------------------------------


class Workload:
    """Feeds requests to the scheduler; `on_finish` lets a conversation continue."""

    def initial(self) -> list[Request]:
        raise NotImplementedError

    def on_finish(self, req: Request) -> list[Request]:
        return []


class Independent(Workload):
    def __init__(self, rng: random.Random, n: int, prompt: tuple[int, int], out: tuple[int, int]):
        self.requests = [
            _request(
                f"r{i}",
                [rng.randrange(VOCAB) for _ in range(rng.randint(*prompt))],
                rng.randint(*out),
            )
            for i in range(n)
        ]

    def initial(self) -> list[Request]:
        return self.requests


class MultiTurn(Workload):
    TURNS = 4

    def __init__(
        self, rng: random.Random, n_requests: int, open_conversations: int, seed: int | None = None
    ):
        """`seed`: each turn draws from its own generator, seeded by (seed, conversation,
        turn), so a turn does not depend on the order in which others finished (replays that
        must see the same requests: `--speculative`); None: one shared generator."""
        self.rng = rng
        self.seed = seed
        self.system = [rng.randrange(VOCAB) for _ in range(480)]
        self.n_conversations = n_requests // self.TURNS
        self.open = open_conversations
        self.started = 0
        self.turn: dict[str, int] = {}

    def _turn(self, conv: int, history: list[int], turn: int) -> Request:
        rng = self.rng if self.seed is None else random.Random(f"{self.seed}:{conv}:{turn}")
        user = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 80))]
        req = _request(f"c{conv}t{turn}", history + user, rng.randint(50, 200))
        self.turn[req.request_id] = turn
        return req

    def _start(self) -> Request:
        conv = self.started
        self.started += 1
        return self._turn(conv, list(self.system), 0)

    def initial(self) -> list[Request]:
        return [self._start() for _ in range(min(self.open, self.n_conversations))]

    def on_finish(self, req: Request) -> list[Request]:
        turn = self.turn.pop(req.request_id)
        conv = int(req.request_id[1:].split("t")[0])
        if turn + 1 < self.TURNS:
            return [self._turn(conv, list(req.all_token_ids), turn + 1)]
        return [self._start()] if self.started < self.n_conversations else []


def make_workload(name: str, seed: int, scale: Scale, order_free: bool = False) -> Workload:
    rng = random.Random(seed)
    if name == "short_chat":
        return Independent(rng, scale.short_requests, (12, 200), (50, 300))
    if name == "multi_turn":
        turn_seed = seed if order_free else None
        return MultiTurn(rng, scale.multi_requests, scale.open_conversations, turn_seed)
    return Independent(rng, scale.long_requests, (8192, 32768), (50, 300))


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


def _time_manager_calls(cm: CacheManager) -> Callable[[], int]:
    """Wrap the manager's entry points; returns a reader of the accumulated nanoseconds."""
    total = [0]

    def wrap(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.perf_counter_ns() - t0

        return timed

    for name in MANAGER_CALLS:
        setattr(cm, name, wrap(getattr(cm, name)))
    return lambda: total[0]


def _unused_pinned(cm: CacheManager, running: list[Request]) -> float:
    """Attention tokens held but not written, per request, summed over full-attention groups."""
    unused = 0
    for req in running:
        rs = cm._reqs.get(req.request_id)
        if rs is None:
            continue
        for m, gr in zip(cm.groups, rs.groups, strict=True):
            if m.caches_tokens and m.prefix_closed:  # full attention (and MLA)
                unused += m.events(gr).capacity - req.num_computed_tokens
    return unused / max(1, len(running))


def whole_context_plan(config: dict, cfg: CacheConfig) -> MemoryPlan:
    """The plan of `config` with every sliding window widened to the whole context."""
    dtypes = resolve_cache_dtypes(config, cfg.kv_cache_dtype, cfg.state_dtype, cfg.ssm_state_dtype)
    layers = [
        replace(layer, spec=replace(layer.spec, sliding_window=None))
        if getattr(layer.spec, "sliding_window", None) is not None
        else layer
        for layer in declared_cache_layers(config, dtypes)
    ]
    max_len = int(text_config(config).get("max_position_embeddings") or 4096)
    target = PlanTarget(max_len, compute_dtype=model_dtype(config))
    return make_plan(layers, cfg, architecture_of(config), target)


def has_sliding_window(model: str) -> bool:
    backend = MLA_BACKEND.get(model, "flashinfer")
    cfg = CacheConfig(platform="cuda", attention_backend=backend, memory_bytes=GIB)
    return any(g.window is not None for g in plan_for_config(load_preset(model), cfg).groups)


def target_token(request_id: str, position: int) -> int:
    """The stand-in model of `--speculative`: request r's token at `position`."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


class SpeculativeReplay:
    """Drafts and their verification without a model (`--speculative`): a draft is the target's
    token with probability 3/4 (else another one); verification keeps the leading right drafts
    and appends the target's token, as greedy verification does."""

    def __init__(self, k: int, seed: int) -> None:
        self.k = k
        self.rng = random.Random(seed)
        self.drafted = self.accepted = 0

    def drafter(self, req: Request, max_drafts: int) -> list[int]:
        n = len(req.all_token_ids)
        return [
            target_token(req.request_id, n + i)
            if self.rng.random() < 0.75
            else (target_token(req.request_id, n + i) + 1) % VOCAB
            for i in range(max_drafts)
        ]

    def verify(self, sched: Scheduler, chunk) -> list[int]:
        req = sched.request(chunk.request_id)
        n = len(req.all_token_ids)
        drafts = chunk.token_ids[chunk.num_known :]
        targets = [target_token(req.request_id, n + i) for i in range(len(drafts) + 1)]
        tokens = greedy_tokens(targets, drafts)
        self.drafted += len(drafts)
        self.accepted += len(tokens) - 1
        return tokens


def replay(
    model: str, workload: str, mode: str, seed: int, scale: Scale, speculative: int | None = None
) -> dict:
    """One replay; `speculative`: None samples random tokens (the tables above), 0 / K runs the
    stand-in model without / with up to K drafts per decode step."""
    # Earlier replays leave managers in reference cycles (the pool knows its groups and they
    # know the pool): collect them first, so that every replay starts from the same heap.
    gc.collect()
    cfg = CacheConfig(
        platform="cuda",
        attention_backend=MLA_BACKEND.get(model, "flashinfer"),
        memory_bytes=40 * GIB,
        allocation="block" if mode == WHOLE else mode,
    )
    config = load_preset(model)
    plan = whole_context_plan(config, cfg) if mode == WHOLE else plan_for_config(config, cfg)
    # Set-up done: what it leaves (torch and sympy, imported to build runnable models on the
    # meta device for their specs) is frozen out of the garbage collector's sight, as the
    # engine does after its set-up, so that collections during the replay walk the replay's
    # own objects only.
    gc.collect()
    gc.freeze()
    cm = CacheManager(plan, cfg)
    manager_ns = _time_manager_calls(cm)
    spec = SpeculativeReplay(speculative, seed) if speculative else None
    sched_cfg = SchedulerConfig(
        max_num_seqs=1024, max_num_batched_tokens=8192,
        speculative_config={"method": "ngram", "num_speculative_tokens": speculative}
        if spec else None,
    )  # fmt: skip
    sched = Scheduler(cm, sched_cfg, spec.drafter if spec else None, 1024 if spec else 0)
    rng = random.Random(seed + 1)
    work = make_workload(workload, seed, scale, order_free=speculative is not None)
    for req in work.initial():
        sched.add_request(req)
    peak = request_steps = max_snapshots = pages_at_peak = 0
    unused_at_peak = 0.0
    while sched.has_unfinished:
        out = sched.schedule()
        sampled: dict[str, int | list[int]] = {}
        for c in out.chunks:
            if not c.samples:
                continue
            if spec is not None and c.num_drafts:
                sampled[c.request_id] = spec.verify(sched, c)
            elif speculative is not None:
                position = sched.request(c.request_id).num_tokens
                sampled[c.request_id] = target_token(c.request_id, position)
            else:
                sampled[c.request_id] = rng.randrange(VOCAB)
        finished = sched.update(out, sampled)
        request_steps += len(out.chunks)
        if len(sched.running) > peak:
            peak = len(sched.running)
            unused_at_peak = _unused_pinned(cm, sched.running)
            pages_at_peak = cm.usage()["in_use"]
        max_snapshots = max(max_snapshots, cm.usage()["snapshot_pages"])
        for req in finished:
            for nxt in work.on_finish(req):
                sched.add_request(nxt)
    cm.check_integrity()
    return {
        "model": model,
        "workload": workload,
        "mode": mode,
        "peak_concurrency": peak,
        "mib_per_request": round(
            pages_at_peak * plan.page_bytes * plan.layers_per_group / max(1, peak) / 2**20, 1
        ),
        "unused_pinned_tokens_per_request": round(unused_at_peak, 1),
        "hit_rate": round(cm.stats.hit_rate, 4),
        "snapshot_pages": cm.usage()["snapshot_pages"],
        "max_snapshot_pages": max_snapshots,
        "manager_us_per_request_step": manager_ns() / 1e3 / max(1, request_steps),
        "preemptions": sched.num_preemptions,
        "page_tokens": plan.page_tokens,
        "spec": speculative or 0,
        "accept": round(spec.accepted / spec.drafted, 3) if spec and spec.drafted else None,
        "snapshots_taken": cm.stats.snapshots_taken,
        "num_pages": plan.num_pages,
        # a pure state model (Mamba2) has no kernel block: its hits land on page_tokens
        "kernel_block_size": next((g.kernel_block_size for g in plan.attention_groups), None),
    }


def run_isolated(
    model: str, workloads: list[str], quick: bool, seed: int, speculative: int = 0
) -> list[dict]:
    """`run` for one model in a fresh Python process: a model's timings then do not depend on
    which models ran before it (in one process, the later models ran 15-35% slower)."""
    cmd = [sys.executable, __file__, "--in-process", "--json", "--seed", str(seed)]
    cmd += ["--models", model, "--workloads", *workloads] + (["--quick"] if quick else [])
    cmd += ["--speculative", str(speculative)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{model}: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
    return json.loads(proc.stdout)


def run(
    models: list[str], workloads: list[str], scale: Scale, seed: int, speculative: int = 0
) -> Iterator[dict]:
    for model in models:
        modes = MODES + ((WHOLE,) if has_sliding_window(model) else ())
        for workload in workloads:
            for mode in modes:
                for spec in (0, speculative) if speculative else (None,):
                    yield _median_row(model, workload, mode, seed, scale, spec)


def _median_row(
    model: str, workload: str, mode: str, seed: int, scale: Scale, spec: int | None
) -> dict:
    """One (model, workload, mode) row: manager time is the median of `scale.runs` replays."""
    rows = [replay(model, workload, mode, seed, scale, spec) for _ in range(scale.runs)]
    row = dict(rows[0])
    row["manager_us_per_request_step"] = round(
        statistics.median(r["manager_us_per_request_step"] for r in rows), 2
    )
    return row


COLUMNS = [
    ("model", 42),
    ("workload", 10),
    ("mode", 6),
    ("page_tokens", 5),
    ("kernel_block_size", 3),
    ("peak_concurrency", 5),
    ("mib_per_request", 7),
    ("unused_pinned_tokens_per_request", 7),
    ("hit_rate", 6),
    ("snapshot_pages", 6),
    ("manager_us_per_request_step", 6),
    ("preemptions", 7),
]
HEADS = [
    "model",
    "workload",
    "mode",
    "page",
    "kb",
    "peak",
    "MiB/req",
    "unused",
    "hit",
    "snaps",
    "us/rs",
    "preempt",
]


SPEC_COLUMNS = [("spec", 4), ("accept", 6), ("snapshots_taken", 6)]
SPEC_HEADS = ["spec", "accept", "snaps+"]


def print_header(speculative: int = 0) -> None:
    columns, heads = COLUMNS, HEADS
    if speculative:
        columns, heads = columns + SPEC_COLUMNS, heads + SPEC_HEADS
    print("  ".join(h.ljust(w) for h, (_, w) in zip(heads, columns, strict=True)))


def print_row(r: dict, speculative: int = 0) -> None:
    columns = COLUMNS + SPEC_COLUMNS if speculative else COLUMNS
    print("  ".join(str(r[k]).ljust(w) for k, w in columns), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced run (under a minute)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--models", nargs="*", default=None, help="preset ids (default: all ten)")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--speculative", type=int, default=0, metavar="K",
        help="also replay with up to K drafts per decode step (stand-in model; see above)",
    )  # fmt: skip
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every model in this process (default: each model in a fresh process)",
    )
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    models = args.models or (QUICK_MODELS if args.quick else MODELS)
    rows = []
    if not args.json:
        print(
            f"capacity benchmark: 40 GiB, platform cuda, flashinfer sizes, max_num_seqs 1024, "
            f"seed {args.seed}{' (quick)' if args.quick else ''}"
        )
        print_header(args.speculative)
    if args.in_process:
        produced: Iterator[dict] = run(
            models, args.workloads, scale, args.seed, args.speculative
        )
    else:
        produced = (
            row
            for model in models
            for row in run_isolated(
                model, args.workloads, args.quick, args.seed, args.speculative
            )
        )
    for row in produced:
        rows.append(row)
        if not args.json:
            print_row(row, args.speculative)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
