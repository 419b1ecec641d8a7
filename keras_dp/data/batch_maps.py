"""Maps after `poisson_dataset`: kept only where each row stays its example's.

A map of a Poisson dataset is the user's function of each whole batch. The
batch keeps its Poisson accounting (one example moves the clipped sum by at
most C) only if the function keeps the examples apart:

* row i of every output depends on row i of the batch alone (and on values
  that depend on no example), with the batch on axis 0;
* the sample weights pass through unchanged (padding rows keep weight 0:
  with any other weight, a padding row, a copy of a real row, would count
  its example twice);
* nothing of the batch is left in state a later batch could read (a
  variable written from the batch, a Python function).

keras-dp reads the map's traced function with the allowlist of
`keras_dp.clipping.independence`: nothing is run, and an op it does not know
refuses the map. Per-example maps belong before sampling
(`poisson_dataset(dataset.map(f), ...)`), where any function is allowed.
"""

import re

import tensorflow as tf

from keras_dp.clipping import independence
from keras_dp.clipping import rowstate
from keras_dp.clipping import rowtags
from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Mixed
from keras_dp.clipping.rowtags import Rows

# Stateful ops that keep nothing of the batch: checks that stop the
# pipeline (a lookup's error for an unknown value).
_KNOWN_EFFECTS = frozenset(["Assert", "NoOp"])
_FIX = ("Apply per-example maps before sampling: keras_dp.data.poisson_dataset("
        "dataset.map(f), expected_batch_size=...), where any function is allowed.")


def check_batch_map(dataset):
    """Refuses a map of Poisson batches that may not keep its examples apart.

    Args:
        dataset: a `tf.data.Dataset.map` of batches of (x, y, sample_weight),
            each leaf with the batch on axis 0.

    Raises:
        ValueError: naming the op that may combine rows, keep state or change
            the sample weights, and the fix.
    """
    problem = rows_problem(dataset) or _weights_problem(dataset)
    if problem:
        raise ValueError(f"A map after keras_dp.data.poisson_dataset {problem}, so its "
                         f"batches may no longer be Poisson samples. {_FIX}")


def rows_problem(dataset, trust_unknown_ops=False):
    """Why a map of batches may not give back row i from row i alone (one
    row per row, nothing kept for a later batch), in words; None if it does.

    Args:
        dataset: a `tf.data.Dataset.map` whose elements are batches.
        trust_unknown_ops: whether an op of text vectorization outside the
            allowlist (`TEXT_OPS`, and what follows it) is taken to keep
            rows apart (docs/security.md states this for a map of batches
            keras-dp did not sample and a map between a batch and its
            unbatch); any other unknown op is a problem either way.
    """
    graph = dataset._map_func.function.graph
    tags = independence.Tags(graph, [(t, Rows(0)) for t in _arguments(graph)], top=True,
                             trusted=_TEXT_RULES if trust_unknown_ops else None,
                             passes_on=_within_the_splitting_layer if trust_unknown_ops else None)
    return (_unknown_effect(graph) or _state_written(graph, tags)
            or _outputs_problem(graph, tags, trust_unknown_ops))


def _arguments(graph):
    """The map function's inputs that are its arguments (its captures follow them)."""
    return graph.inputs[:len(graph.inputs) - len(graph.captures)]


def _unknown_effect(graph, depth=0):
    """The first op with effects beyond its outputs (in `graph` or a function
    it calls) that keras-dp does not know, as words. Ops that lead to the
    outputs are read by their rules, ops taking a variable by
    `_state_written`; a stateless op that leads nowhere does nothing."""
    for op in graph.get_operations():
        if op.type in rowstate.CALLS or op.type in rowstate.LOOPS or op.type in rowstate.BRANCHES:
            inner = rowstate.function_graphs(op)
            if inner is None or depth > 8:
                return f"calls a function keras-dp cannot read ({op.name})"
            found = next(filter(None, (_unknown_effect(g, depth + 1) for g, _ in inner)), None)
            if found:
                return found
        elif (op.op_def.is_stateful and op.type not in _KNOWN_EFFECTS
              and not independence.has_rule(op.type)
              and not any(t.dtype == tf.resource for t in op.inputs)):
            return f"runs {op.type} ({op.name}), which keras-dp does not know to keep rows apart"
    return None


def _state_written(graph, tags):
    """Why an op of `graph` may leave values of the batch in a variable (or a
    table) a later batch reads, or None."""
    for handle in graph.inputs:
        if handle.dtype != tf.resource:
            continue
        for alias in rowstate.aliases(handle):
            for op in alias.consumers():
                if op.type in ("Identity", "IdentityN", "Snapshot") or not rowstate.may_write(
                        op, alias):
                    continue
                if any(tags.tag(t) is not FREE for t in op.inputs if t.dtype != tf.resource):
                    return f"writes values of the batch into a variable ({op.name})"
    return None


# The ops outside the allowlist that text vectorization (TextVectorization,
# StringLookup, tf.strings) runs on a batch of strings, taken on trust where
# `rows_problem` is told to (review round 11: trusting every unknown op let
# Keras' MixUp and a sparse matmul copying a row through, 2 to 4 C):
# element-wise ones keep each string's row; the splitting ones make flat
# tensors of all the batch's tokens, trusted to become rows again only
# through the padding and counting ones, after which every op is read
# again (review round 12: a row copied over the batch after vectorizing hid
# behind the trust, 8 C).
_ELEMENTWISE_TEXT_OPS = frozenset({
    "StringLower", "StringUpper", "StaticRegexReplace", "RegexReplace", "StringStrip",
    "StringLength", "StaticRegexFullMatch", "RegexFullMatch", "StringToHashBucketFast",
    "StringToHashBucketStrong", "UnicodeTranscode"})
_SPLITTING_TEXT_OPS = frozenset({"StringSplitV2", "StringNGrams", "UnicodeDecodeWithOffsets",
                                 "UnicodeEncode"})
_ROWS_OF_TEXT_OPS = frozenset({"RaggedTensorToTensor", "RaggedBincount", "DenseBincount"})
TEXT_OPS = _ELEMENTWISE_TEXT_OPS | _SPLITTING_TEXT_OPS | _ROWS_OF_TEXT_OPS


def _string_of_its_row(op, tags):
    """An element-wise string op: its output is where its first input is; its
    other inputs (a pattern, a rewrite) must hold no example."""
    if any(tag is not FREE for tag in tags[1:]):
        return rowtags.mixed(op, "takes a pattern computed from the batch")
    return tags[0]


def _from_split_text(tags):
    """Of the tags of what an op reads: the first Mixed one that splitting
    text did not make (kept), else the split's (flat tokens), else None."""
    causes = [tag for tag in tags if isinstance(tag, rowtags.Mixed)]
    return next((tag for tag in causes if tag.op_type not in _SPLITTING_TEXT_OPS),
                causes[0] if causes else None)


def _rows_again(op, tags):
    """A row per example again, made from the split tokens `tags` hold:
    trusted only when splitting text alone mixed them."""
    found = _from_split_text(tags)
    if found is None:
        return FREE if all(tag is FREE for tag in tags) else rowtags.mixed(
            op, independence.UNKNOWN_OP)
    return Rows(0) if found.op_type in _SPLITTING_TEXT_OPS else found


def _padded_rows(op, tags):
    """RaggedTensorToTensor(shape, values, default, partitions): each row its
    example's tokens, padded to a length that must not depend on the batch
    (a row padded to the batch's longest moves what an unmasked model
    computes from it)."""
    if tags[0] is not FREE or None in op.outputs[0].shape[1:]:
        return rowtags.mixed(op, "pads each row to a length computed from the batch "
                                 "(set TextVectorization's output_sequence_length)")
    return _rows_again(op, tags[1:])


def _counted_rows(op, tags):
    """RaggedBincount(splits, values, size, weights): each row's counts of its
    own tokens; `size` (the width) may come from the batch."""
    return _rows_again(op, [tags[0], tags[1], tags[3]])


def _counts(op, tags):
    """DenseBincount(input, size, weights): per row for a matrix of rows (the
    width, `size`, may come from the batch); of the split tokens inside a
    ragged tensor, still the split's; over the whole batch otherwise."""
    found = _from_split_text([tags[0], tags[2]])
    if found is not None:
        return found
    if tags[0] == Rows(0) and op.inputs[0].shape.rank == 2 and tags[2] in (FREE, Rows(0)):
        return Rows(0)
    return rowtags.mixed(op, "counts values over the whole batch")


def _within_the_splitting_layer(op, tag):
    """Whether `op` may pass on `tag`: the split tokens of a batch only within
    the name scope of the TextVectorization call that split them (which
    makes rows of them again), by Keras' naming: a **statement**, not a
    verified fact; anything else on those tokens works on the whole batch
    (review round 13: a roll, a sort, `unique` or a first token copied to
    every row, up to 11 C)."""
    if tag.op_type not in _SPLITTING_TEXT_OPS:
        return True
    if tag.op_name.count("/") < 2:
        return False
    layer_scope = tag.op_name.rsplit("/", 2)[0]
    return (_TEXT_LAYER_SCOPE.fullmatch(layer_scope.rsplit("/", 1)[-1]) is not None
            and op.name.startswith(layer_scope + "/"))


# The name scope of a TextVectorization layer's call, as Keras names it (the
# layer's default name, numbered). A name of the user's own (a custom
# vectorizer's scope or layer) is not taken for one (review round 14: tokens
# copied across rows inside `tf.name_scope("my_vectorizer")`, 7 C).
_TEXT_LAYER_SCOPE = re.compile(r"text_vectorization(_\d+)*")


_TEXT_RULES = {**{name: _string_of_its_row for name in _ELEMENTWISE_TEXT_OPS},
               "RaggedTensorToTensor": _padded_rows, "RaggedBincount": _counted_rows,
               "DenseBincount": _counts}


def _outputs_problem(graph, tags, trust_unknown_ops=False):
    """Why the outputs may not be the batch's rows, or None."""
    for output in graph.outputs:
        tag = tags.tag(output)
        if (trust_unknown_ops and isinstance(tag, Mixed) and tag.why == independence.UNKNOWN_OP
                and tag.op_type in _SPLITTING_TEXT_OPS):
            continue  # Ragged tokens of the batch's strings, as returned.
        if isinstance(tag, Mixed):
            return f"runs {tag.op_type} ({tag.op_name}), which {tag.why}"
        if tag != Rows(0):
            return f"gives an output ({output.name}) whose axis 0 is not the batch's rows"
    return None


def _weights_problem(dataset):
    """Why the sample weights may not pass through the map unchanged, or None."""
    graph = dataset._map_func.function.graph
    weights_in = _weights(_arguments(graph), dataset._input_dataset.element_spec)
    weights_out = _weights(graph.outputs, dataset.element_spec)
    if (weights_in is None or weights_out is None or len(weights_in) != len(weights_out)
            or any(_source(out) is not arg for out, arg in zip(weights_out, weights_in))):
        return "changes the sample weights (its padding rows have weight 0)"
    return None


def _weights(tensors, spec):
    """The last of `tensors`, those of the sample weights of (x, y, sample_weight)."""
    if not (isinstance(spec, tuple) and len(spec) == 3):
        return None
    count = len(tf.nest.flatten(spec[2]))
    return list(tensors[len(tensors) - count:])


def _source(tensor):
    """`tensor` before the identities that pass it on."""
    while tensor.op.type in ("Identity", "Snapshot"):
        tensor = tensor.op.inputs[0]
    return tensor
