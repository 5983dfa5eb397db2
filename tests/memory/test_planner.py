"""The memory planner on recorded step sequences (no TensorFlow needed)."""

import pytest

from keras_geeps.memory import (AccessSequence, MemoryBudgetError, UnitRecord,
                                plan)


def dense_chain(sizes, act=100, state=0):
    """A chain of explicit (Dense-like) layers with these parameter bytes."""
    return AccessSequence([
        UnitRecord(i, f"d{i}", size, act, act, state_bytes=state * size,
                   backward="explicit", needs_output=True)
        for i, size in enumerate(sizes)])


def test_sequence_order_is_forward_then_backward():
    seq = dense_chain([1000, 2000])
    items = [(a.phase, a.kind, a.item) for a in seq]
    assert items == [
        ("forward", "read", "table:d0"), ("forward", "local", "act:d0"),
        ("forward", "read", "table:d1"), ("forward", "local", "act:d1"),
        ("loss", "local", "output"),
        ("backward", "local", "output"), ("backward", "local", "act:d1"),
        ("backward", "read", "table:d1"), ("backward", "update", "table:d1"),
        ("backward", "local", "act:d1"), ("backward", "local", "act:d0"),
        ("backward", "read", "table:d0"), ("backward", "update", "table:d0")]
    assert [a.position for a in seq] == list(range(len(seq)))
    assert seq.param_bytes == 3000 and seq.activation_bytes == 300


def test_no_budget_keeps_every_table_resident():
    p = plan(dense_chain([1000] * 4))
    assert p.staged == [False] * 4 and p.pool_bytes == 0
    assert p.resident_bytes == 4000 and p.staged_bytes == 0
    assert p.device_bytes == 4000 + 500
    assert p.minimum_budget == 2 * 1000 + 500


def test_resident_set_pool_and_first_access_order():
    seq = dense_chain([1000] * 8)          # 8,000 bytes of tables
    p = plan(seq, budget=6000)
    # Pool 2 x 1000; activations 900; so 3,000 stay resident: the LAST
    # three tables (the first ones are staged, in first-access order).
    assert p.staged == [True] * 5 + [False] * 3
    assert p.resident_tables == ["d5", "d6", "d7"]
    assert p.peak_working_set == 1000 and p.pool_bytes == 2000
    assert p.resident_bytes == 3000 and p.staged_bytes == 5000
    assert p.device_bytes == 3000 + 2000 + 900 <= 6000
    # Prefetches follow the access sequence: forward reads of d0..d4, then
    # backward reads of d4..d0.
    fetched = [item for _, item, _ in p.prefetch_order]
    assert fetched == [f"table:d{i}" for i in range(5)] + \
        [f"table:d{i}" for i in reversed(range(5))]
    positions = [pos for pos, _, _ in p.prefetch_order]
    assert positions == sorted(positions)
    assert "table:d0" in str(p) and "host" in str(p)


def test_pool_is_twice_the_peak_working_set_with_optimizer_state():
    # Momentum-like state doubles a table; the largest staged table sets it.
    seq = dense_chain([400, 3000, 800, 600, 1200, 500], state=1)
    p = plan(seq, budget=12500)
    staged = [u for u in seq.units if p.staged[u.index]]
    assert staged
    assert p.peak_working_set == max(u.table_bytes for u in staged)
    assert p.pool_bytes == 2 * p.peak_working_set
    assert p.device_bytes <= 12500
    assert p.traffic_bytes == sum(u.param_bytes + 2 * u.table_bytes
                                  for u in staged)


def test_a_table_too_large_for_the_pool_stays_resident():
    seq = dense_chain([5000, 300, 300, 300, 300])
    p = plan(seq, budget=6300)
    # Staging d0 would need a 10,000-byte pool: it stays, the small go.
    assert p.staged[0] is False and all(p.staged[1:])
    assert p.pool_bytes == 600 and p.device_bytes == 5000 + 600 + 600


def test_budget_below_the_minimum_names_it():
    seq = dense_chain([1000] * 8)
    minimum = plan(seq, budget=10**9).minimum_budget
    assert minimum == 2 * 1000 + 900
    assert plan(seq, budget=minimum).staged == [True] * 8
    with pytest.raises(MemoryBudgetError, match=f"{minimum:,} bytes") as info:
        plan(seq, budget=minimum - 1)
    assert info.value.minimum_budget == minimum
    assert info.value.budget == minimum - 1
    with pytest.raises(ValueError):
        plan(seq, budget=0)


def test_offload_auto_moves_activations_only_when_tables_are_not_enough():
    seq = dense_chain([1000] * 8, act=400)   # 9 x 400 bytes of activations
    assert plan(seq, budget=6000, offload_activations="auto") \
        .offloaded_activations == []
    with pytest.raises(MemoryBudgetError):
        plan(seq, budget=5400)
    p = plan(seq, budget=5400, offload_activations="auto")
    assert p.offloaded_activations and all(p.staged)
    first = p.offloaded_activations
    assert first == [f"d{i}" for i in range(len(first))]  # first layers first
    # Working sets now include offloaded input and output activations, and
    # up to three offloaded activations may be on their way out.
    assert p.peak_working_set == 1000 + 400 + 400
    assert p.pool_bytes == 2 * p.peak_working_set
    kept = 400 * (8 - len(first)) + 400          # + the model's output
    assert p.activation_device_bytes == kept + 3 * 400
    assert p.device_bytes == p.pool_bytes + p.activation_device_bytes <= 5400
    assert p.minimum_budget == 2 * 1800 + 400 + 3 * 400


def test_offload_by_name_and_backward_modes():
    units = [UnitRecord(0, "conv", 1000, 800, 800),
             UnitRecord(1, "conv_1", 1000, 800, 800),
             UnitRecord(2, "drop", 0, 800, 800),
             UnitRecord(3, "norm", 1000, 800, 800),
             UnitRecord(4, "dense", 1000, 800, 40, backward="explicit",
                        needs_output=False)]
    seq = AccessSequence(units)
    p = plan(seq, offload_activations=["norm"])
    assert p.offloaded == [False, False, False, True, False]
    assert p.activation_host_bytes == 800
    # "drop" produces the offloaded tensor and "norm" consumes it: neither
    # may keep a tape that pins it; a Dense never keeps one.
    assert p.modes == ["taped", "taped", "recompute", "recompute",
                       "explicit"]
    # Each kept tape is estimated at one output of its layer.
    assert p.tape_bytes == 2 * 800
    acts = 5 * 800 + 40
    # pool + one resident table + drop's tape
    p = plan(seq, budget=acts + 2000 + 1000 + 800)
    assert p.staged == [True, True, False, True, False]
    assert p.resident_tables == ["dense"]
    assert p.modes == ["recompute", "recompute", "taped", "recompute",
                       "explicit"]
    assert p.tape_bytes == 800
    assert p.device_bytes == acts + 2000 + 1000 + 800
    # Without room for that tape, staging the last table makes up for it.
    assert plan(seq, budget=acts + 2000 + 1000).staged == \
        [True, True, False, True, True]
    with pytest.raises(ValueError, match="no layer"):
        plan(seq, offload_activations=["nope"])


def test_random_chains_always_fit_and_the_minimum_is_tight():
    import random  # noqa: PLC0415
    rng = random.Random(5)
    for trial in range(40):
        count = rng.randint(1, 12)
        units = []
        for i in range(count):
            params = rng.choice([0, 300, 1000, 4000])
            units.append(UnitRecord(
                i, f"u{i}", params, rng.choice([50, 200, 800]), 0,
                state_bytes=rng.choice([0, params]),
                backward=rng.choice(["explicit", "autodiff"]),
                needs_output=rng.random() < 0.5))
        seq = AccessSequence(units, output_bytes=rng.choice([10, 300]))
        policy = rng.choice([None, "auto"])
        free = plan(seq, offload_activations=policy)
        minimum = free.minimum_budget
        assert minimum <= free.device_bytes
        for budget in {minimum, (minimum + free.device_bytes) // 2,
                       free.device_bytes}:
            p = plan(seq, budget, offload_activations=policy)
            assert p.device_bytes <= budget, (trial, budget)
            assert p.pool_bytes == 2 * p.peak_working_set
            assert p.resident_bytes + p.staged_bytes == \
                sum(u.table_bytes for u in units)
        with pytest.raises(MemoryBudgetError):
            plan(seq, minimum - 1, offload_activations=policy)


def test_layers_before_the_first_with_parameters_keep_nothing():
    """No gradient reaches a layer before the first one with parameters:
    the backward pass stops there, its input is never kept (the trainer
    drops it after the forward), so the plan neither counts nor offloads
    it; while such a layer runs its input and output are on the device."""
    units = [UnitRecord(0, "flat", 0, 800, 800),
             UnitRecord(1, "scale", 0, 800, 300),
             UnitRecord(2, "d1", 1000, 300, 200, backward="explicit",
                        needs_output=True),
             UnitRecord(3, "d2", 1000, 200, 50, backward="explicit")]
    seq = AccessSequence(units)
    assert seq.first_with_params == 2
    assert [a.item for a in seq if a.phase == "backward"] == [
        "act:d2", "table:d2", "table:d2", "act:d2", "act:d1", "table:d1",
        "table:d1"]
    # kept: d1's and d2's inputs and the output; flat runs with 800 + 800
    assert plan(seq).activation_device_bytes == max(300 + 200 + 50, 1600)
    small = AccessSequence([
        UnitRecord(0, "flat", 0, 100, 100),
        UnitRecord(1, "d1", 1000, 100, 200, backward="explicit",
                   needs_output=True),
        UnitRecord(2, "d2", 1000, 200, 50, backward="explicit")])
    assert plan(small).activation_device_bytes == 100 + 200 + 50
    auto = plan(seq, budget=10**9, offload_activations="auto")
    with pytest.raises(MemoryBudgetError):
        plan(seq, budget=auto.minimum_budget - 1,
             offload_activations="auto")
    assert not any(plan(seq, budget=auto.minimum_budget,
                        offload_activations="auto").offloaded[:2])
    with pytest.raises(ValueError, match="before the first layer with "
                                         "parameters"):
        plan(seq, offload_activations=["scale"])


def test_bad_records_and_policies_are_named():
    with pytest.raises(ValueError, match="'a': param_bytes must be an int"):
        UnitRecord(0, "a", -100, 10)
    with pytest.raises(ValueError, match="'a': state_bytes"):
        UnitRecord(0, "a", 100, 10, state_bytes=-5)
    with pytest.raises(ValueError, match="'a': input_bytes"):
        UnitRecord(0, "a", 100, 1.5)
    seq = dense_chain([1000] * 2)
    for policy in [True, 1, {"d0": 1}, ["d0", 2]]:
        with pytest.raises(TypeError, match="offload_activations must be"):
            plan(seq, offload_activations=policy)
    for budget in [float("inf"), float("nan"), -1, True, "1000"]:
        with pytest.raises(ValueError, match="budget must be a positive"):
            plan(seq, budget=budget)


def offload_chain(first_dtype):
    """Inputs much larger than the tables: offloading them pays."""
    return AccessSequence(
        [UnitRecord(0, "embedding", 400, 4000, 4000,
                    input_dtype=first_dtype)]
        + [UnitRecord(i, f"conv{i}", 400, 4000, 4000, input_dtype="float32")
           for i in range(1, 6)])


@pytest.mark.parametrize("dtype", ["int16", "int8", "bool"])
def test_inputs_the_swap_ops_cannot_copy_are_never_offloaded(dtype):
    floats = offload_chain("float32")
    lowest = plan(floats, offload_activations="auto").minimum_budget
    assert plan(floats, lowest, offload_activations="auto").offloaded[0]
    seq = offload_chain(dtype)
    minimum = plan(seq, offload_activations="auto").minimum_budget
    assert minimum > lowest
    for budget in range(minimum, plan(seq).device_bytes + 1, 500):
        assert not plan(seq, budget, "auto").offloaded[0]
    with pytest.raises(ValueError, match=f"'embedding', whose input is "
                                         f"{dtype}: the swap ops copy only"):
        plan(seq, offload_activations=["embedding", "conv1"])


def test_the_minimum_budget_is_the_searchs_and_says_so():
    """The search is greedy: here offloading the first input (taken first)
    enlarges the pool and keeps out offloading the second alone, a plan
    that fits 100 bytes less. The error says what the minimum is: the
    smallest budget the planner finds a plan for; naming the activation
    reaches the better plan."""
    seq = AccessSequence([
        UnitRecord(0, "dense", 4000, 50, 50, state_bytes=4000,
                   backward="explicit", needs_output=True, fixed_bytes=100),
        UnitRecord(1, "act", 0, 50, 200)])
    minimum = plan(seq, offload_activations="auto").minimum_budget
    assert minimum == 8600
    with pytest.raises(MemoryBudgetError,
                       match="in any plan the planner finds; the minimum "
                             "budget it finds a plan for") as info:
        plan(seq, 8500, offload_activations="auto")
    assert info.value.minimum_budget == minimum
    better = plan(seq, 8500, offload_activations=["act"])
    assert better.device_bytes == 8500 and better.offloaded == [False, True]
    assert "greedy" in plan.__doc__ and "greedy" in MemoryBudgetError.__doc__


def test_layers_before_the_first_with_parameters_have_no_backward_mode():
    """A Flatten and a Dropout before the first Dense have no backward (no
    gradient reaches them), but the plan called them "taped" or
    "recompute" and counted them in recomputed_layers."""
    import keras  # noqa: PLC0415

    from keras_geeps.memory.trainer import LayerwiseTrainer  # noqa: PLC0415
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((4, 8)), keras.layers.Flatten(name="flat"),
        keras.layers.Dropout(0.1, name="drop"),
        keras.layers.Dense(16, activation="gelu", name="d1"),
        keras.layers.Dense(3, name="out")])
    trainer = LayerwiseTrainer(model, "sgd", "mse", 8,
                               device_memory_budget=10 ** 6,
                               offload_activations=["d1"])
    try:
        assert trainer.plan.modes == ["none", "none", "recompute",
                                      "explicit"]
        assert trainer.plan.figures()["recomputed_layers"] == 1
    finally:
        trainer.close()
