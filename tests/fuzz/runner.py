"""Runs a fuzz program on D or D + z, with noise 0 or with the program's
noise, and records a probe after every physical batch: the weights, what
the ledger holds, and what the program knows of the batch (how it was
sampled, how often z was in it, its noise multiplier and clipping norm).

z is removed from D either for real (loops, whose batches the program
chooses) or by a sample weight of 0 (batches keras-dp samples, so that
both runs draw the same batches: the same rows with the same seeds).
"""

import dataclasses
import os
import warnings

import keras
import numpy as np
import tensorflow as tf

import keras_dp
from fuzz import builders
from fuzz import grammar

OPTIMIZER_SEED = 1234


@dataclasses.dataclass
class Probe:
    """One physical batch as it ran."""
    slot: str
    optimizer: int  # Which optimizer object took the batch.
    tag: dict  # What the program knows of the batch (see Run._tag_*).
    sigma: float  # The noise multiplier set when the batch began.
    clip: float  # The clipping norm when the batch began.
    before: dict  # unit -> flat float64 weights of the slot's units before the batch.
    weights: dict  # unit -> flat float64 weights of every unit after the batch.
    ledger_before: int  # Steps in the slot's ledger before the batch.
    ledger_steps: int  # Steps in the slot's ledger after the batch.
    sensitivity: float  # Its last segment's sensitivity.
    refused: bool = False  # A traced step that applied nothing (see `_refused_steps`).


@dataclasses.dataclass
class Trace:
    probes: list
    events: list  # (kind, probe index, detail): refusals, rewinds, decisions.
    reported: float = float("nan")  # The released model's privacy_spent epsilon.
    release_units: tuple = ()
    num_rows: int = 0


def _refused_steps(model):
    """How many traced steps of `model` refused since its last check.

    Read, not taken: keras-dp's own check (which raises in fit and
    train_on_batch, warns before the next step of a custom loop) must still
    see them. A refused step leaves weights, optimizer and ledger as they
    were, so only this count tells it from an accumulated physical batch.
    Code without graph refusals has no count: 0."""
    mechanism = getattr(model, "step_mechanism", None)
    return 0 if mechanism is None else sum(mechanism.pending_refusals().values())


def _pass_index(passes, epoch):
    """Which pass of its seed's draws a Poisson dataset is in: keras-dp's
    pass counter (a dataset built again with the same seed draws passes
    after those its ledger spent), or without one the epoch (code that
    replays its seed's passes from the first)."""
    return epoch if passes is None else passes.count() - 1


class _ProbeCallback(keras.callbacks.Callback):
    """Records each batch of a fit, and does the program's callback."""

    def __init__(self, run, slot, tagger, action):
        super().__init__()
        self.run, self.slot, self.tagger, self.action, self.epoch = run, slot, tagger, action, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        cb = self.action
        if cb and cb[0] in ("sigma", "clip") and batch == cb[1]:
            self.run.set(self.slot, "noise_multiplier" if cb[0] == "sigma" else "l2_norm_clip",
                         cb[2])
        self.run.begin(self.slot)

    def on_train_batch_end(self, batch, logs=None):
        self.run.end(self.slot, self.tagger(self.epoch, batch))
        cb = self.action
        if cb and cb[0] == "stop" and batch == cb[1]:
            self.model.stop_training = True
        if cb and cb[0] == "raise" and batch == cb[1]:
            raise RuntimeError("fuzz: a callback raised")


class Run:
    """One execution of a program.

    Args:
        program: a `grammar.Program`.
        with_z: D + z (True) or D.
        noise: the program's noise (True) or noise 0.
        directory: where files go.
        reference: for the D + z run at noise 0, the D run's `Trace`: after
            each batch the weights are set back to the D run's, so that
            every step of both runs starts from the same weights.
    """

    def __init__(self, program, with_z, noise, directory, reference=None):
        self.p, self.with_z, self.noise, self.dir = program, with_z, noise, directory
        self.reference = reference
        x, y = builders.dataset(program)
        self.x, self.y = x, y
        self.n = program.n
        self.w = np.ones(len(x), "float32")
        self.w[self.n] = 1.0 if with_z else 0.0
        self.trace = Trace([], [], num_rows=self.n + 1)
        self.units, self.models, self.slot_units = {}, {}, {}
        self.sigma = {}  # slot -> the noise multiplier the program set.
        self.clip = {}
        self._begin = {}
        self._steps = {}  # slot -> (private model, its tf.function step)

    # ------------------------------------------------------------ models

    def _optimizer(self, slot):
        p = self.p
        clip = self.clip[slot]
        if p.adaptive:
            clip = keras_dp.AdaptiveClipping(initial_l2_norm_clip=clip)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return keras_dp.DPKerasSGD(
                l2_norm_clip=clip, noise_multiplier=self.sigma[slot] if self.noise else 0.0,
                learning_rate=1.0, momentum=0.0, seed=OPTIMIZER_SEED + ord(slot),
                gradient_accumulation_steps=p.accumulation if p.accumulation > 1 else None,
                num_microbatches=p.microbatches or None,
                noise_correlation=keras_dp.BandedMF(bands=p.bands) if p.bands else None)

    def compile(self, slot, private):
        private.compile(optimizer=self._optimizer(slot), loss="mse", jit_compile=self.p.jit)
        self.models[slot] = private

    def _base(self, slot):
        units = self.slot_units[slot]
        if slot == "e":
            inputs = keras.Input((builders.FEATURES,))
            outputs = keras.layers.Average()([self.units[u](inputs) for u in units])
            return keras.Model(inputs, outputs, name="ensemble")
        return self.units[units[0]]

    def _ensure(self, slot):
        if slot in self.models:
            return self.models[slot]
        if slot == "e":
            for unit in ("a", "b"):
                self._ensure(unit)
            self.slot_units["e"] = ("a", "b")
        else:
            self.units[slot] = builders.base_model(self.p, slot)
            self.slot_units[slot] = (slot,)
        self.sigma.setdefault(slot, self.p.sigma)
        self.clip.setdefault(slot, self.p.clip)
        self.compile(slot, keras_dp.make_private(self._base(slot)))
        return self.models[slot]

    # ------------------------------------------------------------ probes

    def _flat(self, unit):
        return np.concatenate([np.asarray(v, np.float64).ravel()
                               for v in self.units[unit].get_weights()])

    def set(self, slot, name, value):
        getattr(self, "sigma" if name == "noise_multiplier" else "clip")[slot] = value
        optimizer = self.models[slot].optimizer
        if name == "noise_multiplier":
            optimizer.noise_multiplier = value if self.noise else 0.0
        else:
            optimizer.l2_norm_clip = value

    def begin(self, slot):
        model = self.models[slot]
        self._begin[slot] = (self.sigma[slot], float(np.max(model.optimizer.l2_norm_clip)),
                             {u: self._flat(u) for u in self.slot_units[slot]},
                             model.privacy_ledger.total_steps(), _refused_steps(model))

    def end(self, slot, tag):
        model = self.models[slot]
        segments = model.privacy_ledger.segments()
        sigma, clip, before, ledger_before, refused_before = self._begin.pop(slot)
        probe = Probe(slot, id(model.optimizer), tag, sigma, clip, before,
                      {u: self._flat(u) for u in self.units}, ledger_before,
                      model.privacy_ledger.total_steps(),
                      float(segments[-1].sensitivity) if segments else 0.0,
                      refused=_refused_steps(model) > refused_before)
        index = len(self.trace.probes)
        if probe.refused:
            self.event("refused", f"{slot}: a traced step applied nothing")
        self.trace.probes.append(probe)
        reference = self.reference and self.reference.probes
        if reference and index < len(reference):
            for unit, flat in reference[index].weights.items():
                if unit in self.units:
                    self._set_flat(unit, flat)

    def _set_flat(self, unit, flat):
        base, values, start = self.units[unit], [], 0
        for v in base.get_weights():
            values.append(flat[start:start + v.size].reshape(v.shape).astype(v.dtype))
            start += v.size
        base.set_weights(values)

    def event(self, kind, detail=None):
        self.trace.events.append((kind, len(self.trace.probes), detail))

    # ------------------------------------------------------------ actions

    def run(self):
        keras.backend.clear_session()
        keras.utils.set_random_seed(self.p.seed)
        for index, action in enumerate(self.p.actions):
            try:
                self._do(index, action)
            except Exception as error:  # noqa: BLE001  A refusal is a result.
                self.event("refused", f"{index} {type(error).__name__}: {error}"[:300])
            # As users do between phases: a read that may settle state (on
            # old code it moved a base onto its ensemble's joined ledger,
            # which a custom loop traced before then missed).
            self.event("steps", {slot: model.privacy_steps for slot, model in self.models.items()})
            for model in self.models.values():
                if not model.optimizer.is_mid_logical_step():
                    # Batches of a logical step left open (a fit stopped
                    # mid-step) were discarded: they join no later step.
                    self.event("closed", id(model.optimizer))
        release = self.models.get(self.p.release)
        if release is not None:
            self.trace.release_units = self.slot_units[self.p.release]
            try:
                self.trace.reported = float(release.privacy_spent(DELTA)[0])
            except Exception as error:  # noqa: BLE001
                self.event("unreported", f"{type(error).__name__}: {error}"[:300])
        return self.trace

    def _do(self, index, action):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if isinstance(action, grammar.Ensemble):
                self._ensure("e")
            elif isinstance(action, grammar.Fit):
                self._fit(index, action)
            elif isinstance(action, grammar.FitPipeline):
                self._fit_pipeline(index, action)
            elif isinstance(action, grammar.Loop):
                self._loop(action)
            elif isinstance(action, grammar.Set):
                self._ensure(action.slot)
                self.set(action.slot, action.name, action.value)
            elif isinstance(action, grammar.SaveLoad):
                self._save_load(index, action.slot)
            elif isinstance(action, grammar.Checkpoint):
                self._checkpoint(index, action)
            elif isinstance(action, grammar.Alias):
                self._alias(action)

    def _fit(self, index, action):
        private = self._ensure(action.slot)
        k, rows = self.p.accumulation, self.n + 1
        b = action.batch_size
        if self.p.bands:
            def tagger(epoch, batch):
                return {"kind": "cyclic", "q": self.p.bands * b / rows, "bands": self.p.bands,
                        "segment": index, "expected": b}
        elif action.sampling == "poisson":
            def tagger(epoch, batch):
                return {"kind": "poisson", "q": k * b / rows, "expected": b,
                        "draw": ("fit", index, epoch, batch // k)}
        else:
            def tagger(epoch, batch):
                return {"kind": "pass", "pass": (index, epoch), "batch": batch,
                        "batches": -(-rows // b), "rows": min(b, rows - batch * b)}
        callbacks = [_ProbeCallback(self, action.slot, tagger, action.callback)]
        best = os.path.join(self.dir, f"best{index}.keras")
        if action.callback == ("best",):
            # mode="max": as training lowers the loss, the first epoch's file
            # is kept, and its ledger is older than the epochs that chose it.
            callbacks.append(keras.callbacks.ModelCheckpoint(best, monitor="loss", mode="max",
                                                             save_best_only=True))
        kwargs = {"sampling": "shuffle"} if action.sampling == "shuffle" else {}
        try:
            private.fit(self.x, self.y, sample_weight=self.w, batch_size=b,
                        epochs=action.epochs, verbose=0, callbacks=callbacks, **kwargs)
        finally:
            if action.callback == ("best",) and os.path.exists(best):
                self.event("decided", action.slot)
                self._load(action.slot, best)

    def _pipeline(self, action, weights):
        return builders.pipeline(self.x, self.y, weights, action.transforms)

    def _fit_pipeline(self, index, action):
        private = self._ensure(action.slot)
        b = action.batch_size
        if action.reseed:
            keras.utils.set_random_seed(0)
        marked = np.where(np.arange(self.n + 1) == self.n, 2.0, 1.0).astype("float32")
        if action.poisson:
            source = self._pipeline(action, self.w)
            examples = [float(w) for _, _, w in self._pipeline(action, marked)]
            # An explicit seed: the runs on D and D + z must draw the same
            # samples (the default seed is fresh OS randomness per pipeline).
            seed = 0 if action.reseed else 7 + index
            dataset = keras_dp.data.poisson_dataset(source, expected_batch_size=b, seed=seed)
            passes = getattr(keras_dp.data.sampling_info_of(dataset), "passes", None)
            for name in action.batch_maps:
                dataset = dataset.map(builders.BATCH_MAPS[name])
            q = b / max(len(examples), 1)
            mixing = [m for m in action.batch_maps if m in builders.MIXING_BATCH_MAPS]

            def tagger(epoch, batch):
                return {"kind": "poisson", "q": q, "expected": b,
                        "draw": ("pipeline", seed, action.transforms, b,
                                 _pass_index(passes, epoch), batch),
                        "must_refuse": f"maps mixing rows after poisson_dataset {mixing}"
                        if mixing else ""}
        else:
            dataset = self._pipeline(action, self.w).batch(b)
            for name in action.batch_maps:
                dataset = dataset.map(builders.BATCH_MAPS[name])
            seen = [[int(np.sum(w.numpy() == 2.0)) for _, _, w in
                     self._pipeline(action, marked).batch(b)] for _ in range(action.epochs)]
            sizes = [len(w) for _, _, w in self._pipeline(action, marked).batch(b)]
            mixing = [m for m in action.batch_maps if m in builders.MIXING_BATCH_MAPS]

            def tagger(epoch, batch):
                z = seen[epoch][batch] if batch < len(seen[epoch]) else 0
                return {"kind": "arbitrary", "z": z,
                        "rows": sizes[batch] if batch < len(sizes) else b,
                        "must_refuse": f"maps mixing rows of batches {mixing}"
                        if mixing else ""}
        callbacks = [_ProbeCallback(self, action.slot, tagger, ())]
        private.fit(dataset, epochs=action.epochs, verbose=0, callbacks=callbacks)

    def _batch(self, start, size, with_z):
        rows = [(start + i) % self.n for i in range(size)]
        w = np.ones(size, "float32")
        z_in = with_z and self.with_z
        if z_in or self.p.microbatches:  # Microbatches: z's row in every batch, weight 0 if out.
            rows.append(self.n)
            w = np.append(w, 1.0 if z_in else 0.0).astype("float32")
        return self.x[rows], self.y[rows], w

    def _loop(self, action, steps=None, z_steps=None, start=0):
        private = self._ensure(action.slot)
        loop_number = self._loops = getattr(self, "_loops", 0) + 1
        step = None
        if action.kind == "tf_function":  # One traced function per private model, reused.
            cached = self._steps.get(action.slot)
            if cached is None or cached[0] is not private:
                def train(batch):
                    return private.train_step(batch)
                cached = self._steps[action.slot] = (private, tf.function(
                    train, jit_compile=self.p.jit))
            step = cached[1]
        steps = action.steps if steps is None else steps
        z_steps = action.z_steps if z_steps is None else z_steps
        for s in range(steps):
            x, y, w = self._batch(start + s * action.batch_size, action.batch_size, s in z_steps)
            self.begin(action.slot)
            if step is None:
                private.train_on_batch(x, y, sample_weight=w)
            else:
                step((tf.constant(x), tf.constant(y), tf.constant(w)))
            self.end(action.slot, {"kind": "arbitrary", "z": int(s in z_steps),
                                   "rows": len(x), "action": loop_number})

    def _load(self, slot, path):
        loaded = keras.models.load_model(path, custom_objects=builders.CUSTOM_OBJECTS,
                                         safe_mode=False)
        self.units[self.slot_units[slot][0]] = loaded.base_model
        self.compile(slot, loaded)

    def _save_load(self, index, slot):
        private = self._ensure(slot)
        path = os.path.join(self.dir, f"model{index}.keras")
        private.save(path)
        self._load(slot, path)

    def _checkpoint(self, index, action):
        private = self._ensure(action.slot)
        checkpoint = tf.train.Checkpoint(model=private)
        path = checkpoint.write(os.path.join(self.dir, f"ckpt{index}"))
        self.event("checkpoint", action.slot)
        loop = grammar.Loop("train_on_batch", 8, action.steps, (), action.slot)
        self._loop(loop, z_steps=tuple(range(action.steps)))
        checkpoint.read(path).expect_partial()
        self.event("restored", action.slot)

    def _alias(self, action):
        self._ensure(action.slot)
        base = self._base(action.slot) if action.slot == "e" else self.units[action.slot]
        if action.kind == "functional" and not self.p.subclass:
            base = keras.Model(base.inputs, base.outputs)
        self.compile(action.slot, keras_dp.make_private(base))


DELTA = 1e-3
