"""The `fla` KDA ops: prefill chunks through flash-linear-attention's `chunk_kda`, one-token
requests through hybridkv's Triton decode kernel (`FlaKdaOps`; the routing is `ops.fla_varlen`,
shared with the GDN ops).

Without fla (the CI machine), its kernel is stood in for by the PyTorch reference over fla's
interface ([1, n, ...] packed inputs, cu_seqlens, contiguous float32 [N, H, K, V] states), which
checks the routing: which tokens go where, initial states gathered from pages (zeros where
none), final states written back; the stand-in also asserts the flags that make fla's math
hybridkv's (q, k normalised in the kernel, scale 1/sqrt(K), g taken as the log decay, beta as
it is, [K, V] states). Where fla imports, every keyword the ops pass must be one of chunk_kda's
(it takes **kwargs, so a misspelt flag would pass silently). With fla and a GPU
(benchmarks/gpu_check.sh carries fla-core), the real kernel against the PyTorch reference at a
few head / key / value sizes, and bf16 Kimi-Linear engines on the fla ops against the float32
engine and against transformers' float32 model, each as close as the engine on the triton ops.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.ops.kda import kda_gate, kda_varlen  # noqa: E402
from hybridkv.ops.kda_ops import FlaKdaOps, TorchKdaOps  # noqa: E402
from tests.ops.test_gdn_ops_fla import HAS, LENS, NUM_PAGES, PAGES, _meta  # noqa: E402

HAS_FLA = importlib.util.find_spec("fla") is not None
H, K, V = 2, 16, 16
ROUTING_TOL = dict(rtol=1e-4, atol=1e-5)


def _inputs(lens, dtype, device, heads=H, k_dim=K, v_dim=V, state_dtype=torch.float32, seed=5):
    """Rule inputs as the layer makes them (g from `kda_gate`, beta a sigmoid) and a page pool
    [NUM_PAGES, heads, k_dim, v_dim] whose pages 5 and 7 (requests without a state) are NaN."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = rand(t, heads, k_dim).to(dtype), rand(t, heads, k_dim).to(dtype)
    v = rand(t, heads, v_dim).to(dtype)
    # decays exp(g) mostly in (0.7, 1), as trained models have them
    g = kda_gate(rand(t, heads * k_dim), 0.5 * rand(heads) - 1, 0.5 * rand(heads * k_dim) - 1)
    beta = torch.sigmoid(rand(t, heads))
    state = 0.3 * rand(NUM_PAGES, heads, k_dim, v_dim)
    state[[5, 7]] = float("nan")
    return [x.to(device) for x in (q, k, v, g, beta)], state.to(device, state_dtype)


def _reference_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
                         output_final_state=False, use_qk_l2norm_in_kernel=False,
                         use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         state_v_first=False, cu_seqlens=None, **kwargs):  # fmt: skip
    """fla's `chunk_kda` interface over the PyTorch reference, for the flags that make its math
    hybridkv's: [1, n, ...] inputs, [N, H, K, V] float32 initial states -> ([1, n, H, V] in q's
    dtype, final states float32)."""
    assert not kwargs, kwargs
    assert use_qk_l2norm_in_kernel and not use_gate_in_kernel and not use_beta_sigmoid_in_kernel
    assert output_final_state and not state_v_first and scale == q.shape[-1] ** -0.5
    one, n, heads, k_dim = q.shape
    assert one == 1 and k.shape == q.shape and v.shape[:3] == (1, n, heads)  # fla's checks
    assert g.shape == (1, n, heads, k_dim) and beta.shape == (1, n, heads)
    assert cu_seqlens.dtype == torch.long and bool((cu_seqlens.diff() > 1).all())
    N = cu_seqlens.numel() - 1
    assert initial_state.dtype == torch.float32
    assert initial_state.shape == (N, heads, k_dim, v.shape[-1])
    S = initial_state.clone()
    meta = _meta(cu_seqlens.diff().tolist(), list(range(N)), [1] * N, q.device)
    o = kda_varlen(q[0], k[0], v[0], g[0], beta[0], S, meta.state_pages,
                   meta.has_initial_state, meta.query_start_loc, meta.max_query_len)  # fmt: skip
    return o[None].to(q.dtype), S


def _stand_in(monkeypatch) -> list[dict]:
    """fla.ops.kda.chunk_kda := the reference; returns the keywords of each call."""
    calls: list[dict] = []

    def chunk_kda(*args, **kwargs):
        calls.append(kwargs)
        return _reference_chunk_kda(*args, **kwargs)

    module = types.ModuleType("fla.ops.kda")
    module.chunk_kda = chunk_kda
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", module)
    return calls


@pytest.fixture
def stand_in_fla(monkeypatch):
    return _stand_in(monkeypatch)


def _check_against_torch(inputs, state0, lens, pages, has, tol) -> None:
    """FlaKdaOps against TorchKdaOps on one step: outputs, the written pages, and every other
    page untouched (NaNs included)."""
    meta = _meta(lens, pages, has, state0.device)
    state, want_state = state0.clone(), state0.clone()
    got = FlaKdaOps().rule(*inputs, state, meta)
    want = TorchKdaOps().rule(*inputs, want_state, meta)
    torch.testing.assert_close(got, want, **tol)
    used = sorted(p for p, n in zip(pages, lens, strict=True) if n > 0)
    torch.testing.assert_close(state[used].float(), want_state[used].float(), **tol)
    unused = [p for p in range(state0.shape[0]) if p not in used]
    assert torch.equal(state[unused].isnan(), state0[unused].isnan())
    assert torch.equal(state[unused].nan_to_num(), state0[unused].nan_to_num())


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.triton  # the decode kernel: compiled on a GPU, else interpreted
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_routing_through_fla_interface(stand_in_fla, state_dtype):
    """A mixed step (prefill from nothing and from a state, decodes with and without one, a
    two-token chunk, an empty slot): one fla call for the three longer requests, in order."""
    inputs, state0 = _inputs(LENS, torch.float32, _device(), state_dtype=state_dtype)
    tol = ROUTING_TOL if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    _check_against_torch(inputs, state0, LENS, PAGES, HAS, tol)
    assert len(stand_in_fla) == 1


@pytest.mark.triton
@pytest.mark.parametrize(
    ("lens", "pages", "has", "fla_calls"),
    [
        ([5, 3], [1, 4], [0, 1], 1),
        ([1, 1, 1], [0, 3, 6], [1, 0, 1], 0),
        ([1, 4], [2, 0], [1, 0], 1),
    ],
)
@torch.inference_mode()
def test_prefill_only_decode_only_and_one_of_each(stand_in_fla, lens, pages, has, fla_calls):
    inputs, state0 = _inputs(lens, torch.float32, _device(), seed=len(lens))
    _check_against_torch(inputs, state0, lens, pages, has, ROUTING_TOL)
    assert len(stand_in_fla) == fla_calls


@torch.inference_mode()
def test_the_call_names_fla_parameters(monkeypatch):
    """Every keyword FlaKdaOps passes is a parameter of the installed chunk_kda (skipped where fla
    does not import): it also takes **kwargs, where a misspelt flag would vanish."""
    if not HAS_FLA:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    real = pytest.importorskip("fla.ops.kda").chunk_kda
    params = inspect.signature(real).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    calls = _stand_in(monkeypatch)
    inputs, state0 = _inputs([5, 3], torch.float32, "cpu")
    FlaKdaOps().rule(*inputs, state0.nan_to_num(), _meta([5, 3], [1, 4], [0, 1], "cpu"))
    (kwargs,) = calls
    assert set(kwargs) <= named, set(kwargs) - named
    assert list(params)[:3] == ["q", "k", "v"]  # passed by position


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla-core) is not installed")
@pytest.mark.parametrize(("heads", "k_dim", "v_dim"), [(2, 16, 16), (4, 64, 32), (2, 128, 128)])
@torch.inference_mode()
def test_fla_kernel_against_pytorch_reference(heads, k_dim, v_dim):
    # bfloat16 q/k/v as a model feeds them; fla's matrix products take bf16 operands and it
    # rounds its output to bf16; the PyTorch reference computes in float32 throughout
    inputs, state0 = _inputs(LENS, torch.bfloat16, "cuda", heads, k_dim, v_dim)
    _check_against_torch(inputs, state0, LENS, PAGES, HAS, dict(rtol=2e-2, atol=2e-2))


def _kimi_linear(tmp_path_factory):
    from tests.models.test_kimi_linear import SEEDS, build

    return build(tmp_path_factory, "kimi_linear", SEEDS["kimi_linear"])


def _bf16_engines(folder):
    """bf16 Kimi-Linear engines on the fla ops (opt-in: asked for by name) and on the triton
    ones (the plan's choice), prefill chunks of at most 64 tokens."""
    from hybridkv.engine import Engine

    fla = Engine(str(folder), dtype="bfloat16", max_num_batched_tokens=64, state_backend="fla")
    assert {g.backend for g in fla.plan.state_groups} == {"fla"}
    assert {type(o).__name__ for o in fla.runner.state_ops.values()} == {"FlaKdaOps"}
    triton = Engine(str(folder), dtype="bfloat16", max_num_batched_tokens=64)
    assert {g.backend for g in triton.plan.state_groups} == {"triton"}
    return fla, triton


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla-core) is not installed")
def test_engine_on_fla_for_bfloat16_agrees_with_triton(tmp_path_factory, monkeypatch):
    """As the GDN one: prefill logits of a 150-token prompt (three chunks of 64: the state
    carries over) against the float32 engine, which keeps the triton ops; then prefill chunks
    beside decodes."""
    from hybridkv.engine import Engine
    from tests.models.test_kimi_linear import VOCAB
    from tests.models.utils import engine_greedy, engine_prefill_logits, max_rel_error, prompts

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # a float32 reference
    folder, _ = _kimi_linear(tmp_path_factory)
    ids = prompts(VOCAB, [150], seed=6)[0]
    exact = Engine(str(folder), dtype="float32", max_num_batched_tokens=64)
    assert {g.backend for g in exact.plan.state_groups} == {"triton"}  # fla: half precision
    want = engine_prefill_logits(exact, ids).float()
    del exact
    fla, triton = _bf16_engines(folder)
    err_fla = max_rel_error(engine_prefill_logits(fla, ids).float(), want)
    err_triton = max_rel_error(engine_prefill_logits(triton, ids).float(), want)
    print(f"max rel error against the float32 engine: fla {err_fla:.4f}, "
          f"triton {err_triton:.4f}")  # fmt: skip
    # a wrong gate, scale, head map or state layout would be off by the logits' own size
    assert err_fla < 2 * err_triton + 0.05, (err_fla, err_triton)
    batch = prompts(VOCAB, [40, 7, 90, 1], seed=7)
    out = engine_greedy(fla, batch, 6)
    assert [len(o) for o in out] == [6] * 4
    fla.cache.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla-core) is not installed")
def test_engine_on_fla_is_as_close_to_transformers_as_on_triton(tmp_path_factory, monkeypatch):
    """The bf16 engines' prefill logits against transformers' own Kimi-Linear in float32 (on
    the GPU, its experts looped): where fla imports, transformers runs its KDA through fla's
    kernels with the gate, beta and flags it forms itself (else through its PyTorch
    reference), an independent check of `FlaKdaOps`'s mapping; never on CPU tensors, where
    fla fails."""
    from tests.models.test_kimi_linear import VOCAB
    from tests.models.utils import engine_prefill_logits, max_rel_error, prompts

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    folder, hf = _kimi_linear(tmp_path_factory)
    ids = prompts(VOCAB, [150], seed=6)[0]
    hf = type(hf).from_pretrained(str(folder), dtype=torch.float32, experts_implementation="eager")
    with torch.inference_mode():
        logits = hf.cuda().eval()(torch.tensor([ids], device="cuda"), use_cache=False).logits
    want = logits[0].float()
    fla, triton = _bf16_engines(folder)
    err_fla = max_rel_error(engine_prefill_logits(fla, ids).float(), want)
    err_triton = max_rel_error(engine_prefill_logits(triton, ids).float(), want)
    print(f"max rel error against transformers float32: fla {err_fla:.4f}, "
          f"triton {err_triton:.4f}")  # fmt: skip
    assert err_fla < 2 * err_triton + 0.05, (err_fla, err_triton)
