"""Checkpoint and resume: the privacy ledger and the DP optimizer survive every restart.

`privacy_steps` is what epsilon is computed from, so a resumed run must
continue it, never reset it. The optimizer must come back with its privacy
configuration and its state (step counter, slots, accumulated sums), so a
resumed run takes the same steps as an uninterrupted one.
"""

import math
import os
import queue
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_dp
import resume_worker  # tests/ is on the path (conftest.py).

# Does not depend on TensorFlow's CPU kernel set (saving and restoring the ledger
# and the optimizer state): `make test` runs it once, with oneDNN on, where
# its run ends about when the oneDNN-off run does (the markers in pytest.ini).
pytestmark = [pytest.mark.once, pytest.mark.with_onednn_on]

N = 64
BATCH = 16
STEPS_PER_EPOCH = math.ceil(N / BATCH)  # Poisson sampling of fit() on arrays.
LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")


def small_data(n=N):
    generator = np.random.default_rng(0)
    return (generator.normal(size=(n, 5)).astype("float32") * 3,
            generator.integers(0, 3, n))


def private_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras_dp.make_private(keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
    model.compile(optimizer=optimizer, loss=LOGITS_LOSS)
    return model


OPTIMIZERS = {
    "sgd_momentum": lambda: keras_dp.DPKerasSGD(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, momentum=0.9, seed=3,
        save_seed=True),
    "adam": lambda: keras_dp.DPKerasAdam(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.01, seed=3, save_seed=True),
    "accumulation": lambda: keras_dp.DPKerasSGD(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, momentum=0.9, seed=3,
        save_seed=True, gradient_accumulation_steps=2),
}


def optimizer_state(optimizer):
    """(name, value) of every variable, in order (names differ after loading)."""
    return [(v.name, v.numpy()) for v in optimizer.variables]


def train_batches(model, batches):
    x, y = small_data()
    for i in batches:
        model.train_on_batch(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])


# Momentum's slots: make test-all (Adam's, and momentum with accumulation, in make test).
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name == "sgd_momentum" else name for name in OPTIMIZERS])
def test_save_load_resumes_the_ledger_and_the_optimizer_exactly(name, tmp_path):
    # Six fixed batches on a model never saved, against a model loaded from
    # its save after the first logical steps: a save that changed the saved
    # model as well as its file would show. With accumulation the save falls
    # between logical steps: a partial clipped sum is never saved
    # (tests/test_mechanism.py).
    accumulation = 2 if name == "accumulation" else 1
    saved_after = 2 * accumulation
    uninterrupted = private_model(OPTIMIZERS[name]())
    train_batches(uninterrupted, range(6))

    model = private_model(OPTIMIZERS[name]())
    train_batches(model, range(saved_after))
    saved_steps = model.privacy_steps
    assert saved_steps == 2
    path = str(tmp_path / "model.keras")
    model.save(path)
    saved_state = optimizer_state(model.optimizer)

    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert loaded.privacy_steps == saved_steps
    loaded_state = optimizer_state(loaded.optimizer)
    assert len(loaded_state) == len(saved_state)
    assert len(saved_state) > 2  # iterations, learning rate and the slots.
    for (key, saved), (_, restored) in zip(saved_state, loaded_state):
        np.testing.assert_array_equal(restored, saved, err_msg=key)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())

    train_batches(loaded, range(saved_after, 6))
    assert loaded.privacy_steps == uninterrupted.privacy_steps
    assert (int(loaded.optimizer.iterations.numpy())
            == int(uninterrupted.optimizer.iterations.numpy()))
    # Same noise stream (seed and step), same slots: the very same weights.
    for a, b in zip(loaded.trainable_variables, uninterrupted.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)

    if accumulation > 1:
        # A logical batch half done: Poisson batches would not line up with
        # it, so fit() refuses until it is done; then fit continues the
        # ledger (fit after load_model without accumulation:
        # test_model_checkpoint_then_load_model_continues_the_ledger_and_epsilon).
        train_batches(loaded, [6])
        with pytest.raises(ValueError, match="mid-way through a logical batch"):
            loaded.fit(*small_data(), batch_size=BATCH, epochs=1, verbose=0)
        train_batches(loaded, [7])
        steps = loaded.privacy_steps
        loaded.fit(*small_data(), batch_size=BATCH, epochs=1, verbose=0)
        assert loaded.privacy_steps == steps + math.ceil(STEPS_PER_EPOCH / accumulation)


def test_model_checkpoint_then_load_model_continues_the_ledger_and_epsilon(tmp_path):
    x, y = small_data()
    model = private_model(OPTIMIZERS["sgd_momentum"]())
    pattern = str(tmp_path / "epoch{epoch}.keras")
    callbacks = [keras.callbacks.ModelCheckpoint(pattern), keras_dp.PrivacyCallback(delta=1e-3)]
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=callbacks)
    assert model.privacy_steps == 3 * STEPS_PER_EPOCH

    loaded = keras.models.load_model(pattern.format(epoch=2))
    assert loaded.privacy_steps == 2 * STEPS_PER_EPOCH
    assert type(loaded.optimizer).__name__ == "DPKerasSGD"
    assert int(loaded.optimizer.iterations.numpy()) == 2 * STEPS_PER_EPOCH
    resumed = loaded.fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=2, verbose=0,
                         callbacks=[keras_dp.PrivacyCallback(delta=1e-3)])
    assert loaded.privacy_steps == 3 * STEPS_PER_EPOCH
    # Epsilon of step 12 whether or not training was interrupted at step 8.
    assert resumed.history["epsilon"] == pytest.approx(history.history["epsilon"][2:])


# --- A real process, killed with SIGKILL mid-epoch, restarted from its backup.


def parse(line):
    event, *fields = line.split()
    return event, dict(field.split("=", 1) for field in fields)


class Events:
    """The events of an in-process `resume_worker.train`."""

    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append((event, {k: str(v) for k, v in fields.items()}))

    def of(self, event):
        return [fields for name, fields in self.events if name == event]


class Worker(Events):
    """tests/resume_worker.py in a subprocess, its output lines in a queue."""

    def __init__(self, backup_dir, *args):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, WORKER, str(backup_dir), *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env)
        self.lines = queue.Queue()
        self.events = []
        self._stderr = []
        threading.Thread(target=self._pump, args=(self.process.stdout, self.lines),
                         daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.process.stderr),
                         daemon=True).start()

    @staticmethod
    def _pump(stream, lines):
        for line in stream:
            lines.put(line)
        lines.put(None)

    def read_until(self, event, timeout=180):
        """Collects events until `event` (returned), the end of output, or a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.process.kill()
                raise AssertionError(
                    f"worker timed out waiting for {event!r}: {self.events}") from None
            if line is None:
                self.process.wait()
                raise AssertionError(
                    f"worker exited ({self.process.returncode}) before {event!r}: "
                    f"{self.events}\n{''.join(self._stderr[-30:])}")
            if not line.strip():
                continue
            self.events.append(parse(line))
            if self.events[-1][0] == event:
                return self.events[-1][1]


# Training in a subprocess, killed and restarted (10 s): make test-all; make test
# resumes saved and loaded fits exactly (test_save_load_resumes_...).
@pytest.mark.slow
@pytest.mark.program
def test_sigkill_mid_epoch_then_restart_continues_the_ledger(tmp_path):
    epochs, hang_at = 4, 2
    backup_dir = tmp_path / "backup"

    first = Worker(backup_dir, "--epochs", str(epochs), "--hang-at-epoch", str(hang_at))
    try:
        first.read_until("hang")
    finally:
        first.process.kill()  # SIGKILL on POSIX: no cleanup, no final backup.
        first.process.wait(timeout=60)
    if os.name == "posix":
        assert first.process.returncode == -9
    before_kill = first.of("epoch_end")
    assert [int(e["epoch"]) for e in before_kill] == list(range(hang_at))
    # The kill lost a step of epoch `hang_at` that was never backed up.
    assert int(first.of("batch")[-1]["privacy_steps"]) == hang_at * STEPS_PER_EPOCH + 1
    assert (backup_dir / "training_metadata.json").exists()

    # The restart needs no process of its own: a fresh model restored from
    # the files the killed process left (which a SIGKILL cannot tidy up).
    second = Events()
    resume_worker.train(str(backup_dir), epochs, emit=second.emit)
    done = second.of("done")[0]

    # Restored from the last backup (end of epoch hang_at - 1): never from 0.
    begin = second.of("begin")[0]
    assert int(begin["privacy_steps"]) == hang_at * STEPS_PER_EPOCH
    assert int(begin["iterations"]) == hang_at * STEPS_PER_EPOCH
    assert int(second.of("epoch_begin")[0]["epoch"]) == hang_at
    steps_seen = [int(e["privacy_steps"]) for e in second.of("batch")]
    assert steps_seen == list(range(hang_at * STEPS_PER_EPOCH + 1, epochs * STEPS_PER_EPOCH + 1))

    assert int(done["steps_per_epoch"]) == STEPS_PER_EPOCH
    assert int(done["privacy_steps"]) == STEPS_PER_EPOCH * epochs
    assert int(done["history_epochs"]) == epochs - hang_at

    after_restart = second.of("epoch_end")
    # Epsilon keeps growing across the kill: it is computed from the ledger.
    epsilons = [float(e["epsilon"]) for e in before_kill + after_restart]
    assert epsilons == sorted(epsilons) and len(set(epsilons)) == len(epsilons)
