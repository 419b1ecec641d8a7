"""Pipelines of examples from a grammar, checked against Poisson sampling's
neighbours: one example added anywhere, in front too.

Every example carries an id. A pipeline is built on D and on D + z (z
inserted at a random position) and copied by `keras_dp.data.examples_of`,
as `poisson_dataset` copies it. Where keras-dp accepts both, the oracle
compares the copies by id, not by keras-dp's reasoning: D + z's copy must
hold each of D's examples once, with the same values, and nothing else but
z (a copy losing one of D's examples, holding one twice or changing its
values lets one example decide whether, or how, another trains).
"""

import dataclasses
import random

import numpy as np
import tensorflow as tf

import keras_dp

FEATURES = 3
Z_ID = 10_000

# Transformations of an unbatched (x, id) pipeline: some keep each example
# once whatever is added (map, filter, shuffle, ...), some keep examples by
# position or duplicate them, which keras-dp must refuse.
TRANSFORMS = ("map", "filter", "shuffle", "cache", "prefetch", "take", "skip", "shard",
              "batch_unbatch", "batch_unbatch_dropping", "padded_batch_unbatch", "enumerate",
              "concatenate_filtered", "repeat", "zip_columns", "zip_shifted")


@dataclasses.dataclass(frozen=True)
class PipelineCase:
    """One pipeline of `n` examples through `transforms`, z added at `position`."""
    seed: int
    n: int
    transforms: tuple
    position: int


@dataclasses.dataclass(frozen=True)
class Copy:
    """What `examples_of` gave for a pipeline: rows by id, or its refusal."""
    rows: dict
    repeated: tuple
    refusal: str = ""


def generate(seed):
    rng = random.Random(seed)
    n = rng.randrange(6, 30)
    transforms = tuple(f"{rng.choice(TRANSFORMS)}:{rng.randrange(1, n)}"
                       for _ in range(rng.randrange(1, 4)))
    return PipelineCase(seed, n, transforms, rng.randrange(n + 1))


def features_of(ids):
    """Each example's features, a function of its id alone."""
    ids = np.asarray(ids, "float32")[:, None]
    return np.sin(ids * np.arange(1, FEATURES + 1, dtype="float32") + 0.5)


def transform(dataset, name):
    kind, _, arg = name.partition(":")
    value = int(arg)
    if kind == "map":
        return dataset.map(lambda x, i: (tf.tanh(x) * 2.0, i))
    if kind == "filter":
        return dataset.filter(lambda x, i: x[value % FEATURES] > -0.3)
    if kind == "shuffle":
        return dataset.shuffle(8, seed=value)
    if kind == "cache":
        return dataset.cache()
    if kind == "prefetch":
        return dataset.prefetch(value)
    if kind == "take":
        return dataset.take(value)
    if kind == "skip":
        return dataset.skip(value)
    if kind == "shard":
        return dataset.shard(2, value % 2)
    if kind in ("batch_unbatch", "batch_unbatch_dropping"):
        return dataset.batch(value % 4 + 2, drop_remainder=kind.endswith("dropping")).unbatch()
    if kind == "padded_batch_unbatch":
        return dataset.padded_batch(value % 4 + 2, padded_shapes=([FEATURES], [])).unbatch()
    if kind == "enumerate":  # The position as a feature.
        return dataset.enumerate().map(lambda k, e: (e[0] + tf.cast(k, tf.float32), e[1]))
    if kind == "concatenate_filtered":  # Oversampling: some examples twice.
        return dataset.concatenate(dataset.filter(lambda x, i: x[0] > 0.0))
    if kind == "repeat":
        return dataset.repeat(2)
    if kind == "zip_columns":  # Columns of the same examples, joined again.
        return tf.data.Dataset.zip(dataset.map(lambda features, _: features),
                                   dataset.map(lambda _, example: example))
    if kind == "zip_shifted":  # Each element joins two examples.
        return tf.data.Dataset.zip(dataset, dataset.skip(1)).map(
            lambda a, b: (a[0] + b[0], a[1]))
    raise ValueError(f"unknown transformation {name!r}")


def pipeline(ids, transforms):
    dataset = tf.data.Dataset.from_tensor_slices((features_of(ids), np.asarray(ids, "int64")))
    for name in transforms:
        dataset = transform(dataset, name)
    return dataset


def copy(dataset, read=keras_dp.data.examples_of):
    """The rows `read` copies from `dataset`, by id (keras-dp's copy by default)."""
    try:
        x, ids, _ = read(dataset)
    except ValueError as error:
        return Copy({}, (), str(error).split(".")[0])
    rows, repeated = {}, []
    for row, example in zip(np.asarray(x), np.asarray(ids).tolist()):
        if example in rows:
            repeated.append(example)
        rows[example] = row
    return Copy(rows, tuple(repeated))


def compare(d, d_plus_z):
    """What D + z's copy holds that Poisson sampling's neighbours forbid."""
    if d.refusal or d_plus_z.refusal:
        return []
    findings = [f"example {i} copied more than once" for i in d_plus_z.repeated]
    lost = sorted(set(d.rows) - set(d_plus_z.rows))
    if lost:
        findings.append(f"adding z dropped examples {lost}")
    gained = sorted(set(d_plus_z.rows) - set(d.rows) - {Z_ID})
    if gained:
        findings.append(f"adding z brought in examples {gained}")
    changed = sorted(i for i in set(d.rows) & set(d_plus_z.rows)
                     if not np.array_equal(d.rows[i], d_plus_z.rows[i]))
    if changed:
        findings.append(f"adding z changed the values of examples {changed}")
    return findings


def check(case, read=keras_dp.data.examples_of):
    """The oracle's findings for `case` (empty when keras-dp refuses it)."""
    ids = list(range(case.n))
    with_z = ids[:case.position] + [Z_ID] + ids[case.position:]
    return compare(copy(pipeline(ids, case.transforms), read),
                   copy(pipeline(with_z, case.transforms), read))


def unchecked_copy(dataset):
    """Every element of `dataset`, stacked, as a pipeline without keras-dp's
    checks would be copied: the oracle's own test reads this."""
    elements = list(dataset.as_numpy_iterator())
    if not elements:
        raise ValueError("no example.")
    return np.stack([x for x, _ in elements]), np.array([i for _, i in elements]), None
