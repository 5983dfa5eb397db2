"""The layer-wise trainer under device-memory budgets, against no budget.

Swapping must not change results: every run under a budget is compared
bit for bit with the same run without one, and the runs without one with
plain Keras (a GradientTape over the whole model). The bytes the trainer
holds on the device are measured (the variables' real storage) after every
change and must never exceed the budget.
"""

import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_geeps.memory import MemoryBudgetError, plan, record_model
from keras_geeps.memory.trainer import LayerwiseTrainer

WIDTH, LAYERS, BATCH, STEPS = 64, 16, 4, 3


def seeded_mlp(width, layers, outputs):
    """`layers` relu Dense(width) on inputs of `width`, then
    Dense(outputs), seeded (every call gives the same weights)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu")
           for _ in range(layers)]
        + [keras.layers.Dense(outputs)])


def mlp():
    return seeded_mlp(WIDTH, LAYERS, 10)


def mixed():
    """Layers with a tape-computed backward, non-trainable state and
    randomness (convolutions, batch norm, dropout, layer norm, a gelu
    Dense) beside Dense layers; four tables of similar size, so that
    staging pays."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 4)),
        keras.layers.Conv2D(24, 3, padding="same", activation="relu",
                            name="conv"),
        keras.layers.Conv2D(24, 3, padding="same", use_bias=False,
                            name="conv_2"),  # a bias before BN has no gradient
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(64, activation="tanh", name="d_tanh"),
        keras.layers.Dropout(0.25, name="drop"),
        keras.layers.LayerNormalization(name="ln"),
        keras.layers.Dense(64, activation="gelu", name="d_gelu"),
        keras.layers.Dense(64, activation="sigmoid", name="d_sigmoid"),
        keras.layers.Dense(64, activation="relu", name="d_relu"),
        keras.layers.Dense(5, name="logits")])


def batches(shape, classes, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((batch,) + shape).astype("float32"),
             rng.integers(0, classes, batch)) for _ in range(steps)]


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def param_bytes(model):
    return sum(w.nbytes for w in model.get_weights())


def train(build, data, optimizer, budget=None, **kwargs):
    model = build()
    trainer = LayerwiseTrainer(model, optimizer, loss_fn(), BATCH,
                               device_memory_budget=budget, audit=True,
                               **kwargs)
    try:
        measured_between_steps = []
        for x, y in data:
            trainer.train_step(x, y)
            measured_between_steps.append(trainer.measure_device_bytes())
        stats = trainer.stats()
        stats["prefetches"] = list(trainer.last_prefetches)
        trainer.materialize()
        return model.get_weights(), trainer.plan, stats, \
            measured_between_steps
    finally:
        trainer.close()


def keras_reference(build, data, optimizer):
    model = build()
    loss = loss_fn()
    for x, y in data:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    return model.get_weights()


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_record_model_sizes_and_order():
    model = mlp()
    seq = record_model(model, batch_size=BATCH)
    assert len(seq.units) == LAYERS + 1
    first = seq.units[0]
    assert first.param_bytes == (WIDTH * WIDTH + WIDTH) * 4
    assert first.input_bytes == BATCH * WIDTH * 4
    assert first.backward == "explicit" and first.needs_output
    assert seq.units[-1].needs_output is False  # linear output layer
    assert seq.output_bytes == BATCH * 10 * 4
    assert seq.param_bytes == param_bytes(model)
    reads = [a.item for a in seq if a.kind == "read" and a.phase == "forward"]
    assert reads == [f"table:{layer.name}" for layer in model.layers]


def test_parameters_4x_the_budget_train_exactly_as_without_one():
    data = batches((WIDTH,), 10)
    budget = param_bytes(mlp()) // 4
    free, free_plan, _, _ = train(mlp, data, keras.optimizers.SGD(0.05))
    assert free_plan.staged == [False] * (LAYERS + 1)
    weights, p, stats, measured = train(mlp, data,
                                        keras.optimizers.SGD(0.05), budget)
    # The plan really stages almost everything, through a small pool.
    assert sum(p.staged) >= LAYERS - 1
    assert p.pool_bytes == 2 * p.peak_working_set
    assert p.device_bytes <= budget
    # Swapping does not change a single bit.
    assert_same(weights, free)
    # And the trainer computes what Keras computes.
    reference = keras_reference(mlp, data, keras.optimizers.SGD(0.05))
    initial = mlp().get_weights()
    assert max(float(np.abs(a - b).max())
               for a, b in zip(reference, initial)) > 1e-3
    for ours, ref in zip(free, reference):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    # The accounting is real: the measured bytes never exceeded the budget,
    # matched the ledger after every change, and between steps the staged
    # layers' variables hold no storage while the resident ones hold what
    # the plan promised.
    assert stats["audit_mismatches"] == 0 and stats["audits"] > 100
    assert 0 < stats["audit_peak_bytes"] <= budget
    assert stats["peak_device_bytes"] == stats["audit_peak_bytes"]
    assert stats["peak_pool_bytes"] <= p.pool_bytes
    for m in measured:
        assert m == {"resident": p.resident_bytes, "staged": 0}
    # Each staged table came in twice (forward, backward) and went out once.
    assert stats["swapped_in_bytes"] == 2 * STEPS * p.staged_bytes
    assert stats["swapped_out_bytes"] == STEPS * p.staged_bytes


def test_mixed_layers_with_adam_and_offload_match_no_budget():
    data = batches((6, 6, 4), 5)
    free, free_plan, _, _ = train(mixed, data, keras.optimizers.Adam(0.01))
    offload = ["bn", "drop", "ln"]
    # The tightest budget there is (Adam's two moments triple each table).
    budget = plan(free_plan.sequence,
                  offload_activations=offload).minimum_budget
    assert budget < free_plan.device_bytes
    weights, p, stats, _ = train(mixed, data, keras.optimizers.Adam(0.01),
                                 budget, offload_activations=offload)
    assert any(p.staged) and p.offloaded_activations == offload
    # The prefetcher brought the host-resident items in exactly in the
    # plan's (first-access) order.
    assert stats["prefetches"] == [item for _, item, _ in p.prefetch_order]
    assert "recompute" in p.modes and "explicit" in p.modes
    assert stats["audit_mismatches"] == 0
    assert stats["audit_peak_bytes"] <= budget
    # Adam's moments, BatchNorm's statistics and the dropout masks all come
    # out the same (weights include the non-trainable statistics).
    assert_same(weights, free)
    # Adam divides by the root of tiny second moments, so rounding
    # differences between two correct gradient programs show more.
    reference = keras_reference(mixed, data, keras.optimizers.Adam(0.01))
    for ours, ref in zip(free, reference):
        np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4)


def test_activation_offload_gives_the_same_gradients():
    x, y = batches((6, 6, 4), 5, steps=1)[0]

    def gradients(**kwargs):
        model = mixed()
        trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1),
                                   loss_fn(), BATCH, audit=True, **kwargs)
        try:
            loss, grads = trainer.compute_gradients(x, y)
            assert trainer.stats()["audit_mismatches"] == 0
            return float(loss), grads, trainer.plan
        finally:
            trainer.close()

    loss0, plain, _ = gradients()
    names = [layer.name for layer in mixed().layers]
    loss1, offloaded, p = gradients(offload_activations=names)
    assert p.offloaded == [True] * len(names)
    assert loss0 == loss1
    for a, b in zip(plain, offloaded):
        assert_same(a, b)
    # ... and they are the gradients of the whole model.
    model = mixed()
    with tf.GradientTape() as tape:
        loss = loss_fn()(y, model(x, training=True))
    expected = tape.gradient(loss, model.trainable_variables)
    ours = [g for layer in plain for g in layer]
    assert len(ours) == len(expected)
    for g, e in zip(ours, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("build", [mlp, mixed])
def test_an_offloaded_activation_is_freed_before_it_comes_back(build):
    """Once swapped out and dropped, the forward's device copy of an
    offloaded activation is gone (nothing the step's jobs keep holds it)
    by the time the backward prefetch swaps it in again: never two copies
    on the device while the ledger counts one."""
    model = build()
    names = [layer.name for layer in model.layers]
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH, audit=True, offload_activations=names)
    measure = trainer.ledger.audit
    forward = {}   # activation index -> weak reference to its first copy
    back = {}      # index -> whether that copy lived on at the swap-in
    try:
        def audit():  # after every hold and drop, under the ledger's lock
            for index, tensor in trainer._held.items():
                if index not in forward:
                    forward[index] = weakref.ref(tensor)
                elif forward[index]() is not tensor and index not in back:
                    back[index] = forward[index]() is not None
            return measure()

        trainer.ledger.audit = audit
        x, y = batches(model.input_shape[1:], model.output_shape[-1],
                       steps=1)[0]
        trainer.train_step(x, y)
        assert trainer.plan.offloaded == [True] * len(names)
        assert trainer.stats()["audit_mismatches"] == 0
    finally:
        trainer.close()
    assert sorted(back) == list(range(len(names)))  # each came back
    assert not any(back.values()), \
        [names[i] for i, alive in back.items() if alive]


def test_budget_below_the_minimum_is_refused_with_the_minimum():
    model = mlp()
    minimum = plan(record_model(model, BATCH), 10**12).minimum_budget
    with pytest.raises(MemoryBudgetError, match="minimum budget") as info:
        LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(), BATCH,
                         device_memory_budget=minimum - 1)
    assert info.value.minimum_budget == minimum


def test_functional_chain_runs_and_a_residual_model_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    chain = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    data = batches((WIDTH,), 10, steps=1)
    trainer = LayerwiseTrainer(chain, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH)
    try:
        trainer.train_step(*data[0])
    finally:
        trainer.close()
    skip = keras.layers.Add()([inputs, hidden])
    residual = keras.Model(inputs, keras.layers.Dense(10)(skip))
    with pytest.raises(ValueError, match="not a chain"):
        LayerwiseTrainer(residual, keras.optimizers.SGD(0.1), loss_fn(),
                         BATCH)
