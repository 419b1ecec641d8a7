"""The examples keras-dp samples from: arrays, or an unbatched tf.data
pipeline copied once, and the checks of both."""


import inspect
import warnings

import keras
import tensorflow as tf

from keras_dp.clipping import rowstate
from keras_dp.data import batch_maps
from keras_dp.data.info import sampling_info_of


# The most bytes of examples `poisson_dataset` copies out of a tf.data.Dataset.
DEFAULT_MAX_DATASET_BYTES = 2 * 1024**3


# Examples read from a tf.data.Dataset at a time while copying it.
_COPY_CHUNK = 1024


def examples_of(dataset, max_bytes=DEFAULT_MAX_DATASET_BYTES):
    """The examples of an unbatched, finite `tf.data.Dataset`, as tensors.

    Runs the pipeline once (every map included) and stacks its elements.

    Args:
        dataset: a `tf.data.Dataset` whose elements are single examples:
            `(x, y)`, `(x, y, sample_weight)` or `x` (a tensor or a dict).
        max_bytes: the most bytes of examples to copy.

    Returns:
        `(x, y, sample_weight)`: tensors (or structures of them) whose first
        dimension is the number of examples; y and sample_weight may be None.

    Raises:
        ValueError: for a batched, repeating or infinite dataset, one
            larger than `max_bytes`, or examples of different shapes.

    Example:
    ```python
    x, y, _ = keras_dp.data.examples_of(
        tf.data.Dataset.from_tensor_slices((images, labels)).map(preprocess))
    ```
    """
    _check_examples_dataset(dataset)
    warn_of_vocabularies_in_maps(dataset)
    try:
        chunks = _copied_chunks(dataset, max_bytes)
        stacked = tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *chunks)
    except tf.errors.InvalidArgumentError as error:
        raise ValueError(
            "The examples of this tf.data.Dataset differ in shape, so they cannot be "
            "stacked into one batch of examples to sample from. Give them one shape "
            "in the pipeline (image_size=..., TextVectorization(output_sequence_length="
            "...), padding).") from error
    if isinstance(stacked, tuple) and len(stacked) in (2, 3):
        return (*stacked, None) if len(stacked) == 2 else stacked
    return stacked, None, None


def _copied_chunks(dataset, max_bytes):
    """The dataset's examples in chunks of `_COPY_CHUNK`, at most `max_bytes`."""
    chunks, size = [], 0
    for chunk in dataset.batch(_COPY_CHUNK):
        size += sum(_nbytes(leaf) for leaf in tf.nest.flatten(chunk))
        if size > max_bytes:
            raise ValueError(
                f"This tf.data.Dataset holds more than max_dataset_bytes={max_bytes} bytes "
                "of examples, which poisson_dataset copies into memory to sample them. "
                "Pass poisson_dataset(..., max_dataset_bytes=...) a larger limit if "
                "memory allows, or shrink the examples in the pipeline (smaller images, "
                "uint8 pixels rescaled in the model).")
        chunks.append(chunk)
    if not chunks:
        raise ValueError("This tf.data.Dataset holds no example: poisson_dataset needs at "
                         "least one.")
    return chunks


def _check_examples_dataset(dataset):
    """Refuses a pipeline whose elements are not each one example, once."""
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "This tf.data.Dataset is infinite (it repeats), so its examples cannot be "
            "counted: the sampling rate q = B / N needs N. Drop .repeat(): each "
            "pass of keras-dp's batches draws anew.")
    # Before the repeats: keras.utils.timeseries_dataset_from_array zips its
    # windows with a repeated copy of the series, and its message is the zip's.
    unvouched = _unvouched_transformations(dataset, examples_added=True)
    if unvouched:
        raise ValueError(
            f"This tf.data.Dataset is built with {', '.join(unvouched)}, which keras-dp "
            "cannot vouch keeps each example at most once (concatenate, interleave, "
            "flat_map or sample_from_datasets can duplicate an example, and each copy "
            "would move the sum by C). Build it "
            "from one source with per-example transformations (map, filter, shuffle, "
            "cache, prefetch, and zip of inputs that keep their sources' order: no "
            "filter or shuffle before a zip); weight a class "
            "with sample weights instead of oversampling it.")
    if _repeats_elements(dataset):
        raise ValueError(
            "This tf.data.Dataset repeats its examples (or its graph cannot be read to "
            "tell), so one person could be several examples of the sampled set, each "
            "moving the sum by C. Drop .repeat() (each pass of keras-dp's batches "
            "draws anew), or pass the examples as arrays.")
    unbatched = _map_undoing_rows(dataset)
    if unbatched:
        raise ValueError(
            f"This tf.data.Dataset, between a batch and its unbatch, {unbatched}: an "
            "example may come out of the unbatch more than once, or mixed with "
            "others. Drop the batch and the unbatch and map each single example "
            "(a FeatureSpace or TextVectorization runs on single examples too).")
    kept = _state_kept(dataset)
    if kept:
        raise ValueError(
            f"This tf.data.Dataset maps its examples with a function that {kept}, so one "
            "example's values may reach the examples after it. Compute each example "
            "from its own values alone (no variable or table written in a map).")
    if is_batched(dataset):
        raise ValueError(
            "This tf.data.Dataset is batched; poisson_dataset draws its own batches "
            "from a dataset of single examples. Make it without batching "
            "(image_dataset_from_directory(..., batch_size=None), "
            "text_dataset_from_directory(..., batch_size=None), or no .batch()), or "
            "call .unbatch() on it.")


def is_batched(dataset):
    """Whether a tf.data pipeline's elements are batches, not single examples:
    it batches (or is a `poisson_dataset`) and no unbatch follows.

    Args:
        dataset: a `tf.data.Dataset`.

    Returns:
        A bool, read from the chain of transformations (not from shapes).
    """
    current = dataset
    while isinstance(current, tf.data.Dataset):
        name = type(current).__name__
        if "Unbatch" in name:
            return False
        if "Batch" in name or sampling_info_of(current) is not None:
            return True
        current = getattr(current, "_input_dataset", None)
    return False


def _repeats_elements(dataset):
    """Whether a pipeline holds a repeat (which duplicates its examples); True
    when its graph cannot be read to tell."""
    graph = _pipeline_graph(dataset)
    if graph is None:
        return True
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return any("Repeat" in node.op for node in nodes)


# tf.data ops known to pass each element of their input at most once (or to
# read each record of a source once). Anything else in a pipeline of examples
# is refused: "allow what is known".
_ONE_TO_ONE_DATASETS = frozenset({
    "TensorSliceDataset", "TensorDataset", "RangeDataset", "MapDataset",
    "ParallelMapDataset", "ParallelMapDatasetV2", "FilterDataset", "PrefetchDataset",
    "ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3", "CacheDataset",
    "CacheDatasetV2", "TakeDataset", "SkipDataset", "OptionsDataset", "ZipDataset",
    "ModelDataset", "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "AssertCardinalityDataset",
    "TextLineDataset", "TFRecordDataset", "FixedLengthRecordDataset"})
# Batches an unbatch may undo: an unbatch counts as giving back the batched
# elements only after a batch, through ops that keep batches or map them (a
# map over batches is read, `_map_undoing_rows`).
_BATCHES = frozenset({"BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
                      "PaddedBatchDatasetV2"})
_CACHES = frozenset({"CacheDataset", "CacheDatasetV2"})
# Ops by which a map's function reads elements of a dataset (its own, or a
# captured one): example i's map would then see others' (review: a map
# adding the next example's features, through a captured iterator). Every
# iterator op counts (review round 29: MultiDeviceIteratorGetNextFromShard,
# missing from a list of names, read the next example: 2 C).
_READING_ELEMENTS = frozenset({"DatasetToSingleElement", "ReduceDataset"})


def _reads_elements(op_type):
    return op_type in _READING_ELEMENTS or "Iterator" in op_type
_SOURCES = frozenset({"TensorSliceDataset", "TensorDataset", "RangeDataset",
                      "TextLineDataset", "TFRecordDataset", "FixedLengthRecordDataset"})
_KEEPING_BATCHES = _ONE_TO_ONE_DATASETS - _SOURCES
# Ops whose element i is made from element i of their input alone: the
# inputs of a zip must reach their sources through these only, so that the
# zip's element i joins the parts of one example (a skip, filter, shuffle or
# shard on one side would join parts of two, and a zip of a dataset with its
# own shifted copy would put each example in two elements).
_KEEPING_INDICES = frozenset({
    "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2", "PrefetchDataset",
    "OptionsDataset", "ModelDataset", "MaxIntraOpParallelismDataset",
    "PrivateThreadPoolDataset", "AssertCardinalityDataset", "CacheDataset",
    "CacheDatasetV2", "TakeDataset"})


def _unvouched_transformations(dataset, examples_added):
    """The ops of a pipeline not known to keep each example at most once
    (repeats are refused on their own); every op when the graph cannot be read.
    `examples_added`: whether neighbouring datasets differ by an added example
    (Poisson sampling), not by one zeroed in place, so that ops keeping
    examples by position are refused too."""
    graph = _pipeline_graph(dataset)
    if graph is None:
        return ["a graph that cannot be read"]
    by_name = {node.name: node for node in graph.node}
    # Parallel maps keep their input's order unless told not to, here or
    # in the pipeline's options.
    ordered = dataset.options().deterministic is not False
    unvouched = set(_hidden_inputs(dataset))
    for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
        if _reads_elements(node.op):
            unvouched.add("a function that reads the elements of a dataset or an iterator")
        # Review round 21: a test on the end of the name let
        # ParallelInterleaveDatasetV4 and DataServiceDatasetV4 through
        # (an example in R elements: R C).
        if "Dataset" not in node.op and node.op != "WindowOp":
            continue
        if node.op == "UnbatchDataset":
            if not _undoes_a_batch(node, by_name):
                unvouched.add("an unbatch of something other than batches")
        elif node.op == "ZipDataset":
            if _zips_a_range(node, by_name):
                unvouched.add("a zip with a range (enumerate: an example's position, which "
                              "one added example shifts for all after it)")
            elif not _zips_aligned_examples(node, by_name, ordered):
                unvouched.add("a zip of inputs not aligned example by example (as "
                              "keras.utils.timeseries_dataset_from_array builds: its windows "
                              "overlap, each row in several; to protect each window as one "
                              "example, fit on an array of windows)")
        elif node.op == "RangeDataset":
            # Review round 84: windows series[i:i + L] read by a map of a
            # range (a record in 12 of them, 3.74 C moved); round 85: the
            # same behind a shuffle, or with the series a constant (10.3 C).
            unvouched.add("a range as a source of examples (its elements are positions: a "
                          "map of them reads the data by position, e.g. overlapping "
                          "windows series[i:i + L], a record in several, and one added "
                          "shifts every later one; to protect each window as one example, "
                          "fit on an array of windows)")
        elif node.op in _BY_POSITION:
            if examples_added:
                unvouched.add(_BY_POSITION[node.op])
        elif node.op == "FilterDataset" and not examples_added:
            # Review round 56: an example zeroed in place may pass the filter
            # where it did not, shifting every later example into the next
            # batch (5.74 C over a pass, C recorded).
            unvouched.add("a filter of examples (one example's value decides whether it is "
                          "kept, and with it the batch of every example after it; filter "
                          "before keras_dp.data.poisson_dataset, which samples what is kept)")
        elif node.op in _BATCHES and examples_added and _drops_a_remainder(node, by_name):
            unvouched.add("a batch with drop_remainder=True before its unbatch (it drops "
                          "the last examples by position: one added in front pushes "
                          "another out; drop_remainder=False)")
        elif node.op == "IgnoreErrorsDataset":
            # Review round 18: a batch map asserting on the whole batch,
            # unbatched then ignore_errors: one example dropped the others
            # of its batch (k - 1 C).
            unvouched.add("ignore_errors (it drops whatever failed upstream, which one "
                          "example can make fail for others)")
        elif node.op in _CACHES and not _caches_in_memory(node, by_name):
            unvouched.add("a cache in a file (it serves whatever pipeline wrote the file)")
        elif node.op not in _ONE_TO_ONE_DATASETS | _BATCHES and "Repeat" not in node.op:
            unvouched.add(node.op)
    return sorted(unvouched)


# Ops that keep examples by their position. One example added in front moves
# every position after it, so under Poisson sampling's neighbours (an added
# example) one example decides which others are kept: review round 20,
# shard(2, 0) 10 C, growing with N; take(N) 2 C, a replacement accounted as
# an addition. Batches keras-dp did not sample are accounted for an example
# zeroed in place, which moves no position.
_BY_POSITION = {
    "TakeDataset": "take (it keeps the first examples by position: one added in front "
                   "pushes another out; slice the data itself, x[:n], or filter by a "
                   "value of each example)",
    "SkipDataset": "skip (it drops the first examples by position: one added in front "
                   "pushes another in; slice the data itself, x[n:], or filter by a "
                   "value of each example)",
    "ShardDataset": "shard (it keeps examples by position, which one added example "
                    "shifts for all after it; filter by a value of each example)"}


# Python types of sources, which read no other dataset.
_SOURCE_TYPES = frozenset({"_TensorSliceDataset", "_TensorDataset", "_RangeDataset"})


def _hidden_inputs(dataset):
    """Datasets of the pipeline whose inputs keras-dp's Python reading of
    maps, filters and batches cannot see: a dataset made from a variant
    (`tf.data.experimental.from_variant`), one served by tf.data service,
    a `tf.compat.v1.data` dataset (a wrapper hiding the dataset it wraps).
    Review round 21: a map copying a row over its batch hidden by
    from_variant was accepted, 7 C; a v1 batch was sampled as one example."""
    return [f"{type(current).__name__} (its inputs cannot be read; build the pipeline "
            "with tf.data.Dataset itself)"
            for current in _datasets_of(dataset)
            if isinstance(current, tf.compat.v1.data.Dataset)
            or not (current._inputs() or type(current).__name__ in _SOURCE_TYPES)]


def _drops_a_remainder(batch, by_name):
    """Whether a batch may drop its last, partial batch (drop_remainder is
    its last input); True unless it is the constant False."""
    drop = _input_nodes(batch, by_name)[-1]
    return drop is None or drop.op != "Const" or list(
        drop.attr["value"].tensor.bool_val) != [False]


def _input_nodes(node, by_name):
    """The nodes a node reads (None for one outside the graph: a function's)."""
    return [by_name.get(name.split(":")[0]) for name in node.input
            if not name.startswith("^")]


def _zips_aligned_examples(zip_node, by_name, ordered):
    """Whether each input of a zip reaches a source (or an aligned zip)
    through ops that keep element indices, so its element i is example i's
    (`ordered`: whether the pipeline's options keep parallel maps in order)."""
    for node in _input_nodes(zip_node, by_name):
        while node is not None and _keeps_indices(node, ordered):
            node = _input_nodes(node, by_name)[0]
        if node is None or not (node.op in _SOURCES or (
                node.op == "ZipDataset" and _zips_aligned_examples(node, by_name, ordered))):
            return False
    return True


def _zips_a_range(zip_node, by_name):
    """Whether an input of a zip is a range (`enumerate` zips one): its
    element i is the position i, not a part of example i (review round 16:
    a position used as a feature moved every later row, 15 C)."""
    for node in _input_nodes(zip_node, by_name):
        while node is not None and node.op in _KEEPING_INDICES:
            node = _input_nodes(node, by_name)[0]
        if node is not None and node.op == "RangeDataset":
            return True
    return False


def _keeps_indices(node, ordered):
    if node.op not in _KEEPING_INDICES:
        return False
    order = node.attr["deterministic"].s if "deterministic" in node.attr else b"true"
    return order == b"true" or (order == b"default" and ordered)


def _caches_in_memory(cache, by_name):
    """Whether a cache holds its input's elements in memory: a cache in a
    file reads the file if it exists, whatever wrote it."""
    filename = _input_nodes(cache, by_name)[1]
    return (filename is not None and filename.op == "Const"
            and list(filename.attr["value"].tensor.string_val) == [b""])


def _undoes_a_batch(unbatch, by_name):
    node = by_name.get(unbatch.input[0].split(":")[0].lstrip("^"))
    while node is not None and node.op in _KEEPING_BATCHES:
        node = by_name.get(node.input[0].split(":")[0].lstrip("^"))
    return node is not None and node.op in _BATCHES


# Python types of the datasets an unbatch walks back through to its batch.
_MAPS = ("_MapDataset", "_ParallelMapDataset")
_BATCH_TYPES = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset")


def _map_undoing_rows(dataset):
    """Why a map between a batch and the unbatch undoing it may not give back
    each row alone (`batch_maps.rows_problem`), or None. The graph check
    (`_undoes_a_batch`) allows only such maps there; this reads them."""
    seen, work = set(), [dataset]
    while work:
        current = work.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        work.extend(current._inputs())
        if type(current).__name__ != "_UnbatchDataset":
            continue
        below = current._input_dataset
        while below is not None and type(below).__name__ not in _BATCH_TYPES:
            problem = _batches_kept_problem(below)
            if problem:
                return problem
            below = getattr(below, "_input_dataset", None)
        if below is not None and _pads_to_the_longest(below):
            return _PADDED_TO_THE_LONGEST
    return None


def _batches_kept_problem(dataset):
    """Why a transformation between a batch and its unbatch may change the
    rows of a batch, or keep or drop a batch by its values (review round 16:
    a filter there let one example drop the others of its batch, K - 1 C;
    ignore_errors is refused anywhere, `_unvouched_transformations`), in
    words; or None."""
    name = type(dataset).__name__
    if name in _MAPS:
        problem = batch_maps.rows_problem(dataset)
        return problem and f"maps its batches with a function that {problem}"
    if name == "_FilterDataset":
        problem = batch_maps.predicate_problem(dataset)
        return problem and f"filters its batches by a predicate that {problem}"
    return None


# Transformations of batches known to keep each batch's rows as they are, or
# only to choose, order or repeat whole batches (maps are read instead).
_CHOOSING_BATCHES = frozenset({
    "_PrefetchDataset", "_OptionsDataset", "_AssertCardinalityDataset", "_RepeatDataset",
    "_TakeDataset", "_SkipDataset", "_ShuffleDataset", "_ShardDataset",
    "_MaxIntraOpParallelismDataset", "_PrivateThreadPoolDataset"})


def batches_problem(dataset):
    """Why a batched tf.data pipeline keras-dp did not sample may put an
    example in one batch more than once, in words; None when it is built
    from transformations known to keep each example at most once per batch
    (issue 44 d: a batch holding an example twice moves the clipped sum by
    2 C, accounted C), or when its batches come from a source keras-dp
    cannot read (`unread_source`)."""
    chain, batch = _down_to_the_batch(dataset)
    for current in chain:
        name = type(current).__name__.strip("_")
        if type(current).__name__ in _MAPS or name == "FilterDataset":
            problem = _batches_kept_problem(current)
            if problem:
                return problem
        elif name == "CacheDataset":
            if bytes(current._filename.numpy()):
                return "caches its batches in a file, which serves whatever pipeline wrote it"
        elif name == "ZipDataset":
            return "zips batches of several pipelines, which may each hold an example"
        elif type(current).__name__ not in _CHOOSING_BATCHES and not (
                batch is None and current is chain[-1] and name in _SOURCES_OF_ELEMENTS):
            return f"transforms its batches with {name}, which keras-dp cannot read"
    shared = batch_maps.shared_state_problem([c for c in chain if type(c).__name__ in _MAPS])
    if shared:
        return f"maps its batches with functions where {shared}"
    if batch is None:
        return None  # From a source of elements: `unread_source`.
    if _pads_to_the_longest(batch):
        return _PADDED_TO_THE_LONGEST
    unvouched = _unvouched_transformations(batch._input_dataset, examples_added=False)
    if unvouched:
        return (f"batches examples built with {', '.join(unvouched)}, which can "
                "duplicate an example or move the others between batches")
    problem = _map_undoing_rows(batch._input_dataset)
    if problem:
        return f"between a batch and its unbatch, {problem}"
    problem = _state_kept(batch._input_dataset)
    if problem:
        return f"maps its examples with a function that {problem}"
    problem = batch_maps.position_problem(
        function_graphs(batch._input_dataset),
        readers=[c._map_func.function.graph for c in chain if type(c).__name__ in _MAPS])
    return problem and f"maps its batches with a function that {problem}"


_PADDED_TO_THE_LONGEST = (
    "pads each example to the longest of its batch (padded_batch without fixed "
    "padded_shapes), so one long example changes what an unmasked model computes from "
    "the others (give padded_shapes=)")


def _pads_to_the_longest(batch):
    """Whether a padded batch pads a dimension to a length its batch decides
    (review round 15: one long example shrank the others' averages, 4 C)."""
    return type(batch).__name__ == "_PaddedBatchDataset" and any(
        None in spec.shape[1:] for spec in tf.nest.flatten(batch.element_spec))


def _state_kept(dataset):
    """Why a map or filter of `dataset`'s pipeline may leave values of one
    element in a variable or table a later one reads (`batch_maps.state_problem`)."""
    found = next(filter(None, (batch_maps.state_problem(current)
                               for current in _datasets_of(dataset))), None)
    return found or batch_maps.position_problem(function_graphs(dataset))


def unread_source(dataset):
    """The name of the source a tf.data pipeline's batches come from when
    keras-dp cannot read their examples (a generator: `from_generator` is a
    flat map of a Python function; slices of given tensors), else None."""
    chain, batch = _down_to_the_batch(dataset)
    name = type(chain[-1]).__name__.strip("_") if chain else None
    return name if batch is None and name in _SOURCES_OF_ELEMENTS else None


def _down_to_the_batch(dataset):
    """The transformations from `dataset` down to its last batch, and that
    batch (None when the walk ends first at a source of elements or at a
    dataset of several inputs, the chain's last element)."""
    chain, current = [], dataset
    while current is not None and type(current).__name__ not in _BATCH_TYPES:
        chain.append(current)
        below = getattr(current, "_input_dataset", None)
        # A flat map of batches is a transformation of them, not a source.
        if (type(current).__name__.strip("_") in _SOURCES_OF_ELEMENTS
                and not (below is not None and is_batched(below))):
            return chain, None
        current = below
    return chain, current


# Sources whose elements keras-dp cannot see the examples of.
_SOURCES_OF_ELEMENTS = frozenset({"FlatMapDataset", "TensorSliceDataset", "TensorDataset",
                                  "GeneratorDataset", "RangeDataset"})


def adapting_layers_in_maps(dataset):
    """The Keras layers that adapt which the functions of `dataset`'s
    pipeline (maps, filters, scans, ...) refer to in their Python."""
    found = []
    for function in _traced_functions(dataset):
        found += [layer for layer in _adapting_layers_called_by(getattr(function, "_func", None))
                  if all(layer is not other for other in found)]
    return found


def function_graphs(dataset):
    """The traced graphs of the functions of `dataset`'s pipeline: its maps
    and filters, and any other transformation's (a scan's, a grouping's)."""
    return [function.function.graph for function in _traced_functions(dataset)]


def _traced_functions(dataset):
    """The functions tf.data traced for the datasets of `dataset`'s pipeline,
    whatever each transformation names them (`_map_func`, `_predicate`,
    `_scan_func`, `_key_func`, ...): reading maps and filters alone missed a
    released layer a scan of the validation data ran (review round 164,
    5.39 reported against 6.23)."""
    return [value for current in _datasets_of(dataset) for value in vars(current).values()
            if hasattr(getattr(value, "function", None), "graph")]


def warn_of_vocabularies_in_maps(dataset, accounted=()):
    """Warns when a map of a tf.data pipeline reads state a layer may have
    adapted to the training data: a lookup table (the vocabulary of a
    TextVectorization or StringLookup), a variable the map does not write
    (a Normalization's mean and variance) or bin boundaries (a
    Discretization's Bucketize). Adapted to the training data, it is in no
    model's ledger while the layer is outside the model (review round 12: a
    keras_dp.adapt release of epsilon 5 went unreported; round 118: a
    Normalization's, 0.79 reported against 4.62, and Keras' exact mean)."""
    read = {kind for current in _datasets_of(dataset)
            for kind in _adapted_state_read(current, accounted)}
    for kind in sorted(read):
        warnings.warn(
            f"A map of this tf.data pipeline reads {kind}. If it was adapted to the training "
            "data, no privacy ledger holds it: Keras' adapt() is not private. Adapt the "
            "layer with keras_dp.adapt and apply it in a map of the pipeline you fit on "
            "(fit records its release), or inside the model, or adapt it on public "
            "data.", stacklevel=3)


_VOCABULARY = "a vocabulary (a lookup table of a TextVectorization or StringLookup layer)"
_STATISTICS = ("values held in variables it does not write (such as a Normalization "
               "layer's mean and variance)")
_BOUNDARIES = "bin boundaries (a Discretization layer's Bucketize)"


def _adapted_state_read(dataset, accounted=()):
    """The kinds of adapted state the map of `dataset` reads (`_VOCABULARY`,
    `_STATISTICS`, `_BOUNDARIES`), in its function and the ones it calls;
    none for a map whose layers that adapt are all `accounted` (their
    `keras_dp.adapt` releases recorded in the model's ledger)."""
    function = getattr(getattr(dataset, "_map_func", None), "function", None)
    if function is None:
        return set()
    layers = _adapting_layers_called_by(getattr(dataset._map_func, "_func", None))
    if layers and all(any(layer is other for other in accounted) for layer in layers):
        return set()
    graphs = [function.graph] + [f.graph for f in function.graph._functions.values()
                                 if hasattr(f, "graph")]
    ops = [op for graph in graphs for op in graph.get_operations()]
    found = set()
    names = sorted({type(layer).__name__ for layer in layers})
    if names:  # Their state is baked into the map as constants: read the Python.
        found.add(f"the state of a Keras layer that adapts ({', '.join(names)})")
    if any(op.type.startswith("LookupTable") for op in ops):
        found.add(_VOCABULARY)
    if any(op.type == "Bucketize" for op in ops):
        found.add(_BOUNDARIES)
    if any(_reads_a_variable_nothing_writes(op) for op in ops):
        found.add(_STATISTICS)
    return found


def _reads_a_variable_nothing_writes(op):
    """Whether `op` reads a variable (ReadVariableOp, ResourceGather, ...)
    that no op of the graph writes; a table's ops are vocabularies, and a
    function's call is read in the function, and an op passing a handle on
    (an identity) by its consumers."""
    if op.type.startswith("LookupTable") or op.type in rowstate.CALLS or (
            op.type in rowstate.LOOPS or op.type in rowstate.BRANCHES) or any(
            t.dtype == tf.resource for t in op.outputs):
        return False
    return any(t.dtype == tf.resource and not rowstate.writes_of(t) for t in op.inputs)


def _adapting_layers_called_by(function, depth=0):
    """The Keras layers with an `adapt` method that the Python function
    `function` refers to (its globals and closure, the layers of a model,
    and the functions it refers to, three deep)."""
    try:
        names = inspect.getclosurevars(function)
    except (TypeError, ValueError):
        return []
    found = []
    for value in [*names.nonlocals.values(), *names.globals.values()]:
        if isinstance(value, keras.layers.Layer):
            found += [layer for layer in value._flatten_layers(include_self=True)
                      if callable(getattr(layer, "adapt", None))]
        elif inspect.isfunction(value) and depth < 3:
            found += _adapting_layers_called_by(value, depth + 1)
    return found


def _datasets_of(dataset):
    """`dataset` and every dataset it reads, once each."""
    seen, work = {}, [dataset]
    while work:
        current = work.pop()
        if id(current) not in seen:
            seen[id(current)] = current
            work.extend(current._inputs())
    return list(seen.values())


def _reads_a_table(dataset):
    function = getattr(getattr(dataset, "_map_func", None), "function", None)
    if function is None:
        return False
    graphs = [function.graph] + [f.graph for f in function.graph._functions.values()
                                 if hasattr(f, "graph")]
    return any(op.type.startswith("LookupTable") for graph in graphs
               for op in graph.get_operations())


def _nbytes(tensor):
    """Bytes of a tensor's values (of its strings' bytes for tf.string)."""
    if tensor.dtype == tf.string:
        return int(tf.reduce_sum(tf.strings.length(tensor)))
    return int(tf.size(tensor)) * tensor.dtype.size


def num_rows_of(data):
    """The rows of the `(x, y, sample_weight)` tensors of `to_tensors`."""
    return int(tf.nest.flatten(data[0])[0].shape[0])


def to_tensors(x, y, sample_weight):
    """Converts (x, y, sample_weight) to tensors and returns them with N."""
    data = []
    num_examples = None
    for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if value is None:
            if name == "x":
                raise ValueError("x is required; received x=None.")
            data.append(None)
            continue
        if isinstance(value, tf.data.Dataset):
            raise ValueError(
                f"poisson_dataset samples examples from in-memory arrays or from one "
                f"unbatched tf.data.Dataset of examples; {name} is a tf.data.Dataset "
                "beside other data. Pass the dataset of (x, y) examples alone as x, or "
                "arrays.")
        _refuse_composite(name, value)
        # tf.data stacks a list output into one tensor; tuples stay structures.
        tensors = tf.nest.map_structure(tf.convert_to_tensor, _lists_to_tuples(value))
        for leaf in tf.nest.flatten(tensors):
            if not leaf.shape.rank:
                raise ValueError(f"{name} has a scalar where an array of examples "
                                 f"was expected: {leaf!r}.")
            if num_examples is None:
                num_examples = leaf.shape[0]
            if leaf.shape[0] != num_examples:
                raise ValueError(
                    f"Every array of x, y and sample_weight must have the same first "
                    f"dimension (the number of examples, {num_examples} from x); "
                    f"{name} has an array of shape {tuple(leaf.shape)}."
                )
        data.append(tensors)
    return tuple(data), num_examples


def _refuse_composite(name, value):
    """Refuses ragged or sparse examples: a Poisson batch is a dense stack
    of rows, padded to a fixed size."""
    for leaf in tf.nest.flatten(value):
        if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
            raise ValueError(
                f"poisson_dataset samples dense examples; {name} holds a "
                f"{type(leaf).__name__}. Give every example one shape first: ragged "
                "rows padded to one length (TextVectorization(output_sequence_length=...), "
                "ragged.to_tensor(shape=[None, length])), sparse ones with "
                "tf.sparse.to_dense.")


def _lists_to_tuples(structure):
    if isinstance(structure, (list, tuple)):
        return tuple(_lists_to_tuples(s) for s in structure)
    if isinstance(structure, dict):
        return {k: _lists_to_tuples(v) for k, v in structure.items()}
    return structure


def repeats_before_batches(dataset):
    """True when a tf.data pipeline repeats its batches (or cannot be read).

    Raises:
        ValueError: when it repeats before batching, so that one batch can
            hold an example twice (no sensitivity C covers that).
    """
    if not isinstance(dataset, tf.data.Dataset):
        return False
    graph = _pipeline_graph(dataset)
    if graph is None:
        return True
    if any("Repeat" in n.op for f in graph.library.function for n in f.node_def):
        raise _repeats_examples_error()  # Inside a map, interleave or flat_map.
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name.split(":")[0].lstrip("^"), []).append(node)
    repeats = [node for node in graph.node if "Repeat" in node.op]
    for repeat in repeats:  # A batch after a repeat can hold an example twice.
        downstream, seen = list(consumers.get(repeat.name, [])), set()
        while downstream:
            node = downstream.pop()
            if node.name not in seen:
                seen.add(node.name)
                if "Batch" in node.op:
                    raise _repeats_examples_error()
                downstream += consumers.get(node.name, [])
    return bool(repeats)


def _repeats_examples_error():
    return ValueError(
        "This dataset repeats its examples before batching them (or inside a map, "
        "interleave or flat_map), so one batch can hold an example twice and move "
        "the clipped sum by more than l2_norm_clip. Call .repeat() after .batch(), "
        "or fit on arrays or on keras_dp.data.poisson_dataset.")


def num_batches(dataset):
    """The number of batches in one pass of a tf.data dataset or of a
    `keras.utils.PyDataset` (its length, which `sampling="shuffle"` states
    is one pass), or None."""
    if isinstance(dataset, keras.utils.PyDataset):
        return dataset.num_batches
    if not isinstance(dataset, tf.data.Dataset):
        return None
    count = int(dataset.cardinality())
    return count if count >= 0 else None  # INFINITE or UNKNOWN.


def seen_batch_size(dataset):
    """The rows its last batch transformation gives a dataset's batches (for
    the warning's figures), or None when that is not a constant. Read from
    the pipeline, never by iterating it: an iterator dropped after one batch
    can leave a `cache()` above it complete with the few batches its
    prefetch had read (TensorFlow took the cancellation for the end of the
    data), and fit then trained on those alone (seen on a CI machine: 2 of
    4 batches)."""
    _, batch = _down_to_the_batch(dataset)
    size = None if batch is None else tf.get_static_value(batch._batch_size)
    return None if size is None else int(size)


def peek_batch_size(dataset):
    """The static batch size of a dataset, if it has one (for reporting)."""
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    # A distributed dataset's spec (PerReplicaSpec) has no one shape.
    shape = getattr(tf.nest.flatten(spec)[0], "shape", None)
    return shape[0] if shape is not None and shape.rank else None


def _pipeline_graph(dataset):
    """The GraphDef of a tf.data pipeline, or None when it cannot be read
    (which every caller treats as the worst case)."""
    try:
        return tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return None
