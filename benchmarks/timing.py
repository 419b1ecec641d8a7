"""Timing one fit() epoch, shared by the benchmarks (no flags: importable anywhere)."""

import math
import statistics
import time


def fit_examples_per_second(model, data, batch_size, warmup_steps, **fit_kwargs):
    """One fit() epoch on `data` (`(x, y)` arrays, or a dataset); expected
    examples/second after `warmup_steps` steps (tracing and the input
    pipeline's start are not counted)."""
    return timed_fit(model, data, batch_size, warmup_steps, **fit_kwargs)[0]


def timed_fit(model, data, batch_size, warmup_steps, **fit_kwargs):
    """`(examples/second, CPU ms per step)` of one fit() epoch, after
    `warmup_steps` steps (see `fit_examples_per_second`); the CPU time is
    the whole process's, every thread, input pipeline included. Keras calls
    the batch hook once per execution of steps_per_execution batches, with
    the last batch's index, which it does not cap at the epoch's last batch
    when an epoch's steps are not a multiple of steps_per_execution."""
    import keras

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batch = min(batch, (self.params.get("steps") or math.inf) - 1)
            ends.append((batch, time.perf_counter(), time.process_time()))

    ends = []
    if isinstance(data, tuple):
        fit_kwargs.update(x=data[0], y=data[1], batch_size=batch_size)
    else:
        fit_kwargs.update(x=data)
    callbacks = [StepEnds()] + fit_kwargs.pop("callbacks", [])
    model.fit(epochs=1, verbose=0, callbacks=callbacks, **fit_kwargs)
    timed = [end for end in ends if end[0] >= warmup_steps] or ends
    if len(timed) < 2:
        timed = ends[-2:]
    (first, start, cpu_start), (last, stop, cpu_stop) = timed[0], timed[-1]
    return ((last - first) * batch_size / (stop - start),
            1000 * (cpu_stop - cpu_start) / (last - first))


def round_ratios(references, values):
    """`(median, least, largest)` of reference / value within each round
    (rounds in the same order in both lists), or None. A machine whose
    speed drifts within minutes can pair a fast round's best with a slow
    one's; a ratio within a round compares what ran seconds apart."""
    paired = [r / v for r, v in zip(references or [], values or []) if r and v]
    return (statistics.median(paired), min(paired), max(paired)) if paired else None
