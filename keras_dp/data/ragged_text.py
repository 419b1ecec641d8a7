"""Text in a map of batches: the ragged tokens of a split, followed to their rows.

Splitting a batch of strings (TextVectorization, `tf.strings.split`,
`tf.strings.unicode_decode`) makes one flat tensor of all the batch's tokens
and a row partition: token k is example r[k]'s, r the partition's row ids.
An op that moves tokens along the flat tensor (a roll, a sort, a gather,
one token added to every other) gives a row another example's words (review
round 13: 11 C), so the tokens and the partition are followed apart, each
with a `Ragged` tag of its split:

* the tokens stay the split's through ops on each token alone (element-wise
  ops with scalars, string ops, a lookup in a table), and through no other;
* the partition is the split's own row ids, number of rows, and the row
  splits computed from them as TensorFlow does (a bincount of the row ids
  over the rows, its cumulative sum, a leading 0), each step checked;
* rows of the batch are made again only by an op known to put each token
  into its row (RaggedTensorToTensor to a fixed width, RaggedBincount of a
  fixed size, UnicodeEncode, a ragged output of the map), and only when its
  tokens and its partition come from one and the same split; StringNGrams
  makes a new split of each row's tokens.

Each split made gets a mark of its own, so that two splits (two calls of one
function included) never pass for one. Nothing is taken on trust: a `Ragged`
tag is `Mixed` to every op without a rule here (`keras_dp.clipping.
independence`), so a split's tokens reach an output only through these rules.
"""

import dataclasses
import enum

from keras_dp.clipping import rowops
from keras_dp.clipping import rowtags
from keras_dp.clipping.rowtags import FREE
from keras_dp.clipping.rowtags import Mixed
from keras_dp.clipping.rowtags import Rows


class Part(enum.Enum):
    """What a tensor is of one split of the batch's strings (the value says
    why it is not a row per example)."""
    TOKENS = "makes one flat tensor of the tokens of all the batch's strings"
    COORDINATES = "gives the row and position of every token of the batch"
    SHAPE = "gives the number of rows and the longest row of the batch"
    ROW_IDS = "gives the row of every token of the batch"
    ROWS = "gives the number of rows of a split"
    ROW_LENGTHS = "counts the tokens of each row of a split"
    ROW_ENDS = "gives where each row of a split ends among all the batch's tokens"
    ROW_SPLITS = "gives where each row of a split starts among all the batch's tokens"
    BATCH = "gives the ragged rows of a split as one value"


@dataclasses.dataclass(frozen=True)
class Ragged(Mixed):
    """A tensor that is `part` of the split marked `split` (made by the op
    `op_name`): row-wise only through this module's rules."""
    part: Part = None
    split: object = None


@dataclasses.dataclass(frozen=True)
class AtLeast(Mixed):
    """A scalar computed from the whole batch, but never below `bound` (an
    int, or the ROWS tag of a split): the size TensorFlow's bincount takes,
    `min(maxlength, max(minlength, max(values) + 1))`."""
    bound: object = None


def _of(tag, part):
    """The mark of the split `tag` is `part` of, or None."""
    return tag.split if isinstance(tag, Ragged) and tag.part is part else None


def _as(tag, part):
    return dataclasses.replace(tag, part=part, why=part.value)


def _new_split(op, part):
    return Ragged(op.name, op.type, part.value, part=part, split=object())


def _split_strings(op, tags):
    """StringSplitV2(input, sep): the coordinates, tokens and dense shape of
    a new split of the batch's strings (one per row)."""
    if all(tag is FREE for tag in tags):
        return FREE
    if tags[0] != Rows(0) or tags[1] is not FREE or op.inputs[0].shape.rank != 1:
        return rowtags.mixed(op, "splits strings that are not one per example")
    tokens = _new_split(op, Part.TOKENS)
    return [_as(tokens, Part.COORDINATES), tokens, _as(tokens, Part.SHAPE)]


def _decode(op, tags):
    """UnicodeDecode(WithOffsets)(input): the row splits and the characters
    (and their offsets) of a new split of the batch's strings."""
    if tags[0] is FREE:
        return FREE
    if tags[0] != Rows(0) or op.inputs[0].shape.rank != 1:
        return rowtags.mixed(op, "splits strings that are not one per example")
    characters = _new_split(op, Part.TOKENS)
    return [_as(characters, Part.ROW_SPLITS)] + [characters] * (len(op.outputs) - 1)


def _ngrams(op, tags):
    """StringNGrams(data, data_splits): each row's n-grams, a new split."""
    split = _of(tags[0], Part.TOKENS)
    if split is None or _of(tags[1], Part.ROW_SPLITS) is not split:
        return None
    ngrams = _new_split(op, Part.TOKENS)
    return [ngrams, _as(ngrams, Part.ROW_SPLITS)]


def _token_wise(op, tags):
    """An element-wise op on the tokens of one split and on scalars fixed
    before the step: each output token is its input token's."""
    ragged = [tag for tag in tags if isinstance(tag, Ragged)]
    if not ragged or any(_of(tag, Part.TOKENS) is not ragged[0].split for tag in ragged):
        return None
    fixed = [(t, tag) for t, tag in zip(op.inputs, tags) if not isinstance(tag, Ragged)]
    if any(tag is not FREE or t.shape.rank != 0 for t, tag in fixed) or _rank(op) != 1:
        return None
    return ragged[0]


def _rank(op):
    return op.outputs[0].shape.rank


def _elementwise_string(op, tags):
    """An element-wise string op (lower, regex replace, hash): its output is
    where its first input is; the others (a pattern) must hold no example."""
    if any(tag is not FREE for tag in tags[1:]):
        return rowtags.mixed(op, "takes a pattern computed from the batch")
    return tags[0]


def _lookup(op, tags):
    """LookupTableFindV2(table, keys, default) of a split's tokens, with one
    default for all (a default per token would give each token its position's)."""
    if _of(tags[1], Part.TOKENS) is None or tags[2] is not FREE:
        return None
    if rowops.default_by_position(op, 0):
        return rowtags.mixed(op, "gives each token a default that depends on its position")
    return tags[1]


def _picked(op):
    """k when the StridedSlice `op` is x[..., k] (whole along the axes
    before the last), else None."""
    begin, end, strides = (rowtags.ints(t) for t in op.inputs[1:4])
    rank = op.inputs[0].shape.rank
    if None in (begin, end, strides, rank) or len(begin) != rank or set(strides) != {1}:
        return None
    whole = (1 << (rank - 1)) - 1
    if (op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")
            or op.get_attr("shrink_axis_mask") != 1 << (rank - 1)
            or op.get_attr("begin_mask") != whole or op.get_attr("end_mask") != whole
            or begin[-1] < 0 or end[-1] != begin[-1] + 1):
        return None
    return begin[-1]


_PICKS = {Part.COORDINATES: Part.ROW_IDS, Part.SHAPE: Part.ROWS}


def _slice(op, tags):
    """coordinates[:, 0], the row ids; dense_shape[0], the number of rows."""
    tag = tags[0]
    if (isinstance(tag, Ragged) and tag.part in _PICKS and all(t is FREE for t in tags[1:])
            and _picked(op) == 0):
        return _as(tag, _PICKS[tag.part])
    return None


def _cast(op, tags):
    """A cast of tokens, or of a partition to an integer type holding its
    values (review round 15: row ids cast to uint8 wrapped at 256 rows and
    gave rows other examples' tokens, 120 C)."""
    tag = tags[0]
    if not isinstance(tag, Ragged):
        return None
    return tag if tag.part is Part.TOKENS or rowtags.keeps_counts(op) else None


def _reshape(op, tags):
    """A vector reshaped to a vector: itself."""
    if (isinstance(tags[0], Ragged) and tags[1] is FREE and op.inputs[0].shape.rank == 1
            and op.outputs[0].shape.rank == 1):
        return tags[0]
    return None


def _bound(tensor, tag):
    """The lower bound `tensor` is: its int value, or the ROWS tag of a split."""
    if _of(tag, Part.ROWS) is not None:
        return tag
    # Integer constants alone (review round 15: int() truncated 5.9 and 5.1,
    # and a clip of the batch's longest string to [5.1, 5.9] passed as 5).
    known = tag is FREE and tensor.shape.rank == 0 and tensor.dtype.is_integer
    value = rowtags.ints(tensor) if known else None
    return value[0] if value else None


def _not_above(low, bound):
    if isinstance(low, int) and isinstance(bound, int):
        return low <= bound
    return isinstance(low, Ragged) and isinstance(bound, Ragged) and low.split is bound.split


def _maximum(op, tags):
    """Maximum(bound, anything): at least the bound."""
    found = _token_wise(op, tags)
    if found is not None:
        return found
    for i in (0, 1):
        bound = _bound(op.inputs[i], tags[i])
        if bound is not None and isinstance(tags[1 - i], Mixed) and _rank(op) == 0:
            return AtLeast(op.name, op.type, "is a size computed from the whole batch",
                           bound=bound)
    return None


def _minimum(op, tags):
    """Minimum(a, Maximum(b, anything)) with a <= b: a."""
    found = _token_wise(op, tags)
    if found is not None:
        return found
    for i in (0, 1):
        low, other = _bound(op.inputs[i], tags[i]), tags[1 - i]
        if (low is not None and isinstance(other, AtLeast) and _not_above(low, other.bound)
                and _rank(op) == 0):
            return tags[i]
    return None


def _row_lengths(op, tags):
    """DenseBincount(row ids, rows, no weights) of a split: each row's
    length; of a matrix of rows, each row's counts."""
    ids, size, weights = tags
    split = _of(ids, Part.ROW_IDS)
    if split is not None:
        if (_of(size, Part.ROWS) is split and _no_weights(op.inputs[2], weights)
                and not op.get_attr("binary_output") and op.inputs[0].shape.rank == 1):
            return _as(ids, Part.ROW_LENGTHS)
        return rowtags.mixed(op, "counts row ids over a size not the split's rows")
    if ids == Rows(0) and op.inputs[0].shape.rank == 2 and weights in (FREE, Rows(0)):
        # Per row of a matrix, as wide as a size fixed before the step (review
        # round 15: a width of the batch's largest id moved every row, ? C),
        # weighted by the row's own weights or by ones the same for every row
        # (review round 61: constant weights of alternating signs by row gave
        # every example after an added one the other sign, 7 C).
        if weights is FREE and rowops.by_position(op.inputs[2], 0):
            return rowtags.mixed(op, "gives each example a value that depends on its "
                                     "position in the batch")
        return Rows(0) if size is FREE else rowtags.mixed(op, _WIDTH_OF_THE_BATCH)
    return None


_WIDTH_OF_THE_BATCH = "counts into a width computed from the batch"


def _no_weights(tensor, tag):
    return tag is FREE and tensor.shape.rank == 1 and tensor.shape[0] == 0


def _row_ends(op, tags):
    """Cumsum(row lengths, 0): where each row of a split ends."""
    axis = rowtags.ints(op.inputs[1])
    if (_of(tags[0], Part.ROW_LENGTHS) is not None and axis == (0,)
            and not op.get_attr("exclusive") and not op.get_attr("reverse")):
        return _as(tags[0], Part.ROW_ENDS)
    return None


def _row_splits(op, tags):
    """ConcatV2([0], row ends, 0): a split's row splits."""
    if (len(tags) == 3 and _of(tags[1], Part.ROW_ENDS) is not None
            and rowtags.ints(op.inputs[0]) == (0,) and rowtags.ints(op.inputs[2]) == (0,)):
        return _as(tags[1], Part.ROW_SPLITS)
    return None


def _rows_again(op, tokens, partition):
    """Rows of the batch from `tokens` and `partition` ((part, tag) pairs):
    only when both are one split's."""
    split = _of(tokens, Part.TOKENS)
    if split is not None and all(_of(tag, part) is split for part, tag in partition):
        return Rows(0)
    if tokens is FREE and all(tag is FREE for _, tag in partition):
        return FREE
    tags = [tokens] + [tag for _, tag in partition]
    cause = next((tag for tag in tags if type(tag) is Mixed), None)
    return cause or rowtags.mixed(
        op, "puts tokens into rows by a partition that is not their split's own")


_PARTITIONS = {(b"FIRST_DIM_SIZE", b"VALUE_ROWIDS"): (Part.ROWS, Part.ROW_IDS),
               (b"ROW_SPLITS",): (Part.ROW_SPLITS,)}


def _padded_rows(op, tags):
    """RaggedTensorToTensor(shape, values, default, partitions): each row
    its example's tokens, padded to a length that must not depend on the
    batch (a row padded to the batch's longest moves what an unmasked model
    computes from it)."""
    if tags[0] is not FREE or None in op.outputs[0].shape[1:]:
        return rowtags.mixed(op, "pads each row to a length computed from the batch "
                                 "(set TextVectorization's output_sequence_length)")
    parts = _PARTITIONS.get(tuple(op.get_attr("row_partition_types")))
    if parts is None or tags[2] is not FREE:
        return rowtags.mixed(op, "pads a nested ragged tensor or pads with a value of the batch")
    return _rows_again(op, tags[1], list(zip(parts, tags[3:])))


def _counted_rows(op, tags):
    """RaggedBincount(splits, values, size, weights): each row's counts of
    its own tokens, as wide as a size fixed before the step."""
    splits, values, size, weights = tags
    if all(tag is FREE for tag in tags):
        return FREE
    if size is not FREE:
        return rowtags.mixed(op, _WIDTH_OF_THE_BATCH)
    split = _of(values, Part.TOKENS)
    if not (_no_weights(op.inputs[3], weights)
            or split is not None and _of(weights, Part.TOKENS) is split):
        # Review round 15: constant tokens weighted by a batch total made
        # that total a "count" of every row (? C).
        return rowtags.mixed(op, "weighs tokens with values not theirs")
    return _rows_again(op, values, [(Part.ROW_SPLITS, splits)])


def _encoded_rows(op, tags):
    """UnicodeEncode(characters, row splits): one string per row."""
    return _rows_again(op, tags[0], [(Part.ROW_SPLITS, tags[1])])


def _ragged_output(op, tags):
    """RaggedTensorToVariant(splits, values): the ragged rows of a split."""
    if op.get_attr("RAGGED_RANK") != 1:
        return None
    rows = _rows_again(op, tags[1], [(Part.ROW_SPLITS, tags[0])])
    if rows != Rows(0) or op.get_attr("batched_input"):
        return rows
    return _as(tags[1], Part.BATCH)


def is_ragged_batch(tag):
    """Whether `tag` is a ragged tensor whose row i is example i's (a map's output)."""
    return _of(tag, Part.BATCH) is not None


_ELEMENTWISE_STRING_OPS = frozenset({
    "StringLower", "StringUpper", "StaticRegexReplace", "RegexReplace", "StringStrip",
    "StringLength", "StaticRegexFullMatch", "RegexFullMatch", "StringToHashBucketFast",
    "StringToHashBucketStrong", "UnicodeTranscode"})

# Rules read before the allowlist's (`independence.Tags(more_rules=...)`); one
# that returns None leaves the op to the allowlist, where a `Ragged` input
# makes it mixed.
RULES = {
    **{name: _token_wise for name in rowops.ELEMENTWISE},
    **{name: _elementwise_string for name in _ELEMENTWISE_STRING_OPS},
    "Maximum": _maximum, "Minimum": _minimum, "Cast": _cast, "Reshape": _reshape,
    "StridedSlice": _slice, "LookupTableFindV2": _lookup, "StringSplitV2": _split_strings,
    "UnicodeDecode": _decode, "UnicodeDecodeWithOffsets": _decode, "StringNGrams": _ngrams,
    "DenseBincount": _row_lengths, "Cumsum": _row_ends, "ConcatV2": _row_splits,
    "RaggedTensorToTensor": _padded_rows, "RaggedBincount": _counted_rows,
    "UnicodeEncode": _encoded_rows, "RaggedTensorToVariant": _ragged_output,
}
