"""The layer-wise trainer on what a plain float32 MLP does not exercise:
mixed precision, float64 input, frozen layers, reading weights between
steps, variable-length inputs, unseeded random ops and budgets that fail
before the optimizer state exists. Every run under a budget is compared
with the same run without one (or with Keras' own gradients)."""

import functools
import logging
import threading
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_geeps.errors import GeePSError
from keras_geeps.memory import MemoryBudgetError, plan, record_model
from keras_geeps.memory import trainer as trainer_module
from keras_geeps.memory.swapping import AccessPool, Worker
from keras_geeps.memory.trainer import LayerwiseTrainer
from tests.memory.test_trainer import (assert_same, keras_reference,
                                       seeded_mlp)

BATCH = 4


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches(shape, classes, steps=2, batch=BATCH, dtype="float32"):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((batch,) + shape).astype(dtype),
             rng.integers(0, classes, batch)) for _ in range(steps)]


def minimum_budget(build, batch=BATCH, offload_activations=None, **kwargs):
    trainer = LayerwiseTrainer(build(), keras.optimizers.SGD(0.1), loss_fn(),
                               batch, **kwargs)
    try:
        return plan(trainer.sequence,
                    offload_activations=offload_activations).minimum_budget
    finally:
        trainer.close()


def train(build, data, budget=None, batch=BATCH, **kwargs):
    model = build()
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               batch, device_memory_budget=budget, audit=True,
                               **kwargs)
    try:
        for x, y in data:
            trainer.train_step(x, y)
        stats = trainer.stats()
        trainer.materialize()
        return model.get_weights(), trainer.plan, stats
    finally:
        trainer.close()


# ------------------------------------------------------ 1. compute dtypes
def dense_stack(policy):
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((32,))]
            + [keras.layers.Dense(32, activation=a, dtype=policy)
               for a in ("relu", "sigmoid", "tanh", None)]
            + [keras.layers.Dense(10, dtype="float32")])
    return build


@pytest.mark.parametrize("policy",
                         ["bfloat16", "mixed_float16", "mixed_bfloat16"])
def test_explicit_dense_backward_in_low_precision_policies(policy):
    build = dense_stack(policy)
    data = batches((32,), 10)
    free, free_plan, _ = train(build, data)
    assert free_plan.modes.count("explicit") == 5
    budget = minimum_budget(build)
    weights, p, stats = train(build, data, budget)
    assert any(p.staged)
    assert stats["audit_mismatches"] == 0
    assert stats["audit_peak_bytes"] <= budget
    assert_same(weights, free)
    # The explicit backward computes what Keras' autodiff computes (to the
    # precision of the compute dtype); the weights keep their dtypes.
    reference = keras_reference(build, data, keras.optimizers.SGD(0.1))
    for ours, ref in zip(free, reference):
        assert ours.dtype == ref.dtype
        np.testing.assert_allclose(np.asarray(ours, np.float32),
                                   np.asarray(ref, np.float32),
                                   rtol=2e-2, atol=2e-2)


def wide_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(16, activation=a)
           for a in ("gelu", "relu", "gelu")]
        + [keras.layers.Dense(10)])


def test_float64_input_is_cast_and_keeps_to_the_budget():
    batch = 64
    budget = minimum_budget(wide_mlp, batch, offload_activations="auto")
    run = {}
    for dtype in ("float32", "float64"):
        data = batches((512,), 10, batch=batch, dtype=dtype)
        run[dtype] = train(wide_mlp, data, budget, batch=batch,
                           offload_activations="auto")
        _, _, stats = run[dtype]
        assert stats["audit_mismatches"] == 0
        assert stats["audit_peak_bytes"] <= budget, dtype
    assert_same(run["float64"][0], run["float32"][0])


def test_access_pool_refuses_a_negative_release():
    pool = AccessPool(100)
    pool.reserve(60)
    with pytest.raises(GeePSError, match="cannot release"):
        pool.release(-50)
    assert pool.reserved == 60


# ------------------------------------------------ 3. non-trainable state
def frozen_model():
    keras.utils.set_random_seed(0)
    frozen = keras.layers.Dense(256, activation="relu", name="frozen")
    frozen.trainable = False
    return keras.Sequential([
        keras.Input((256,)), frozen,
        keras.layers.Dense(64, activation="relu", name="d1"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(10, name="out")])


def test_frozen_weights_and_statistics_are_planned_and_audited():
    model = frozen_model()
    seq = record_model(model, BATCH)
    fixed = sum(int(np.prod(v.shape)) * 4
                for v in model.non_trainable_variables)
    assert fixed >= 256 * 257 * 4
    assert seq.fixed_bytes == fixed
    data = batches((256,), 10)
    free, _, _ = train(frozen_model, data)
    budget = minimum_budget(frozen_model)
    assert budget > fixed
    weights, p, stats = train(frozen_model, data, budget)
    assert p.fixed_bytes == fixed and p.resident_bytes >= fixed
    # The audit measures the frozen weights too: still within the budget.
    assert stats["audit_mismatches"] == 0
    assert fixed < stats["audit_peak_bytes"] <= budget
    assert_same(weights, free)
    # A budget that fits the tables but not the frozen weights is refused.
    with pytest.raises(MemoryBudgetError):
        LayerwiseTrainer(frozen_model(), keras.optimizers.SGD(0.1),
                         loss_fn(), BATCH, device_memory_budget=budget - 1)


def frozen_conv_model():
    keras.utils.set_random_seed(0)
    frozen = keras.layers.Conv2D(32, 3, padding="same", name="frozen")
    frozen.trainable = False
    return keras.Sequential([
        keras.Input((8, 8, 32)), keras.layers.Conv2D(32, 1, name="conv_in"),
        frozen, keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dropout(0.25, seed=3, name="drop"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(10, name="out")])


def test_a_recomputed_layer_copies_only_the_state_its_forward_writes():
    """Recomputing a layer puts back the non-trainable variables its first
    forward wrote (BatchNorm statistics, a dropout's seed) from a copy
    held until its backward, outside the budget: a frozen layer's weights,
    only read, are not copied (that copy was as large as the layer)."""
    data = batches((8, 8, 32), 10)
    free, _, _ = train(frozen_conv_model, data)
    model = frozen_conv_model()
    trainer = LayerwiseTrainer(
        model, keras.optimizers.SGD(0.1), loss_fn(), BATCH,
        device_memory_budget=10**9, audit=True,
        offload_activations=["frozen", "bn", "drop"])
    try:
        for x, y in data:
            trainer.train_step(x, y)
        units = {u.name: u for u in trainer.units}
        assert [trainer.plan.modes[units[n].index]
                for n in ("frozen", "bn", "drop")] == ["recompute"] * 3
        layers = {layer.name: layer for layer in model.layers}
        assert units["frozen"]._written == []

        def of(name):
            return {id(trainer_module._tf_variable(v))
                    for v in layers[name].non_trainable_variables}
        assert {id(v) for v in units["bn"]._written} == of("bn")
        assert {id(v) for v in units["drop"]._written} == of("drop") != set()
        trainer.materialize()
        assert_same(model.get_weights(), free)
    finally:
        trainer.close()


# ------------------------------------------- 6. weights between two steps
def small_mlp():
    return seeded_mlp(64, 4, 10)


def test_weights_read_or_saved_between_steps_are_never_empty(tmp_path):
    data = batches((64,), 10)
    free, _, _ = train(small_mlp, data)
    model = small_mlp()
    budget = plan(record_model(model, BATCH), 10**12).minimum_budget
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH, device_memory_budget=budget)
    try:
        for x, y in data:
            trainer.train_step(x, y)
        assert all(trainer.plan.staged) and not trainer.materialized
        path = str(tmp_path / "w.weights.h5")
        model.save_weights(path)
        assert_same(model.get_weights(), free)
        assert_same(model.layers[0].get_weights(), free[:2])
        trainer.train_step(*data[0])  # stages them out again
        assert not trainer.materialized
        # Keras' saving functions go through each layer's own saver.
        trainer.release()
        trainer.materialize()
        again = model.get_weights()
        trainer.release()
        keras.saving.save_model(model, str(tmp_path / "m.keras"))
        assert trainer.materialized
    finally:
        trainer.close()
    loaded = small_mlp()
    loaded.load_weights(path)
    assert_same(loaded.get_weights(), free)
    assert_same(keras.saving.load_model(str(tmp_path / "m.keras"))
                .get_weights(), again)
    # After close the model's own methods are back.
    assert "get_weights" not in vars(model)


# ------------------------------------------------ 7. variable-length input
def test_variable_length_input_is_refused_with_a_value_error():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((None, 16)), keras.layers.Dense(16, activation="relu"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="fixed input shape"):
        LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(), BATCH,
                         device_memory_budget=10**6)


# ----------------------------------------- 8. the global seed generator
class Noisy(keras.layers.Layer):
    """Dropout through Keras' global seed generator (no seed given)."""

    def call(self, x, training=False):
        return keras.random.dropout(x, 0.5) if training else x


def noisy_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(16, activation="gelu", name="d0"),
        Noisy(name="noisy"),
        keras.layers.Dense(3, activation="gelu", name="d1")])


def test_recompute_replays_the_global_seed_generator():
    x, y = batches((16,), 3, steps=1)[0]
    results = []
    for offload in (None, ["noisy"]):
        trainer = LayerwiseTrainer(noisy_model(), keras.optimizers.SGD(0.1),
                                   loss_fn(), BATCH,
                                   offload_activations=offload)
        try:
            loss, grads = trainer.compute_gradients(x, y)
            results.append((float(loss), grads, trainer.plan.modes))
        finally:
            trainer.close()
    assert results[0][2][0] == "taped" and results[1][2][0] == "recompute"
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert_same(a, b)


# ----------------------------- 9. the plan comes before the optimizer state
def test_budget_too_small_fails_before_optimizer_state_is_built(monkeypatch):
    built = []

    class CountingUnit(trainer_module._Unit):
        def __init__(self, *args, **kwargs):
            built.append(args[1].name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "_Unit", CountingUnit)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((128,))]
            + [keras.layers.Dense(128, activation="relu") for _ in range(8)])

    budget = minimum_budget(build)  # enough for SGD, not for Adam's moments
    built.clear()
    with pytest.raises(MemoryBudgetError) as info:
        LayerwiseTrainer(build(), keras.optimizers.Adam(0.01), loss_fn(),
                         BATCH, device_memory_budget=budget)
    assert info.value.minimum_budget > budget
    assert built == []
    trainer = LayerwiseTrainer(build(), keras.optimizers.Adam(0.01),
                               loss_fn(), BATCH,
                               device_memory_budget=info.value.minimum_budget)
    try:
        assert trainer.plan.device_bytes <= info.value.minimum_budget
    finally:
        trainer.close()


def test_setup_holds_one_staged_layers_optimizer_state_at_a_time(
        monkeypatch):
    """A staged layer's optimizer state is built on the device and stashed
    before the next layer's is built: setting up never holds the whole
    model's state (Adam's: twice its parameters) beside the parameters."""
    units, held = [], []
    swapping = trainer_module.swapping

    class MeasuringUnit(trainer_module._Unit):
        def __init__(self, *args, **kwargs):
            held.append(int(swapping.stored_bytes(
                [v for u in units for v in u.tf_state])))
            super().__init__(*args, **kwargs)
            units.append(self)

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((128,))]
            + [keras.layers.Dense(128, activation="relu") for _ in range(6)])

    probe = build()
    state = trainer_module._probe_state_bytes(keras.optimizers.Adam(0.01),
                                              probe.layers)
    budget = plan(record_model(probe, BATCH, state_bytes=state),
                  10**12).minimum_budget
    monkeypatch.setattr(trainer_module, "_Unit", MeasuringUnit)
    data = batches((128,), 10)
    model = build()
    trainer = LayerwiseTrainer(model, keras.optimizers.Adam(0.01), loss_fn(),
                               BATCH, device_memory_budget=budget)
    try:
        assert all(trainer.plan.staged)
        assert max(held) <= max(state) < sum(state)
        for x, y in data:
            trainer.train_step(x, y)
        trainer.materialize()
        staged = model.get_weights()
    finally:
        trainer.close()
    monkeypatch.undo()
    reference = build()
    trainer = LayerwiseTrainer(reference, keras.optimizers.Adam(0.01),
                               loss_fn(), BATCH)
    try:
        for x, y in data:
            trainer.train_step(x, y)
    finally:
        trainer.close()
    assert_same(staged, reference.get_weights())


def test_a_trainer_that_fails_to_set_up_gives_the_layers_back():
    """Staged layers are stashed while the trainer is set up; a failure
    after that (here the optimizer's state, built for another model, has
    no slot for a later layer) leaves the model's weights as they were."""
    def build(width):
        keras.utils.set_random_seed(0)
        return keras.Sequential(  # (the same names: the same slots)
            [keras.Input((32,))]
            + [keras.layers.Dense(32, name=f"d{i}") for i in range(3)]
            + [keras.layers.Dense(width, name="out")], name="m")

    model = build(10)
    before = model.get_weights()
    other = build(7)
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(other.trainable_variables)
    state = trainer_module._probe_state_bytes(optimizer, model.layers)
    budget = plan(record_model(model, BATCH, state_bytes=state),
                  10**12).minimum_budget
    with pytest.raises(ValueError, match="no .* of shape"):
        LayerwiseTrainer(model, optimizer, loss_fn(), BATCH,
                         device_memory_budget=budget)
    assert_same(model.get_weights(), before)
    assert getattr(model, "_geeps_layerwise_trainer", None) is None


# ------------------------------------- 10. a finished job lets go of its data
def test_a_finished_job_keeps_nothing_its_function_was_given():
    """Jobs stay referenced (pending, waited on) until a step ends; a job
    that has run must not keep what its function was given alive."""
    worker = Worker("test-worker")
    try:
        tensor = tf.ones([64, 64])
        ref = weakref.ref(tensor)
        job = worker.submit(functools.partial(tf.reduce_sum, tensor), "sum")
        del tensor
        assert float(job.wait()) == 64 * 64
        assert job.fn is None and ref() is None
    finally:
        worker.close()


# --------------------------------- 11. offloads more than a layer apart
def gapped_mlp():
    """63 wide at a batch of 64: a table and an activation both 16,128
    bytes, so two staged tables fill the pool as the forward runs."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((63,))]
        + [keras.layers.Dense(63, activation="relu", name=f"d{i}")
           for i in range(5)]
        + [keras.layers.Dense(10, name="out")])


def test_offloads_three_layers_apart_stay_within_the_plan():
    """The plan counts an offloaded activation on the device until the
    layer after next has run (three consecutive ones at most): the trainer
    must not let it stay longer when the next offload is further away.
    The writer is held up (a job of ours ahead of the step's) until the
    last layer's output is held or 3 s pass: the staged tables' forward
    copies stay in the pool, and the activation offloaded at layer 2, if
    nobody waits for it before layer 5's offload, is still there too."""
    batch, offload = 64, ["d2", "out"]
    free = plan(record_model(gapped_mlp(), batch),
                offload_activations=offload)
    table = free.units[0].table_bytes
    assert table == free.units[2].input_bytes == 16128
    budget = free.device_bytes - 2 * table   # two tables staged
    model = gapped_mlp()
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               batch, device_memory_budget=budget,
                               audit=True, offload_activations=offload)
    p = trainer.plan
    # (d1 stays: its backward would need its table and d2's input at once)
    assert p.staged == [True, False, False, True, False, False]
    assert p.offloaded == [False, False, True, False, False, True]
    output = len(trainer.units)
    measure = trainer.ledger.audit
    release = threading.Event()

    def audit():  # under the ledger's lock, after every hold and drop
        if output in trainer._held:
            release.set()
        return measure()

    trainer.ledger.audit = audit
    try:
        data = batches((63,), 10, steps=2, batch=batch)
        trainer.train_step(*data[0])  # traced: fast from here on
        release.clear()
        trainer.writer.submit(functools.partial(release.wait, 3.0),
                              "a slow writer")
        trainer.train_step(*data[1])
        stats = trainer.stats()
    finally:
        trainer.close()
    assert stats["audit_mismatches"] == 0
    assert stats["audit_peak_bytes"] <= p.device_bytes <= budget
    assert stats["peak_device_bytes"] <= p.device_bytes


# ----------------------------------------- 12. tapes kept until backward
def test_the_tapes_kept_until_the_backward_are_in_the_plan():
    """A taped layer's tape holds tensors of its own (dropout's mask, the
    gelu's input) from its forward to its backward: the plan counts one
    output of the layer for each; a recomputed layer keeps none, nor does
    a layer before the first with parameters (it runs without a tape)."""
    seq = record_model(noisy_model(), BATCH)
    outputs = [u.output_bytes for u in seq.units]
    p = plan(seq)
    assert p.modes == ["taped", "taped", "taped"]
    assert p.tape_bytes == sum(outputs) > 0
    assert p.device_bytes == (p.resident_bytes + p.pool_bytes
                              + p.activation_device_bytes + sum(outputs))
    assert p.figures()["tape_bytes"] == sum(outputs)
    offloaded = plan(seq, offload_activations=["noisy"])
    assert offloaded.modes == ["recompute", "recompute", "taped"]
    assert offloaded.tape_bytes == outputs[2]
    keras.utils.set_random_seed(0)
    dropout_first = keras.Sequential([
        keras.Input((16,)), keras.layers.Dropout(0.5),
        keras.layers.Dense(3, activation="gelu")])
    seq = record_model(dropout_first, BATCH)
    assert plan(seq).tape_bytes == seq.units[1].output_bytes


def test_arguments_take_keras_names_and_bad_ones_are_named():
    """As `model.compile` does, the optimizer and loss may be given by
    name, and a loss returning per-sample values is averaged over the
    batch: the weights then equal those of the Loss object's run. Bad
    arguments are named before anything is built."""
    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                                 keras.layers.Dense(3)])
    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((BATCH, 6)).astype("float32"),
             rng.standard_normal((BATCH, 3)).astype("float32"))
            for _ in range(3)]
    weights = []
    for optimizer, loss in [(keras.optimizers.SGD(0.01),
                             keras.losses.MeanSquaredError()),
                            ("sgd", "mse"),
                            ("sgd", keras.losses.mean_squared_error)]:
        model = build()
        trainer = LayerwiseTrainer(model, optimizer, loss, BATCH)
        try:
            for x, y in data:
                assert trainer.train_step(x, y).shape.rank == 0
            trainer.materialize()
            weights.append(model.get_weights())
        finally:
            trainer.close()
    for other in weights[1:]:  # ("sgd" is SGD(0.01))
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(weights[0][0], build().get_weights()[0])
    for args, error, pattern in [
            ((None, "sgd", "mse", BATCH), TypeError, "a Keras model, got "
                                                     "NoneType"),
            ((build(), "sgd", "mse", 0), ValueError,
             "batch_size must be an int >= 1, not 0"),
            ((build(), "sgd", "mse", 2.5), ValueError, "batch_size"),
            ((build(), "sgd", 5, BATCH), TypeError,
             "loss must be a Keras loss, its name or a callable"),
            ((build(), "nope", "mse", BATCH), ValueError, "nope")]:
        with pytest.raises(error, match=pattern):
            LayerwiseTrainer(*args)
    for kwargs, error, pattern in [
            (dict(optimizer=None), TypeError, "optimizer must be"),
            (dict(loss=None), TypeError, "loss must be"),
            (dict(device_memory_budget=-1), ValueError,
             "device_memory_budget must be a positive"),
            (dict(device_memory_budget=float("inf")), ValueError,
             "device_memory_budget must be a positive"),
            (dict(sync="x"), TypeError, "sync must be a keras_geeps "
                                        "ParameterSync"),
            (dict(offload_activations=True), TypeError,
             "offload_activations must be None")]:
        given = {"model": build(), "optimizer": "sgd", "loss": "mse",
                 "batch_size": BATCH, **kwargs}
        with pytest.raises(error, match=pattern):
            LayerwiseTrainer(**given)


def test_a_batch_the_plan_was_not_made_for_is_refused_before_it_runs():
    """x of another shape would pass the budget unnoticed, y of another
    length would broadcast against the output: both are refused, and the
    trainer (not broken by a refused batch) trains on."""
    model = small_mlp()
    data = batches((64,), 10)
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH)
    try:
        x, y = data[0]
        for bad_x, bad_y, pattern in [
                (x[:, :32], y, r"x has shape \(4, 32\)"),
                (x[:, :, None], y, "x has shape"),
                (x[0], y[0], "x has shape"),
                (x[:0], y[:0], "empty batch"),
                (np.concatenate([x, x]), np.concatenate([y, y]),
                 "larger than the batch_size=4"),
                (x, y[:1], r"y has shape \(1,\)"),
                (x, 3, r"y has shape \(\)")]:
            with pytest.raises(ValueError, match=pattern):
                trainer.train_step(bad_x, bad_y)
        assert np.isfinite(float(trainer.train_step(x[:3], y[:3])))
        with pytest.raises(ValueError, match="epochs must be an int >= 1"):
            trainer.fit(data, epochs=0)
        with pytest.raises(ValueError, match="spent after one pass"):
            trainer.fit(iter(data), epochs=2)
        with pytest.raises(ValueError, match="epoch 1 of 1 found no batch"):
            trainer.fit([], epochs=1)
    finally:
        trainer.close()


def test_closing_after_a_failed_step_leaves_weights_not_empty_ones():
    """A step that failed midway leaves staged layers empty; closing gives
    them the values last written back (with a warning), never 0-element
    weights, and a closed trainer refuses to stage them out again."""
    data = batches((64,), 10)
    model = small_mlp()
    budget = plan(record_model(model, BATCH), 10**12).minimum_budget
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH, device_memory_budget=budget)
    trainer.train_step(*data[0])
    assert all(trainer.plan.staged) and not trainer.materialized
    trainer.materialize()
    after_one = model.get_weights()
    x, y = data[1]
    try:
        with pytest.raises(Exception):  # a label out of range, midway
            trainer.train_step(x, y + 100)
        with pytest.warns(RuntimeWarning, match="closed after a failed step"):
            trainer.close()
    finally:
        trainer.close()
    # The step failed in its loss, before any update: nothing of it stays.
    assert_same(model.get_weights(), after_one)
    with pytest.raises(GeePSError, match="closed"):
        trainer.release()
    # Nor does the closed trainer keep the activations the step held.
    assert trainer._held == {} and trainer._host_acts == {}
    assert trainer.ledger.bytes["activations"] == 0


def test_a_device_this_process_lacks_is_refused():
    """TensorFlow would run the step on another device without a word."""
    model = small_mlp()
    for device, pattern in [("/gpu:99", "none of this process's devices"),
                            ("not a device", "not a device name"),
                            (3, "not a device name")]:
        with pytest.raises(ValueError, match=pattern):
            LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                             BATCH, device=device)
    assert getattr(model, "_geeps_layerwise_trainer", None) is None


def test_many_staged_layers_trace_without_tensorflows_retracing_warning():
    """Each layer's functions trace on their own: TensorFlow, counting
    traces per code object, warned of "retracing" for 5 staged layers or
    more when the layers' closures shared one."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    tf.get_logger().addHandler(handler)
    try:
        train(functools.partial(seeded_mlp, 32, 6, 10),
              batches((32,), 10), budget=minimum_budget(
                  functools.partial(seeded_mlp, 32, 6, 10)))
    finally:
        tf.get_logger().removeHandler(handler)
    assert not [m for m in messages if "retracing" in m]


def test_a_second_trainer_on_a_model_held_by_an_open_one_is_refused():
    model = small_mlp()
    budget = plan(record_model(model, BATCH), 10**12).minimum_budget
    first = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                             BATCH, device_memory_budget=budget)
    try:
        with pytest.raises(GeePSError, match="close.. it before"):
            LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                             BATCH, device_memory_budget=budget)
    finally:
        first.close()
    second = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                              BATCH, device_memory_budget=budget)
    second.close()


def test_weights_set_between_steps_are_trained_on():
    """set_weights (of the model or of a staged layer) between steps writes
    the weights the next step trains from, not empty variables."""
    data = batches((64,), 10)
    runs = []
    for budget_of in (None, "minimum"):
        model = small_mlp()
        budget = None if budget_of is None else plan(
            record_model(model, BATCH), 10**12).minimum_budget
        trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1),
                                   loss_fn(), BATCH,
                                   device_memory_budget=budget)
        try:
            trainer.train_step(*data[0])
            model.set_weights([w * 0.5 for w in model.get_weights()])
            layer = model.layers[1]
            layer.set_weights([w + 1.0 for w in layer.get_weights()])
            trainer.train_step(*data[1])
            trainer.materialize()
            runs.append(model.get_weights())
        finally:
            trainer.close()
    assert_same(runs[1], runs[0])


def test_pool_ledger_and_worker_refuse_without_changing_their_counts():
    pool = AccessPool(100)
    with pytest.raises(GeePSError, match="cannot reserve -50"):
        pool.reserve(-50)
    pool.reserve(60)
    with pytest.raises(GeePSError, match="60 are reserved"):
        pool.release(70)
    assert pool.reserved == 60
    for args in [(-5,), (10, 0), (10, None)]:
        with pytest.raises(ValueError):
            AccessPool(*args)
    ledger = trainer_module.DeviceLedger()
    ledger.change("pool", 10)
    with pytest.raises(GeePSError, match="would go negative"):
        ledger.change("pool", -15)
    assert ledger.bytes["pool"] == 10 and ledger.current == 10
    worker = Worker("geeps-test")
    assert worker.submit(lambda: 7, "seven").wait(10) == 7
    worker.close()
    with pytest.raises(GeePSError, match="closed"):
        worker.submit(lambda: 8, "eight")


# ------------------------------------------ losses, scaling, shared layers
SMALL = 64  # small_mlp's width


def test_a_loss_scale_factor_scales_the_loss_as_keras_does():
    """Each layer's optimizer copy divided its gradients by the given
    optimizer's loss_scale_factor, but the loss was never multiplied by it:
    the steps came out 128 times too short (0.05 off Keras)."""
    data = batches((SMALL,), 10)
    budget = minimum_budget(small_mlp)

    def optimizer():
        return keras.optimizers.SGD(0.1, loss_scale_factor=128.0)

    reference, keras_optimizer = small_mlp(), optimizer()
    for x, y in data:  # (as Keras' train_step: the loss scaled)
        with tf.GradientTape() as tape:
            value = keras_optimizer.scale_loss(
                loss_fn()(y, reference(x, training=True)))
        keras_optimizer.apply(tape.gradient(
            value, reference.trainable_variables),
            reference.trainable_variables)
    expected = reference.get_weights()
    for limit in (None, budget):
        _trained_as(small_mlp, optimizer(), data, limit, expected)


def _trained_as(build, optimizer, data, limit, expected, rtol=1e-6,
                atol=1e-7):
    """Trains `build()` on `data` with `optimizer` under the budget
    `limit`, checks its weights against `expected`; returns the model."""
    model = build()
    trainer = LayerwiseTrainer(model, optimizer, loss_fn(), BATCH,
                               device_memory_budget=limit)
    try:
        for x, y in data:
            trainer.train_step(x, y)
        trainer.materialize()
        for mine, theirs in zip(model.get_weights(), expected):
            np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=atol)
    finally:
        trainer.close()
    return model


def test_a_plain_callable_or_named_loss_is_wrapped_as_compile_wraps_it():
    """A loss function (not a keras.losses.Loss) was called as it is: with
    float64 targets it failed after the forward ('Sub' of float32 and
    float64), where Keras casts the targets to the prediction's dtype."""
    def squared(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - y_true), axis=-1)

    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((BATCH, SMALL)).astype("float32"),
             rng.standard_normal((BATCH, 10)))  # float64 targets
            for _ in range(2)]
    reference = small_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=squared,
                      jit_compile=False)
    expected = [float(reference.train_on_batch(x, y)) for x, y in data]
    for loss in (squared, "mse"):
        trainer = LayerwiseTrainer(small_mlp(), keras.optimizers.SGD(0.1),
                                   loss, BATCH)
        try:
            losses = [float(trainer.train_step(x, y)) for x, y in data]
        finally:
            trainer.close()
        np.testing.assert_allclose(losses, expected, rtol=1e-6)


def test_shared_layers_and_tied_weights_are_refused_by_name():
    """A layer used twice, or a variable two layers hold, became two units
    with an optimizer copy each: two updates per step (0.04 off Keras),
    and under a budget staging one emptied the other's variables."""
    shared = keras.layers.Dense(SMALL, name="shared")
    twice = keras.Sequential([keras.Input((SMALL,)), shared, shared,
                              keras.layers.Dense(10, name="out")])
    with pytest.raises(ValueError, match="layer 'shared' is used twice"):
        LayerwiseTrainer(twice, "sgd", loss_fn(), BATCH)

    class Tied(keras.layers.Layer):  # an output projection tied to `first`
        def __init__(self, first, **kwargs):
            super().__init__(**kwargs)
            self.first = first

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.first.kernel))

    first = keras.layers.Dense(SMALL, name="first")
    tied = keras.Sequential([keras.Input((SMALL,)), first,
                             Tied(first, name="tied")])
    with pytest.raises(ValueError, match="'first' and 'tied' share the "
                                         "variable .*tied weights"):
        LayerwiseTrainer(tied, "sgd", loss_fn(), BATCH)
    a, b = keras.Input((SMALL,)), keras.Input((3,))
    two = keras.Model([a, b], keras.layers.Dense(10)(
        keras.layers.Concatenate()([a, b])))
    with pytest.raises(ValueError, match="the model has 2 inputs"):
        LayerwiseTrainer(two, "sgd", loss_fn(), BATCH)


def test_fit_reports_each_epochs_loss_over_its_samples():
    """trainer.fit averaged its batches' losses unweighted: a short last
    batch counted as much as a full one (251 against Keras' 101)."""
    rng = np.random.default_rng(5)
    sizes = (BATCH, BATCH, 3)
    data = [(rng.standard_normal((n, SMALL)).astype("float32"),
             rng.integers(0, 10, n)) for n in sizes]
    trainer = LayerwiseTrainer(small_mlp(), keras.optimizers.SGD(0.0),
                               loss_fn(), BATCH)
    try:
        losses = [float(trainer.train_step(x, y)) for x, y in data]
        history = trainer.fit(data, epochs=1)
    finally:
        trainer.close()
    assert history[0] == pytest.approx(np.average(losses, weights=sizes))


class _Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule with no get_config, as model.fit takes it."""

    def __call__(self, step):
        return 0.1 * tf.minimum(1.0, tf.cast(step + 1, "float32") / 3.0)


def test_the_given_optimizers_learning_rate_is_every_layers():
    """Each layer's copy was made from the config: setting the given
    optimizer's learning_rate between steps (the only way to change it,
    fit's callbacks being refused under a budget) changed nothing, and a
    schedule with no get_config (fine for fit) raised
    NotImplementedError."""
    data = batches((SMALL,), 10, steps=3)
    model = small_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    trainer = LayerwiseTrainer(model, optimizer, loss_fn(), BATCH)
    try:
        trainer.train_step(*data[0])
        optimizer.learning_rate = 0.0
        trainer.materialize()
        before = model.get_weights()
        trainer.train_step(*data[1])
        trainer.materialize()
        assert_same(model.get_weights(), before)
    finally:
        trainer.close()
    expected = keras_reference(small_mlp, data,
                               keras.optimizers.SGD(_Warmup()))
    _trained_as(small_mlp, keras.optimizers.SGD(_Warmup()), data,
                minimum_budget(small_mlp), expected)


class _WithUnused(keras.layers.Layer):
    """Scales its input by `w`; `unused` takes no gradient (a weight used
    only elsewhere, or a leftover)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones",
                                 name="w")
        self.unused = self.add_weight(shape=(4,), initializer="ones",
                                      name="unused")

    def call(self, x):
        return x * self.w


def with_unused():
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((SMALL,)),
                             keras.layers.Dense(SMALL, activation="relu"),
                             _WithUnused(name="scaled"),
                             keras.layers.Dense(10)])


def test_a_weight_with_no_gradient_is_left_alone_as_keras_leaves_it():
    """Unconnected gradients were zeros: AdamW still decayed the unused
    weight (0.985 where Keras keeps 1.0) and moved its moments."""
    data = batches((SMALL,), 10)

    def optimizer():
        return keras.optimizers.AdamW(0.01, weight_decay=0.5)

    expected = keras_reference(with_unused, data, optimizer())
    probe = LayerwiseTrainer(with_unused(), optimizer(), loss_fn(), BATCH)
    try:  # (AdamW's state makes it more than SGD's)
        least = plan(probe.sequence).minimum_budget
    finally:
        probe.close()
    for limit in (None, least):
        model = _trained_as(with_unused, optimizer(), data, limit, expected,
                            rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(
            model.get_layer("scaled").unused.numpy(), 1.0)


def test_regularizers_the_trainer_leaves_out_are_named():
    """Layer regularisation losses are not added (documented), but the
    trainer said nothing: training came out silently unlike fit's."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((SMALL,)),
        keras.layers.Dense(SMALL, kernel_regularizer="l2", name="decayed"),
        keras.layers.Dense(10, name="out")])
    with pytest.warns(UserWarning, match="does not add regularisation "
                                         "losses.*decayed.kernel_regularizer"):
        trainer = LayerwiseTrainer(model, "sgd", loss_fn(), BATCH)
    trainer.close()


def test_a_trainers_own_model_predicts_and_evaluates_between_steps():
    """With no strategy, get_weights and the savers materialized the
    staged layers, but predict and evaluate ran on their empty variables
    ('In[1] ndims must be >= 2 [Op:MatMul]')."""
    data = batches((SMALL,), 10)
    model = small_mlp()
    model.compile(loss=loss_fn(), jit_compile=False)
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), loss_fn(),
                               BATCH, device_memory_budget=minimum_budget(
                                   small_mlp))
    try:
        assert any(trainer.plan.staged)
        x, y = data[0]
        trainer.train_step(x, y)
        predicted = model.predict(x, verbose=0)
        loss = model.evaluate(x, y, verbose=0)
        trainer.train_step(*data[1])
        assert np.isfinite(model.predict_on_batch(x)).all()
        trainer.materialize()
    finally:
        trainer.close()
    assert predicted.shape == (BATCH, 10) and np.isfinite(loss)
