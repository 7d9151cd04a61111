"""ops.derived: a weight's derived form is computed once and recomputed when the weight
changes (an in-place write, new storage), per view of it."""

import torch

from hybridkv.ops.derived import derived


def widen(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def test_kept_until_written_in_place_or_given_new_storage():
    w = torch.nn.Parameter(torch.randn(8).bfloat16(), requires_grad=False)
    first = derived(w, "f32", widen)
    assert derived(w, "f32", widen) is first  # kept
    with torch.no_grad():
        w.mul_(2)  # an in-place write moves the version counter
    second = derived(w, "f32", widen)
    assert second is not first and torch.equal(second, w.float())
    w.data = torch.randn(8).bfloat16()  # what module.to(...) does
    third = derived(w, "f32", widen)
    assert third is not second and torch.equal(third, w.float())


def test_views_are_kept_apart_and_invalidated_with_their_base():
    base = torch.nn.Parameter(torch.randn(4, 2, 3), requires_grad=False)

    def taps(t: torch.Tensor) -> torch.Tensor:
        return t.t().contiguous()

    a, b = derived(base[:, 0, :], "taps", taps), derived(base[:, 1, :], "taps", taps)
    assert torch.equal(a, base[:, 0, :].t()) and torch.equal(b, base[:, 1, :].t())
    assert derived(base[:, 0, :], "taps", taps) is a  # a new view object, the same part
    with torch.no_grad():
        base[:, 0, :].zero_()
    assert torch.equal(derived(base[:, 0, :], "taps", taps), torch.zeros(3, 4))


def test_a_float32_weight_is_its_own_float32_form_and_nothing_is_kept():
    w = torch.randn(5)
    assert derived(w, "f32", widen) is w
    assert not w.__dict__.get("_hybridkv_derived")


def test_inference_tensors_are_computed_every_time():
    with torch.inference_mode():
        w = torch.randn(5).bfloat16()
        assert torch.equal(derived(w, "f32", widen), w.float())
        w.add_(1)  # (no version counter: nothing may be kept)
        assert torch.equal(derived(w, "f32", widen), w.float())
