"""Speculative decoding with the checkpoint's own multi-token-prediction layers (method "mtp").

Every family with MTP weights (Qwen3-Next, Qwen3.5 dense and MoE, DeepSeek-V3): the drafts the
engine makes equal those of a reference built from transformers' modules on the same weights
(`mtp_checkpoints`), in every step, through rejections and rewinds; greedy tokens equal
transformers' under page allocation, multi-turn prefix hits, chunked prefill, preemption and
tensor parallelism 2; the prefix cache hits what it hits without speculation.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridkv.core.scheduler import replace_drafts
from hybridkv.engine import Engine
from hybridkv.layers.linear import native_small_linear
from hybridkv.ops import native
from hybridkv.sampling_params import SamplingParams
from tests.distributed import test_tensor_parallel as dense
from tests.distributed import test_tp_mla as mla
from tests.distributed import test_tp_state_families as state
from tests.models.conformance import CASES, NEW_TOKENS, TURNS, check_case, make_family
from tests.models.utils import engine_greedy
from tests.spec_decode.mtp_checkpoints import add_mtp, reference_drafts

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
BUILDERS = {
    "qwen3_next": dense.qwen3_next_checkpoint,  # GDN + gated attention, MoE
    "qwen3_5": dense.qwen3_5_checkpoint,  # dense MLPs (the MTP layer's too)
    "qwen3_5_moe": dense.qwen3_5_moe_checkpoint,
    "deepseek_v3": mla.deepseek_v3,  # MLA; the MTP block is MoE
}
FULL = ("qwen3_next", "deepseek_v3")  # every cache setting; the others: multi-turn
SETTINGS = {c.name: c for c in CASES if c.name in ("page", "multi-turn", "chunked", "preempt")}

one_thread = state.one_thread  # one intra-op thread (autouse)


@dataclasses.dataclass
class MtpFamily:
    fam: object
    hf: object
    mtp: object


_BUILT: dict[str, MtpFamily] = {}  # one build per family for the module (pytest tears a
# parametrized module fixture down whenever consecutive tests change its parameter)


@pytest.fixture(scope="module", params=list(BUILDERS))
def mtp_family(request, tmp_path_factory) -> MtpFamily:
    name = request.param
    if name not in _BUILT:
        folder, hf = BUILDERS[name](tmp_path_factory)
        mtp = add_mtp(folder, hf)
        _BUILT[name] = MtpFamily(make_family(folder, hf, hf.config.vocab_size), hf, mtp)
    return _BUILT[name]


def record_drafts(engine: Engine) -> list[tuple[str, int, tuple[int, ...]]]:
    """(request id, tokens before the drafts, drafts) of every step from now on."""
    seen: list[tuple[str, int, tuple[int, ...]]] = []
    execute = engine.runner.execute

    def recording(out):
        result = execute(out)
        for c in out.chunks:
            if c.request_id in result.drafts:
                seen.append((c.request_id, c.start + c.num_known, result.drafts[c.request_id]))
        return result

    engine.runner.execute = recording
    return seen


def test_drafts_equal_the_reference_mtp(mtp_family) -> None:
    """Every draft of every step equals the reference MTP's on the same tokens (its K/V
    cache, the pairs a step leaves for the next, rewinds after rejections, the continuation
    passes), and the greedy tokens are transformers'."""
    seen = check_drafts(mtp_family, Engine(str(mtp_family.fam.folder), dtype="float32",
                                           speculative_config=MTP))  # fmt: skip
    assert any(len(d) == K for _, _, d in seen)


@pytest.mark.parametrize("mtp_family", ["qwen3_next"], indirect=True)
def test_adaptive_k_cuts_mtp_drafts_and_keeps_them_right(mtp_family) -> None:
    """adaptive_k: steps whose drafts were cut (none, while the pairs still run) leave the
    MTP layer's cache as the reference's: later drafts still equal the reference's."""
    engine = Engine(str(mtp_family.fam.folder), dtype="float32",
                    speculative_config={**MTP, "adaptive_k": True})  # fmt: skip
    sched = engine.scheduler
    assert sched.adaptive is not None
    sched.adaptive.probe_every = 4  # probes draft again now and then
    observe = sched.observe_step
    sched.observe_step = lambda out, s: observe(  # type: ignore[method-assign]
        out, 1e-3 * (1 + 0.1 * sum(len(c.token_ids) for c in out.chunks))
    )
    steps = []
    update = sched.update

    def counting(out, sampled):
        steps.append(sum(c.sampling is not None for c in out.chunks))
        return update(out, sampled)

    sched.update = counting  # type: ignore[method-assign]
    seen = check_drafts(mtp_family, engine)
    # (random MTP heads: drafts are rejected, so drafting stops after its first steps)
    assert 0 < len(seen) < sum(steps) - 3  # steps ran without drafts, their pairs still ran


def check_drafts(mtp_family: MtpFamily, engine: Engine) -> list:
    """Three requests: transformers' tokens, every draft the reference MTP's."""
    fam = mtp_family.fam
    seen = record_drafts(engine)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = fam.plain[:3]
    reqs = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[r.request_id] for r in reqs] == [r[:12] for r in fam.plain_ref[:3]]
    by_id = {r.request_id: i for i, r in enumerate(reqs)}
    assert len({rid for rid, _, _ in seen}) == 3
    for rid, num_tokens, drafts in seen:
        i = by_id[rid]
        ids = prompts[i] + fam.plain_ref[i][: num_tokens - len(prompts[i])]
        want = reference_drafts(mtp_family.hf, mtp_family.mtp, ids, len(drafts))
        assert list(drafts) == want, (rid, num_tokens)
    assert engine.spec_stats.num_draft_tokens == sum(len(d) for _, _, d in seen)
    return seen


@pytest.mark.parametrize(
    ("mtp_family", "setting"),
    [(f, s) for f in BUILDERS for s in SETTINGS if f in FULL or s == "multi-turn"],
    indirect=["mtp_family"],
)
def test_greedy_with_mtp_matches_transformers(mtp_family, setting) -> None:
    check_case(mtp_family.fam, SETTINGS[setting], speculative_config=MTP)


def test_prefix_cache_hits_are_the_ones_without_mtp(mtp_family) -> None:
    """A second turn hits the first turn's blocks (and state snapshots) exactly as without
    speculation: the MTP layer's blocks are hashed and shared with its group's."""
    fam = mtp_family.fam
    stats = []
    for spec in (None, MTP):
        engine = Engine(str(fam.folder), dtype="float32", kernel_block_size=4,
                        speculative_config=spec)  # fmt: skip
        assert engine_greedy(engine, fam.plain[:TURNS], NEW_TOKENS) == fam.plain_ref[:TURNS]
        assert engine_greedy(engine, fam.turns, NEW_TOKENS) == fam.turn_ref
        stats.append(dataclasses.asdict(engine.cache.stats))
        if spec is not None:
            assert engine.spec_stats.num_draft_tokens > 0
    assert stats[1] == stats[0] and stats[0]["hit_tokens"] > 0


def test_the_mtp_layer_is_a_cache_layer_of_the_plan(mtp_family) -> None:
    engine = Engine(str(mtp_family.fam.folder), dtype="float32", speculative_config=MTP)
    names = [n for g in engine.plan.groups for n in g.layer_names]
    assert any(n.startswith("mtp.layers.0.") for n in names), names
    plain = Engine(str(mtp_family.fam.folder), dtype="float32")
    plain_names = [n for g in plain.plan.groups for n in g.layer_names]
    assert not any(n.startswith("mtp.") for n in plain_names)
    assert plain.model.mtp is None


@pytest.mark.parametrize("mtp_family", FULL, indirect=True)
def test_tensor_parallel_mtp(mtp_family) -> None:
    """TP = 2: the MTP layer is sharded like the target's; rank 0's argmax reaches the other
    rank by one all-reduce per pass; transformers' tokens."""
    check_case(mtp_family.fam, SETTINGS["multi-turn"], speculative_config=MTP,
               tensor_parallel_size=2)  # fmt: skip


def right_drafts(engine: Engine, refs: dict[tuple[int, ...], list[int]]) -> None:
    """The MTP passes run as always (what they draft is still recorded), then their drafts are
    replaced by the right tokens (`refs`: each prompt's greedy continuation): every draft is
    accepted, so a request's next pass 1 has k + 1 pairs, the same for every request."""
    drafter, scheduler = engine.runner.mtp, engine.scheduler
    step = drafter.step

    def with_right_drafts(chunks):
        chunks, drafts = step(chunks)
        right = {}
        for rid, made in drafts.items():
            req = scheduler.request(rid)
            j = req.num_output_tokens
            ref = refs[tuple(req.prompt_token_ids)][j : j + len(made)]
            right[rid] = tuple(ref) + made[len(ref) :]
        return replace_drafts(chunks, right), right

    drafter.step = with_right_drafts


def run_mtp(mtp_family: MtpFamily, oracle: bool, **kwargs) -> tuple[list, list, Engine]:
    """Greedy tokens of four requests, the drafts the MTP passes made, and the engine."""
    fam = mtp_family.fam
    engine = Engine(str(fam.folder), dtype="float32", speculative_config=MTP, **kwargs)
    seen = record_drafts(engine)  # (the MTP's own drafts: recorded before any replacement)
    prompts = fam.plain[:4]
    if oracle:
        right_drafts(engine, {tuple(p): r for p, r in zip(prompts, fam.plain_ref, strict=False)})
    assert engine_greedy(engine, prompts, NEW_TOKENS) == fam.plain_ref[:4]
    return seen, engine_greedy(engine, prompts[:1], 8), engine


@pytest.mark.parametrize("oracle", [False, True], ids=["own-drafts", "right-drafts"])
def test_captured_mtp_passes_draft_what_eager_ones_draft(mtp_family, oracle) -> None:
    """Uniform MTP passes run captured (the one-pair passes, and with every draft accepted
    pass 1's k + 1 pairs per request): the same drafts and tokens as with capture off, shapes
    captured under the decode steps' policy (one pair: at the second sight; k + 1 pairs: at the
    first, once a shape was captured)."""
    eager_seen, eager_tail, eager = run_mtp(mtp_family, oracle, enforce_eager=True)
    seen, tail, engine = run_mtp(mtp_family, oracle)
    assert eager.runner.mtp.graphs is None
    assert seen == eager_seen and tail == eager_tail
    assert any(len(d) == K for _, _, d in seen)
    graphs = engine.runner.mtp.graphs
    if native.library() is None or not native_small_linear(torch.float32):
        pytest.skip("no native small-batch linears here: nothing is captured")
    if graphs.disabled is not None:  # (a one-pair pass was refused: every pass stays eager)
        assert graphs.disabled.startswith("computes outside native kernels: "), graphs.disabled
        assert graphs.replays == 0 and not graphs.passes
        return
    assert graphs.replays > 0 and not graphs.refused, graphs.refused
    one_pair = [s for s in graphs.passes if s[1] == 1]
    assert one_pair and all(graphs.seen[s] == 2 for s in one_pair), graphs.seen
    if oracle:
        wide = [s for s in graphs.passes if s[1] == K + 1]
        assert wide and all(graphs.seen[s] == 1 for s in wide), graphs.seen


@pytest.mark.parametrize("mtp_family", ["qwen3_5"], indirect=True)
def test_an_mtp_layer_with_pytorch_ops_keeps_its_passes_eager(mtp_family, monkeypatch, caplog):
    """torch.cat in the MTP forward (as before the native concatenation): the first one-pair
    pass's capture is refused, said once in the log; every pass runs eagerly, drafts and
    tokens unchanged, and the decode steps are still captured."""
    from hybridkv.models import qwen3_next
    from hybridkv.ops.elementwise import torch_concat

    if native.library() is None or not native_small_linear(torch.float32):
        pytest.skip("no native small-batch linears here: nothing is captured")
    eager_seen, eager_tail, _ = run_mtp(mtp_family, True, enforce_eager=True)
    monkeypatch.setattr(qwen3_next, "concat", torch_concat)
    with caplog.at_level("INFO", logger="hybridkv"):
        seen, tail, engine = run_mtp(mtp_family, True)
    assert seen == eager_seen and tail == eager_tail
    graphs = engine.runner.mtp.graphs
    assert graphs.disabled == "computes outside native kernels: aten.cat.default"
    assert graphs.replays == 0 and not graphs.passes and list(graphs.seen.values()) == [2]
    assert caplog.text.count("MTP passes of this model run eagerly") == 1
    assert engine.runner.graphs.disabled is None and engine.runner.graphs.replays > 0


def test_mtp_needs_mtp_layers(tmp_path_factory) -> None:
    folder, _ = mla.deepseek_v2(tmp_path_factory)  # DeepSeek-V2: no MTP layers
    with pytest.raises(ValueError, match="needs a checkpoint with multi-token-prediction"):
        Engine(str(folder), speculative_config={"method": "mtp"})


def test_mtp_refusals(mtp_family, tmp_path) -> None:
    folder = mtp_family.fam.folder
    with pytest.raises(ValueError, match="draft_sample_method 'probabilistic' is not supported"):
        Engine(str(folder), speculative_config={"method": "mtp", "draft_sample_method":
                                                "probabilistic"})  # fmt: skip
    # a checkpoint declaring two MTP layers (none released has more than one)
    for f in folder.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = config["mtp_num_hidden_layers"] = 2
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="checkpoints with 2 MTP layers are not supported"):
        Engine(str(tmp_path), speculative_config={"method": "mtp"})
