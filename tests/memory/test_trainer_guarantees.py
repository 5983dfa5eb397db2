"""What the layer-wise trainer keeps where it once did not: a materialize
or close that fails midway loses no weights, Keras masks go from layer to
layer, optimizer copies keep their weight-decay exclusions and carry the
optimizer's state in and back out, activations the swap ops cannot copy
stay on the device, and a model that is no chain is refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_geeps.memory import plan, record_model
from keras_geeps.memory.trainer import LayerwiseTrainer, _probe_state_bytes
from tests.memory.test_trainer import assert_same, seeded_mlp

BATCH = 4


def mlp():
    return seeded_mlp(16, 4, 1)


def regression_batch(shape=(16,), batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch,) + shape).astype("float32"),
            rng.standard_normal((batch, 1)).astype("float32"))


# ------------------------------------------- 1. a materialize that fails
def staged_trainer():
    """A trainer with every layer staged, after one step."""
    model = mlp()
    budget = plan(record_model(model, BATCH), 10**12).minimum_budget
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1), "mse",
                               BATCH, device_memory_budget=budget,
                               audit=True)
    trainer.train_step(*regression_batch())
    assert all(trainer.plan.staged) and not trainer.materialized
    return model, trainer


def fail_once(unit):
    """Makes `unit`'s next fill raise as a device out of memory would."""
    real = unit.fill_all
    calls = []

    def fill_all(hosts):
        calls.append(1)
        if len(calls) == 1:
            raise tf.errors.ResourceExhaustedError(None, None,
                                                   "OOM (injected)")
        return real(hosts)
    unit.fill_all = fill_all


def host_values(trainer):
    return {u.index: [np.array(h) for h in trainer.store.get(u.index)]
            for u in trainer.units if trainer.plan.staged[u.index]}


def assert_as_before(trainer, store):
    """Nothing materialized, nothing held, the host store unchanged."""
    assert not trainer.materialized
    assert trainer.ledger.bytes["materialized"] == 0
    assert trainer.measure_device_bytes()["staged"] == 0
    assert not trainer.ledger.mismatches
    for index, values in host_values(trainer).items():
        assert_same(values, store[index])


def test_a_materialize_failing_midway_leaves_the_trainer_as_before():
    model, trainer = staged_trainer()
    try:
        store = host_values(trainer)
        victim = trainer.units[2]
        fail_once(victim)
        with pytest.raises(tf.errors.ResourceExhaustedError):
            model.get_weights()  # materializes: layers 0, 1 filled first
        assert_as_before(trainer, store)
        # Tried again, it gives every weight, as the host store holds it.
        weights = model.get_weights()
        params = [v for u in trainer.units for v in store[u.index][:2]]
        assert_same(weights, params)
        trainer.train_step(*regression_batch(seed=1))  # releases them
        assert not trainer.ledger.mismatches
    finally:
        trainer.close()
    assert all(w.size for w in model.get_weights())


def test_a_close_failing_midway_keeps_the_trainer_open_and_guarded():
    model, trainer = staged_trainer()
    try:
        store = host_values(trainer)
        fail_once(trainer.units[3])
        with pytest.raises(tf.errors.ResourceExhaustedError):
            trainer.close()
        assert_as_before(trainer, store)
        # Still guarded: reading the weights materializes them, whole.
        weights = model.get_weights()
        assert_same(weights,
                    [v for u in trainer.units for v in store[u.index][:2]])
        trainer.close()
        assert_same(model.get_weights(), weights)
    finally:
        trainer.close()


# ------------------------------------------------------------ 2. masks
def embedding_pooled():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((10,), dtype="int32"),
        keras.layers.Embedding(50, 8, mask_zero=True),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1)])


def masking_lstm():
    """The mask is made before the first layer with parameters."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((10, 3)),
        keras.layers.Masking(0.0),
        keras.layers.LSTM(6),
        keras.layers.Dense(1)])


def masked_output():
    """The model's output carries the mask: the loss is weighted by it."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((10,), dtype="int32"),
        keras.layers.Embedding(50, 8, mask_zero=True),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.LSTM(6, return_sequences=True),
        keras.layers.Dense(1)])


def padded_batch(build):
    rng = np.random.default_rng(0)
    if build is masking_lstm:
        x = rng.standard_normal((BATCH, 10, 3)).astype("float32")
    else:
        x = rng.integers(1, 50, size=(BATCH, 10)).astype("int32")
    x[:, 6:] = 0  # padded to one length
    x[0, 3:] = 0
    rows = (BATCH, 10, 1) if build is masked_output else (BATCH, 1)
    return x, rng.standard_normal(rows).astype("float32")


@pytest.mark.parametrize("build", [embedding_pooled, masking_lstm,
                                   masked_output])
@pytest.mark.parametrize("budgeted", [False, True])
def test_keras_masks_are_carried_from_layer_to_layer(build, budgeted):
    """The trainer's loss and gradients are Keras' own; under a budget
    too, where every input that can wait on the host does (so the layers
    with a taped backward are run again from their input and mask)."""
    x, y = padded_batch(build)
    loss = keras.losses.MeanSquaredError()
    reference = build()
    with tf.GradientTape() as tape:
        expected_loss = loss(y, reference(x, training=True))
    expected = tape.gradient(expected_loss, reference.trainable_variables)
    model = build()
    budget = offload = None
    if budgeted:
        probe = LayerwiseTrainer(model, "sgd", loss, BATCH)
        first = probe.sequence.first_with_params
        offload = [u.name for u in probe.sequence.units[first:]]
        budget = plan(probe.sequence,
                      offload_activations=offload).minimum_budget
        probe.close()
    trainer = LayerwiseTrainer(model, "sgd", loss, BATCH,
                               device_memory_budget=budget,
                               offload_activations=offload, audit=True)
    try:
        if budgeted:
            assert trainer.plan.modes.count("recompute") >= 1
        value, grads = trainer.compute_gradients(x, y)
    finally:
        trainer.close()
    np.testing.assert_allclose(float(value), float(expected_loss),
                               rtol=1e-6)
    grads = [g for layer in grads for g in layer]
    assert len(grads) == len(expected)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                   tf.convert_to_tensor(e).numpy(),
                                   rtol=1e-5, atol=1e-7)


# ---------------------------------------------- 3. the optimizer's copies
def biased_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,))]
        + [keras.layers.Dense(8, activation="relu", bias_initializer="ones")
           for _ in range(4)]
        + [keras.layers.Dense(4, bias_initializer="ones")])


def adamw(model, exclude):
    optimizer = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5)
    if exclude == "names":
        optimizer.exclude_from_weight_decay(var_names=["bias"])
    else:
        optimizer.exclude_from_weight_decay(
            var_list=[model.layers[0].kernel, model.layers[-1].bias])
    return optimizer


def tape_steps(model, optimizer, data):
    """Plain Keras training steps (what `model.fit` does, uncompiled)."""
    loss = keras.losses.MeanSquaredError()
    for x, y in data:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(value, model.trainable_variables),
                        model.trainable_variables)


def trainer_steps(model, optimizer, data, budgeted):
    budget = None
    if budgeted:  # the least, for the optimizer's state
        budget = plan(record_model(model, BATCH, state_bytes=(
            _probe_state_bytes(keras.optimizers.get(optimizer),
                               model.layers))), 10**12).minimum_budget
    trainer = LayerwiseTrainer(model, optimizer, "mse", BATCH,
                               device_memory_budget=budget)
    try:
        assert any(trainer.plan.staged) == budgeted
        for x, y in data:
            trainer.train_step(x, y)
    finally:
        trainer.close()


@pytest.mark.parametrize("exclude", ["names", "variables"])
@pytest.mark.parametrize("budgeted", [False, True])
def test_weight_decay_exclusions_reach_every_layer_copy(exclude, budgeted):
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((BATCH, 8)).astype("float32"),
             rng.standard_normal((BATCH, 4)).astype("float32"))
            for _ in range(2)]
    reference = biased_mlp()
    tape_steps(reference, adamw(reference, exclude), data)
    model = biased_mlp()
    trainer_steps(model, adamw(model, exclude), data, budgeted)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def state(optimizer):
    """[(kind, value)] of the optimizer's variables, in order (the two
    models' variable paths differ; state of the optimizer's own, such as
    Nadam's momentum product, has an automatic name: "own")."""
    return [(v.name.rsplit("_", 1)[-1] if "dense" in v.name else "own",
             v.numpy()) for v in optimizer.variables]


OPTIMIZERS = {  # name: (make, its variables on the 10 of biased_mlp)
    "adam": (lambda: keras.optimizers.Adam(0.01), 2 + 2 * 10),
    # a momentum product of its own, besides the slots
    "nadam": (lambda: keras.optimizers.Nadam(0.01), 2 + 2 * 10 + 1),
    # a step count that `iterations` divides; an accumulator per variable
    "accumulating": (lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2), 2 + 3 * 10)}


@pytest.mark.parametrize("first", ["keras", "unbuilt"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_goes_into_the_copies_and_back(first, kind):
    """Steps 1-2 under plain Keras (or a trainer given a fresh optimizer),
    3-4 under a staging trainer, 5-6 under a resident one, all with one
    optimizer: the same weights and optimizer state as 6 plain Keras
    steps. (Had a copy started without the moments, or the step count,
    the weights would differ: Adam's first steps are the largest.)"""
    make, count = OPTIMIZERS[kind]
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((BATCH, 8)).astype("float32"),
             rng.standard_normal((BATCH, 4)).astype("float32"))
            for _ in range(6)]
    reference, reference_optimizer = biased_mlp(), make()
    tape_steps(reference, reference_optimizer, data)
    model, optimizer = biased_mlp(), make()
    if first == "keras":
        tape_steps(model, optimizer, data[:2])
    else:
        trainer_steps(model, optimizer, data[:2], budgeted=False)
    assert int(optimizer._iterations.numpy()) == 2
    trainer_steps(model, optimizer, data[2:4], budgeted=True)
    trainer_steps(model, optimizer, data[4:], budgeted=False)
    assert int(optimizer._iterations.numpy()) == 6
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got, want = state(optimizer), state(reference_optimizer)
    assert len(got) == len(want) == count
    for (kind, value), (want_kind, want_value) in zip(got, want):
        assert kind == want_kind
        np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-7,
                                   err_msg=kind)


def test_state_the_trainer_cannot_place_is_refused_or_kept_with_a_warning():
    """Adafactor names its factored moments after the variable's name
    ("kernel"), not its path: no layer's can be told apart. A fresh one
    trains as before and close() warns (and closes) without giving it
    state; one with state is refused."""
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((BATCH, 8)).astype("float32"),
             rng.standard_normal((BATCH, 4)).astype("float32"))]
    model, adafactor = biased_mlp(), keras.optimizers.Adafactor(0.01)
    with pytest.warns(RuntimeWarning, match="could not give the optimizer "
                      "its layers' state.*cannot tell apart by layer"):
        trainer_steps(model, adafactor, data, budgeted=False)
    assert not adafactor.built
    tape_steps(model, adafactor, data)
    with pytest.raises(ValueError, match="Adafactor keeps state the "
                       "layer-wise trainer cannot tell apart by layer"):
        LayerwiseTrainer(model, adafactor, "mse", BATCH)
    LayerwiseTrainer(model, "adam", "mse", BATCH).close()  # model free


def test_optimizer_state_round_trips_through_a_checkpoint(tmp_path):
    """A trainer's optimizer state saved with tf.train.Checkpoint after
    close() and restored into a fresh model and optimizer trains on as
    the uninterrupted run does."""
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((BATCH, 8)).astype("float32"),
             rng.standard_normal((BATCH, 4)).astype("float32"))
            for _ in range(4)]
    reference, reference_sgd = biased_mlp(), keras.optimizers.SGD(
        0.05, momentum=0.9)
    tape_steps(reference, reference_sgd, data)
    model, sgd = biased_mlp(), keras.optimizers.SGD(0.05, momentum=0.9)
    trainer_steps(model, sgd, data[:2], budgeted=True)
    path = tf.train.Checkpoint(model=model, optimizer=sgd).write(
        str(tmp_path / "ckpt"))
    resumed, resumed_sgd = biased_mlp(), keras.optimizers.SGD(
        0.05, momentum=0.9)
    resumed_sgd.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed_sgd).read(
        path).assert_consumed()
    trainer_steps(resumed, resumed_sgd, data[2:], budgeted=True)
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_optimizer_built_for_other_variables_is_refused():
    model = biased_mlp()
    other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    foreign = keras.optimizers.Adam(0.01)
    foreign.build(other.trainable_variables)
    with pytest.raises(ValueError, match=r"built for 2 variables.*no "
                       r"'sequential_\d*_?dense_\w*' .*for layer 'dense"):
        LayerwiseTrainer(model, foreign, "mse", BATCH)
    assert all(w.size for w in model.get_weights())  # nothing held
    LayerwiseTrainer(model, "adam", "mse", BATCH).close()  # still free


# -------------------------------- 5. activations the swap ops cannot copy
def int16_tokens():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((10,), dtype="int16"),
        keras.layers.Embedding(50, 8),
        keras.layers.Flatten(),
        keras.layers.Dense(1)])


def test_an_input_the_swap_ops_cannot_copy_is_not_offloaded():
    model = int16_tokens()
    sequence = record_model(model, BATCH)
    dtypes = [u.input_dtype for u in sequence.units[:2]]
    assert dtypes == ["int16", "float32"]
    assert not sequence.units[0].offloadable
    with pytest.raises(ValueError, match="'embedding.*', whose input is "
                                         "int16: the swap ops copy only"):
        LayerwiseTrainer(model, "sgd", "mse", BATCH,
                         offload_activations=[model.layers[0].name])
    # Refused before anything was held: the model is free for another.
    trainer = LayerwiseTrainer(model, "sgd", "mse", BATCH,
                               offload_activations=[model.layers[2].name])
    try:
        assert trainer.plan.offloaded == [False, False, True]
        x = np.random.default_rng(0).integers(0, 50, (BATCH, 10))
        trainer.train_step(x.astype("int16"), np.zeros((BATCH, 1)))
    finally:
        trainer.close()


# ------------------------------------------------ 6. models of no chain
def test_a_subclassed_model_is_refused_with_a_value_error():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(8, activation="relu")
            self.b = keras.layers.Dense(1)

        def call(self, x):
            return self.b(self.a(x))

    model = Net()
    model(np.zeros((2, 4), "float32"))
    for make in (lambda: LayerwiseTrainer(model, "sgd", "mse", BATCH),
                 lambda: record_model(model, BATCH)):
        with pytest.raises(ValueError, match="Net is a subclassed model.*"
                                             "keras.Sequential or a "
                                             "functional model"):
            make()
