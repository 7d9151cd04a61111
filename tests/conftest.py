import os
from pathlib import Path

import pytest
import torch

# Keep the suite deterministic and light on the 2-core CI machine (pytest -n 2: one thread per
# worker). torch was imported above, so its intra-op pool has already read the environment:
# set it too (the transformers references otherwise run two threads per worker, which on a
# busy 2-core machine made tiny matmuls wait for each other: minutes instead of seconds).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Without a GPU, Triton kernels run through its interpreter. Triton reads this when a kernel is
# decorated, so it is set before any test imports a kernels module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk cache does not key its C++ kernels by ATEN_CPU_CAPABILITY: a kernel
# built for this CPU's AVX-512 and loaded again under ATEN_CPU_CAPABILITY=avx2 (the AVX2
# simulation, README "Machines") gave wrong tokens (test_compiled_decode_matches_transformers;
# right with a fresh cache). One cache per capability.
if os.environ.get("ATEN_CPU_CAPABILITY") and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir())
        / f"torchinductor-{getpass.getuser()}-{os.environ['ATEN_CPU_CAPABILITY']}"
    )
# torch.compile's first CPU kernel checks which vector instruction sets the C++ compiler can
# build by compiling and loading a probe for each (AMX, AVX-512, AVX2: ~7 s of g++ per process,
# twice that on a half-speed machine, on every fresh machine). The suite takes the CPU's flags
# for it (a compiler that cannot build one then fails the kernel's build, loudly); runs outside
# the suite keep torch's probes.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

HAS_GPU = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=30.0,
        help="how long the server soak test (tests/entrypoints/test_server_soak.py) runs its "
        "clients (default 30, half plain, half speculative: about 45 s with set-up and checks, "
        "so that `make test` stays under 10 minutes on 2 cores; a release check passes e.g. "
        "600)",
    )


# Markers by folder: `make test-fast` runs everything but these (and `slow`).
FOLDER_MARKERS = {"models": "conformance", "distributed": "distributed", "serving": "distributed"}


# Modules whose one module-scoped fixture must not be split between xdist workers: run first.
# `--dist worksteal` gives each worker a contiguous half of the collection and an idle worker
# steals from the *end* of the other's queue, so the first tests stay on worker 0. Split, the
# Ray Serve module started a second local cluster with its two replicas on the other worker
# (seen twice on one loaded core: 250 s of the run instead of 66).
RUN_FIRST = ("serving/test_ray_serve.py",)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    root = Path(__file__).resolve().parent
    # each test's file, relative to tests/ (several thousand tests: resolved once)
    where = {id(i): Path(str(i.fspath)).resolve().relative_to(root) for i in items}
    items.sort(key=lambda i: where[id(i)].as_posix() not in RUN_FIRST)  # (a stable sort)
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
        parts = where[id(item)].parts
        marker = FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker is not None:
            item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="session", autouse=True)
def shared_references(request, tmp_path_factory):
    """The workers of an xdist run share transformers' reference tokens (tests/models/
    conformance.py) in the run's temporary folder, which pytest removes with old runs."""
    if not hasattr(request.config, "workerinput"):  # one process: its own dict serves
        return
    from tests.models import conformance

    conformance.SHARED_REFERENCES = tmp_path_factory.getbasetemp().parent / "references"


@pytest.fixture(autouse=True)
def cpu_unless_marked(request, monkeypatch):
    """Tests run on the CPU, also on a machine with a GPU: engines built with device="auto"
    must not move there. Tests marked `gpu` (GPU only) or `triton` (Triton kernels: compiled on a
    GPU when there is one, interpreted on the CPU otherwise) see the machine as it is."""
    if HAS_GPU and not any(request.node.get_closest_marker(m) for m in ("gpu", "triton")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    """Run a test with the native CPU kernels (hybridkv.ops.native) and with the PyTorch path."""
    from hybridkv.ops import native, registry

    if request.param == "torch":
        monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
        registry.reset_all()  # op choices follow the new setting
    elif native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    return request.param


@pytest.fixture
def mamba2_ops(kernels):
    """The Mamba2 ops a state group would run: the native kernels or the PyTorch reference."""
    from hybridkv.ops.mamba2_ops import NativeMamba2Ops, TorchMamba2Ops

    return NativeMamba2Ops() if kernels == "native" else TorchMamba2Ops()


@pytest.fixture
def gdn_ops(kernels):
    """The gated-delta-net ops a state group would run: the native kernels or the PyTorch
    reference."""
    from hybridkv.ops.gdn_ops import NativeGDNOps, TorchGDNOps

    return NativeGDNOps() if kernels == "native" else TorchGDNOps()


def state_meta(pages, has_initial_state, query_start_loc, max_query_len):
    from hybridkv.forward_batch import StateMetadata

    return StateMetadata(pages, has_initial_state, query_start_loc, max_query_len)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny seeded GraniteMoeHybrid checkpoint (Mamba2 + attention + MoE) with a tokenizer
    whose words are t0 .. t95, saved once per test session."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from tests.models.utils import save_model, seeded

    cfg = GraniteMoeHybridConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=4,
        num_experts_per_tok=2, position_embedding_type="rope", initializer_range=0.1,
        max_position_embeddings=256,
    )  # fmt: skip
    hf = seeded(GraniteMoeHybridForCausalLM, cfg)
    folder = save_model(hf, tmp_path_factory.mktemp("tiny-granite"))
    return folder


@pytest.fixture(autouse=True)
def _fresh_op_choices():
    """Each test chooses op implementations afresh (hybridkv.ops.registry chooses once per
    process), so that a test which sets HYBRIDKV_NATIVE=0 before its first op gets the
    reference implementations and the next test does not inherit them."""
    from hybridkv.ops import registry
    from hybridkv.ops.native import cpu

    cpu.record.cache_clear()
    registry.reset_all()
    yield
    cpu.record.cache_clear()
    registry.reset_all()
