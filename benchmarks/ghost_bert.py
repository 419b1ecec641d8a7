"""Engine and step time of a private Keras Hub BERT classifier (issue 44).

The model: `keras_hub.models.BertBackbone` built from its config (random
weights, no download): by default that of the preset bert_tiny_en_uncased
(30522 tokens, 2 layers, hidden 128, 2 heads, intermediate 512) on
sequences of 128 tokens (--vocabulary, --layers, --hidden, --heads,
--sequence_length), and a Dense head on its pooled output, made private with
`keras_dp.make_private`, DPKerasSGD (noise 1.1, clip 1.0), on random token
ids and segment ids (BERT's 2-row segment embedding).

Before issue 44, `clipping_engine="auto"` ran the vectorized engine for it
(the probe took the 2-row segment embedding for one that mixes examples);
now the traced forward pass is read and ghost clipping runs. This prints:

* the engine "auto" chooses;
* step time of clipping_engine="ghost" against "vectorized", measured side
  by side in one process (same weights, same batches, interleaved rounds of
  --steps train_on_batch calls, after an untimed round; CPU time of the
  process and wall time): the
  ratio vectorized / ghost, median over --rounds, is the speed-up of the
  engine "auto" now picks over the one it picked before;
* the cost of the analysis: its time while the step is traced, the number of
  ops it tagged, the whole first call (trace and run) for scale, and whether
  the traced step has the same ops with and without it (it adds none, so
  the step it traces cannot be slower).

Only ratios are meant to be compared: the machine is shared.

Usage:
  python benchmarks/ghost_bert.py
  python benchmarks/ghost_bert.py --vocabulary=1000 --hidden=64 --sequence_length=64
"""

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# After PYTHONPATH: `PYTHONPATH=<a checkout of an older keras-dp>` measures that one.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

flags.DEFINE_integer("vocabulary", 30522, "Vocabulary size.")
flags.DEFINE_integer("layers", 2, "Transformer layers.")
flags.DEFINE_integer("hidden", 128, "Hidden size (intermediate: 4x).")
flags.DEFINE_integer("heads", 2, "Attention heads.")
flags.DEFINE_integer("sequence_length", 128, "Tokens per example.")
flags.DEFINE_integer("batch_size", 32, "Examples per step.")
flags.DEFINE_integer("steps", 3, "Steps per engine and round.")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
FLAGS = flags.FLAGS


def classifier(seed=0):
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers, num_heads=FLAGS.heads,
        hidden_dim=FLAGS.hidden, intermediate_dim=4 * FLAGS.hidden,
        max_sequence_length=FLAGS.sequence_length)
    pooled = backbone(backbone.input)["pooled_output"]
    return keras.Model(backbone.input, keras.layers.Dense(2)(pooled))


def private(engine):
    import keras
    import keras_dp

    model = keras_dp.make_private(classifier(), clipping_engine=engine)
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                learning_rate=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batches(count):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (FLAGS.batch_size, FLAGS.sequence_length)
    return [({"token_ids": rng.integers(0, FLAGS.vocabulary, shape).astype("int32"),
              "segment_ids": rng.integers(0, 2, shape).astype("int32"),
              "padding_mask": np.ones(shape, "int32")},
             rng.integers(0, 2, FLAGS.batch_size)) for _ in range(count)]


class AnalysisTimer:
    """Times `independence.Analysis.check` (the walk over the traced ops), or,
    in a keras-dp from before issue 44, the probe it replaced."""

    def __init__(self):
        from keras_dp.clipping import independence

        self.seconds, self.ops = 0.0, None
        self.kind = "analysis" if hasattr(independence, "Analysis") else "probe"
        owner, name = ((independence.Analysis, "check") if self.kind == "analysis"
                       else (independence, "rows_are_independent"))
        original, timer = getattr(owner, name), self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                if timer.kind == "analysis":
                    timer.ops = len(args[0].tags.memo)

        setattr(owner, name, timed)
        if self.kind == "probe":  # The engine imported the function itself.
            from keras_dp.clipping import engine
            if getattr(engine, "independence", None) is not independence:
                raise RuntimeError("cannot time this keras-dp's probe")


def traced_ops(model, batch, analysed):
    """The op count of the traced ghost step, with or without the analysis."""
    import tensorflow as tf
    from keras_dp.clipping import engine
    from keras_dp.clipping import recorder

    original = getattr(recorder.Recorder, "check_rows", None)
    if original is None:
        return None  # A keras-dp from before issue 44: no analysis to leave out.
    if not analysed:
        recorder.Recorder.check_rows = lambda self, outputs: {}
    try:
        def step(x, y):
            return engine.clipped_gradient_sum(model, engine.as_batch(x, y, None),
                                               FLAGS.batch_size, model.trainable_variables,
                                               tf.constant(1.0)).grad_sum
        graph = tf.function(step, autograph=False).get_concrete_function(*batch).graph
        return len(graph.get_operations())
    finally:
        recorder.Recorder.check_rows = original


def timed_steps(model, data):
    wall, cpu = time.perf_counter(), time.process_time()
    for x, y in data:
        model.train_on_batch(x, y)
    return ((time.perf_counter() - wall) / len(data), (time.process_time() - cpu) / len(data))


def main(argv):
    del argv
    timer = AnalysisTimer()
    data = batches(FLAGS.steps)
    models = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = private("auto")
        start = time.perf_counter()
        auto.train_on_batch(*data[0])
        first_call = time.perf_counter() - start
    fallbacks = [str(w.message) for w in caught if "vectorized engine" in str(w.message)]
    print(f"BERT classifier: {FLAGS.layers} layers, hidden {FLAGS.hidden}, "
          f"{FLAGS.sequence_length} tokens, batch {FLAGS.batch_size}, "
          f"{auto.count_params():,} weights")
    print(f'clipping_engine="auto" runs: {auto.clipping_engine_in_use}'
          + (f" ({fallbacks[0][:200]})" if fallbacks else ""))
    tagged = f" for {timer.ops} tagged tensors" if timer.ops is not None else ""
    print(f"{timer.kind}: {timer.seconds * 1000:.0f} ms{tagged} while tracing; the first "
          f"step (trace and run) took {first_call:.1f} s")
    import tensorflow as tf
    inputs = (tf.nest.map_structure(tf.convert_to_tensor, data[0][0]),
              tf.convert_to_tensor(data[0][1]))
    with_analysis = traced_ops(auto, inputs, True)
    if with_analysis is not None:
        without = traced_ops(auto, inputs, False)
        print(f"ops of the traced ghost step: {with_analysis} with the analysis, {without} "
              f"without ({'the same' if with_analysis == without else 'DIFFERENT'})")

    for engine in ("ghost", "vectorized"):
        models[engine] = private(engine)
        try:
            timed_steps(models[engine], data)  # Trace, and a round of warm-up.
        except ValueError as error:  # UnsupportedModelError: before issue 44, "ghost" refused.
            print(f'clipping_engine="ghost" refuses: {str(error)[:200]}')
            return
    ratios = {"wall": [], "cpu": []}
    for _ in range(FLAGS.rounds):
        times = {engine: timed_steps(models[engine], data) for engine in models}
        ratios["wall"].append(times["vectorized"][0] / times["ghost"][0])
        ratios["cpu"].append(times["vectorized"][1] / times["ghost"][1])
    for kind, values in ratios.items():
        print(f"step time vectorized / ghost ({kind}): median {statistics.median(values):.2f} "
              f"(rounds: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    app.run(main)
