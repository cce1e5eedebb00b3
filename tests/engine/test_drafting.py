"""Stage 0's drafters and the adaptive draft length (pure; expected values by hand)."""

from __future__ import annotations

import pytest

from ringlet.daemon.engine.drafting import Drafter, NgramIndex, Speculation, TripMeter


def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    # [1, 2, 3] occurred at 0 (then 4, 9) and at 5 (then 5, 6): the latest, at 5, wins
    assert index.propose(index.tokens, 2) == ([5, 6], 8)
    # no earlier occurrence of the tail: nothing
    index.extend([7])
    assert index.propose(index.tokens, 3) == ([], None)


def test_longest_ngram_first():
    index = NgramIndex(1, 3)
    index.extend([8, 2, 3, 40, 7, 3, 50, 2, 3])
    # tail [2, 3] (n = 2) matches at 1 (then 40); n = 1 alone ([3]) would take the latest, 50
    assert index.propose(index.tokens, 1) == ([40], 3)


def test_drafter_follows_the_prediction_and_finds_it_again_after_an_edit():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter = Drafter(prompt=[1, 2, 3], prediction=prediction)
    out: list[int] = []
    assert drafter.propose(out, 3) == [10, 11, 12]  # the output so far is a prefix of it
    out += [10, 11]
    drafter.add([10, 11])
    assert drafter.propose(out, 3) == [12, 13, 14]
    out += [99, 13, 14]  # an edit: 12 became 99; its last two tokens are found in the prediction
    drafter.add([99, 13, 14])
    assert drafter.propose(out, 2) == [15, 16]


def test_drafter_without_prediction_uses_the_prompt_and_output():
    drafter = Drafter(prompt=[5, 6, 7, 8, 9, 1, 5, 6])
    drafter.add([7])
    assert drafter.propose([7], 2) == [8, 9]  # [5, 6, 7] occurred in the prompt, then 8, 9


def test_draft_length_adapts_and_backs_off():
    spec = Speculation(limit=4)
    assert spec.allowance() == 4
    spec.verified(4, 4)  # whole draft accepted: stays at the limit
    assert spec.k == 4
    spec.verified(4, 1)  # one accepted: next draft one longer than what was accepted
    assert spec.k == 2
    spec.verified(2, 0)  # rejected whole: halved
    assert spec.k == 1
    spec.verified(1, 0)  # twice in a row: paused for 8 steps
    assert [spec.allowance() for _ in range(9)] == [0] * 8 + [1]
    assert (spec.drafted, spec.accepted, spec.rejected, spec.trips, spec.tokens) == (11, 5, 6, 4, 9)


def test_bad_ngram_lengths_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


def test_trip_meter_says_when_a_verifying_trip_costs_more_than_it_gives():
    meter = TripMeter()
    assert meter.cost() is None and meter.wants_plain()  # nothing measured: measure a plain trip first
    meter.observe(0, 0.040)
    meter.observe(4, 0.100)
    assert meter.cost() == pytest.approx(2.5)  # 0.100 / 0.040
    meter.observe(4, 0.200)  # moving average: 0.100 + 0.2 * (0.200 - 0.100) = 0.120
    assert meter.cost() == pytest.approx(3.0)
    assert [meter.wants_plain() for _ in range(TripMeter.PLAIN_EVERY)].count(True) == 1
    spec = Speculation(limit=4)
    spec.verified(4, 1)  # 2 tokens for that trip: below a cost of 3 plain trips
    assert spec.per_trip == 2
    assert spec.k == 2  # the partial accept shortened the draft
    allowed = [spec.allowance(meter.cost()) for _ in range(Speculation.PROBE)]
    # only the probe step drafts, at full length: at k = 2 a probe gives at most 3 tokens,
    # and could never show a prediction's later run of hits paying for a trip of cost 3
    assert allowed.count(0) == Speculation.PROBE - 1 and max(allowed) == 4
    spec.verified(4, 4)  # the probe hit whole: 5 tokens; 2 + 0.2 * (5 - 2) = 2.6
    assert spec.per_trip == pytest.approx(2.6) and spec.k == 4
    assert spec.allowance(1.5) == spec.k  # it pays where a trip costs 1.5 plain ones
