"""Captured decode steps (hybridkv.worker.graphs): a replayed step computes exactly what the
eager step computes (same tokens, same log-probabilities bit for bit), for every batch size it
meets, across preemption, prefix-cache hits and requests that finish at different times."""

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.layers.linear import native_small_linear
from hybridkv.layers.quantization import W8A8_LINEAR
from hybridkv.ops.native import int8_linear as native_int8
from tests.models.utils import prompts, save_model, seeded
from tests.ops.test_native import needs_compiler

pytestmark = needs_compiler
VOCAB = 96


def granite(tmp_path_factory, experts: int = 0, name: str = "granite"):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=experts,
        num_experts_per_tok=2, position_embedding_type="rope", initializer_range=0.1,
        attention_multiplier=0.25, embedding_multiplier=2.0, residual_multiplier=0.7,
        logits_scaling=0.5, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return save_model(seeded(GraniteMoeHybridForCausalLM, cfg), tmp_path_factory.mktemp(name))


def qwen3_windowed(tmp_path_factory):
    """Qwen3 with sliding-window layers (the window shorter than the prompts)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
        use_sliding_window=True, sliding_window=7, max_window_layers=1,
        max_position_embeddings=512,
    )  # fmt: skip
    return save_model(seeded(Qwen3ForCausalLM, cfg), tmp_path_factory.mktemp("qwen3w"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return granite(tmp_path_factory)


def results(outs) -> list:
    """Each request's tokens and per-token log-probabilities (None without them)."""
    return [(o.token_ids, o.logprobs) for o in outs]


def run(folder, prompt_ids, params, **kwargs):
    """Tokens and log-probabilities of every request, and the engine's DecodeGraphs."""
    llm = LLM(str(folder), **kwargs)
    return results(llm.generate(prompt_ids, params)), llm.engine.runner.graphs


def expect_capture(graphs, dtype: str = "float32", quantization: str | None = None) -> None:
    """Steps were captured and replayed where this build has native small-batch linears for
    the weights (AVX-512); without them the capture is refused and every step runs eagerly."""
    if quantization == "int8":
        native = native_int8.available()
    elif quantization == "w8a8":  # a native kernel (AMX-INT8 or AVX2), not the reference
        native = W8A8_LINEAR.chain(torch.device("cpu"), torch.float32).describe() != "torch"
    else:
        native = native_small_linear(getattr(torch, dtype))
    if native:
        assert graphs.disabled is None, graphs.disabled
        assert graphs.replays > 0
    else:  # (refused for the model at its first decode shape, else per verify shape)
        assert graphs.replays == 0
        why = [graphs.disabled] if graphs.disabled else list(graphs.refused.values())
        assert why and all(w.startswith("computes outside native kernels: ") for w in why), why


def uneven_params(n: int) -> list[SamplingParams]:
    """Greedy with log-probabilities, each request stopping at its own length (the batch
    shrinks one request at a time: every size down to 1 is met)."""
    return [
        SamplingParams(max_tokens=6 + 3 * i, temperature=0, logprobs=2, ignore_eos=True)
        for i in range(n)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_equal_eager_ones(dense, dtype):
    ids = prompts(VOCAB, [5, 17, 9, 30, 12])
    params = uneven_params(len(ids))
    eager, none = run(dense, ids, params, dtype=dtype, enforce_eager=True)
    captured, graphs = run(dense, ids, params, dtype=dtype)
    assert none is None
    assert captured == eager  # tokens and log-probabilities, bit for bit
    expect_capture(graphs, dtype)
    if graphs.replays:
        # every batch size the run met, one token each
        assert set(graphs.steps) == {(n, 1) for n in (1, 2, 3, 4, 5)}


def test_int8_weights_capture_too(dense):
    ids = prompts(VOCAB, [8, 21, 3])
    params = uneven_params(len(ids))
    eager, _ = run(dense, ids, params, quantization="int8", enforce_eager=True)
    captured, graphs = run(dense, ids, params, quantization="int8")
    assert captured == eager
    expect_capture(graphs, quantization="int8")


def test_w8a8_weights_capture_too(dense):
    """The native w8a8 kernel (activations rounded to int8 inside it) is recorded and replayed:
    replays equal eager steps bit for bit; without one the reference stays eager."""
    ids = prompts(VOCAB, [8, 21, 3])
    params = uneven_params(len(ids))
    eager, _ = run(dense, ids, params, quantization="w8a8", enforce_eager=True)
    captured, graphs = run(dense, ids, params, quantization="w8a8")
    assert captured == eager
    expect_capture(graphs, quantization="w8a8")


def test_seeded_sampling_is_unchanged(dense):
    ids = prompts(VOCAB, [6, 6, 14])
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=3)
    eager, _ = run(dense, ids, params, enforce_eager=True)
    captured, graphs = run(dense, ids, params)
    assert captured == eager
    expect_capture(graphs)


def test_preemption_and_prefix_hits_between_replays(dense):
    """A pool too small for every request at once (requests preempted and resumed) and prompts
    sharing a prefix (hits on snapshots copied into pages before the step)."""
    ids = prompts(VOCAB, [20, 26, 23, 31], shared=16)
    params = [
        SamplingParams(max_tokens=30 + 5 * i, temperature=0, logprobs=2, ignore_eos=True)
        for i in range(len(ids))
    ]
    kwargs = dict(num_pages=8, kernel_block_size=8, max_num_seqs=4)
    eager, _ = run(dense, ids, params, enforce_eager=True, **kwargs)
    llm = LLM(str(dense), **kwargs)
    assert results(llm.generate(ids, params)) == eager
    expect_capture(llm.engine.runner.graphs)
    assert llm.engine.scheduler.num_preemptions > 0


def test_sliding_window_attention_captures(tmp_path_factory):
    folder = qwen3_windowed(tmp_path_factory)
    ids = prompts(VOCAB, [15, 4, 11])
    params = uneven_params(len(ids))
    eager, _ = run(folder, ids, params, enforce_eager=True)
    captured, graphs = run(folder, ids, params)
    assert captured == eager
    expect_capture(graphs)


def test_a_model_with_pytorch_ops_in_its_step_stays_eager(tmp_path_factory, caplog, monkeypatch):
    """gpt-oss with its clamped SwiGLU experts on PyTorch (as where the native kernel does not
    take them): the capture is refused, said once in the log, and every step runs eagerly."""
    from hybridkv.layers import moe
    from tests.models.test_gpt_oss import build_default

    monkeypatch.setattr(moe, "clamped_experts_fit", lambda *a: False)
    folder = save_model(build_default(), tmp_path_factory.mktemp("gpt_oss"))
    ids = prompts(VOCAB, [7, 12])
    params = uneven_params(len(ids))
    eager, _ = run(folder, ids, params, enforce_eager=True)
    with caplog.at_level("INFO", logger="hybridkv"):
        captured, graphs = run(folder, ids, params)
    assert captured == eager
    # (the experts' aten ops; the linears' mkldnn ones first without AVX-512)
    assert graphs.disabled.startswith("computes outside native kernels: ")
    assert graphs.replays == 0 and not graphs.steps
    assert "run eagerly" in caplog.text


def test_bfloat16_granite_moe_captures_on_amx(tmp_path_factory):
    """In bfloat16 on an AMX CPU the MoE's router and experts are native kernels, so the same
    MoE checkpoint's decode steps are captured and equal the eager ones."""
    from hybridkv.ops.native import moe

    if not moe.available():
        pytest.skip("no AMX-BF16 kernels here (the MoE stays in PyTorch: eager steps)")
    folder = granite(tmp_path_factory, experts=4, name="granite-moe-bf16")
    ids = prompts(VOCAB, [7, 12, 3])
    params = uneven_params(len(ids))
    eager, _ = run(folder, ids, params, dtype="bfloat16", enforce_eager=True)
    captured, graphs = run(folder, ids, params, dtype="bfloat16")
    assert captured == eager
    assert graphs.disabled is None and graphs.replays > 0


def test_sizes_above_the_limit_run_eagerly(dense):
    ids = prompts(VOCAB, [5, 6, 7, 8])
    params = SamplingParams(max_tokens=8, temperature=0)
    eager, _ = run(dense, ids, params, enforce_eager=True)
    captured, graphs = run(dense, ids, params, max_capture_size=2)
    assert captured == eager
    assert max((s for s, _ in graphs.steps), default=0) <= 2


def test_capture_settings_are_checked(dense):
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_capture_size must be an integer >= 0"):
            LLM(str(dense), max_capture_size=bad)
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        LLM(str(dense), enforce_eager="yes")
    assert LLM(str(dense), max_capture_size=0).engine.runner.graphs is None


def test_threads_may_change_between_replays(dense):
    """A replay uses however many threads OpenMP has at that moment (CpuShare changes it)."""
    ids = prompts(VOCAB, [9, 13])
    params = uneven_params(len(ids))
    eager, _ = run(dense, ids, params, enforce_eager=True)
    llm = LLM(str(dense))
    before = torch.get_num_threads()
    try:
        first = results(llm.generate(ids, params))
        torch.set_num_threads(2 if before == 1 else 1)
        second = results(llm.generate(ids, params))
    finally:
        torch.set_num_threads(before)
    assert first == eager and second == eager
    expect_capture(llm.engine.runner.graphs)


def qwen3_5(tmp_path_factory):
    """Qwen3.5 dense: gated delta net layers (per-position states kept natively in verify
    steps) and gated attention."""
    from tests.models.test_qwen3_next import build

    return build(tmp_path_factory, "qwen3_5")[0]


@pytest.mark.parametrize("family", ["granite", "qwen3_5"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_steps_replay_like_eager_ones(family, dtype, tmp_path_factory, monkeypatch):
    """Speculative decoding's uniform verify steps (q tokens per request, attention as decode
    rows, state layers on q-token chunks keeping every position's state) are captured per
    (requests, q), none refused, and replay the eager step's numbers: same tokens with drafts
    as without, captured or eager."""
    from hybridkv.engine import Engine

    dense = (granite if family == "granite" else qwen3_5)(tmp_path_factory)

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    ids = prompts(VOCAB, [5, 17, 9, 30])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    init = Engine.__init__

    def always_k(self, *args, **kwargs):  # every step of a request drafts 3 (uniform shapes)
        init(self, *args, **kwargs)
        if self.proposer is not None:
            self.scheduler.drafter = lambda req, k: [int(req.all_token_ids[-1])] * k

    monkeypatch.setattr(Engine, "__init__", always_k)
    plain, _ = run(dense, ids, params, dtype=dtype)
    eager, _ = run(dense, ids, params, dtype=dtype, enforce_eager=True, speculative_config=spec)
    captured, graphs = run(dense, ids, params, dtype=dtype, speculative_config=spec)
    assert captured == eager == plain
    expect_capture(graphs, dtype)
    if graphs.replays:
        assert any(q > 1 for _, q in graphs.steps), graphs.steps
        assert not graphs.refused, graphs.refused
        # the first shape captured waited for its second step (an eager one computed what the
        # kernels keep with the weights); a verify shape after it captured at its first
        first, *later = list(graphs.steps)
        assert graphs.seen[first] == 2
        assert all(graphs.seen[shape] == 1 for shape in later if shape[1] > 1), graphs.seen


def test_replays_expose_the_hidden_states_of_their_logits(dense):
    """A replay's `hidden` is what its logits came from (rewritten by every replay, not the
    capture step's): the MTP drafter takes it (speculative decoding, method "mtp")."""
    llm = LLM(str(dense), dtype="float32")
    graphs = llm.engine.runner.graphs
    model = llm.engine.runner.model
    checked = []
    replay = graphs.logits

    def checking(chunks):
        logits = replay(chunks)
        if logits is not None:
            checked.append(torch.equal(model.compute_logits(graphs.hidden), logits))
        return logits

    graphs.logits = checking
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for lengths in ([5, 9, 3], [4], [6, 2, 7]):  # size 3 replays after size 1 was captured
        llm.generate(prompts(VOCAB, lengths), params)
    expect_capture(graphs)
    if graphs.replays:
        assert len(checked) > 10 and all(checked)
