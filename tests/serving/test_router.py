"""Cache-aware routing over two in-process engines: the index predicts each engine's lookup."""

from __future__ import annotations

import random

import pytest

from hybridkv.core.coordinator import SimpleRequest
from hybridkv.engine import DEFAULT_MODEL, Engine
from hybridkv.sampling_params import SamplingParams
from hybridkv.serving.router import (
    IndexSpec,
    PrefixIndex,
    ReplicaLoad,
    Router,
    load_of,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_engine(**kw) -> Engine:
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", max_model_len=1024, **kw)
    engine.cache.enable_events()
    return engine


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {"a": make_engine(), "b": make_engine()}


def run(engine: Engine, prompt: list[int]) -> list[int]:
    req = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished:
        engine.step()
    return list(req.all_token_ids)


def lookup(engine: Engine, prompt: list[int]) -> int:
    probe = SimpleRequest(f"probe-{random.random()}", list(prompt), len(prompt))
    hit = engine.cache.lookup(probe).num_tokens
    engine.cache.free(probe)  # forgets the lookup's hashes
    return hit


def sync(index: PrefixIndex, engines: dict[str, Engine]) -> None:
    for name, engine in engines.items():
        index.apply(name, engine.cache.drain_events())


def user_turn(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def converse_and_check(engines: dict[str, Engine], index: PrefixIndex, seed: int) -> int:
    """Two interleaved conversations on replica "a"; before each turn the index's hit for the
    turn's prompt (and for prompts sharing only part of it) equals a's lookup, b's is 0.
    Returns how many of the checked prompts hit."""
    rng = random.Random(seed)
    a = engines["a"]
    system = user_turn(rng, 300)
    histories = [system + user_turn(rng, 40), system + user_turn(rng, 60)]
    hits = 0
    for turn in range(6):
        c = turn % 2
        prompt = histories[c] + user_turn(rng, rng.randint(10, 50))
        cut = rng.randint(1, len(prompt) - 1)
        probes = [prompt, prompt[:cut] + user_turn(rng, 30), system + [7, 7, 7], prompt[:-5]]
        sync(index, engines)
        for p in probes:
            expected = lookup(a, p)
            assert index.hit_tokens("a", p) == expected, (turn, len(p))
            assert index.hit_tokens("b", p) == 0
            hits += expected > 0
        histories[c] = run(a, prompt)
    return hits


@pytest.mark.parametrize(
    "kw",
    [
        {"kernel_block_size": 16},  # block mode, kernel blocks smaller than the page
        {"allocation": "page"},
        {"allocation": "page", "num_pages": 10},  # small pool: evictions
    ],
    ids=["block", "page", "page-evicting"],
)
def test_index_equals_lookup(kw):
    engines = {"a": make_engine(**kw), "b": make_engine(**kw)}
    index = PrefixIndex(IndexSpec.from_plan(engines["a"].plan))
    hits = converse_and_check(engines, index, seed=len(kw))
    assert hits >= 6
    if "num_pages" in kw:
        assert engines["a"].cache.pool.num_evictions > 0
    index.forget("a")
    assert index.replicas == ["b"] and index.hit_tokens("a", list(range(500))) == 0


def test_router_policies(engines):
    index = PrefixIndex(IndexSpec.from_plan(engines["a"].plan))
    rng = random.Random(3)
    prompt = user_turn(rng, 400)
    history = run(engines["a"], prompt)
    sync(index, engines)
    follow_up = history + user_turn(rng, 20)
    assert index.hit_tokens("a", follow_up) == lookup(engines["a"], follow_up) > 0

    loads = {name: load_of(e) for name, e in engines.items()}
    router = Router("prefix_aware", ["a", "b"], index=index)
    assert router.choose(follow_up, loads) == "a"
    assert {router.choose(user_turn(rng, 300), loads) for _ in range(4)} == {"a", "b"}

    busy = {"a": ReplicaLoad(20, 5, 400, 769), "b": ReplicaLoad(1, 0, 400, 769)}
    assert router.choose(follow_up, busy) == "b"  # queue 25 > 1 + 8
    short = {"a": ReplicaLoad(0, 0, 10, 769), "b": ReplicaLoad(0, 0, 700, 769)}
    assert router.choose(follow_up, short) == "b"  # free pages under 5%
    mild = {"a": ReplicaLoad(5, 0, 400, 769), "b": ReplicaLoad(0, 0, 400, 769)}
    assert router.choose(follow_up, mild) == "a"  # within the threshold: the hit wins

    rr = Router("round_robin", ["a", "b"])
    assert [rr.choose(follow_up, busy) for _ in range(4)] == ["a", "b", "a", "b"]
    least = Router("least_loaded", ["a", "b"])
    assert least.choose(follow_up, busy) == "b"
    assert least.choose([1], {"a": ReplicaLoad(1, 0, 5, 9), "b": ReplicaLoad(1, 0, 9, 9)}) == "b"

    router.remove_replica("a")
    assert router.choose(follow_up, loads) == "b" and "a" not in index.replicas


def test_router_rejects_unknown_policy_and_missing_index():
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_aware"):
        Router("random", ["a"])
    with pytest.raises(ValueError, match="needs index"):
        Router("prefix_aware", ["a"])
