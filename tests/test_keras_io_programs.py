"""keras-io programs made private (issue 45), on generated data of their layout.

Each program follows a keras-io example's way of bringing its data: JPEG
folders through `image_dataset_from_directory`, text folders through
`text_dataset_from_directory` and a `TextVectorization` map, CSV columns
through `from_tensor_slices(...).shuffle().batch()`, and a `FeatureSpace`
mapped over batches of CSV records. Their models are small stand-ins (no
BatchNormalization, which DP-SGD cannot train per example). Made private by
the lines marked `# dp`, at most three: `make_private`, a DP optimizer
in `compile`, and the one-line conversion of the pipeline to keras-dp's
Poisson sampling that fit's warning names. Each converted program spends the
Poisson epsilon of the same examples as arrays and trains on both engines.
"""

import csv
import inspect
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

pytestmark = pytest.mark.program

SIGMA = 1.1
EPOCHS = 2
DELTA = 1e-3


def dp_adam():
    return keras_dp.DPKerasAdam(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=1e-3)


# ------------------------------------------------------------------ the data

def jpeg_folders(root, per_class=40, size=24):
    """cats_vs_dogs' layout: one folder of JPEG files per class."""
    rng = np.random.default_rng(0)
    for label in ("Cat", "Dog"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            tf.io.write_file(str(root / label / f"{i}.jpg"), tf.io.encode_jpeg(pixels))
    return str(root)


def text_folders(root, per_class=40):
    """aclImdb's layout: train/pos and train/neg, one review per text file."""
    rng = np.random.default_rng(1)
    words = {"pos": ["great", "fine", "loved"], "neg": ["awful", "dull", "hated"]}
    for label in ("pos", "neg"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            review = rng.choice(words[label] + ["the", "movie", "plot", "was"], 10)
            (root / label / f"{i}.txt").write_text(" ".join(review))
    return str(root)


def series_csv(path, rows=96, length=40):
    """FordA's layout: a label column, then the series' values, tab-separated."""
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, rows)
    values = rng.normal(size=(rows, length)) + labels[:, None] * np.sin(np.arange(length))
    np.savetxt(path, np.column_stack([labels * 2 - 1, values]), delimiter="\t")
    return str(path)


def heart_csv(path, rows=96):
    """The heart-disease CSV's kinds of columns: integer and string categories,
    a float, the target."""
    rng = np.random.default_rng(3)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["age", "sex", "thal", "target"])
        for _ in range(rows):
            writer.writerow([int(rng.integers(30, 80)), int(rng.integers(0, 2)),
                             rng.choice(["fixed", "normal", "reversible"]),
                             int(rng.integers(0, 2))])
    return str(path)


# -------------------------------------------------------------- the programs

def image_classification(folder, convert, engine):
    """After keras-io's image_classification_from_scratch."""
    train_ds = keras.utils.image_dataset_from_directory(
        folder, validation_split=0.2, subset="training", seed=1337, image_size=(24, 24),
        batch_size=16)
    augmentation = keras.Sequential([keras.layers.RandomFlip("horizontal")])
    train_ds = train_ds.map(lambda img, label: (augmentation(img), label),
                            num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    if convert:
        train_ds = keras_dp.data.poisson_dataset(train_ds.unbatch(), expected_batch_size=16)  # dp
    inputs = keras.Input((24, 24, 3))
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    x = keras.layers.Conv2D(8, 3, strides=2, activation="relu")(x)
    x = keras.layers.Conv2D(8, 3, strides=2, activation="relu")(x)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras_dp.make_private(keras.Model(inputs, outputs), clipping_engine=engine)  # dp
    model.compile(optimizer=dp_adam(), loss=keras.losses.BinaryCrossentropy(from_logits=True),  # dp
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    return model, model.fit(train_ds, epochs=EPOCHS, verbose=0)


def text_classification(folder, convert, engine):
    """After keras-io's text_classification_from_scratch."""
    raw_train_ds = keras.utils.text_dataset_from_directory(
        folder, batch_size=16, validation_split=0.2, subset="training", seed=1337)
    vectorize_layer = keras.layers.TextVectorization(max_tokens=40, output_mode="int",
                                                     output_sequence_length=12)
    vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))  # Outside the DP guarantee.

    def vectorize_text(text, label):
        return vectorize_layer(tf.expand_dims(text, -1)), label

    train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    if convert:
        train_ds = keras_dp.data.poisson_dataset(train_ds.unbatch(), expected_batch_size=16)  # dp
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = keras.layers.Embedding(40, 8)(inputs)
    x = keras.layers.Conv1D(8, 3, strides=2, activation="relu")(x)
    x = keras.layers.GlobalMaxPooling1D()(x)
    predictions = keras.layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras_dp.make_private(keras.Model(inputs, predictions), clipping_engine=engine)  # dp
    model.compile(loss="binary_crossentropy", optimizer=dp_adam(), metrics=["accuracy"])  # dp
    return model, model.fit(train_ds, epochs=EPOCHS, verbose=0)


def timeseries_classification(path, convert, engine):
    """After keras-io's timeseries_classification_from_scratch, its arrays
    batched by a tf.data pipeline."""
    data = np.loadtxt(path, delimiter="\t")
    x_train, y_train = data[:, 1:, None].astype("float32"), (data[:, 0] == 1).astype("int32")
    train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
        len(x_train)).batch(32)
    if convert:
        train_ds = keras_dp.data.poisson_dataset(train_ds.unbatch(), expected_batch_size=32)  # dp
    inputs = keras.layers.Input(x_train.shape[1:])
    x = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv1D(8, 3, padding="same", activation="relu")(x)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras_dp.make_private(keras.Model(inputs, outputs), clipping_engine=engine)  # dp
    model.compile(optimizer=dp_adam(), metrics=["sparse_categorical_accuracy"],  # dp
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, model.fit(train_ds, epochs=EPOCHS, verbose=0)


def structured_data(path, convert, engine):
    """After keras-io's structured_data_classification_with_feature_space."""
    with open(path) as file:
        rows = list(csv.DictReader(file))
    columns = {name: np.array([row[name] for row in rows]) for name in rows[0]}
    labels = columns.pop("target").astype("int32")
    features = {"age": columns["age"].astype("float32"), "sex": columns["sex"].astype("int64"),
                "thal": columns["thal"]}
    train_ds = tf.data.Dataset.from_tensor_slices((features, labels)).shuffle(
        len(labels)).batch(32)
    feature_space = keras.utils.FeatureSpace(
        features={"sex": keras.utils.FeatureSpace.integer_categorical(num_oov_indices=0),
                  "thal": keras.utils.FeatureSpace.string_categorical(num_oov_indices=0),
                  "age": keras.utils.FeatureSpace.float_normalized()},
        output_mode="concat")
    feature_space.adapt(train_ds.map(lambda x, _: x))  # Outside the DP guarantee.
    ready_ds = train_ds.map(lambda x, y: (feature_space(x), y),
                            num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
    if convert:
        ready_ds = keras_dp.data.poisson_dataset(ready_ds.unbatch(), expected_batch_size=32)  # dp
    encoded = keras.Input(shape=(feature_space.get_encoded_features().shape[-1],))
    x = keras.layers.Dense(8, activation="relu")(encoded)
    model = keras_dp.make_private(keras.Model(encoded, keras.layers.Dense(1)(x)),  # dp
                                  clipping_engine=engine)
    model.compile(optimizer=dp_adam(), loss=keras.losses.BinaryCrossentropy(from_logits=True),  # dp
                  metrics=["accuracy"])
    return model, model.fit(ready_ds, epochs=EPOCHS, verbose=0)


PROGRAMS = {
    # name: (program, make its data, its training examples, batch size)
    "image_classification": (image_classification, lambda tmp: jpeg_folders(tmp / "images"),
                             64, 16),
    "text_classification": (text_classification, lambda tmp: text_folders(tmp / "aclImdb"),
                            64, 16),
    "timeseries_classification": (timeseries_classification,
                                  lambda tmp: series_csv(tmp / "FordA_TRAIN.tsv"), 96, 32),
    "structured_data": (structured_data, lambda tmp: heart_csv(tmp / "heart.csv"), 96, 32),
}


def mnist_convnet(x_train, y_train, engine="auto"):
    """After keras-io's mnist_convnet: one-hot labels, a softmax output and
    categorical_crossentropy, fit on arrays with a validation split."""
    num_classes = 10
    y_train = keras.utils.to_categorical(y_train, num_classes)
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(num_classes, activation="softmax"),
    ])
    model = keras_dp.make_private(model, clipping_engine=engine)  # dp
    model.compile(loss="categorical_crossentropy", optimizer=dp_adam(),  # dp
                  metrics=["accuracy"])
    return model, model.fit(x_train, y_train, batch_size=32, epochs=EPOCHS,
                            validation_split=0.1, verbose=0)


def test_keras_io_mnist_convnet_runs_ghost_on_its_softmax_output():
    """Keras' cross-entropies read the logits under a softmax output, which
    ghost clipping takes (before, "auto" ran the vectorized engine here,
    6.3x the time of ghost on this model at batch 128)."""
    assert len(changed_lines(mnist_convnet)) <= 3
    rng = np.random.default_rng(4)
    x_train = rng.uniform(size=(160, 28, 28, 1)).astype("float32")
    y_train = rng.integers(0, 10, 160)
    keras.utils.set_random_seed(0)
    model, history = mnist_convnet(x_train, y_train)
    assert model.clipping_engine_in_use == "ghost"
    assert np.all(np.isfinite(history.history["loss"]))
    # keras-dp holds each row out with probability 0.1 (a split by position
    # would let one added example push another out).
    epsilon, event = model.privacy_spent(DELTA)
    (steps,) = event.events
    num_train = round(32 / steps.event.sampling_probability)
    assert 120 <= num_train <= 160 and steps.count == EPOCHS * math.ceil(num_train / 32)
    assert epsilon == pytest.approx(arrays_epsilon(num_train, 32), rel=1e-2)


def arrays_epsilon(num_examples, batch_size):
    """The Poisson epsilon of fit on the same examples as arrays."""
    return keras_dp.accounting.compute_epsilon(num_examples, batch_size, SIGMA, DELTA,
                                               epochs=EPOCHS)


def changed_lines(program):
    """The lines of a program that make it private."""
    return [line for line in inspect.getsource(program).splitlines()
            if line.rstrip().endswith("# dp")]


# The image folder program in make test; the text folder's (16 s, on both
# engines; a cached, prefetched pipeline is read once per epoch in
# test_pipelines) and the CSV ones, about as long each, in make test-all.
_SLOW_PROGRAMS = ("text_classification", "timeseries_classification", "structured_data")
# The programs make test also trains on the vectorized engine (make test-all:
# all); the engines' agreement is tested on many models elsewhere.
_BOTH_ENGINES = ("text_classification",)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_PROGRAMS else name
    for name in PROGRAMS])
def test_a_keras_io_program_reaches_the_poisson_epsilon_of_its_arrays(name, tmp_path):
    program, make_data, num_examples, batch_size = PROGRAMS[name]
    assert len(changed_lines(program)) <= 3
    source = make_data(tmp_path)
    keras.utils.set_random_seed(0)
    with pytest.warns(UserWarning, match="keras-dp did not sample these batches"):
        before, _ = program(source, convert=False, engine="auto")
    epsilon_before = before.privacy_spent(DELTA)[0]
    expected = arrays_epsilon(num_examples, batch_size)
    for engine in ("ghost", "vectorized") if name in _BOTH_ENGINES + _SLOW_PROGRAMS else ("ghost",):
        keras.utils.set_random_seed(0)
        after, history = program(source, convert=True, engine=engine)
        assert after.clipping_engine_in_use == engine
        assert np.all(np.isfinite(history.history["loss"]))
        assert after.privacy_spent(DELTA)[0] == pytest.approx(expected, rel=1e-2)
    assert epsilon_before > 2 * expected  # Before: no amplification by sampling.
