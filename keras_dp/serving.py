"""Serving a privately trained model where keras-dp is not installed."""

import os

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
    model.export(path)
    tf.io.gfile.makedirs(os.path.join(path, os.path.dirname(PRIVACY_REPORT)))
    with tf.io.gfile.GFile(os.path.join(path, PRIVACY_REPORT), "w") as file:
        file.write(report)
    return model


def _report_of(private):
    """The private model's report; without a default delta (no N known),
    its ledger's segments and why no epsilon could be computed."""
    try:
        return private.privacy_report()
    except ValueError as error:
        segments = "\n".join(str(segment) for segment in private.privacy_ledger.segments())
        return f"No epsilon: {error}\nSteps recorded:\n{segments}\n"
