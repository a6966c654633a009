"""The split loop's timeline simulation (backends/training/async_planner.py): its schedule and its bounds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.training.async_planner import fit_costs, ideal_overlap, simulate_split

pytestmark = pytest.mark.offpolicy

costs = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=30)


@st.composite
def runs(draw):
    rollout = draw(costs)
    n = len(rollout)
    train = draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=n, max_size=n))
    push = draw(st.lists(st.floats(0.0, 2.0, allow_nan=False), min_size=n, max_size=n))
    return rollout, train, push


@settings(max_examples=200, deadline=None)
@given(runs())
def test_sync_is_the_serial_sum(run):
    rollout, train, push = run
    assert simulate_split(rollout, train, push, lag=0).total_s == pytest.approx(sum(rollout) + sum(train) + sum(push))


@settings(max_examples=200, deadline=None)
@given(runs(), st.integers(1, 4))
def test_a_lag_is_never_slower_than_sync_and_never_beats_the_busier_pool(run, lag):
    rollout, train, push = run
    out = simulate_split(rollout, train, push, lag=lag)
    assert out.total_s <= simulate_split(rollout, train, push, lag=0).total_s + 1e-9
    assert out.total_s >= max(sum(rollout), sum(train) + sum(push)) - 1e-9


def test_a_longer_lag_can_be_slower_because_the_push_waits_for_the_pool():
    """The weights' broadcast completes only when the rollout pool joins it, after sampling batch v + lag: with a
    slow last batch, a longer lag holds the trainer's earlier pushes behind it."""
    rollout, train = [0.0] * 6 + [1.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    four, five = simulate_split(rollout, train, lag=4), simulate_split(rollout, train, lag=5)
    assert four.total_s == pytest.approx(1.0)  # update 3 overlaps the last batch
    assert five.total_s == pytest.approx(2.0) and five.trainer_idle_s == pytest.approx(1.0)  # push 2 waits for it


@settings(max_examples=200, deadline=None)
@given(runs(), st.integers(0, 4))
def test_each_batch_is_sampled_after_the_weights_it_needs(run, lag):
    """Batch s is sampled by version max(0, s - 1 - lag): it cannot be ready before that version arrived
    plus its own sampling time; the trainer never updates on a batch before it is ready."""
    rollout, train, push = run
    out = simulate_split(rollout, train, push, lag=lag)
    for s in range(1, len(rollout) + 1):
        version = s - 1 - lag
        if version >= 1:
            assert out.batch_ready_s[s - 1] >= out.pushed_s[version - 1] + rollout[s - 1] - 1e-9
        assert out.pushed_s[s - 1] >= out.batch_ready_s[s - 1] + train[s - 1] + push[s - 1] - 1e-9


def test_one_step_off_with_equal_costs_approaches_the_ideal_overlap():
    steps, r, u = 200, 1.0, 1.0
    sync = simulate_split([r] * steps, [u] * steps, lag=0).total_s
    off = simulate_split([r] * steps, [u] * steps, lag=1).total_s
    assert sync == pytest.approx(400.0)
    assert off == pytest.approx(r + steps * max(r, u))  # the first batch, then one step per max(r, u)
    assert sync / off == pytest.approx(ideal_overlap([r] * steps, [u] * steps), rel=0.01)


def test_a_rollout_bound_run_pays_the_push_on_the_rollout_side():
    """Rollout-bound (sampling 3 s, update 1 s, push 0.5 s): after the first two batches each batch costs the
    sampling plus the broadcast the pool takes part in; the trainer idles."""
    out = simulate_split([3.0] * 10, [1.0] * 10, 0.5, lag=1)
    gaps = [b - a for a, b in zip(out.batch_ready_s[2:], out.batch_ready_s[3:])]
    assert gaps == pytest.approx([3.5] * len(gaps))
    assert out.total_s == pytest.approx(out.batch_ready_s[-1] + 0.5 + 1.0 + 0.5)  # push 9, update 10, push 10
    assert out.trainer_idle_s > 0
    assert ideal_overlap([3.0] * 10, [1.0] * 10, 0.5) == pytest.approx(4.5 / 3.0)


def test_fit_costs_recovers_an_affine_cost_and_falls_back_to_a_rate():
    tokens = [100, 150, 300, 120, 260]
    cost = fit_costs(tokens, [0.2 + 0.01 * t for t in tokens])
    assert cost.fixed_s == pytest.approx(0.2) and cost.per_token_s == pytest.approx(0.01)
    assert cost(1000) == pytest.approx(10.2)
    flat = fit_costs([100, 100, 100], [1.0, 2.0, 3.0])
    assert flat.fixed_s == 0.0 and flat.per_token_s == pytest.approx(0.02)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="one cost per step"):
        simulate_split([1.0, 1.0], [1.0], lag=1)
    with pytest.raises(ValueError, match="lag must be >= 0"):
        simulate_split([1.0], [1.0], lag=-1)
    with pytest.raises(ValueError, match="at least one step"):
        fit_costs([], [])


def test_sampling_version_follows_the_lag_and_drains_at_checkpoints():
    from backends.loop.split import sampling_version

    assert [sampling_version(s, 1) for s in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    assert [sampling_version(s, 0) for s in range(1, 5)] == [0, 1, 2, 3]
    # checkpoints every 2 steps: the batch after a checkpoint is sampled with its weights
    assert [sampling_version(s, 1, every=2) for s in range(1, 7)] == [0, 0, 2, 2, 4, 4]
    assert [sampling_version(s, 2, every=3) for s in range(1, 9)] == [0, 0, 0, 3, 3, 3, 6, 6]
    # a run resumed from step 3 (a stop between scheduled checkpoints) starts from that version
    assert [sampling_version(s, 1, every=4, start=3) for s in range(4, 8)] == [3, 4, 4, 5]
