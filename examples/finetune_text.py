"""Private LoRA fine-tuning of a small Keras Hub text classifier, offline.

A BERT-shaped `keras_hub.models.BertBackbone` (2 layers, width 64, built
from a config: random weights, nothing downloaded) with LoRA on the query and
value projections of its attention (`backbone.enable_lora`), the rest of the
backbone frozen, and a classifier head on the mean of its token states, is
fine-tuned with DP-SGD on a generated
sentiment task: short reviews, raw strings, made of a positive or negative
opinion word among neutral words, in random order, some opinions negated
("not good" is negative). The strings go through Keras Hub's own BERT
tokenizer and preprocessor, with a vocabulary made of the task's words.

The private step runs on the ghost clipping engine: exact per-example
gradient norms of the LoRA factors, without per-example copies of the
frozen kernels. It prints the test accuracy and epsilon.

On 2 shared CPU cores the default run took 71 s of training: test accuracy
0.71 at epsilon 5.37 (delta 1e-5); the same run without noise (not private)
reached 0.82 in 5 epochs, and a bag of words cannot pass 0.7 here (negations).

Usage:
  python examples/finetune_text.py                   # default run, about 2 minutes
  python examples/finetune_text.py --num_train=1000 --epochs=1   # smoke test
"""

import os
import sys
import time

# TensorFlow's C++ log level: 2 hides its INFO and WARNING lines; on a machine
# without an NVIDIA GPU, 3 also hides the one ERROR it prints there, the GPU
# probe's "failed call to cuInit". Python warnings and exceptions still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if os.path.exists("/dev/nvidiactl") else "3")

from absl import app
from absl import flags

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import keras_dp  # noqa: E402

FLAGS = flags.FLAGS

POSITIVE = ["good", "great", "fine", "lovely", "superb", "fun", "moving", "clever"]
NEGATIVE = ["bad", "dull", "awful", "boring", "weak", "silly", "poor", "flat"]
NEUTRAL = ["the", "a", "film", "movie", "plot", "actor", "story", "was", "is", "and",
           "it", "very", "really", "quite", "ending", "music", "scene", "cast", "this"]
NEGATION = "not"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def define_flags():
    flags.DEFINE_integer("num_train", 20000, "Generated training reviews.")
    flags.DEFINE_integer("num_test", 2000, "Generated test reviews.")
    flags.DEFINE_integer("epochs", 10, "Training epochs.")
    flags.DEFINE_integer("batch_size", 1000, "Expected examples per (Poisson) batch.")
    flags.DEFINE_float("noise_multiplier", 1.0, "sigma: noise std is sigma * C on the sum.")
    flags.DEFINE_float("l2_norm_clip", 1.0, "C: bound on each example's gradient norm.")
    flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate.")
    flags.DEFINE_integer("lora_rank", 4, "Rank of the LoRA factors.")
    flags.DEFINE_float("delta", 1e-5, "delta of the (epsilon, delta) guarantee.")
    flags.DEFINE_integer("seed", 0, "Seed of the data and the initial weights.")


def reviews(n, rng, length=10):
    """`n` generated reviews and their labels (1 positive, 0 negative)."""
    texts, labels = [], []
    for _ in range(n):
        positive = rng.random() < 0.5
        negated = rng.random() < 0.3
        opinion = rng.choice(POSITIVE if positive != negated else NEGATIVE)
        words = list(rng.choice(NEUTRAL, size=length - 2))
        at = rng.integers(0, len(words) + 1)
        words[at:at] = [NEGATION, opinion] if negated else ["very", opinion]
        texts.append(" ".join(words))
        labels.append(int(positive))
    return np.array(texts), np.array(labels, "int32")


def build_classifier(lora_rank, sequence_length=16):
    import keras_hub
    vocabulary = SPECIAL + sorted(set(POSITIVE + NEGATIVE + NEUTRAL + [NEGATION]))
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=sequence_length)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=2, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=sequence_length)
    backbone.enable_lora(lora_rank)  # Freezes the backbone but for LoRA's factors.
    # A head on the mean of the token states: the [CLS] pooler of
    # BertTextClassifier, frozen at random weights, passes too little through.
    inputs = {name: keras.Input((sequence_length,), dtype="int32", name=name)
              for name in ("token_ids", "segment_ids", "padding_mask")}
    states = backbone(inputs)["sequence_output"]
    mask = keras.ops.cast(inputs["padding_mask"], states.dtype)[..., None]
    # (At least 1: the padding rows of Poisson batches have no token.)
    pooled = keras.ops.sum(states * mask, axis=1) / keras.ops.maximum(
        keras.ops.sum(mask, axis=1), 1.0)
    classifier = keras.Model(inputs, keras.layers.Dense(2)(pooled))
    return preprocessor, classifier


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    rng = np.random.default_rng(FLAGS.seed)
    train_text, train_labels = reviews(FLAGS.num_train, rng)
    test_text, test_labels = reviews(FLAGS.num_test, rng)
    preprocessor, classifier = build_classifier(FLAGS.lora_rank)
    # Tokenized once, outside the private fit (which samples in-memory arrays).
    x_train = {k: np.asarray(v) for k, v in preprocessor(train_text).items()}
    x_test = {k: np.asarray(v) for k, v in preprocessor(test_text).items()}

    model = keras_dp.make_private(classifier)
    model.compile(
        optimizer=keras_dp.DPKerasAdam(l2_norm_clip=FLAGS.l2_norm_clip,
                                       noise_multiplier=FLAGS.noise_multiplier,
                                       learning_rate=FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    total = sum(int(np.prod(v.shape)) for v in model.weights)
    print(f"example: {str(train_text[0])!r} -> label {train_labels[0]}")
    print(f"training {trainable:,} of {total:,} weights (LoRA rank {FLAGS.lora_rank}, "
          f"classifier head); clipping engine: "
          f"{'ghost' if keras_dp.clipping.ghost.supports(model) else 'vectorized'}")
    start = time.time()
    model.fit(x_train, train_labels, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
              verbose=2, callbacks=[keras_dp.PrivacyCallback(delta=FLAGS.delta)])
    _, accuracy = model.evaluate(x_test, test_labels, batch_size=512, verbose=0)
    epsilon, _ = model.privacy_spent(delta=FLAGS.delta)
    print(f"test accuracy {accuracy:.4f} at epsilon {epsilon:.2f} (delta {FLAGS.delta:g}), "
          f"{time.time() - start:.0f} s of training")


if __name__ == "__main__":
    define_flags()
    app.run(main)
