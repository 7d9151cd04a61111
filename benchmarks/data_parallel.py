"""Data-parallel routing benchmark: capacity.py's multi_turn workload over N simulated replicas.

Each replica is what capacity.py replays (the real scheduler and cache manager, no model: the
sampled tokens are random): one `CacheManager` + `Scheduler` per replica on the same plan
(a bundled preset planned for platform cuda with FlashInfer's sizes, `--gib` per replica).
Eight real engines would measure the same thing more slowly: the router sees only events and
loads, which the simulation produces exactly as an engine does.

The replicas run in lock step (one scheduler step each per tick). A request is routed when it
arrives (the first turns of the open conversations at tick 0; each next turn when the previous
finishes) with the replicas' current loads; after every tick each replica's cache events are
drained into the router's `PrefixIndex`. Per (N, policy):

- hit rate: prefix-hit tokens / prompt tokens over all replicas (CacheStats);
- prefill/req: prompt tokens computed per request (prompt - hit): the TTFT proxy in work;
- ttft ticks: mean scheduler steps from arrival to the first sampled token (queueing and
  chunked prefill included, 8192 batched tokens per step);
- share of the best replica: requests on the busiest replica / requests (1/N is even).

The reference row is one replica with the same memory serving the whole workload.

    python benchmarks/data_parallel.py            # 2000 requests, N = 2 and 8
    python benchmarks/data_parallel.py --quick    # 400 requests
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import capacity  # noqa: E402

from hybridkv.config import CacheConfig, SchedulerConfig  # noqa: E402
from hybridkv.core.coordinator import CacheManager  # noqa: E402
from hybridkv.core.request import Request  # noqa: E402
from hybridkv.core.scheduler import Scheduler  # noqa: E402
from hybridkv.kv.plan import MemoryPlan  # noqa: E402
from hybridkv.kv.presets import load_preset  # noqa: E402
from hybridkv.models.registry import plan_for_config  # noqa: E402
from hybridkv.serving.router import (  # noqa: E402
    POLICIES,
    IndexSpec,
    PrefixIndex,
    ReplicaLoad,
    Router,
)

MODEL = "ibm-granite/granite-4.0-h-small"
GIB = 2**30


@dataclass
class Replica:
    name: str
    cache: CacheManager
    sched: Scheduler
    routed: int = 0
    waiting_first: dict[str, tuple[Request, int]] = field(default_factory=dict)

    def load(self) -> ReplicaLoad:
        usage = self.cache.usage()
        free = usage["free"] + usage["cached"]
        return ReplicaLoad(len(self.sched.running), len(self.sched.waiting), free, usage["total"])


def make_plan(model: str, gib: float) -> tuple[MemoryPlan, CacheConfig]:
    cfg = CacheConfig(platform="cuda", attention_backend="flashinfer", memory_bytes=int(gib * GIB))
    return plan_for_config(load_preset(model), cfg), cfg


def make_replica(name: str, plan: MemoryPlan, cfg: CacheConfig) -> Replica:
    cm = CacheManager(plan, cfg)
    cm.enable_events()
    sched = Scheduler(cm, SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192))
    return Replica(name, cm, sched)


def replay(n: int, policy: str, plan: MemoryPlan, cfg: CacheConfig, scale, seed: int) -> dict:
    replicas = {f"r{i}": make_replica(f"r{i}", plan, cfg) for i in range(n)}
    index = PrefixIndex(IndexSpec.from_plan(plan))
    router = Router(policy, list(replicas), index=index)
    rng = random.Random(seed + 1)
    work = capacity.make_workload("multi_turn", seed, scale)
    ttft: list[int] = []
    tick = 0

    def route(req: Request) -> None:
        loads = {name: r.load() for name, r in replicas.items()}
        rep = replicas[router.choose(req.all_token_ids, loads)]
        rep.sched.add_request(req)
        rep.routed += 1
        rep.waiting_first[req.request_id] = (req, tick)

    for req in work.initial():
        route(req)
    while any(r.sched.has_unfinished for r in replicas.values()):
        tick += 1
        finished: list[Request] = []
        for rep in replicas.values():
            finished += _step(rep, rng, ttft, tick)
            index.apply(rep.name, rep.cache.drain_events())
        for req in finished:
            for nxt in work.on_finish(req):
                route(nxt)
    return _row(n, policy, replicas, ttft, tick)


def _step(rep: Replica, rng: random.Random, ttft: list[int], tick: int) -> list[Request]:
    if not rep.sched.has_unfinished:
        return []
    out = rep.sched.schedule()
    sampled = {c.request_id: rng.randrange(capacity.VOCAB) for c in out.chunks if c.samples}
    for rid in sampled:
        if rid in rep.waiting_first:
            _, arrived = rep.waiting_first.pop(rid)
            ttft.append(tick - arrived)
    return rep.sched.update(out, sampled)


def _row(n: int, policy: str, replicas: dict[str, Replica], ttft: list[int], ticks: int) -> dict:
    stats = [r.cache.stats for r in replicas.values()]
    prompt = sum(s.query_tokens for s in stats)
    hit = sum(s.hit_tokens for s in stats)
    requests = sum(s.queries for s in stats)
    return {
        "replicas": n,
        "policy": policy,
        "hit_rate": round(hit / max(1, prompt), 4),
        "prefill_per_request": round((prompt - hit) / max(1, requests), 1),
        "ttft_ticks": round(sum(ttft) / max(1, len(ttft)), 2),
        "busiest_share": round(max(r.routed for r in replicas.values()) / max(1, requests), 3),
        "ticks": ticks,
        "preemptions": sum(r.sched.num_preemptions for r in replicas.values()),
    }


def run(counts: list[int], scale, seed: int, gib: float) -> list[dict]:
    plan, cfg = make_plan(MODEL, gib)
    rows = []
    base = replay(1, "round_robin", plan, cfg, scale, seed)
    base["policy"] = "single"
    rows.append(base)
    for n in counts:
        for policy in POLICIES:
            t0 = time.perf_counter()
            row = replay(n, policy, plan, cfg, scale, seed)
            row["of_single"] = round(row["hit_rate"] / max(1e-9, base["hit_rate"]), 3)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
    return rows


COLUMNS = [
    ("replicas", 8),
    ("policy", 13),
    ("hit_rate", 8),
    ("of_single", 9),
    ("prefill_per_request", 11),
    ("ttft_ticks", 10),
    ("busiest_share", 13),
    ("preemptions", 11),
]


def print_table(rows: list[dict]) -> None:
    print("  ".join(k.ljust(w) for k, w in COLUMNS))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(w) for k, w in COLUMNS), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="400 requests, 32 open conversations")
    p.add_argument("--json", action="store_true")
    p.add_argument("--replicas", nargs="*", type=int, default=[2, 8])
    p.add_argument("--gib", type=float, default=40.0, help="cache memory per replica")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    scale = (
        capacity.Scale(multi_requests=400, open_conversations=32) if args.quick else (capacity.FULL)
    )
    rows = run(args.replicas, scale, args.seed, args.gib)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            f"data-parallel routing: {MODEL}, multi_turn ({scale.multi_requests} requests, "
            f"{scale.open_conversations} open conversations), {args.gib:g} GiB per replica, "
            f"seed {args.seed}"
        )
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
