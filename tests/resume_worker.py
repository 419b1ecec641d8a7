"""Trains a tiny private model with BackupAndRestore; tests/test_resume.py kills it.

Usage: python resume_worker.py BACKUP_DIR [--epochs E] [--hang-at-epoch K]

Prints one flushed line per event, `event key=value ...` (`train` gives them
to any `emit` function instead, for the restart inside the test's process):

    begin privacy_steps=S iterations=I      (after BackupAndRestore restored)
    epoch_begin epoch=E privacy_steps=S
    batch epoch=E batch=B privacy_steps=S
    epoch_end epoch=E privacy_steps=S epsilon=X  (after the epoch's backup)
    hang                                     (then sleeps until killed)
    done privacy_steps=S steps_per_epoch=P epochs=E history_epochs=H

With --hang-at-epoch K, the worker stops making progress after the first
batch of epoch K (0-based), so the parent can SIGKILL it mid-epoch.
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402

NUM_EXAMPLES = 64
BATCH_SIZE = 16
DELTA = 1e-3


def emit(event, **fields):
    print(" ".join([event] + [f"{k}={v}" for k, v in fields.items()]), flush=True)


def train(backup_dir, epochs=5, hang_at_epoch=None, emit=emit):
    """Fits with BackupAndRestore in `backup_dir`, reporting each event to `emit`."""
    keras.utils.set_random_seed(0)
    generator = np.random.default_rng(0)
    x = generator.normal(size=(NUM_EXAMPLES, 5)).astype("float32")
    y = generator.integers(0, 3, NUM_EXAMPLES)

    model = keras_dp.DPSequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                   keras.layers.Dense(3)])
    model.compile(optimizer=keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                                learning_rate=0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    state = {"epoch": None}

    def on_train_begin(logs):
        emit("begin", privacy_steps=model.privacy_steps,
             iterations=int(model.optimizer.iterations.numpy()))

    def on_epoch_begin(epoch, logs):
        state["epoch"] = epoch
        emit("epoch_begin", epoch=epoch, privacy_steps=model.privacy_steps)

    def on_batch_end(batch, logs):
        emit("batch", epoch=state["epoch"], batch=batch, privacy_steps=model.privacy_steps)
        if state["epoch"] == hang_at_epoch:
            emit("hang")
            time.sleep(600)  # The parent kills us here, mid-epoch.

    def on_epoch_end(epoch, logs):
        emit("epoch_end", epoch=epoch, privacy_steps=model.privacy_steps,
             epsilon=repr(float(logs["epsilon"])))

    # Order matters: BackupAndRestore restores in on_train_begin (and backs up
    # in on_epoch_end) before the callbacks listed after it see the model.
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
                 keras_dp.PrivacyCallback(delta=DELTA)]
    callbacks.append(keras.callbacks.LambdaCallback(
        on_train_begin=on_train_begin, on_epoch_begin=on_epoch_begin,
        on_train_batch_end=on_batch_end, on_epoch_end=on_epoch_end))

    history = model.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
                        callbacks=callbacks)
    emit("done", privacy_steps=model.privacy_steps,
         steps_per_epoch=math.ceil(NUM_EXAMPLES / BATCH_SIZE), epochs=epochs,
         history_epochs=len(history.history["loss"]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hang-at-epoch", type=int, default=None)
    args = parser.parse_args()
    train(args.backup_dir, args.epochs, args.hang_at_epoch)


if __name__ == "__main__":
    main()
