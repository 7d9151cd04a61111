"""Speculative decoding in the engine: n-gram drafts verified in decode steps.

Greedy decoding with drafts must give transformers' tokens exactly, on every kind of cache:
attention only, sliding windows with sinks, MLA, and every state kind (whose rejected drafts are
undone by committing the state kept after the last accepted position where the state ops keep
per-position states, the native Mamba2 ops, else by restoring the state saved before the verify
step and recomputing), under the cache settings that
stress it (pages, a second turn hitting the first turn's blocks and state snapshots, a pool so
small that requests are preempted). The tiny models' vocabulary (96 tokens) and
`prompt_lookup_min` 1 make drafts frequent and often wrong, so both acceptance and rollback run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.sampling_params import SamplingParams
from tests.distributed import test_tensor_parallel as dense
from tests.distributed import test_tp_mla as mla
from tests.distributed import test_tp_state_families as state
from tests.models.conformance import CASES, NEW_TOKENS, Family, check_case, make_family
from tests.models.test_mamba2 import transformers_norms_groups

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}  # fmt: skip
FAMILIES = {
    "granite": dense.granite,  # Mamba2 + attention
    "llama": dense.llama_checkpoint,  # attention only
    "qwen3_next": dense.qwen3_next_checkpoint,  # gated delta net + gated attention
    "jamba": state.jamba,  # Mamba1 + attention
    "lfm2": state.lfm2,  # short conv + attention
    "gpt_oss": dense.gpt_oss_checkpoint,  # sliding + full attention, sinks
    "kimi_linear": mla.kimi_linear,  # KDA + MLA
    "mamba2": dense.mamba2_checkpoint,  # state only
}
# block and page allocation, a second turn hitting the first's blocks and state snapshots,
# chunked prefill (a 13-token budget also cuts drafts), a pool that preempts
SETTINGS = {c.name: c for c in CASES if c.name in ("page", "multi-turn", "chunked", "preempt")}

one_thread = state.one_thread  # one intra-op thread (autouse)


_BUILT: dict[str, Family] = {}


def built_family(name: str, tmp_path_factory) -> Family:
    """FAMILIES[name]'s checkpoint and transformers references, built once per process (the
    module's fixture and the tests of other state ops share them)."""
    if name not in _BUILT:
        folder, hf = FAMILIES[name](tmp_path_factory)
        _BUILT[name] = make_family(folder, hf, hf.config.vocab_size)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    if request.param == "mamba2" and not transformers_norms_groups():
        pytest.skip("this transformers normalises Mamba2's gated norm over all n_groups at once")
    return built_family(request.param, tmp_path_factory)


class Oracle:
    """Drafts from transformers' own continuation, some spoiled on purpose: of a request's
    calls c = 0, 1, 2, ..., c % 3 == 0 gets drafts all right (all accepted), c % 3 == 1 the
    last wrong (some accepted), c % 3 == 2 the first wrong (none accepted). Deterministic
    coverage of every verify outcome on every family, where n-gram drafts on random weights
    may never hit."""

    def __init__(self, fam: Family) -> None:
        pairs = [(fam.plain, fam.plain_ref), (fam.shared, fam.shared_ref),
                 (fam.turns, fam.turn_ref)]  # fmt: skip
        self.refs = {tuple(p): r for ps, rs in pairs for p, r in zip(ps, rs, strict=True)}
        self.vocab = fam.vocab
        self.calls: dict[str, int] = {}

    def __call__(self, req, max_drafts: int) -> list[int]:
        j = req.num_output_tokens
        drafts = list(self.refs[tuple(req.prompt_token_ids)][j : j + max_drafts])
        c = self.calls[req.request_id] = self.calls.get(req.request_id, -1) + 1
        if drafts and c % 3:
            at = -1 if c % 3 == 1 else 0
            drafts[at] = (drafts[at] + 1) % self.vocab
        return drafts


def check_with_oracle(family, setting: str, monkeypatch, **kwargs) -> tuple[Engine, int, int]:
    """check_case with `Oracle` drafts (`kwargs` to the engine) -> (the last engine, state
    restores, state commits)."""
    engines: list[Engine] = []
    counts = [0, 0]
    init = Engine.__init__

    def with_oracle(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)
        self.scheduler.drafter = Oracle(family)
        schedule = self.scheduler.schedule

        def counting():
            out = schedule()
            counts[0] += len(out.restores)
            counts[1] += len(out.commits)
            return out

        self.scheduler.schedule = counting

    monkeypatch.setattr(Engine, "__init__", with_oracle)
    case = {c.name: c for c in CASES}[setting]
    check_case(family, case, speculative_config=SPEC, **kwargs)
    stats = engines[-1].spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_tokens_per_pos[0] > 0 and stats.accepted_tokens_per_pos[-1] > 0
    return engines[-1], counts[0], counts[1]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_with_drafts_matches_transformers(family, setting, monkeypatch) -> None:
    """Every verify outcome (all, some, none accepted) on every cache kind gives transformers'
    greedy tokens; a state model rolls its states back after every partial acceptance: by
    committing a kept position where its ops keep them (Mamba2 on the native kernels), else by
    restoring and recomputing."""
    engine, restores, commits = check_with_oracle(family, setting, monkeypatch)
    if not engine.plan.state_groups:
        assert restores == commits == 0
    elif engine.runner.keeps_positions:
        assert commits > 0 and restores == 0, "no state was ever committed"
    else:
        assert restores > 0 and commits == 0, "no state was ever rolled back"


# On a GPU the Triton attention backend takes kernel blocks of multiples of 16 only
GPU_SETTINGS = {
    "page": {},
    "multi-turn": {"kernel_block_size": 16},
    "chunked": {"kernel_block_size": 16},
}


@pytest.mark.gpu
@pytest.mark.parametrize("setting", list(GPU_SETTINGS))
def test_greedy_with_drafts_on_cuda(family, setting, monkeypatch) -> None:
    """The same on a CUDA GPU: attention and state kernels in Triton, the verify chunks'
    per-position states kept through `ops.positions` (one-token sub-batches through the Triton
    decode kernels), rejections committed. float32 means float32 (no TF32 convolutions), so the
    tokens are the CPU reference's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    engine, restores, commits = check_with_oracle(
        family, setting, monkeypatch, **GPU_SETTINGS[setting]
    )
    assert engine.device.type == "cuda"
    if engine.plan.state_groups:
        assert {g.backend for g in engine.plan.state_groups} == {"triton"}
        assert engine.runner.keeps_positions and commits > 0 and restores == 0


@pytest.mark.parametrize("name", ["granite", "qwen3_next", "jamba", "kimi_linear"])
def test_pytorch_state_ops_commit_kept_positions_too(name, tmp_path_factory, monkeypatch):
    """The PyTorch state ops (`state_backend="torch"`: what CUDA's Triton ops run verify steps
    through) keep per-position states too (`ops.positions`): every verify outcome gives
    transformers' tokens, rejections commit."""
    fam = built_family(name, tmp_path_factory)
    engine, restores, commits = check_with_oracle(fam, "page", monkeypatch, state_backend="torch")
    assert all(g.backend == "torch" for g in engine.plan.state_groups)
    assert engine.runner.keeps_positions and commits > 0 and restores == 0


@pytest.mark.parametrize("name", ["granite", "mamba2"])
def test_mamba2_rewinds_where_its_ops_keep_no_positions(name, tmp_path_factory, monkeypatch):
    """The same with the native Mamba2 ops declaring no per-position states: rejections rewind
    (restore + recompute) and the tokens are still transformers'; with them, commits."""
    from hybridkv.ops import native
    from hybridkv.ops.mamba2_ops import NativeMamba2Ops

    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler): Mamba2 runs on torch")
    if name == "mamba2" and not transformers_norms_groups():
        pytest.skip("this transformers normalises Mamba2's gated norm over all n_groups at once")
    fam = built_family(name, tmp_path_factory)
    monkeypatch.setattr(NativeMamba2Ops, "keeps_positions", False)
    engine, restores, commits = check_with_oracle(fam, "page", monkeypatch)
    assert not engine.runner.keeps_positions and restores > 0 and commits == 0


@pytest.fixture(scope="module")
def granite_family(tmp_path_factory):
    return built_family("granite", tmp_path_factory)


def test_ngram_drafts_match_transformers(granite_family) -> None:
    """The real proposer (prompt lookup) on a hybrid: same tokens, drafts accepted."""
    engine = Engine(str(granite_family.folder), dtype="float32", speculative_config=SPEC)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in _run_all(engine, [(p, params) for p in granite_family.plain])]
    assert got == granite_family.plain_ref
    assert engine.spec_stats.num_accepted_tokens > 0


def test_stops_inside_the_accepted_run(granite_family) -> None:
    """max_tokens and stop tokens end a request inside its verified tokens: nothing after the
    stop is kept, and the pool is intact."""
    fam = granite_family
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=SPEC)
    for prompt, ref in zip(fam.plain, fam.plain_ref, strict=True):
        for max_tokens in (1, 2, 5, 7):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            assert _run(engine, prompt, params) == ref[:max_tokens]
        stop = ref[6]
        params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop])
        assert _run(engine, prompt, params) == ref[: ref.index(stop) + 1]
    engine.cache.check_integrity()
    assert engine.cache.usage()["in_use"] == 0
    assert engine.spec_stats.num_accepted_tokens > 0


def test_max_model_len_caps_the_drafts(granite_family) -> None:
    fam = granite_family
    prompt = fam.plain[3]  # 48 tokens
    engine = Engine(str(fam.folder), dtype="float32", max_model_len=len(prompt) + 10,
                    speculative_config=SPEC)  # fmt: skip
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    tokens = _run(engine, prompt, params)
    assert tokens == fam.plain_ref[3][:10]


def test_penalties_bias_and_logprobs_with_drafts(granite_family) -> None:
    """Penalties and logit bias apply row by row (the drafts before a row counted as output),
    log-probs come from each verified token's row: such requests carry drafts too and give what
    they give without speculation, next to plain greedy ones."""
    fam = granite_family
    plain = Engine(str(fam.folder), dtype="float32")
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=SPEC)
    drafted = record_drafted(engine)
    base = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    kinds = [
        SamplingParams(**base),
        SamplingParams(**base, logprobs=2),
        SamplingParams(**base, repetition_penalty=1.3),
        SamplingParams(**base, frequency_penalty=0.8, presence_penalty=0.5),
        SamplingParams(**base, logit_bias={3: 2.5, 7: -1.0}),
    ]
    requests = [(fam.plain[i], p) for i, p in enumerate(kinds)]
    want = _run_all(plain, requests)
    got = _run_all(engine, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].logprobs is not None and len(got[1].logprobs) == NEW_TOKENS
    for a, b in zip(got[1].logprobs, want[1].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    ids = sorted(drafted)
    assert len(ids) == len(kinds), ids  # every kind carried drafts
    assert set(engine.proposer.indexes) <= {r for r in engine.requests}  # discarded when done


def test_seeded_sampling_with_drafts(granite_family) -> None:
    """Random sampling verifies drafts by rejection sampling: a seeded request is reproducible
    and its tokens are in the vocabulary; top_k 1 is greedy whatever the temperature."""
    fam = granite_family
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=SPEC)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    first = _run(engine, fam.plain[2], params)
    assert first == _run(engine, fam.plain[2], params)
    assert len(first) == 24 and all(0 <= t < fam.vocab for t in first)
    top1 = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.5, top_k=1, ignore_eos=True)
    assert _run(engine, fam.plain[0], top1) == fam.plain_ref[0]
    assert engine.spec_stats.num_accepted_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution(granite_family, monkeypatch) -> None:
    """The first token after a prompt whose drafts are forced: with drafts or without, its
    distribution is the target's (a chi-square-like bound over many seeds)."""
    fam = granite_family
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=SPEC)
    prompt = fam.plain[4][:6]
    # the second output token (its drafts: the first, forced) with drafts and without
    counts = torch.zeros(fam.vocab)
    with_drafts = torch.zeros(fam.vocab)
    plain = Engine(str(fam.folder), dtype="float32")
    monkeypatch.setattr(engine, "_drafts", lambda req, k: [int(req.all_token_ids[-1])][:k])
    engine.scheduler.drafter = engine._drafts
    n = 300
    for seed in range(n):
        p = SamplingParams(max_tokens=3, temperature=0.7, top_k=3, ignore_eos=True, seed=seed)
        a = _run(plain, prompt, p)
        b = _run(engine, prompt, p)
        counts[a[1]] += 1
        with_drafts[b[1]] += 1
    # total variation distance between the two empirical distributions
    tv = float((counts / n - with_drafts / n).abs().sum() / 2)
    assert tv < 0.15, tv
    assert engine.spec_stats.num_drafts > 0


def test_mtp_is_refused_with_a_clear_error(granite_family) -> None:
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with multi-token"):
        Engine(str(granite_family.folder), speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="speculative_config"):
        Engine(str(granite_family.folder), speculative_config={"method": "eagle"})


def record_drafted(engine: Engine) -> set[str]:
    """The ids of the requests that carried drafts in any step from now on (filled as the
    engine runs)."""
    drafted: set[str] = set()
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        drafted.update(c.request_id for c in out.chunks if c.num_drafts)
        return out

    engine.scheduler.schedule = recording
    return drafted


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return _run_all(engine, [(prompt, params)])[0].token_ids


def _run_all(engine: Engine, requests):
    ids = [engine.add_request(p, params).request_id for p, params in requests]
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0]
    engine.cache.check_integrity()
    assert engine.cache.usage()["in_use"] == 0
    return [done[i] for i in ids]


def test_grammar_requests_verify_drafts_under_their_masks() -> None:
    """Structured outputs carry drafts too: each verify row is masked by the grammar after the
    drafts before it (the matcher advanced and rolled back), so verification never accepts a
    token the grammar forbids; outputs equal the plain run's, next to free requests."""
    import json

    from hybridkv.engine import DEFAULT_MODEL
    from hybridkv.structured.grammar import GrammarSpec

    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    base = dict(max_tokens=40, temperature=0.0)
    digits = SamplingParams(**base, structured=GrammarSpec("regex", "[0-9]{6}"))
    shaped = SamplingParams(**base, structured=GrammarSpec("json_schema", json.dumps(schema)))
    greedy = SamplingParams(**base, ignore_eos=True)
    requests = [(code, greedy), (code, digits), (code + "\n", greedy), ("{", shaped)]
    want = _run_all(Engine(str(DEFAULT_MODEL), dtype="float32"), requests)
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", speculative_config=SPEC)
    drafted = record_drafted(engine)
    got = _run_all(engine, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].text.isdigit() and len(got[1].text) == 6
    assert set(json.loads(got[3].text)) == {"name", "n"}
    assert len(drafted) == len(requests)  # the grammar requests verified drafts too
    assert engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.distributed
def test_tensor_parallel_verify_steps(granite_family, monkeypatch) -> None:
    """TP = 2: drafts travel in the step's token ids, restores in the step description; every
    rank saves and restores its own shard of the states; transformers' tokens."""
    engines: list[Engine] = []
    init = Engine.__init__

    def with_oracle(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)
        self.scheduler.drafter = Oracle(granite_family)

    monkeypatch.setattr(Engine, "__init__", with_oracle)
    check_case(granite_family, SETTINGS["multi-turn"], speculative_config=SPEC,
               tensor_parallel_size=2)  # fmt: skip
    stats = engines[-1].spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_prefix_cache_hits_are_the_ones_without_drafts(granite_family) -> None:
    """Snapshots land on confirmed positions only (a chunk with drafts ends before the next
    boundary): the same two-turn workload hits the same tokens, with the same snapshots,
    whether drafts run or not."""
    from tests.models.conformance import TURNS
    from tests.models.utils import engine_greedy

    fam = granite_family
    stats = []
    for spec in (None, SPEC):
        engine = Engine(str(fam.folder), dtype="float32", kernel_block_size=4,
                        speculative_config=spec)  # fmt: skip
        if spec is not None:
            engine.scheduler.drafter = Oracle(fam)
        assert engine_greedy(engine, fam.plain[:TURNS], NEW_TOKENS) == fam.plain_ref[:TURNS]
        assert engine_greedy(engine, fam.turns, NEW_TOKENS) == fam.turn_ref
        stats.append(dataclasses.asdict(engine.cache.stats))
    assert stats[1] == stats[0] and stats[0]["hit_tokens"] > 0 and stats[0]["snapshots_taken"] > 0


class RightDrafts:
    """Drafts from transformers' own continuation, all right."""

    def __init__(self, fam: Family) -> None:
        self.refs = {tuple(p): r for p, r in zip(fam.plain, fam.plain_ref, strict=True)}

    def __call__(self, req, max_drafts: int) -> list[int]:
        j = req.num_output_tokens
        return list(self.refs[tuple(req.prompt_token_ids)][j : j + max_drafts])


COSTS = {
    # a step that streams the weights: more rows nearly free
    "memory-bound": lambda n, q: 1e-3 * (1 + 0.01 * n * q),
    # compute-bound, and verify steps run eagerly: a row of one costs more than a decode row
    "compute-bound": lambda n, q: 1e-4 * n * q * (1.5 if q > 1 else 1.0),
}


@pytest.mark.parametrize("bound", list(COSTS))
def test_adaptive_k_follows_the_step_times(granite_family, bound) -> None:
    """adaptive_k with every draft right: where rows are nearly free every step verifies k
    drafts; where they cost more than they return, the engine stops drafting once it has
    measured that. Either way transformers' tokens. (Step times are synthetic: the engine's
    measured ones replaced by a cost model of the shape.)"""
    fam = granite_family
    engine = Engine(str(fam.folder), dtype="float32", enable_prefix_caching=False,
                    speculative_config={**SPEC, "adaptive_k": True})  # fmt: skip
    sched = engine.scheduler
    sched.drafter = RightDrafts(fam)
    observe, cost = sched.observe_step, COSTS[bound]
    sched.observe_step = lambda out, s: observe(  # type: ignore[method-assign]
        out, cost(len(out.chunks), len(out.chunks[0].token_ids) if out.chunks else 1)
    )
    shapes: list[int] = []
    update = sched.update

    def recording(out, sampled):
        shapes.extend(len(c.token_ids) for c in out.chunks if c.sampling is not None)
        return update(out, sampled)

    sched.update = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # one request at a time: batch size 1
        for prompt, ref in zip(fam.plain, fam.plain_ref, strict=True):
            shapes.clear()
            assert [o.token_ids for o in _run_all(engine, [(prompt, params)])] == [ref]
    k1 = SPEC["num_speculative_tokens"] + 1
    decode = shapes[1:]  # (the last request's steps after its prefill)
    if bound == "memory-bound":
        assert decode.count(k1) >= len(decode) - 2
    else:
        assert set(decode) == {1}
    assert engine.scheduler.adaptive is not None
    assert engine.scheduler.adaptive.firsts == {}  # finished requests forgotten


def test_batch_size_schedule_drafts_by_batch_size(granite_family) -> None:
    """num_speculative_tokens_per_batch_size: k drafts alone, none at batch 2 (vLLM's
    dynamic k), transformers' tokens both ways."""
    fam = granite_family
    spec = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=spec)
    engine.scheduler.drafter = RightDrafts(fam)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = _run_all(engine, [(p, params) for p in fam.plain[:2]])
    assert [o.token_ids for o in got] == fam.plain_ref[:2]
    together = engine.spec_stats.num_draft_tokens
    got = _run_all(engine, [(fam.plain[2], params)])
    assert [o.token_ids for o in got] == fam.plain_ref[2:3]
    assert engine.spec_stats.num_draft_tokens > together
    assert together <= 2 * 3  # at most the steps where one of the two ran alone


@pytest.mark.parametrize("keeps", [True, False])
def test_state_scratch_comes_out_of_the_cache_budget(granite_family, monkeypatch, keeps) -> None:
    """The runner's state scratch is the plan's reserved bytes (k states per drafting request
    with per-position states, one when requests rewind), and the pages are what the budget
    holds after it."""
    from hybridkv.ops import native
    from hybridkv.ops.mamba2_ops import NativeMamba2Ops

    monkeypatch.setattr(NativeMamba2Ops, "keeps_positions", keeps)
    budget = 8 * 2**20
    plain = Engine(str(granite_family.folder), dtype="float32", memory_bytes=budget)
    engine = Engine(str(granite_family.folder), dtype="float32", memory_bytes=budget,
                    max_num_seqs=6, speculative_config=SPEC)  # fmt: skip
    plan = engine.plan
    per_page = plan.page_bytes * plan.layers_per_group
    scratch = engine.runner.scratch_bytes
    state_layers = sum(len(g.layer_names) for g in plan.state_groups)
    depth = SPEC["num_speculative_tokens"] if engine.runner.keeps_positions else 1
    # (without a C compiler the plan takes the PyTorch ops, which keep none)
    assert engine.runner.keeps_positions == (keeps and native.library() is not None)
    assert scratch == plan.reserved_bytes == 6 * depth * state_layers * plan.state_bytes
    assert plain.plan.num_pages == budget // per_page
    assert plan.num_pages == (budget - scratch) // per_page < plain.plan.num_pages


def test_scratch_rows_shrink_to_half_the_budget(granite_family) -> None:
    """Where the scratch of every request that may draft would take more than half the budget,
    fewer requests get scratch rows (the rest decode without drafts in that step): the runner,
    the scheduler and the plan agree, and the tokens are still transformers'."""
    plain = Engine(str(granite_family.folder), dtype="float32", memory_bytes=8 * 2**20)
    plan = plain.plan
    per_row = SPEC["num_speculative_tokens"] * plan.state_bytes * sum(
        len(g.layer_names) for g in plan.state_groups
    )
    budget = int(7.9 * per_row)  # half of it holds 3 rows; the rest is the pages (a small pool)
    engine = Engine(str(granite_family.folder), dtype="float32", memory_bytes=budget,
                    max_num_seqs=8, speculative_config=SPEC)  # fmt: skip
    assert engine.plan.scratch_rows == engine.scheduler.num_scratch_rows == 3
    assert engine.runner.scratch_bytes == engine.plan.reserved_bytes == 3 * per_row
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in _run_all(engine, [(p, params) for p in granite_family.plain])]
    assert got == granite_family.plain_ref
    assert engine.spec_stats.num_draft_tokens > 0


def test_metrics_count_the_proposers_drafts_not_fillers(granite_family, monkeypatch) -> None:
    """When one request has drafts, the others of a step that runs captured carry fillers
    (their last token repeated) to give it one shape; the metrics count the proposer's drafts
    only: every draft proposed, none of the fillers, and at most as many accepted."""
    proposed = []
    engine = Engine(str(granite_family.folder), dtype="float32", speculative_config=SPEC)
    first_id = []

    def drafter(req, cap):
        if not first_id:
            first_id.append(req.request_id)
        if req.request_id != first_id[0]:
            return []  # the other request: fillers only
        drafts = [req.all_token_ids[-1]] * cap
        proposed.append(len(drafts))
        return drafts

    engine.scheduler.drafter = drafter
    fillers = [0]
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        others = [c for c in out.chunks if first_id and c.request_id != first_id[0]]
        fillers[0] += sum(c.num_drafts for c in others)
        return out

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in _run_all(engine, [(p, params) for p in granite_family.plain[:2]])]
    assert got == granite_family.plain_ref[:2]
    stats = engine.spec_stats
    assert fillers[0] > 0, "no step carried fillers"
    assert stats.num_draft_tokens == sum(proposed) > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
