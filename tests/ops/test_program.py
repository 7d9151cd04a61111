"""Recording native kernel calls and replaying them (hybridkv.ops.native.program)."""

import pytest
import torch

from hybridkv.ops import native
from hybridkv.ops.native import elementwise
from hybridkv.ops.native import program as prog
from hybridkv.ops.native.norms import rms_norm
from tests.ops.test_native import needs_compiler

pytestmark = needs_compiler


def test_every_declared_kernel_has_a_replay_adapter():
    lib = native.library()
    assert lib is not None
    count = lib.cdll.hkv_program_adapter_count()
    names = sorted(native._SIGNATURES)
    assert count == len(names)
    assert [getattr(lib, n).index for n in names] == list(range(count))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_on_new_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)

    def step():
        y = rms_norm(x, w, 1e-5)
        return elementwise.add_scaled(y, x, 0.37)

    step()  # (a bfloat16 norm converts its weight once, kept with it: not during the capture)
    out, program, why = prog.capture(step)
    assert why is None and program is not None
    assert program.kernel_names == ["hkv_rms_norm_" + ("bf16" if dtype == torch.bfloat16 else
                                                       "f32"), "hkv_add_scaled"]  # fmt: skip
    for _ in range(3):  # new values in the same input buffer, then the recorded calls
        x.copy_(torch.randn(3, 96, generator=g).to(dtype))
        program.run()
        assert torch.equal(out, step())


def test_a_pytorch_op_in_the_function_refuses_the_capture():
    x, w = torch.randn(2, 32), torch.randn(32)
    out, program, why = prog.capture(lambda: rms_norm(x * 2, w, 1e-5))
    assert program is None and "aten.mul" in why
    torch.testing.assert_close(out, rms_norm(x * 2, w, 1e-5), rtol=0, atol=0)


def test_views_and_aliasing_conversions_are_allowed():
    x, w = torch.randn(4, 2, 16), torch.randn(32)

    def step():
        rows = x.view(4, 32).to(torch.float32).contiguous()  # (nothing computed)
        return rms_norm(rows[1:3], w, 1e-5)

    out, program, why = prog.capture(step)
    assert why is None and len(program) == 1
    x.mul_(3.0)
    program.run()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)


def test_the_program_keeps_what_it_allocated_alive():
    x, w = torch.randn(1, 64), torch.randn(64)
    out, program, _ = prog.capture(lambda: rms_norm(rms_norm(x, w, 1e-5), w, 1e-5))
    first = [t for t in program.keep if t.data_ptr() != out.data_ptr()]
    assert first  # the intermediate row: its memory is written by every replay
    x.copy_(torch.randn(1, 64))
    program.run()
    torch.testing.assert_close(out, rms_norm(rms_norm(x, w, 1e-5), w, 1e-5))


def test_a_failing_kernel_stops_the_replay_with_its_name():
    table = torch.randn(10, 8)
    ids = torch.tensor([1, 2])
    out, program, why = prog.capture(lambda: elementwise.embedding(ids, table))
    assert why is None
    ids[1] = 10  # outside the table
    with pytest.raises(RuntimeError, match="hkv_embedding"):
        program.run()


def test_no_kernel_call_is_nothing_to_replay():
    _, program, why = prog.capture(lambda: torch.empty(3))
    assert program is None and why == "no native kernel calls"


def test_one_tape_at_a_time():
    with prog.recording(), pytest.raises(RuntimeError, match="already"), prog.recording():
        pass
    assert native._tape is None


def test_programs_sharing_an_arena_reuse_its_memory():
    """Two captures on one arena: each allocates from its start, so the arena is as large as
    the larger capture, and each program, run alone, computes its own step."""
    arena = prog.Arena()
    w = torch.randn(64)
    xs = {n: torch.randn(n, 64) for n in (1, 5)}
    programs = {}
    for n, x in xs.items():
        out, program, why = prog.capture(lambda x=x: rms_norm(x, w, 1e-5), arena)
        assert why is None
        programs[n] = (program, out)
    assert programs[1][1].data_ptr() == programs[5][1].data_ptr()  # the same bytes
    assert len(arena.chunks) == 1
    for n in (5, 1, 5):
        xs[n].copy_(torch.randn(n, 64))
        program, out = programs[n]
        program.run()
        assert torch.equal(out, rms_norm(xs[n], w, 1e-5))


def test_arena_allocations_keep_shape_strides_and_alignment():
    arena = prog.Arena()
    a = arena.allocate(torch.empty(3, 5, dtype=torch.bfloat16))
    b = arena.allocate(torch.empty_strided((4, 3), (1, 4)))
    big = arena.allocate(torch.empty(prog.Arena.CHUNK_BYTES // 4 + 7))  # past the first chunk
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert b.stride() == (1, 4) and b.data_ptr() % prog.Arena.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 2  # no overlap
    assert len(arena.chunks) == 2 and big.numel() == prog.Arena.CHUNK_BYTES // 4 + 7
    arena.rewind()
    assert arena.allocate(torch.empty(2)).data_ptr() == a.data_ptr()


def test_profiled_replays_time_every_call():
    x, w = torch.randn(4, 256), torch.randn(256)
    _, program, _ = prog.capture(lambda: rms_norm(rms_norm(x, w, 1e-5), w, 1e-5))
    program.start_profile()
    for _ in range(3):
        program.run()
    times = program.profiled()
    assert [name for name, _ in times] == ["hkv_rms_norm_f32"] * 2
    assert all(0 < seconds < 1 for _, seconds in times)
