"""Private `adapt()` for Keras preprocessing layers.

Keras' `layer.adapt(data)` stores statistics of the data in the layer: a
`Normalization`'s mean and variance, a `Discretization`'s quantiles, a lookup
layer's vocabulary (where a word seen in one example sits verbatim). Saved
with the model, they are released with it. `keras_dp.adapt` computes them
with a Gaussian mechanism instead, and records that release in the privacy
ledger of every private model that contains the layer, so `privacy_spent`
counts it with training (docs/privacy_accounting.md, "Preprocessing").

One type per layer family (`NormalizationRelease`, `QuantileRelease`,
`VocabularyRelease`) computes the noised statistics from one Gaussian
release of a given noise multiplier; `adapt` calibrates it to
`(epsilon, delta)` with `dp_accounting` and keeps the `Release` on the layer.
"""

import dataclasses
import functools
import json
import statistics
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_dp import accounting
from keras_dp import data as keras_dp_data
from keras_dp.data import examples
from keras_dp import ledger
from keras_dp import sampling_schemes

# The attribute of a layer that keeps its `Release` (in this process).
_RELEASE_ATTRIBUTE = "keras_dp_release"
# On a class of released layers: its call notes them on the graphs tracing it.
_NOTING_CALL_ATTRIBUTE = "keras_dp_notes_calls"
# On a graph: the released layers whose calls it traced.
_CALLS_ATTRIBUTE = "keras_dp_released_layers_called"
# The entry of a private model's saved weights naming its released layers.
RELEASED_LAYERS_KEY = "keras_dp_released_layers"
# The regular expression of Keras' "strip_punctuation" standardization.
_PUNCTUATION = r'[!"#$%&()\*\+,-\./:;<=>?@\[\\\]^_`{|}~\']'
_LOOKUP_LAYERS = (keras.layers.StringLookup, keras.layers.IntegerLookup,
                  keras.layers.TextVectorization)
_ADAPTABLE = (keras.layers.Normalization, keras.layers.Discretization) + _LOOKUP_LAYERS


@dataclasses.dataclass(eq=False)  # Two releases are the same only if one object.
class Release:
    """What `keras_dp.adapt` released into a layer.

    Args:
        segment: the release as a `keras_dp.ledger.Segment` (one Gaussian
            release of `noise_multiplier`, plus the threshold's delta of a
            vocabulary as `extra_delta`); None for a layer loaded from a
            file saved before releases carried their segments.
        state: the layer's state as released (to tell a later plain
            `adapt()` apart); None when not known (loaded).
        ledgers: the ledgers the release was added to (each once).
        earlier: the release this one replaced on its layer (review round
            30: adapted twice, the first release's spending was lost, 1.00
            reported against 1.45).
        inputs: the releases of the layers its data ran through (a map of
            the pipeline it adapted on calling a released layer: review
            round 152, 2.56 reported against 4.55).
    """

    segment: ledger.Segment | None
    state: object = None
    ledgers: list = dataclasses.field(default_factory=list)
    earlier: "Release | None" = None
    inputs: list = dataclasses.field(default_factory=list)

    def chain(self):
        """This release and every one it rests on, once each: those it
        replaced on its layer and those of the layers its data ran through,
        each read from the data and in what it released."""
        seen, work = [], [self]
        while work:
            release = work.pop()
            if release is None or any(release is other for other in seen):
                continue
            seen.append(release)
            yield release
            work += [release.earlier, *release.inputs]

    @property
    def noise_multiplier(self):
        """Sigma: the noise std over the release's L2 sensitivity."""
        return self.segment.noise_multiplier


class NormalizationRelease:
    """A `keras.layers.Normalization`'s mean and variance, noised.

    Each example (a row of `features` values) is clipped to `value_range`
    and rescaled to u in [-1, 1] (each feature by its own range, if given
    one); the mechanism releases the sums of u, of u^2 and the count of
    examples, with Gaussian noise of std sigma * D on each, D =
    sqrt(2 * features + 1) their L2 sensitivity. The mean of a feature is
    then off by about `mean_error(...)`: the half-width of its range times
    sigma * D over the number of examples.

    Args:
        value_range: `(low, high)`, fixed without looking at the data; low
            and high are numbers, or one per feature (features of different
            scales each keep their precision).
    """

    layer_types = (keras.layers.Normalization,)

    def __init__(self, value_range):
        self.low, self.high = _check_feature_ranges(value_range)

    def noised(self, layer, data, noise_multiplier, rng):
        """The noised sums, squared sums and count (every check before the draw)."""
        rows = _rows(data).astype(np.float64)
        x = rows.reshape(len(rows), -1) if rows.ndim != 1 else rows[:, None]
        if layer.input_mean is not None:
            raise ValueError(
                f"Layer '{layer.name}' was given its mean and variance: it has nothing "
                "to adapt. Create it without mean= and variance= to adapt it privately.")
        if not layer.built:  # At the examples' shape, as the layer will be called.
            layer.build((None, *rows.shape[1:]) if rows.ndim != 1 else (None, 1))
        if int(np.prod(layer.adapt_mean.shape)) != x.shape[1]:
            raise ValueError(
                f"Layer '{layer.name}' normalizes {int(np.prod(layer.adapt_mean.shape))} "
                f"features, but keras_dp.adapt reads each example as one row of "
                f"{x.shape[1]} values: one example must be one row of the features the "
                "layer normalizes (shape (examples, features)).")
        if self.low.size > 1 and self.low.size != x.shape[1]:
            raise ValueError(
                f"value_range gives {self.low.size} lows and highs, one per feature, but "
                f"layer '{layer.name}' normalizes {x.shape[1]} features: give one (low, "
                "high) for all features, or one low and one high per feature.")
        center, half = (self.high + self.low) / 2, (self.high - self.low) / 2
        # A NaN counts as the center, an infinity as its end of the range:
        # every example stays within the range the sensitivity assumes.
        u = (np.clip(np.where(np.isnan(x), center, x), self.low, self.high) - center) / half
        std = noise_multiplier * self.sensitivity(x.shape[1])
        sums = np.concatenate([u.sum(0), (u * u).sum(0), [len(u)]])
        return sums + rng.normal(0.0, std, sums.shape)

    def apply(self, layer, noised):
        """Sets the layer's mean and variance from the noised sums."""
        features = (len(noised) - 1) // 2
        center, half = (self.high + self.low) / 2, (self.high - self.low) / 2
        count = max(noised[-1], 1.0)
        mean = np.clip(noised[:features] / count, -1, 1)
        variance = np.maximum(np.clip(noised[features:-1] / count, 0, 1) - mean ** 2, 0)
        layer.adapt_mean.assign(np.reshape(center + half * mean, layer.adapt_mean.shape))
        layer.adapt_variance.assign(
            np.reshape(half * half * variance, layer.adapt_variance.shape))
        layer.count.assign(round(count))
        layer.finalize_state()

    @staticmethod
    def sensitivity(features):
        """D: how far one example moves the released sums (L2)."""
        return float(np.sqrt(2 * features + 1))

    def mean_error(self, features, num_examples, noise_multiplier):
        """The std of a released mean's noise, for data inside the range
        (a number, or one per feature for ranges given per feature)."""
        half = (self.high - self.low) / 2
        return half * noise_multiplier * self.sensitivity(features) / num_examples

    @staticmethod
    def state_of(layer):
        return (np.array(layer.adapt_mean.numpy()), np.array(layer.adapt_variance.numpy()))

    @staticmethod
    def holds_data_state(layer):
        # Keras 3's adapt() sets the mean and variance but leaves `count` (kept
        # for older files) at 0: statistics off their initial 0 and 1 are data's.
        if layer.input_mean is not None or not layer.built:
            return False
        return bool(layer.count.numpy() > 0 or np.any(layer.adapt_mean.numpy() != 0)
                    or np.any(layer.adapt_variance.numpy() != 1))


class QuantileRelease:
    """A `keras.layers.Discretization`'s bin boundaries: private quantiles.

    A histogram of `grid_size` equal cells over `value_range`, where each
    example adds 1 / (its number of values) per value (L2 sensitivity at
    most 1), noised with std sigma per cell; the boundaries are the cells
    where the noised cumulative count crosses 1/num_bins, 2/num_bins, ...
    of the noised total (post-processing).

    Args:
        value_range: `(low, high)`, fixed without looking at the data.
        grid_size: cells of the histogram (its resolution).
    """

    layer_types = (keras.layers.Discretization,)

    def __init__(self, value_range, grid_size=1024):
        self.low, self.high = _check_range(value_range)
        self.grid_size = int(grid_size)

    def noised(self, layer, data, noise_multiplier, rng):
        """The noised histogram (every check before the draw)."""
        if not layer.num_bins:
            raise ValueError(
                f"Layer '{layer.name}' has no num_bins: it was given its bin_boundaries "
                "and has nothing to adapt. Create it with num_bins= to adapt it privately.")
        x = _rows(data).astype(np.float64)
        x = x.reshape(len(x), -1) if x.ndim != 1 else x[:, None]
        edges = np.linspace(self.low, self.high, self.grid_size + 1)
        cells = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, self.grid_size - 1)
        histogram = np.zeros(self.grid_size)
        np.add.at(histogram, cells.ravel(), 1.0 / x.shape[1])
        return np.maximum(histogram + rng.normal(0.0, noise_multiplier, self.grid_size), 0)

    def apply(self, layer, noised):
        """Sets the bin boundaries where the noised histogram crosses each quantile."""
        edges = np.linspace(self.low, self.high, self.grid_size + 1)
        cumulative = np.cumsum(noised)
        targets = cumulative[-1] * np.arange(1, layer.num_bins) / layer.num_bins
        crossing = np.minimum(np.searchsorted(cumulative, targets), self.grid_size - 1)
        layer.bin_boundaries = [float(b) for b in edges[crossing + 1]]

    @staticmethod
    def state_of(layer):
        return list(layer.bin_boundaries or [])

    @staticmethod
    def holds_data_state(layer):
        return bool(layer.num_bins) and layer.bin_boundaries is not None


class VocabularyRelease:
    """A lookup layer's vocabulary, by Gaussian partition selection.

    Each example counts each distinct token it holds once, at most
    `max_tokens_per_example` = k of them (a random k of more), so one example
    moves the counts by at most sqrt(k) in L2. The counts get Gaussian noise
    of std sigma * sqrt(k), and a token is released when its noised count
    exceeds `threshold(...)`, chosen so that the at most k tokens held by one
    example alone are released with probability at most `threshold_delta`
    in all (docs/privacy_accounting.md derives it). The most frequent
    released tokens fill the layer's `max_tokens`.

    Args:
        max_tokens_per_example: k, an integer >= 1.
    """

    layer_types = _LOOKUP_LAYERS

    def __init__(self, max_tokens_per_example):
        if not isinstance(max_tokens_per_example, int) or max_tokens_per_example < 1:
            raise ValueError(
                "keras_dp.adapt of a lookup layer needs max_tokens_per_example, the most "
                "distinct tokens one example may add to the vocabulary counts (an "
                f"integer >= 1); received {max_tokens_per_example!r}.")
        self.max_tokens_per_example = max_tokens_per_example
        self.threshold_delta = None

    def noised(self, layer, data, noise_multiplier, rng):
        """The tokens, their noised counts, and the threshold to pass."""
        counts = {}
        for tokens in _tokens_of_examples(layer, data):
            distinct = sorted(set(tokens))
            if len(distinct) > self.max_tokens_per_example:
                picked = rng.choice(len(distinct), self.max_tokens_per_example, replace=False)
                distinct = [distinct[i] for i in picked]
            for token in distinct:
                counts[token] = counts.get(token, 0) + 1
        tokens = list(counts)
        std = noise_multiplier * np.sqrt(self.max_tokens_per_example)
        noised = np.array([counts[t] for t in tokens], np.float64)
        noised += rng.normal(0.0, std, len(tokens))
        return tokens, noised, self.threshold(noise_multiplier, self.threshold_delta)

    @staticmethod
    def apply(layer, noised):
        """Sets the vocabulary: the tokens above the threshold, most held first."""
        tokens, noised, threshold = noised
        order = [i for i in np.argsort(-noised, kind="stable") if noised[i] > threshold]
        released = [tokens[i] for i in order[:_room(layer)]]
        if not released:  # Keras refuses an empty vocabulary.
            raise ValueError(
                f"No token of layer '{layer.name}' passed the release threshold "
                f"({threshold:.1f} examples): too few examples hold each token for this "
                "epsilon and delta. Use more examples, a larger epsilon, or a smaller "
                "max_tokens_per_example.")
        layer.set_vocabulary(released)

    def threshold(self, noise_multiplier, threshold_delta):
        """The noised count a token must exceed to be released.

        A token only one example holds has count 1: it is released with
        probability P[1 + N(0, s^2) > t] = Q((t - 1) / s), s = sigma * sqrt(k);
        t makes k of them at most `threshold_delta`.
        """
        std = noise_multiplier * np.sqrt(self.max_tokens_per_example)
        tail = statistics.NormalDist().inv_cdf(
            1.0 - threshold_delta / self.max_tokens_per_example)
        return 1.0 + std * tail

    @staticmethod
    def state_of(layer):
        return list(layer.get_vocabulary())

    @staticmethod
    def holds_data_state(layer):
        given = layer.get_config().get("vocabulary") is not None
        return not given and len(layer.get_vocabulary(include_special_tokens=False)) > 0


_FAMILIES = (NormalizationRelease, QuantileRelease, VocabularyRelease)


def adapt(layer, data, epsilon, delta, *, value_range=None, max_tokens_per_example=None,
          grid_size=1024, seed=None, secure_mode=False):
    """Adapts a preprocessing layer to private data, differentially privately.

    The layer's statistics come from one Gaussian release calibrated with
    `dp_accounting` to `(epsilon, delta)`; the release is recorded in the
    privacy ledger of every private model that contains the layer (its
    `privacy_spent` counts it with training, composed as `dp_accounting`
    composes them), and saved with it.

    Args:
        layer: a `keras.layers.Normalization` (needs `value_range`),
            `Discretization` (with `num_bins`; needs `value_range`),
            `StringLookup`, `IntegerLookup` or `TextVectorization` (need
            `max_tokens_per_example`), or a `keras.utils.FeatureSpace`: each
            preprocessor that adapts gets one release, all of one noise
            multiplier, their composition calibrated to `(epsilon, delta)`.
        data: the examples: an array, list or tensor whose first axis is the
            example (for lookups a row holds one example's tokens; for
            TextVectorization one string per example), or a `tf.data.Dataset`
            of batches of them.
        epsilon: the epsilon of the release, > 0.
        delta: its delta, in (0, 1); a vocabulary spends half of it on the
            threshold.
        value_range: `(low, high)` of a feature's values, chosen without the
            data; values outside are clipped. A Normalization of several
            features takes one low and one high per feature too. For a
            FeatureSpace, a dict
            `{feature: (low, high)}` for its normalized and discretized
            features.
        max_tokens_per_example: the most distinct tokens one example adds to
            the vocabulary counts (more are sampled down); 1 by default for
            a FeatureSpace's categorical features.
        grid_size: resolution of `Discretization`'s private quantiles.
        seed: an integer for reproducible noise (tests); None draws from OS
            entropy.
        secure_mode: refuse a seed (noise from OS entropy only).

    Returns:
        The `Release` (also kept on the layer); for a FeatureSpace, the list
        of its preprocessors' releases.

    Raises:
        ValueError: for another layer type, missing bounds, a seed under
            `secure_mode`, or while a fit with a budget runs.

    Example:
    ```python
    vectorize = keras.layers.TextVectorization(max_tokens=20000)
    keras_dp.adapt(vectorize, texts, epsilon=1.0, delta=1e-6,
                   max_tokens_per_example=64)
    ```
    """
    if ledger.budget_in_force_anywhere():
        raise ValueError(
            "keras_dp.adapt was called while a fit with PrivacyCallback(target_epsilon=...) "
            "runs: the release would enter the ledger of the model holding the layer "
            "outside that budget's checks. Adapt the layer before fit() or after it ends.")
    rng = _noise_generator(seed, secure_mode)
    if isinstance(layer, keras.utils.FeatureSpace):
        return _adapt_feature_space(layer, data, epsilon, delta, value_range,
                                    max_tokens_per_example, grid_size, rng)
    family = _family_of(layer, value_range, max_tokens_per_example, grid_size)
    return _release([(layer, family, data)], epsilon, delta, rng)[0]


def _release(parts, epsilon, delta, rng):
    """One Gaussian release for each `(layer, family, data)` of `parts`, all
    of one noise multiplier, whose composition is calibrated to
    `(epsilon, delta)`; vocabularies' thresholds share half of delta."""
    vocabularies = [family for _, family, _ in parts if isinstance(family, VocabularyRelease)]
    gaussian_delta = delta / 2 if vocabularies else delta
    noise_multiplier = accounting.calibrate_noise_multiplier(
        epsilon, 1, 1, epochs=len(parts), delta=gaussian_delta, sampling="shuffle")
    releases = []
    for layer, family, data in parts:
        extra_delta = 0.0
        if isinstance(family, VocabularyRelease):
            family.threshold_delta = extra_delta = (delta - gaussian_delta) / len(vocabularies)
        noised = family.noised(layer, data, noise_multiplier, rng)
        try:
            family.apply(layer, noised)
        finally:
            # Drawn, the release counts even if applying it fails (no token
            # above the threshold, a reserved token Keras refuses): the
            # failure itself tells of the data, and a retry with other
            # settings is chosen by it (review round 131: 3.41 reported
            # against 5.13 for the two releases).
            release = Release(ledger.Segment(sampling_schemes.StatisticsRelease.name,
                                             noise_multiplier, 1, extra_delta=extra_delta),
                              state=family.state_of(layer), earlier=release_of(layer),
                              inputs=releases_run_by(data))
            _mark_released(layer, release)
            releases.append(release)
    return releases


def released_layers_in_maps(dataset, graphs=()):
    """The layers `keras_dp.adapt` released that the functions of
    `dataset`'s pipeline (maps, filters, scans, ...; and those of `graphs`)
    ran, once each: their calls noted on the functions' graphs, and the
    Keras layers their Python refers to."""
    found = []
    for layer in examples.adapting_layers_in_maps(dataset) + layers_called_in(
            examples.function_graphs(dataset) + list(graphs)):
        if release_of(layer) is not None and all(layer is not other for other in found):
            found.append(layer)
    return found


def releases_run_by(data):
    """The releases of the layers the maps of the pipeline `data` ran; none
    for arrays (or anything else that is not a `tf.data.Dataset`)."""
    if not isinstance(data, tf.data.Dataset):
        return []
    return [release_of(layer) for layer in released_layers_in_maps(data)]


def _mark_released(layer, release):
    """Gives `layer` its `release`, and makes its calls noted wherever they
    are traced (review round 189: a loaded released layer called through a
    Lambda in a fresh process, whose class no keras_dp.adapt had wrapped,
    brought no release: 11.69 reported against 11.99)."""
    setattr(layer, _RELEASE_ATTRIBUTE, release)
    _note_calls(layer)


def _note_calls(layer):
    """Makes every trace of a call of a released layer of `layer`'s class
    note it on the graphs being traced (`layers_called_in`): however a
    map's Python reaches the layer (a dict, an object, a default argument,
    its class's call: review rounds 132 and 136, a Normalization reached
    through a dict or called as `type(layer).call(layer, x)` was not found,
    its release unreported, 2.40 against 4.41), its graph says it ran it.
    The class's call is wrapped once, for every instance: the ones
    `keras_dp.adapt` never released note nothing."""
    layer_class = type(layer)
    if vars(layer_class).get(_NOTING_CALL_ATTRIBUTE):
        return
    plain = layer_class.call

    def call(self, *args, **kwargs):
        if release_of(self) is not None and not tf.executing_eagerly():
            graph = tf.compat.v1.get_default_graph()
            while graph is not None:
                noted = getattr(graph, _CALLS_ATTRIBUTE, [])
                if all(other is not self for other in noted):
                    setattr(graph, _CALLS_ATTRIBUTE, [*noted, self])
                graph = getattr(graph, "outer_graph", None)
        return plain(self, *args, **kwargs)

    layer_class.call = functools.wraps(plain)(call)
    setattr(layer_class, _NOTING_CALL_ATTRIBUTE, True)


def layers_called_in(graphs):
    """The layers `keras_dp.adapt` released whose calls `graphs` (or the
    functions they run) traced, once each."""
    found = []
    for graph in graphs:
        found += [layer for layer in getattr(graph, _CALLS_ATTRIBUTE, ())
                  if all(layer is not other for other in found)]
    return found


def _adapt_feature_space(space, data, epsilon, delta, value_ranges, max_tokens_per_example,
                         grid_size, rng):
    """keras_dp.adapt of each FeatureSpace preprocessor that adapts, composed."""
    columns = _columns(data)
    parts = []
    for name, layer in space.preprocessors.items():
        if isinstance(layer, _ADAPTABLE) and _adapts(layer):
            family = _family_of(layer, (value_ranges or {}).get(name),
                                max_tokens_per_example or 1, grid_size, feature=name)
            parts.append((layer, family, columns[name]))
    releases = _release(parts, epsilon, delta, rng) if parts else []
    # FeatureSpace has no public way to say its preprocessors are adapted;
    # this is what its own adapt() ends with.
    space._is_adapted = True
    space.get_encoded_features()
    return releases


def release_of(layer):
    """The `Release` keras_dp.adapt made for `layer` (None if none)."""
    return getattr(layer, _RELEASE_ATTRIBUTE, None)


def releases_of(model):
    """The `Release` of each layer of `model` that keras_dp.adapt adapted."""
    return [release_of(layer) for layer in _preprocessing_layers(model) if release_of(layer)]


def record_releases(model, privacy_ledger):
    """Adds to `privacy_ledger`, once, the release of each layer of `model`
    that `keras_dp.adapt` adapted.

    Args:
        model: a Keras model.
        privacy_ledger: the model's `keras_dp.ledger.PrivacyLedger`.
    """
    record_releases_of(releases_of(model), privacy_ledger)


def record_releases_of(releases, privacy_ledger):
    """Adds to `privacy_ledger`, once each, `releases` (`Release`s) and the
    ones they replaced: a layer's in the model, or in a map of the pipeline
    the model trains on (review round 120: keras-io's FeatureSpace adapted
    by keras_dp.adapt in a map, its epsilon of 1 unreported)."""
    for release in (earlier for latest in releases for earlier in latest.chain()):
        if release.segment is None:
            continue
        if not any(other is privacy_ledger for other in release.ledgers):
            with tf.init_scope():
                privacy_ledger.add([release.segment])
            release.ledgers.append(privacy_ledger)


def check_adapted_layers(model, secure_mode=False):
    """Warns of (under `secure_mode`, refuses) layers of `model` whose state
    came from the data outside `keras_dp.adapt`: Keras' own `adapt()`,
    which no ledger accounts.

    Args:
        model: a Keras model.
        secure_mode: the DP optimizer's `secure_mode`.

    Raises:
        ValueError: under `secure_mode`, naming the layer and the fix.
    """
    for layer in _preprocessing_layers(model):
        family = _family_of_layer(layer)
        if not family.holds_data_state(layer) or _released_as_is(layer, family):
            continue
        message = (
            f"Layer '{layer.name}' ({type(layer).__name__}) holds statistics of data "
            "from Keras' adapt(), which keras-dp does not account: they are saved with "
            "the model and can reveal single examples. Use keras_dp.adapt(layer, data, "
            "epsilon=..., delta=...), or give the layer public values (vocabulary=..., "
            "mean=..., bin_boundaries=...).")
        if secure_mode:
            raise ValueError(message + " (refused under secure_mode=True)")
        warnings.warn(message, stacklevel=3)


def save_released(store, model):
    """Writes the names of `model`'s layers whose release its ledger holds,
    each with its state as released (`Release` records do not survive
    saving otherwise) and the segments of its release: a loaded layer
    adapted again by Keras' own adapt() is then told apart (review round
    30: after a load it was taken as released, the exact mean saved under
    secure_mode), and one put in another private model brings its release
    to that model's ledger (review round 187: a loaded Discretization in a
    new model, 4.07 reported against 4.48)."""
    released = {layer.name: {
        "state": _as_saved(release.state if release.state is not None
                           else _family_of_layer(layer).state_of(layer)),
        "segments": [_segment_as_saved(r.segment) for r in release.chain()
                     if r.segment is not None]}
        for layer in _preprocessing_layers(model) if (release := release_of(layer)) is not None}
    store[RELEASED_LAYERS_KEY] = np.frombuffer(json.dumps(released).encode(), np.uint8)


def _segment_as_saved(segment):
    return {"row": list(segment.row()), "steps": segment.steps,
            "releases": segment.releases, "history": segment.history}


def _segment_as_loaded(saved):
    return ledger.Segment.from_row(saved["row"], saved["steps"], saved["releases"],
                                   saved["history"])


def _loaded_release(saved, family, privacy_ledger):
    """The `Release` of a loaded layer: its state and segments as saved
    (`save_released`), held by `privacy_ledger` (the loading model's, which
    the saved ledger was merged into). A file saved before the segments
    were holds the state alone (a list), or only the name (None)."""
    if not isinstance(saved, dict):
        saved = {"state": saved, "segments": []}
    state = None if saved["state"] is None else _as_loaded(saved["state"], family)
    segments = [_segment_as_loaded(s) for s in saved["segments"]] or [None]
    release = None
    for segment in reversed(segments):
        release = Release(segment, state, ledgers=[privacy_ledger], earlier=release)
    return release


def _as_saved(state):
    """A layer's state as JSON values: lists of numbers or tokens."""
    if isinstance(state, tuple):
        return [np.asarray(part).tolist() for part in state]
    return [value.decode() if isinstance(value, bytes) else value for value in state]


def _as_loaded(saved, family):
    """`_as_saved`'s inverse for a layer of `family`."""
    if family is NormalizationRelease:
        return tuple(np.asarray(part, np.float32) for part in saved)
    return list(saved)


def _family_of_layer(layer):
    return next(f for f in _FAMILIES if isinstance(layer, f.layer_types))


def load_released(store, model):
    """Marks the layers a saved private model had released (their spending
    is in its saved ledger).

    Returns:
        The store's other entries, as a dict.
    """
    entries = {name: store[name] for name in store.keys()}
    saved = entries.pop(RELEASED_LAYERS_KEY, None)
    if saved is not None:
        released = json.loads(np.asarray(saved, np.uint8).tobytes().decode())
        if isinstance(released, list):  # Files saved before the states were: names.
            released = dict.fromkeys(released)
        for layer in _preprocessing_layers(model):
            if layer.name in released and release_of(layer) is None:
                _mark_released(layer, _loaded_release(
                    released[layer.name], _family_of_layer(layer), model.privacy_ledger))
    return entries


def _released_as_is(layer, family):
    """Whether the layer's state is still what keras_dp.adapt released."""
    release = release_of(layer)
    if release is None:
        return False
    if release.state is None:
        return True
    return _same_state(family.state_of(layer), release.state)


def _same_state(first, second):
    if isinstance(first, tuple):
        return all(np.array_equal(a, b) for a, b in zip(first, second))
    return list(first) == list(second)


def _preprocessing_layers(model):
    kinds = tuple(t for family in _FAMILIES for t in family.layer_types)
    layers = model._flatten_layers(include_self=False)
    # A TextVectorization's own StringLookup is the TextVectorization's state.
    inner = {id(sublayer) for layer in layers if isinstance(layer, keras.layers.TextVectorization)
             for sublayer in layer._flatten_layers(include_self=False)}
    return [layer for layer in layers if isinstance(layer, kinds) and id(layer) not in inner]


def _family_of(layer, value_range, max_tokens_per_example, grid_size, feature=None):
    if isinstance(layer, _LOOKUP_LAYERS):
        if layer.get_config().get("output_mode") == "tf_idf":
            raise ValueError(
                f"keras_dp.adapt of '{layer.name}' (output_mode='tf_idf'): the inverse "
                "document frequencies are statistics of the data that keras_dp.adapt does "
                "not release (it releases the vocabulary). Use output_mode 'multi_hot', "
                "'count' or 'int', or give the layer a public vocabulary and idf_weights.")
        return VocabularyRelease(max_tokens_per_example)
    for family in (NormalizationRelease, QuantileRelease):
        if isinstance(layer, family.layer_types):
            if value_range is None:
                where = f" (feature {feature!r}: value_range={{name: (low, high)}})"
                raise ValueError(
                    f"keras_dp.adapt of a {type(layer).__name__} needs value_range=(low, "
                    "high): the range of the feature values, chosen without looking at "
                    "the private data (values outside it are clipped)"
                    f"{where if feature else ''}.")
            if family is QuantileRelease:
                return QuantileRelease(value_range, grid_size)
            return NormalizationRelease(value_range)
    raise ValueError(
        f"keras_dp.adapt does not know {type(layer).__name__}: it adapts Normalization, "
        "Discretization, StringLookup, IntegerLookup and TextVectorization. Give other "
        "layers public values, or compute their statistics privately yourself.")


def _adapts(layer):
    """Whether the layer takes its state from adapt() (not its constructor)."""
    if isinstance(layer, keras.layers.Normalization):
        return layer.input_mean is None
    if isinstance(layer, keras.layers.Discretization):
        return bool(layer.num_bins)
    return layer.get_config().get("vocabulary") is None


def _columns(data):
    """A FeatureSpace's data as {feature: array} (a dataset's examples)."""
    if isinstance(data, tf.data.Dataset):
        return {name: np.reshape(values, (len(values), -1))
                for name, values in _examples_of(data).items()}
    if not isinstance(data, dict):
        raise TypeError("keras_dp.adapt of a FeatureSpace needs its data as a dict "
                        "{feature: array} or a tf.data.Dataset of such dicts; received "
                        f"{type(data).__name__}.")
    return {name: np.asarray(values) for name, values in data.items()}


def _noise_generator(seed, secure_mode):
    if secure_mode and seed is not None:
        raise ValueError(
            "secure_mode=True draws noise from OS entropy and refuses a user "
            f"seed; received seed={seed!r}. Drop the seed or set secure_mode=False.")
    return np.random.default_rng(seed)  # Seeded from OS entropy when seed is None.


def _check_feature_ranges(value_range):
    """`(low, high)` as float64 arrays: numbers, or one of each per feature."""
    try:
        low, high = (np.asarray(bound, np.float64) for bound in value_range)
    except (TypeError, ValueError):
        low = high = np.array(np.nan)
    if (low.shape != high.shape or low.ndim > 1 or not np.isfinite([low, high]).all()
            or np.any(low >= high)):
        raise ValueError(f"value_range must be (low, high) with finite low < high, "
                         f"numbers or one per feature; received {value_range!r}.")
    return low, high


def _check_range(value_range):
    """`(low, high)` as two floats (`_check_feature_ranges` of numbers)."""
    low, high = _check_feature_ranges(value_range)
    if low.ndim:
        raise ValueError(f"value_range must be (low, high) with finite low < high; "
                         f"received {value_range!r}.")
    return float(low), float(high)


def _room(layer):
    """How many tokens the layer's vocabulary holds beyond its special ones."""
    max_tokens = layer.get_config().get("max_tokens")
    if max_tokens is None:
        return None
    special = (len(layer.get_vocabulary(include_special_tokens=True))
               - len(layer.get_vocabulary(include_special_tokens=False)))
    return max_tokens - special


def _rows(data):
    """The examples of `data` as one array, one row per example (each element
    of an unbatched dataset is one example, however many values or tokens it
    holds)."""
    return np.asarray(_examples_of(data) if isinstance(data, tf.data.Dataset) else data)


def _examples_of(dataset):
    """The examples of a (batched or unbatched) dataset, each once: a pipeline
    keras-dp cannot vouch holds each example once is refused, as poisson_dataset
    refuses it (review round 57: a repeat, a concatenation or a flat_map
    copying each example moved a released count by 2, 1 recorded: 1.0
    reported against 2.11)."""
    unbatched = dataset.unbatch() if keras_dp_data.is_batched(dataset) else dataset
    examples, _, _ = keras_dp_data.examples_of(unbatched, max_bytes=float("inf"))
    return tf.nest.map_structure(np.asarray, examples)


def _tokens_of_examples(layer, data):
    """Each example's tokens, as the layer would split them."""
    rows = _rows(data)
    rows = rows.reshape(len(rows), -1)
    if isinstance(layer, keras.layers.TextVectorization):
        return _text_tokens(layer, rows)
    if rows.dtype.kind in "SUO":
        return [[t.decode() if isinstance(t, bytes) else str(t) for t in row] for row in rows]
    return [[int(t) for t in row] for row in rows]


def _of_each_alone(function, inputs):
    """A user's `standardize` or `split` function of each example alone (a
    batch of one), joined: given every example at once it may combine them
    (review round 153: one appending the last text to every text counted
    its token in all 201 examples against a sensitivity of 1)."""
    return tf.concat([function(inputs[i:i + 1]) for i in range(int(inputs.shape[0]))], 0)


def _text_tokens(layer, rows):
    """TextVectorization's standardization, split and n-grams, as configured,
    of each example (a row of `rows`): a text, or with `split=None` its tokens.

    Raises:
        ValueError: for examples of several texts to split: each text was
            counted as an example of its own (review round 129: a token of
            one example of 30 texts counted 30 times against a
            sensitivity of 1, released every time).
    """
    config = layer.get_config()
    standardize, split, ngrams = config["standardize"], config["split"], config["ngrams"]
    if split is not None and rows.shape[1] != 1:
        raise ValueError(
            f"keras_dp.adapt of a TextVectorization that splits its texts takes one text "
            f"per example (data of shape (n,) or (n, 1)); these examples hold "
            f"{rows.shape[1]} texts each, and one example's token would count once per "
            "text. Join each example's texts into one, or give split=None tokens.")
    inputs = tf.constant(rows if split is None else rows[:, 0], tf.string)
    if standardize in ("lower", "lower_and_strip_punctuation"):
        inputs = tf.strings.lower(inputs)
    if standardize in ("strip_punctuation", "lower_and_strip_punctuation"):
        inputs = tf.strings.regex_replace(inputs, _PUNCTUATION, "")
    if callable(standardize):
        inputs = _of_each_alone(standardize, inputs)
    if split == "whitespace":
        inputs = tf.strings.split(inputs)
    elif split == "character":
        inputs = tf.strings.unicode_split(inputs, "UTF-8")
    elif callable(split):
        inputs = _of_each_alone(split, inputs)
    if ngrams is not None:
        # As Keras: an int n means the n-grams of every width 1 to n.
        widths = tuple(range(1, ngrams + 1)) if isinstance(ngrams, int) else tuple(ngrams)
        inputs = tf.strings.ngrams(inputs, ngram_width=widths, separator=" ")
    tokens = inputs.to_list() if isinstance(inputs, tf.RaggedTensor) else inputs.numpy().tolist()
    return [[t.decode() for t in row] for row in tokens]
