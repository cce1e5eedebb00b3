"""Stage 0's drafters and the adaptive draft length (pure; expected values by hand)."""

from __future__ import annotations

import pytest

from ringlet.daemon.engine.draft_length import RunLengths, Speculation, TripMeter, expected_tokens
from ringlet.daemon.engine.drafting import Drafter, NgramIndex


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


def test_the_prediction_is_found_again_at_its_first_place_after_where_the_output_agreed():
    """A file repeats its lines: the output walks through the prediction in order, so a
    lookup takes the first occurrence at or after where the output last agreed, not the
    latest (prompt lookup's rule), and a place the output did not follow moves nothing."""
    fence, a, x = 50, 60, 61
    prediction = [fence, 51, a, x, 62, 70, a, x, 63, fence]  # two lines "a x ...", then a closing fence
    drafter = Drafter(prompt=[1, 2, 3], prediction=prediction)
    out = [90, 91, a, x]  # a preamble, then the first line's start
    drafter.add(out)
    assert drafter.propose(out, 3) == [62, 70, a]  # the first "a x", not the latest
    out += [55]  # the model wrote something else: that place was never agreed on
    drafter.add([55])
    assert drafter.propose(out, 3) == []  # "x 55" is nowhere in it (prompt lookup has nothing either)
    out += [a, x]
    drafter.add([a, x])
    assert drafter.propose(out, 3) == [62, 70, a]  # still the first, as nothing was agreed
    out += [62, 70]  # now the output follows it there
    drafter.add([62, 70])
    assert drafter.propose(out, 2) == [a, x]
    out += [a, x]
    drafter.add([a, x])
    assert drafter.propose(out, 2) == [63, fence]
    out += [99, a, x]  # an edit, then "a x" again: only occurrences after where it agreed count
    drafter.add([99, a, x])
    assert drafter.propose(out, 2) == []
    out += [fence, 7]  # the closing fence
    drafter.add([fence, 7])
    assert drafter.propose(out, 1) == []


def test_prompt_lookup_takes_over_from_a_prediction_the_model_does_not_follow():
    drafter = Drafter(prompt=[7, 1, 2, 3, 4, 5, 6], prediction=[1, 2, 9, 2, 3, 9, 9])
    out = [1, 2]
    drafter.add(out)
    # the output follows the prediction: its continuation (prompt lookup has "1 2" then 3 4 5:
    # neither missed yet, the prediction goes first)
    assert drafter.propose(out, 3) == [9, 2, 3]
    drafter.verified(0)  # the model wrote 3, not 9
    out += [3]
    drafter.add([3])
    # the prediction has "2 3" again (then 9 9), the prompt "1 2 3" (then 4 5 6): the
    # prediction missed last, prompt lookup never did
    assert drafter.propose(out, 3) == [4, 5, 6]
    drafter.verified(0)  # prompt lookup missed as often: the prediction goes first again
    assert drafter.propose(out, 3) == [9, 9]


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


def test_expected_tokens_per_trip_follow_leviathan_eq_1():
    # (1 - a^(k+1)) / (1 - a), by hand: a = 0.5, k = 3: (1 - 1/16) / 0.5 = 1.875
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(0.0, 6) == 1.0 and expected_tokens(1.0, 6) == 7.0


def test_run_lengths_are_counted_by_position():
    """Kaplan-Meier by draft position, by hand. Fresh, every position takes the prior
    hazard: 0.5 gives eq. 1 of Leviathan et al. (1 + 0.5 + 0.25 + 0.125 = 1.875)."""
    runs = RunLengths(4)
    assert runs.expected(3, 0.5) == pytest.approx(1.875)
    runs.add(4, 4, 0.7)  # reached 1 1 1 1, rejected 0 0 0 0
    runs.add(4, 1, 0.7)  # decayed, then: reached 1.7 1.7 0.7 0.7, rejected 0 1 0 0
    assert runs.reached == pytest.approx([1.7, 1.7, 0.7, 0.7]) and runs.rejected == pytest.approx([0, 1, 0, 0])
    # hazards (rejected + 0.2) / (reached + 1): 0.2/2.7, 1.2/2.7, 0.2/1.7, 0.2/1.7
    # S = 0.925926, 0.514403, 0.453885, 0.400487; 1 + their sum = 3.294701
    assert runs.expected(4, 0.2) == pytest.approx(3.294701, abs=1e-5)
    assert runs.expected(1, 0.2) == pytest.approx(1.925926, abs=1e-5)


def test_the_length_that_pays_is_read_from_where_drafts_were_rejected():
    """Two drafts of 6 accepted whole, then one rejected at its 6th token: per-token
    acceptance a = 12.14 / 13.14 (decayed, by hand) would make 6 drafts the best buy at
    these costs, but the rejections by position say the 6th draft is the weak one."""
    spec = Speculation(limit=6)
    for accepted in (6, 6, 5):
        spec.verified(6, accepted)
    assert spec.k == 6 and spec.acceptance_estimate == pytest.approx(12.14 / 13.14)
    # reached 2.19 at every position, rejected 1 at the 6th; prior hazard h = 1 - a = 0.07610
    # positions 1-5: 1 - h / 3.19 = 0.976144 each; 6th: 1 - 1.07610 / 3.19 = 0.662665
    # expected(5) = 1 + 0.976144 + 0.952857 + 0.930126 + 0.907937 + 0.886277 = 5.653341
    assert spec.expected(None, 5) == pytest.approx(5.653341, abs=1e-4)
    assert spec.expected(None, 6) == pytest.approx(5.653341 + 0.886277 * 0.662665, abs=1e-4)
    cost = {j: 1 + 0.25 * j for j in range(1, 7)}.get
    # 5.6533 / 2.25 = 2.513 beats 6.2406 / 2.5 = 2.496 (and shorter lengths); per token,
    # (1 - a^7) / (1 - a) / 2.5 = 2.236 would beat (1 - a^6) / (1 - a) / 2.25 = 2.208
    assert expected_tokens(12.14 / 13.14, 6) / 2.5 > expected_tokens(12.14 / 13.14, 5) / 2.25
    assert spec.allowance(cost) == 5


def test_trip_meter_costs_each_draft_length():
    meter = TripMeter()
    assert meter.cost(4) is None and meter.wants_plain()  # nothing measured: measure a plain trip first
    meter.observe(0, 0.040)
    assert meter.cost(4) is None  # no verifying trip yet
    meter.observe(4, 0.100)
    assert meter.cost(4) == pytest.approx(2.5)  # 0.100 / 0.040
    meter.observe(4, 0.200)  # moving average: 0.100 + 0.2 * (0.200 - 0.100) = 0.120
    assert meter.cost(4) == pytest.approx(3.0) and meter.cost() == pytest.approx(3.0)
    # unmeasured lengths on the line from (0, 1) through (4, 3): 1 + 2 * j / 4
    assert meter.cost(2) == pytest.approx(2.0) and meter.cost(6) == pytest.approx(4.0)
    meter.observe(1, 0.048)
    assert meter.cost(1) == pytest.approx(1.2) and meter.cost(2) == pytest.approx(1.4)  # nearest: 1
    assert [meter.wants_plain() for _ in range(TripMeter.PLAIN_EVERY)].count(True) == 1


def test_the_draft_length_is_the_one_that_pays_most_or_none():
    cost = {1: 1.2, 2: 1.4, 3: 1.6, 4: 1.8}.get  # plain trips, as a CPU's few-row forward
    spec = Speculation(limit=4)
    assert spec.allowance(cost) == 4  # no trip yet: the adaptive length, to measure
    spec.verified(4, 4)  # acceptance so far 4 / (4 + 0) = 1: k + 1 tokens at every length
    assert spec.acceptance_estimate == 1.0
    # 5 / 1.8 = 2.78 beats 4 / 1.6, 3 / 1.4, 2 / 1.2
    assert spec.allowance(cost) == 4
    spec.verified(4, 1)  # decayed: accepted 4 * 0.7 + 1 = 3.8, rejections 1: a = 0.79
    # by position (test_run_lengths_are_counted_by_position), prior hazard 1 - a = 0.208333:
    # S1 = 1 - 0.208333 / 2.7 = 0.922840, S2 = S1 * (1 - 1.208333 / 2.7) = 0.509840;
    # k is now 2: 1.922840 / 1.2 = 1.602 < 2.432680 / 1.4 = 1.738
    assert spec.k == 2 and spec.expected(None, 2) == pytest.approx(2.432680, abs=1e-5)
    assert spec.allowance(cost) == 2
    spec.verified(2, 0)
    spec.verified(1, 0)  # two whole rejections: paused 8 steps
    assert [spec.allowance(cost) for _ in range(8)] == [0] * 8
    # accepted 3.8 * 0.49 = 1.862, rejections 0.49 + 0.7 + 1 = 2.19: a = 0.46; k = 1: (1 + a) / 1.2 = 1.22 > 1
    assert spec.allowance(cost) == 1
    dear = {1: 2.5, 2: 3.0, 3: 3.5, 4: 4.0}.get  # a trip too dear for what this request gives
    spec.verified(1, 0)  # (a = 1.303 / (1.303 + 2.533) = 0.34: no length pays at these costs)
    allowed = [spec.allowance(dear) for _ in range(Speculation.PROBE)]
    # PROBE steps after the last trip a probe is due, at full length: at k = 1 a probe could
    # never show a trip paying
    assert allowed == [0] * (Speculation.PROBE - 1) + [4]
    # the drafter had nothing to send on that step: the probe stays due until a trip goes
    assert [spec.allowance(dear) for _ in range(3)] == [4, 4, 4]
    spec.verified(4, 1)
    assert spec.allowance(dear) == 0 and spec.k == 2
    assert spec.allowance(None) == spec.k  # drafts on every step (no cost): the adaptive length


def test_acceptance_is_kept_per_evidence():
    """A draft from a 5-token match and one from a 3-token match are not equally likely
    right: each kind of evidence (source, match length) keeps its own acceptance; one never
    tried is tried once at the adaptive length."""
    cost = {1: 1.2, 2: 1.4, 3: 1.6, 4: 1.8}.get
    spec = Speculation(limit=4)
    long, short = ("lookup", 5), ("lookup", 3)
    assert spec.allowance(cost, long) == 4  # no trip yet
    spec.verified(4, 4, long)  # 5-token matches: 4 of 4 (a = 1); k -> 4
    spec.verified(4, 0, short)  # 3-token matches: 0 of 4 (a = 0); k -> 2
    assert spec.k == 2
    assert spec.allowance(cost, short) == 0  # 1 token a trip at any length: never worth a dearer trip
    assert spec.allowance(cost, long) == 2  # 3 / 1.4 beats 2 / 1.2; k is 2
    assert spec.allowance(cost, ("prediction", 0)) == 2  # never tried: tried at k
    # the request's pooled acceptance, decayed: accepted 4 * 0.7, rejections 1
    assert spec.acceptance_for(None) == pytest.approx(2.8 / 3.8)
    assert spec.acceptance_for(long) == 1.0 and spec.acceptance_for(short) == 0.0


def test_the_drafter_says_what_its_draft_rests_on():
    drafter = Drafter(prompt=[5, 6, 7, 8, 9, 1, 5, 6], prediction=[20, 21, 22, 23])
    assert drafter.propose([], 2) == [20, 21] and drafter.evidence == ("prediction", 0)  # the output follows it
    drafter.add([5, 6, 7])
    # the output left the prediction, which has no "6 7"; the prompt has "5 6 7" (a 3-token match)
    assert drafter.propose([5, 6, 7], 2) == [8, 9] and drafter.evidence == ("lookup", 3)
    drafter.add([4])
    assert drafter.propose([5, 6, 7, 4], 2) == [] and drafter.evidence == ("", 0)
