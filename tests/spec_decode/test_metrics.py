"""SpecDecodeStats: counts, derived rates, merge, Prometheus exposition."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.spec_decode.metrics import SpecDecodeStats
from hybridkv.spec_decode.rejection import greedy_verify


def test_counts_and_derived_numbers():
    s = SpecDecodeStats(4)
    s.observe(4, 2)  # positions 0, 1 accepted; 2 rejected; 3 never checked
    s.observe(3, 3)
    s.observe(2, 0)
    s.observe(0, 0)  # no drafts: not a verify step with drafts
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 5)
    assert s.draft_tokens_per_pos == [3, 3, 2, 1]
    assert s.accepted_tokens_per_pos == [2, 2, 1, 0]
    assert s.acceptance_rate == pytest.approx(5 / 9)
    assert s.acceptance_rate_per_pos == pytest.approx([2 / 3, 2 / 3, 1 / 2, 0.0])
    assert s.mean_accepted_length == pytest.approx(1 + 5 / 3)


def test_empty_stats():
    s = SpecDecodeStats()
    assert s.acceptance_rate == 0.0
    assert s.mean_accepted_length == 1.0
    assert s.acceptance_rate_per_pos == []
    assert "0 verify steps" in s.summary()


def test_observe_validates_and_widens():
    s = SpecDecodeStats(2)
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        s.observe(2, 3)
    with pytest.raises(ValueError, match="accepted -1"):
        s.observe(2, -1)
    s.observe(5, 5)  # a wider step (k grew): the lists grow with it
    assert s.num_speculative_tokens == 5
    assert s.accepted_tokens_per_pos == [1, 1, 1, 1, 1]


def test_observe_batch_from_a_verify_result():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [0, 0, 0]])
    num = torch.tensor([3, 3, 0])
    r = greedy_verify(target, drafts, num)
    s = SpecDecodeStats(3)
    s.observe_batch(num, r.num_accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 4)
    assert s.accepted_tokens_per_pos == [2, 1, 1]
    with pytest.raises(ValueError, match="2 draft counts for 1"):
        s.observe_batch([1, 1], [0])


def test_merge_equals_observing_everything():
    steps_a = [(4, 1), (4, 4), (2, 2)]
    steps_b = [(3, 0), (6, 5)]
    a, b, both = SpecDecodeStats(4), SpecDecodeStats(3), SpecDecodeStats()
    for d, acc in steps_a:
        a.observe(d, acc)
        both.observe(d, acc)
    for d, acc in steps_b:
        b.observe(d, acc)
        both.observe(d, acc)
    merged = a.merge(b)
    assert merged == both
    assert a + b == both
    # the inputs are left as they were
    assert a.num_drafts == 3 and b.num_drafts == 2 and a.num_speculative_tokens == 4


def test_copy_is_independent():
    s = SpecDecodeStats(2)
    s.observe(2, 1)
    c = s.copy()
    s.observe(2, 2)
    assert c.num_drafts == 1 and c.accepted_tokens_per_pos == [1, 0]
    assert s.accepted_tokens_per_pos == [2, 1]


def test_as_dict_and_summary():
    s = SpecDecodeStats(2)
    s.observe(2, 1)
    d = s.as_dict()
    assert d["num_drafts"] == 1 and d["accepted_tokens_per_pos"] == [1, 0]
    assert d["mean_accepted_length"] == pytest.approx(2.0)
    assert d["acceptance_rate_per_pos"] == [1.0, 0.0]
    line = s.summary()
    assert "1 accepted (50.0%)" in line and "mean accepted length 2.00" in line
    assert "[1.00 0.00]" in line


def test_prometheus_exposition_parses():
    s = SpecDecodeStats(3)
    s.observe(3, 2)
    s.observe(3, 0)
    text = s.render_prometheus("hybridkv")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("hybridkv_spec_decode_num_drafts_total", ())] == 2
    assert samples[("hybridkv_spec_decode_num_draft_tokens_total", ())] == 6
    assert samples[("hybridkv_spec_decode_num_accepted_tokens_total", ())] == 2
    per_pos = "hybridkv_spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, (("position", str(i)),))] for i in range(3)] == [1, 1, 0]
    proposed = "hybridkv_spec_decode_num_draft_tokens_per_pos_total"
    assert [samples[(proposed, (("position", str(i)),))] for i in range(3)] == [2, 2, 2]
    assert samples[("hybridkv_spec_decode_acceptance_rate", ())] == pytest.approx(2 / 6)
    assert samples[("hybridkv_spec_decode_mean_accepted_length", ())] == pytest.approx(2.0)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["hybridkv_spec_decode_num_drafts"] == "counter"
    assert types["hybridkv_spec_decode_acceptance_rate"] == "gauge"


def test_metric_families_take_a_prefix():
    names = {f.name for f in SpecDecodeStats(1).metric_families("engine7")}
    assert "engine7_spec_decode_num_drafts" in names
    assert all(n.startswith("engine7_spec_decode_") for n in names)
