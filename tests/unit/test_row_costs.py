"""How many of the server's own drafts a sequence gets, from the decoding step's time by rows measured at start
(engine/row_costs.RowCosts) and the sequence's acceptance (speculation.AdaptiveK)."""

from waferscale.engine.row_costs import row_sizes
from waferscale.engine.speculation import AdaptiveK, RowCosts, StepLoad


def alone() -> StepLoad:
    """A step of one sequence decoding."""
    return StepLoad(rows=1, tokens=1)


def test_drafts_go_on_while_rows_cost_little():
    costs = RowCosts({r: 0.010 + 0.0005 * (r - 1) for r in range(1, 13)})  # bound by memory: a row adds 5%
    assert costs.best_k(0.8, 8, alone()) == 8


def test_no_drafts_where_each_row_costs_a_whole_step():
    costs = RowCosts({r: 0.010 * r for r in range(1, 13)})  # rows bound by compute
    assert costs.best_k(0.9, 8, alone()) == 0


def test_fewer_drafts_where_rows_cost_half_a_step_and_acceptance_is_middling():
    costs = RowCosts({r: 0.010 * (1 + 0.5 * (r - 1)) for r in range(1, 13)})
    # one draft: (1 + 0.7) / 1.5 = 1.13x; two: (1 + 0.7 + 0.49) / 2 = 1.10x; more pay less
    assert costs.best_k(0.7, 8, alone()) == 1


def test_a_batch_of_sequences_weighs_drafts_against_its_own_step():
    costs = RowCosts({r: 0.010 * r for r in range(1, 41)})  # rows bound by compute
    assert costs.best_k(0.9, 8, StepLoad(rows=4, tokens=4)) == 0  # a batch does not make them pay


def test_the_first_sequences_take_the_rows_that_cost_nothing_and_the_next_get_none():
    costs = RowCosts({r: 0.020 + 0.010 * max(0, r - 12) for r in range(1, 41)})  # free up to 12 rows, then not
    step = StepLoad(rows=4, tokens=4)
    assert costs.best_k(0.9, 8, step) == 8
    step.add(8, 0.9)
    assert step.rows == 12 and abs(step.tokens - (4 + sum(0.9**j for j in range(1, 9)))) < 1e-12
    assert costs.best_k(0.9, 8, step) == 0


def test_steps_between_the_sizes_measured_are_interpolated():
    costs = RowCosts({1: 0.010, 2: 0.012, 4: 0.020})
    assert abs(costs.at(3) - 0.016) < 1e-12


def test_the_sizes_measured_are_one_sequences_then_a_few_up_to_every_sequence_speculating():
    assert row_sizes(max_draft=8, max_seqs=4) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 36]
    assert row_sizes(max_draft=2, max_seqs=1) == [1, 2, 3]


def test_sizes_past_the_measured_ones_carry_on_the_last_slope():
    costs = RowCosts({1: 0.010, 2: 0.012, 3: 0.014})
    assert abs(costs.at(5) - 0.018) < 1e-12
    assert costs.at(2) == 0.012


def test_the_start_up_log_gives_each_size_against_one_row():
    assert RowCosts({1: 0.010, 2: 0.015}).describe() == "1: 1.00x, 2: 1.50x"


def test_a_sequence_whose_drafts_miss_is_estimated_to_miss():
    adapt = AdaptiveK()
    assert adapt.acceptance() == 0.5  # the prior
    for _ in range(10):
        adapt.update(proposed=4, accepted=0, max_k=8)
    assert adapt.acceptance() < 0.1
    for _ in range(20):
        adapt.update(proposed=4, accepted=4, max_k=8)
    assert adapt.acceptance() > 0.9


def test_a_draft_forward_costing_a_whole_step_never_pays_even_if_every_draft_is_accepted():
    costs = RowCosts({r: 0.010 + 0.0005 * (r - 1) for r in range(1, 13)})  # rows cost little
    assert costs.shared_k([(8, 0.99)], alone(), per_forward=0.010) == 0  # the target's own weights again


def test_a_cheap_draft_forward_pays_for_several_drafts():
    costs = RowCosts({r: 0.010 + 0.0005 * (r - 1) for r in range(1, 13)})
    assert costs.shared_k([(8, 0.9)], alone(), per_forward=0.002) > 2  # a draft model a fifth of the target


def test_one_draft_forward_serves_every_sequence():
    costs = RowCosts({r: 0.010 + 0.0005 * (r - 1) for r in range(1, 41)})
    # a forward of 0.7 steps pays for one sequence at 90%: (1 + 0.9) x 10 ms against 10.5 + 7 ms
    assert costs.shared_k([(8, 0.9)], alone(), per_forward=0.007) >= 1
    # two sequences share each forward (charged to each, it would cost 11.5 + 14 ms against 19.95)
    assert costs.shared_k([(8, 0.9), (8, 0.9)], StepLoad(rows=2, tokens=2), per_forward=0.007) >= 1


def test_a_sequence_whose_drafts_do_not_pay_tries_one_after_2_4_8_16_32_steps():
    adapt = AdaptiveK()
    tries = [step for step in range(1, 100) if adapt.probe(0, could_pay=True)]
    assert tries == [2, 6, 14, 30, 62, 94]


def test_no_draft_is_tried_where_none_could_pay_at_the_priors_acceptance():
    adapt = AdaptiveK()
    assert not any(adapt.probe(0, could_pay=False) for _ in range(100))


def test_drafts_that_pay_pass_and_make_the_next_try_soon_again():
    adapt = AdaptiveK()
    for _ in range(6):
        adapt.probe(0, could_pay=True)  # tried at step 2 and 6: the next try 8 steps on
    assert adapt.probe(3, could_pay=True) == 3
    assert [adapt.probe(0, could_pay=True) for _ in range(2)] == [0, 1]  # the wait is 2 steps again
    assert [adapt.probe(0, could_pay=True) for _ in range(2)] == [0, 0]  # then 4
    adapt.update(proposed=1, accepted=1, max_k=8)  # a try fully accepted: soon again
    assert [adapt.probe(0, could_pay=True) for _ in range(2)] == [0, 1]
