"""Serving a privately trained model where keras-dp is not installed."""


def export_for_serving(private, path):
    """Exports a private model's base model as a TensorFlow SavedModel.

    The SavedModel serves (`tf.saved_model.load(path).serve(x)`, TF Serving)
    where keras-dp is not installed. For a Keras file that loads without
    keras-dp, save `private.base_model` (`.save("model.keras")`).

    Args:
        private: a keras-dp private model (or its base model).
        path: the SavedModel's directory.

    Returns:
        The exported plain Keras model.

    Example:
    ```python
    keras_dp.export_for_serving(private, "serving/1")
    ```
    """
    model = getattr(private, "base_model", private)
    if not model.built:
        raise ValueError(
            "The model was never called, so its input signature is unknown: "
            "call it on a batch of inputs first (model(x[:1])).")
    model.export(path)
    return model
