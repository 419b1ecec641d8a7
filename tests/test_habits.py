"""A Keras user's habits (issue 31): serving, custom steps, TF Privacy's settings."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

# Refusals and plumbing before any step: no CPU kernel changes them. Run with
# oneDNN on, to even out make test's two runs.
pytestmark = [pytest.mark.once, pytest.mark.with_onednn_on]


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n)


def classifier():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def compiled(model, loss=None, metrics=None, **optimizer_kwargs):
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                **optimizer_kwargs),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics, weighted_metrics=metrics)
    return model


@pytest.mark.program
def test_the_base_model_and_its_saved_model_serve_without_keras_dp(tmp_path):
    x, y = data()
    private = compiled(keras_dp.make_private(classifier()))
    private.fit(x, y, batch_size=16, verbose=0)
    private.base_model.save(str(tmp_path / "model.keras"))
    keras_dp.export_for_serving(private, str(tmp_path / "saved_model"))
    # Review round 149: the SavedModel's variables hold no ledger; its report
    # is beside it.
    report = (tmp_path / "saved_model" / keras_dp.serving.PRIVACY_REPORT).read_text()
    assert report == private.privacy_report()
    expected = private.predict(x[:5], verbose=0)
    np.save(tmp_path / "x.npy", x[:5])
    np.save(tmp_path / "expected.npy", expected)
    program = textwrap.dedent(f"""
        import os, sys
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        sys.modules["keras_dp"] = None  # Any import of keras_dp fails.
        import keras, numpy as np, tensorflow as tf
        x = np.load({str(tmp_path / "x.npy")!r})
        expected = np.load({str(tmp_path / "expected.npy")!r})
        model = keras.models.load_model({str(tmp_path / "model.keras")!r})
        np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
        served = tf.saved_model.load({str(tmp_path / "saved_model")!r})
        np.testing.assert_allclose(served.serve(x).numpy(), expected, rtol=1e-5, atol=1e-6)
        print("served")
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            cwd=str(tmp_path), timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "served" in result.stdout


def test_a_loaded_private_model_exports_its_base(tmp_path):
    x, y = data()
    private = compiled(keras_dp.make_private(classifier()))
    private.train_on_batch(x[:8], y[:8])
    assert private.base_model is private.model
    path = str(tmp_path / "private.keras")
    private.save(path)
    loaded = keras.models.load_model(path)  # Never called: Keras' export refused it.
    exported = keras_dp.export_for_serving(loaded, str(tmp_path / "export"))
    assert exported is loaded.base_model


def test_a_saved_model_export_holds_none_of_the_training_random_states(tmp_path):
    """Review round 172: the SavedModel held a Dropout's SeedGenerator state
    (its secret seed and counter), from which every mask of training could
    be replayed: one example moved a ghost step's clipped sum by 6.40 C.
    The export holds fresh states; the model keeps its own."""
    x, y = data()
    base = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Dropout(0.5),
                             keras.layers.Dense(3)])
    private = compiled(keras_dp.make_private(base))
    private.fit(x, y, batch_size=16, verbose=0)
    state = base.layers[0].seed_generator.state
    trained = state.numpy().copy()
    # Round 176: the private model's own export, too.
    for export, path in [(lambda path: keras_dp.export_for_serving(private, path), "served"),
                         (private.export, "exported")]:
        export(str(tmp_path / path))
        checkpoint = str(tmp_path / path / "variables" / "variables")
        saved = [tf.train.load_variable(checkpoint, name)
                 for name, shape in tf.train.list_variables(checkpoint) if shape == [2]]
        assert len(saved) == 1 and np.all(saved[0] != trained)
        np.testing.assert_array_equal(state.numpy(), trained)
    with pytest.raises(ValueError, match="would write the state of its random layers"):
        tf.saved_model.save(private, str(tmp_path / "saved"))


class OwnStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        raise AssertionError("never called by the private step")


def test_a_model_with_its_own_train_step_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="overrides train_step"):
        keras_dp.make_private(OwnStep())


def test_tf_privacys_per_example_microbatches_are_refused_with_the_fix():
    x, y = data()
    private = compiled(keras_dp.make_private(classifier()), num_microbatches=16)
    with pytest.raises(ValueError, match="num_microbatches=16 equals batch_size"):
        private.fit(x, y, batch_size=16, verbose=0)
    assert private.privacy_steps == 0


def test_an_unreduced_loss_is_refused_with_the_fix():
    x, y = data()
    private = compiled(keras_dp.make_private(classifier()), loss=keras.losses.
                       SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
    with pytest.raises(ValueError, match="reduction='none'"):
        private.train_on_batch(x[:8], y[:8])


def test_the_ledger_is_out_of_the_weights_keras_users_see(tmp_path):
    x, y = data()
    base = classifier()
    private = compiled(keras_dp.make_private(base))
    assert private.count_params() == base.count_params() == 15  # Before any fit too.
    private.fit(x, y, batch_size=16, verbose=0)
    base.set_weights(private.get_weights())
    path = str(tmp_path / "private.weights.h5")
    private.save_weights(path)
    again = compiled(keras_dp.make_private(classifier()))
    again.load_weights(path)
    assert again.privacy_steps == private.privacy_steps == 4  # Carried beside the weights.


def test_poisson_dataset_of_a_dataset_beside_labels_says_to_pass_it_alone():
    x, y = data()
    with pytest.raises(ValueError, match="Pass the dataset of \\(x, y\\) examples alone"):
        keras_dp.data.poisson_dataset(tf.data.Dataset.from_tensor_slices(x), y,
                                      expected_batch_size=8)


def test_the_engine_in_use_and_why_are_shown_once_per_trace():
    x, y = data()
    prelu = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.PReLU()])
    private = compiled(keras_dp.make_private(prelu))
    with pytest.warns(UserWarning, match="runs the vectorized engine.*PReLU"):
        private.train_on_batch(x[:8], y[:8])
    assert (private.clipping_engine, private.clipping_engine_in_use) == ("auto", "vectorized")
    fast = compiled(keras_dp.make_private(classifier()))
    fast.train_on_batch(x[:8], y[:8])
    assert fast.clipping_engine_in_use == "ghost"



class TracedSteps(keras_dp.DPSequential):
    """Counts the traces of its private train_step."""

    traces = 0

    def train_step(self, data):
        TracedSteps.traces += 1
        return super().train_step(data)


@pytest.mark.parametrize("entry", ["fit", "train_on_batch"])
def test_a_step_with_compiled_metrics_is_traced_once(entry):
    # Keras builds compiled metrics in the first trace, whose new variables
    # make tf.function trace the whole private step again: they are built first.
    x, y = data()
    private = compiled(TracedSteps([keras.Input((4,)), keras.layers.Dense(3)]),
                       metrics=["accuracy"])
    TracedSteps.traces = 0
    if entry == "fit":
        logs = private.fit(x, y, batch_size=16, epochs=2, verbose=0).history
        logs = {name: values[-1] for name, values in logs.items()}
    else:
        logs = private.train_on_batch(x[:16], y[:16], return_dict=True)
    assert TracedSteps.traces == 1
    assert 0.0 <= logs["accuracy"] <= 1.0 and 0.0 <= logs["weighted_accuracy"] <= 1.0
    assert private.evaluate(x, y, verbose=0, return_dict=True).keys() >= {"accuracy", "loss"}


def test_a_custom_loop_traces_the_step_as_fit_does():
    # A user's tf.function around train_step had AutoGraph rewrite the whole
    # private step (statements turned into graph control flow, and ten times
    # the tracing time of fit's step): the step runs as written, as in fit.
    statuses = []

    def loss(y_true, y_pred):
        statuses.append(tf.__internal__.autograph.control_status_ctx().status)
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    x, y = data()
    private = compiled(keras_dp.make_private(classifier()), loss=loss)
    private.train_on_batch(x[:16], y[:16])
    in_train_on_batch = list(statuses)
    statuses.clear()
    tf.function(private.train_step)((tf.constant(x[:16]), tf.constant(y[:16])))
    assert statuses == in_train_on_batch and statuses
    assert statuses[0] != type(statuses[0]).ENABLED


# Found by review: the metrics' early build could not describe these batches or
# built what the step refuses; each now builds its metrics in its first step.
@pytest.mark.parametrize("dtype", ["str", "object"])
def test_numpy_strings_train_on_batch_with_compiled_metrics(dtype):
    inputs = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["a", "b", "c", "d"])(inputs)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Embedding(5, 4)(ids)))
    private = compiled(keras_dp.make_private(keras.Model(inputs, outputs)), metrics=["accuracy"])
    x = np.array([["a"], ["b"], ["c"], ["d"]] * 4).astype(dtype)
    logs = private.train_on_batch(x, np.arange(16) % 3, return_dict=True)
    assert 0.0 <= logs["accuracy"] <= 1.0 and private.privacy_steps == 1


class Reshaping(keras.Model):
    """Takes inputs of any rank."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(tf.reshape(x, [-1, 4]))


def test_a_dataset_of_unknown_rank_trains_with_compiled_metrics():
    x, y = data()

    def batches():
        for start in range(0, len(x), 16):
            yield x[start:start + 16], y[start:start + 16]

    dataset = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec(None, tf.float32), tf.TensorSpec([None], tf.int64)))
    model = Reshaping()
    model(x[:1])
    private = compiled(keras_dp.make_private(model), metrics=["accuracy"])
    private.fit(dataset, verbose=0, sampling="shuffle")  # A generator's: on your word.
    assert private.privacy_steps == 4
    assert "accuracy" in private.evaluate(dataset, verbose=0, return_dict=True)


class Unbuilt(keras_dp.DPModel):
    """A subclassed private model with no input shape."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_an_unbuilt_subclass_is_refused_with_compiled_metrics_too():
    x, y = data()
    private = compiled(Unbuilt(), metrics=["accuracy"])
    with pytest.raises(ValueError, match="has no weights yet"):
        private.train_on_batch(x[:16], y[:16])
    assert private.privacy_steps == 0
