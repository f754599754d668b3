"""How many of the server's own drafts a sequence gets, from the steps' measured times by rows
(engine/speculation.StepCosts) and the sequence's acceptance (AdaptiveK)."""

from waferscale.engine.speculation import AdaptiveK, StepCosts


def costs_of(times: dict[int, float]) -> StepCosts:
    """Step times by rows, each measured often enough to count."""
    costs = StepCosts()
    for rows, seconds in times.items():
        for _ in range(costs.trusted_after):
            costs.record(rows, seconds)
    return costs


def test_drafts_go_on_while_rows_cost_little():
    costs = costs_of({r: 0.010 + 0.0005 * (r - 1) for r in range(1, 10)})  # memory-bound: a row adds 5%
    assert costs.best_k(0.8, 8, rows=1) == 8


def test_no_drafts_where_each_row_costs_a_whole_step():
    costs = costs_of({r: 0.010 * r for r in range(1, 10)})  # compute-bound rows
    assert costs.best_k(0.9, 8, rows=1) == 0


def test_fewer_drafts_where_rows_cost_half_a_step_and_acceptance_is_middling():
    costs = costs_of({r: 0.010 * (1 + 0.5 * (r - 1)) for r in range(1, 10)})
    # one draft: (1 + 0.7) / 1.5 = 1.13x; two: (1 + 0.7 + 0.49) / 2 = 1.10x; more pay less
    assert costs.best_k(0.7, 8, rows=1) == 1


def test_a_step_size_not_measured_yet_is_tried():
    costs = costs_of({1: 0.010, 2: 0.020})
    assert costs.best_k(0.9, 8, rows=1) == 2  # 2 rows' cost is known to lose; 3 rows' is not known
    assert StepCosts().best_k(0.1, 8, rows=1) == 8  # nothing known: no cap


def test_the_first_step_of_a_size_does_not_count():
    costs = StepCosts()
    costs.record(3, 5.0)  # a cold first step
    assert costs.seconds(3) is None
    costs.record(3, 0.012)
    assert costs.seconds(3) == 0.012


def test_a_sequence_whose_drafts_miss_is_estimated_to_miss():
    adapt = AdaptiveK()
    assert adapt.acceptance() == 0.5  # the prior
    for _ in range(10):
        adapt.update(proposed=4, accepted=0, max_k=8)
    assert adapt.acceptance() < 0.1
    for _ in range(20):
        adapt.update(proposed=4, accepted=4, max_k=8)
    assert adapt.acceptance() > 0.9
