"""Serving a privately trained model where keras-dp is not installed."""

import contextlib
import os
import secrets

import numpy as np
import tensorflow as tf

# Beside the SavedModel, where TF Serving keeps files it does not load.
PRIVACY_REPORT = os.path.join("assets.extra", "privacy_report.txt")


def export_for_serving(private, path):
    """Exports a private model's base model as a TensorFlow SavedModel, with
    its privacy report beside it.

    The SavedModel serves (`tf.saved_model.load(path).serve(x)`, TF Serving)
    where keras-dp is not installed. Its variables hold no ledger, so the
    export writes `private.privacy_report()` to `PRIVACY_REPORT` in `path`:
    a released model carries the epsilon of the training that made it
    (review round 149). For a Keras file that loads without keras-dp, save
    `private.base_model` (`.save("model.keras")`), which carries none.

    Args:
        private: a keras-dp private model.
        path: the SavedModel's directory.

    Returns:
        The exported plain Keras model.

    Example:
    ```python
    keras_dp.export_for_serving(private, "serving/1")
    ```
    """
    model = getattr(private, "base_model", None)
    if model is None:
        raise ValueError(
            "export_for_serving takes the private model, whose privacy report it "
            "writes beside the SavedModel: pass the model keras_dp.make_private returned.")
    if not model.built:
        raise ValueError(
            "The model was never called, so its input signature is unknown: "
            "call it on a batch of inputs first (model(x[:1])).")
    report = _report_of(private)
    private.export(path)  # Fresh random states, not the training's.
    tf.io.gfile.makedirs(os.path.join(path, os.path.dirname(PRIVACY_REPORT)))
    with tf.io.gfile.GFile(os.path.join(path, PRIVACY_REPORT), "w") as file:
        file.write(report)
    return model


def random_states(model):
    """The model's random states: its SeedGenerators', the integer variables
    Keras counts among its `variables` but not its `weights`."""
    weights = {id(weight) for weight in model.weights}
    return [v for v in model.variables if id(v) not in weights
            and np.issubdtype(np.dtype(v.dtype), np.integer)]


@contextlib.contextmanager
def fresh_random_states(model):
    """Gives the model's `random_states` fresh values while it is exported,
    then its own back. The state of the training's draws is what keeps a
    Dropout's masks unknown (docs/security.md, row g; review round 172: the
    exported state replayed every mask, and one example moved the clipped
    sum of a ghost step by 6.40 C)."""
    states = random_states(model)
    kept = [np.array(state.numpy()) for state in states]
    for state, value in zip(states, kept):
        state.assign(_random_like(value))
    try:
        yield
    finally:
        for state, value in zip(states, kept):
            state.assign(value)


def _random_like(value):
    """Values of `value`'s shape and integer dtype, from OS entropy."""
    info = np.iinfo(value.dtype)
    bits = min(info.bits - (info.min < 0), 62)
    return np.array([secrets.randbits(bits) for _ in range(value.size)],
                    value.dtype).reshape(value.shape)


def _report_of(private):
    """The private model's report; without a default delta (no N known),
    its ledger's segments and why no epsilon could be computed."""
    try:
        return private.privacy_report()
    except ValueError as error:
        segments = "\n".join(str(segment) for segment in private.privacy_ledger.segments())
        return f"No epsilon: {error}\nSteps recorded:\n{segments}\n"
