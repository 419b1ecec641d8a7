"""Ghost clipping by construction (issue 44), read as an attacker would: every
way we found to combine the rows of a batch, in the forward pass or the
backward pass, must be refused by the analysis of the traced graph
(`keras_dp.clipping.independence`), naming the layer and the op.

Each case is a layer between two Dense layers of a model whose step is
traced as fit traces it (batch size unknown) or, where the trick needs one,
at a static batch size. Nothing runs: the analysis reads the graph.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from brute_force import per_example_loss, rng
from keras_dp.clipping import ghost

L = keras.layers
pytestmark = pytest.mark.once


def refusal(model, x, static=False):
    """The refusal of ghost clipping for `model` on inputs like `x` (None when it runs)."""
    variables = model.trainable_variables
    batch = {"x": x, "y": np.zeros(len(x), "int32")}
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(
        [len(t) if static else None, *np.shape(t)[1:]], tf.as_dtype(t.dtype)), batch)

    def step(batch):
        return ghost.clipped_gradient_sum(model, batch, variables, 1.0, per_example_loss)

    try:
        tf.function(step, autograph=False).get_concrete_function(specs)
    except ghost.UnsupportedModelError as error:
        return str(error)
    return None


def between_dense(layer, features=4):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((features,)), L.Dense(4), layer, L.Flatten(),
                             L.Dense(3)])


def x4(rows=8):
    return rng().normal(size=(rows, 4)).astype("float32")


# --- The forward pass.

@tf.function(autograph=False)
def _nested_mean(x):
    return x - tf.reduce_mean(x, axis=0)


@tf.function(autograph=False)
def _doubly_nested_mean(x):
    return _nested_mean(x) * 1.0


def _loop_over_rows(x):
    # Each row plus the sum of the rows before it: a loop carrying a value across rows.
    def body(i, acc, out):
        acc = acc + x[i]
        return i + 1, acc, out.write(i, acc)
    n = tf.shape(x)[0]
    _, _, out = tf.while_loop(lambda i, acc, out: i < n, body,
                              (0, tf.zeros_like(x[0]), tf.TensorArray(x.dtype, n)))
    return tf.ensure_shape(out.stack(), x.shape)


def _loop_with_free_count(x):
    # A fixed trip count, but the state shifts the rows by one each time.
    def body(i, h):
        return i + 1, tf.concat([h[1:], h[:1]], axis=0)
    return tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]


def _branch_on_the_batch(x):
    return tf.cond(tf.reduce_sum(x) > 0, lambda: x, lambda: -x)


def _seeded_by_the_batch(x):
    # A stateless draw seeded by the batch's values: example 0 moves example 1's noise.
    seed = tf.cast(tf.reshape(x[:, :1], [-1])[:2] * 1000, tf.int64)
    return x + tf.random.stateless_normal(tf.shape(x), seed=tf.stack([seed[0], seed[1]]))


def _reshape_merge_then_split(x):
    # [B, 4] -> [2, 2B] -> [B, 4]: rows of two examples end up interleaved.
    merged = tf.reshape(tf.transpose(tf.reshape(x, [-1, 2])), [2, -1])
    return tf.reshape(tf.transpose(merged), [-1, 4])


class _WritesThenGathers(L.Layer):
    """Writes the batch mean to a variable, then reads it by a gather (no ReadVariableOp)."""

    def build(self, shape):
        self.memory = self.add_weight(shape=(1, shape[-1]), initializer="zeros",
                                      trainable=False)

    def call(self, x):
        self.memory.assign(tf.reduce_mean(x, axis=0, keepdims=True))
        return x + tf.gather(self.memory.value, tf.zeros([tf.shape(x)[0]], tf.int32))


class _WritesASlice(L.Layer):
    """Writes the batch mean into a slice of a variable, then reads the variable."""

    def build(self, shape):
        self.memory = self.add_weight(shape=(2, shape[-1]), initializer="zeros",
                                      trainable=False)

    def call(self, x):
        self.memory.value[0:1].assign(tf.reduce_mean(x, axis=0, keepdims=True))
        return x + self.memory[0]


class _WritesInANestedFunction(L.Layer):
    """Writes the batch mean to a variable inside a nested tf.function; reads it outside."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False)
        memory = self.memory

        @tf.function(autograph=False)
        def write(x):
            memory.value.assign(tf.reduce_mean(x, axis=0))
            return tf.constant(0.0)
        self.write = write

    def call(self, x):
        self.write(x)
        return x - self.memory


class _ReadsInANestedFunction(L.Layer):
    """Writes the batch mean outside; reads the variable inside a nested tf.function."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False)
        memory = self.memory
        self.read = tf.function(lambda x: x - memory.value.read_value(), autograph=False)

    def call(self, x):
        self.memory.value.assign(tf.reduce_mean(x, axis=0))
        return self.read(x)


class _WritesThroughAnAlias(L.Layer):
    """Writes the batch mean through an identity of the variable's handle."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False)

    def call(self, x):
        handle = self.memory.value.handle
        tf.raw_ops.AssignVariableOp(resource=tf.identity(handle),
                                    value=tf.reduce_mean(x, axis=0))
        return x - tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)


class _AddsAssignFromTheBatch(L.Layer):
    """assign_add of a column sum: state written from the batch and read back."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False)

    def call(self, x):
        self.memory.assign_add(tf.reduce_sum(x, axis=0))
        return x * self.memory


MIXING = {
    "sum_over_everything": (lambda x: x - tf.reduce_max(x), r"reduces over the batch axis"),
    "cumsum_over_batch": (lambda x: tf.cumsum(x, axis=0), r"acts along the batch axis"),
    "roll_batch": (lambda x: tf.roll(x, 1, axis=0), r"\(Roll\) acts along the batch axis"),
    "roll_by_the_batch": (lambda x: tf.roll(x, tf.cast(x[0, 0], tf.int32), axis=1),
                          r"slices the batch axis"),
    "reverse_batch": (lambda x: tf.reverse(x, [0]), r"acts along the batch axis"),
    "sort_across_batch": (lambda x: tf.sort(x, axis=0), r"\(TopKV2\)"),
    "argsort_gather": (lambda x: tf.gather(x, tf.argsort(x[:, 0])), r"\(TopKV2\)"),
    "gather_by_data": (lambda x: tf.gather(x, tf.cast(x[:, 0] > 0, tf.int32)),
                       r"gathers rows of the batch by positions from the batch"),
    "gather_fixed_rows": (lambda x: tf.gather(x, [0, 0, 0]), r"picks rows along the batch axis"),
    "gather_nd_by_data": (lambda x: tf.gather_nd(x, tf.cast(x[:, :1] > 0, tf.int32)),
                          r"gathers rows of the batch by positions"),
    "gather_nd_of_the_batch_by_position": (lambda x: tf.gather_nd(x, tf.stack(
        [tf.range(tf.shape(x)[0]), tf.zeros([tf.shape(x)[0]], tf.int32)], 1))[:, None] * x,
        r"position in the batch"),
    "scatter_nd": (lambda x: tf.tensor_scatter_nd_add(x, [[0]], x[1:2]), r"slices the batch"),
    "scatter_into_zeros": (lambda x: tf.tensor_scatter_nd_add(
        tf.zeros_like(x), tf.zeros([tf.shape(x)[0], 1], tf.int32), x),
        r"\(TensorScatterAdd\) is not one of the ops"),
    "segment_sum": (lambda x: tf.math.unsorted_segment_sum(x, tf.zeros([tf.shape(x)[0]],
                                                                       tf.int32), 1)[0] + x,
                    r"is not one of the ops"),
    "gram_matrix": (lambda x: tf.matmul(tf.matmul(x, x, transpose_b=True), x),
                    r"multiplies two tensors"),
    "matmul_over_batch": (lambda x: tf.matmul(tf.transpose(x), x)[:1] + x,
                          r"multiplies two tensors"),
    "matmul_free_over_batch": (lambda x: tf.matmul(tf.ones([4, 8]), x),
                               r"sums over the batch axis"),
    "einsum_batch_summed": (lambda x: x + tf.einsum("bi->i", x), r"sums over the batch axis"),
    "einsum_outer_of_rows": (lambda x: tf.einsum("bi,cj->bj", x, x),
                             r"multiplies rows of different examples"),
    "batch_matmul_contracts_batch": (lambda x: tf.linalg.matmul(x[None], x[None],
                                                                transpose_a=True),
                                     r"sums over the batch axis"),
    "softmax_over_batch": (lambda x: tf.transpose(tf.nn.softmax(tf.transpose(x))),
                           r"acts along the batch axis"),
    "top_k_over_batch": (lambda x: tf.transpose(tf.math.top_k(tf.transpose(x), 2).values),
                         r"acts along the batch axis"),
    "shift_by_slicing": (lambda x: tf.concat([x[1:], x[:1]], axis=0), r"slices the batch axis"),
    "pad_then_slice": (lambda x: tf.pad(x, [[1, 0], [0, 0]]), r"pads the batch axis"),
    "reshape_rows_together": (lambda x: tf.reshape(x, [-1, 8]),
                              r"reshapes the rows of several examples together"),
    "reshape_merge_then_split": (_reshape_merge_then_split, r"reshape"),
    "batch_size_as_value": (lambda x: x / tf.cast(tf.size(x), x.dtype),
                            r"uses the batch size as a value"),
    "batch_size_in_range": (lambda x: x + tf.cast(tf.range(tf.shape(x)[0])[:, None], x.dtype),
                            r"position in the batch"),
    "batch_size_maximum": (lambda x: x * tf.cast(tf.maximum(tf.shape(x)[0], 2), x.dtype),
                           r"uses the batch size as a value"),
    "batch_size_as_depth": (lambda x: x * tf.reduce_sum(tf.one_hot(0, tf.shape(x)[0])),
                            r"batch size as a value"),
    "random_shuffle": (lambda x: tf.random.shuffle(x), r"shuffles"),
    "seed_from_the_batch": (_seeded_by_the_batch, r"slices the batch axis"),
    "loop_over_rows": (_loop_over_rows, r"batch"),
    "loop_shifting_rows": (_loop_with_free_count, r"slices the batch axis"),
    "branch_on_the_batch": (_branch_on_the_batch, r"reduces over the batch axis"),
    "nested_function": (_nested_mean, r"reduces over the batch axis"),
    "doubly_nested_function": (_doubly_nested_mean, r"reduces over the batch axis"),
    "conv_across_batch": (lambda x: tf.nn.conv1d(x[None, :, :], tf.ones([3, 4, 4]), 1,
                                                 "SAME")[0], r"convolves across the batch axis"),
    "pool_across_batch": (lambda x: tf.nn.max_pool2d(x[None, :, :, None], [1, 3, 1, 1], 1,
                                                     "SAME")[0, :, :, 0],
                          r"pools across the batch axis"),
    "tile_batch": (lambda x: tf.tile(x, [2, 1])[:, :1] * 0.0 + tf.tile(x, [2, 1]),
                   r"repeats rows along the batch axis"),
    "mirror_pad_batch": (lambda x: tf.pad(x, [[1, 1], [0, 0]], "REFLECT"),
                         r"pads the batch axis"),
    "split_batch": (lambda x: tf.concat(tf.split(x, 2)[::-1], 0), r"splits the batch axis"),
    "reshape_by_a_transposed_shape": (lambda x: tf.transpose(tf.reshape(
        x, tf.stack([tf.shape(x)[1], -1]))), r"reshape"),
    "tensor_array_of_rows": (lambda x: tf.TensorArray(tf.float32, 0, dynamic_size=True,
                                                      element_shape=[4]).unstack(x).stack(),
                             r"makes a list of the examples of a batch"),
    "softmax_of_a_column": (lambda x: x * tf.nn.softmax(x[:, 0])[:, None],
                            r"acts along the batch axis"),
    "broadcast_first_row": (lambda x: tf.broadcast_to(x[:1], tf.shape(x)),
                            r"slices the batch axis"),
    "where_indices": (lambda x: tf.gather(x, tf.where(x[:, 0] > 0)[:, 0]), r"\(Where\)"),
    "py_function": (lambda x: tf.ensure_shape(tf.py_function(lambda a: a, [x], tf.float32),
                                              x.shape), r"\(EagerPyFunc\) is not one of the ops"),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_an_op_mixing_rows_is_refused(name):
    function, refused = MIXING[name]
    message = refusal(between_dense(L.Lambda(function, name="attack")), x4())
    assert message is not None, f"{name} ran ghost clipping"
    assert "Layer 'attack' (Lambda)" in message and "Fix:" in message, message
    assert re.search(refused, message), message


# A static batch size of 2 lets a row of the batch stand for a seed of shape [2].
def _seed_is_a_column_of_the_batch(x):
    seed = tf.cast(x[:, 0] * 1000, tf.int64)
    return x + tf.random.stateless_normal(tf.shape(x), seed=seed)


def _position_constant(x):
    return x + tf.constant(np.arange(2, dtype="float32")[:, None])


_PER_POSITION = keras.Variable(np.arange(8, dtype="float32").reshape(2, 4), trainable=False)


def _unstack_reversed(x):
    return tf.stack(tf.unstack(x)[::-1])


STATIC = {
    "unstack_batch": (_unstack_reversed, r"splits the batch into one tensor per example"),
    "adds_a_variable_per_position": (lambda x: x + _PER_POSITION.value,
                                     r"position in the batch"),
    "seed_is_a_column_of_the_batch": (_seed_is_a_column_of_the_batch,
                                      r"seed|depends on the batch"),
    "adds_a_constant_per_position": (_position_constant, r"position in the batch"),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_an_op_mixing_rows_at_a_static_batch_size_is_refused(name):
    function, refused = STATIC[name]
    message = refusal(between_dense(L.Lambda(function, name="attack")), x4(2), static=True)
    assert message is not None, f"{name} ran ghost clipping"
    assert "Layer 'attack' (Lambda)" in message, message
    assert re.search(refused, message), message


STATEFUL = {
    "gather_after_a_write": (_WritesThenGathers, r"variable written from the batch"),
    "read_after_a_sliced_write": (_WritesASlice, r"variable written from the batch"),
    "read_after_a_nested_write": (_WritesInANestedFunction, r"variable written from the batch"),
    "nested_read_after_a_write": (_ReadsInANestedFunction, r"variable written from the batch"),
    "read_after_assign_add": (_AddsAssignFromTheBatch, r"variable written from the batch"),
    "read_after_a_write_through_an_alias": (_WritesThroughAnAlias,
                                            r"variable written from the batch"),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_state_written_from_the_batch_and_read_back_is_refused(name):
    layer, refused = STATEFUL[name]
    message = refusal(between_dense(layer(name="attack")), x4())
    assert message is not None, f"{name} ran ghost clipping"
    assert "Layer 'attack'" in message, message
    assert re.search(refused, message), message


def test_a_variable_written_from_constants_is_still_read_as_free():
    class Counter(L.Layer):
        def build(self, shape):
            self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

        def call(self, x):
            self.count.assign_add(1.0)
            return x * self.count

    assert refusal(between_dense(Counter()), x4()) is None


def test_a_normalization_over_the_batch_axis_is_refused():
    # The built-in norm function is trusted to keep rows apart: not on axis 0.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,), batch_size=8), L.Dense(8),
                              L.RMSNormalization(axis=0, name="attack"), L.Dense(3)])
    message = refusal(model, rng().normal(size=(8, 8)).astype("float32"), static=True)
    assert message is not None and "RMSNormalization 'attack' normalizes over the batch axis" \
        in message, message


# --- The backward pass.

@tf.RegisterGradient("KerasDpTestMixingGrad")
def _mixing_grad(op, grad):
    return grad - tf.reduce_mean(grad, axis=0, keepdims=True)


def _overridden_identity(x):
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {"Identity": "KerasDpTestMixingGrad"}):
        return tf.identity(x)


@tf.custom_gradient
def _forward_rowwise_backward_mixed(x):
    return x * 2.0, lambda d: 2.0 * d - tf.reduce_mean(d, axis=0, keepdims=True)


@tf.function(autograph=False)
def _nested_custom_gradient(x):
    return _forward_rowwise_backward_mixed(x)


@tf.custom_gradient
def _elementwise_custom_gradient(x):
    # Row-wise both ways, and still refused: keras-dp does not read Python gradients.
    return tf.nn.relu(x), lambda d: d * tf.cast(x > 0, d.dtype)


def _recompute_grad(x):
    return tf.recompute_grad(lambda t: t * 2.0)(x)


def _registered_gradient(op, grad):
    return [grad - tf.reduce_mean(grad, axis=0, keepdims=True), None]


try:  # TruncateMod has no gradient in TensorFlow: a user may register one.
    tf.RegisterGradient("TruncateMod")(_registered_gradient)
except KeyError:  # Registered already (this module imported twice).
    pass


def _keras_custom_gradient(x):
    @keras.ops.custom_gradient
    def mixed_backward(u):
        def grad(*args, upstream=None):
            upstream = args[0] if args else upstream
            return upstream - keras.ops.mean(upstream, axis=0, keepdims=True)
        return u * 1.0, grad
    return mixed_backward(x)


BACKWARD = {
    "keras_ops_custom_gradient": _keras_custom_gradient,
    "gradient_registered_for_an_op_without_one": lambda x: tf.truncatemod(x, 1e6),
    "custom_gradient": _forward_rowwise_backward_mixed,
    "gradient_override_map": _overridden_identity,
    "custom_gradient_in_a_nested_function": _nested_custom_gradient,
    "elementwise_custom_gradient": _elementwise_custom_gradient,
    "recompute_grad": _recompute_grad,
}


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_a_gradient_keras_dp_cannot_read_is_refused(name):
    message = refusal(between_dense(L.Lambda(BACKWARD[name], name="attack")), x4())
    assert message is not None, f"{name} ran ghost clipping"
    assert "Layer 'attack' (Lambda)" in message, message
    assert re.search(r"custom gradient|gradient registered outside TensorFlow", message), message


# --- No false positives: ops along other axes than the batch's run ghost clipping.

ROW_WISE = {
    "take_along_axis": lambda x: keras.ops.take_along_axis(
        x, keras.ops.argsort(x, axis=-1), axis=-1),
    "top_k": lambda x: tf.math.top_k(x, 4).values,
    "sort": lambda x: tf.sort(x, axis=-1),
    "cumsum": lambda x: tf.cumsum(x, axis=1),
    "roll": lambda x: tf.roll(x, 1, axis=1),
    "reverse": lambda x: tf.reverse(x, [1]),
    "gather": lambda x: tf.gather(x, [3, 2, 1, 0], axis=1),
    "one_hot_of_argmax": lambda x: keras.ops.one_hot(keras.ops.argmax(x, axis=-1), 4) * x,
    "standardize_each_row": lambda x: (x - tf.reduce_mean(x, 1, keepdims=True))
    / tf.math.reduce_std(x, 1, keepdims=True),
    "impute_with_a_constant": lambda x: tf.where(tf.math.is_nan(x), tf.zeros_like(x), x),
    "zeros_of_the_batch_shape": lambda x: x + tf.zeros(tf.shape(x)),
    "noise_of_the_batch_shape": lambda x: x + keras.random.normal(keras.ops.shape(x)),
    "dropout_shared_over_rows": lambda x: tf.nn.dropout(x, 0.5, noise_shape=[1, 4]),
    "reshape_and_back": lambda x: tf.reshape(tf.reshape(x, [-1, 2, 2]), [-1, 4]),
    "nested_function": tf.function(lambda x: x * 2.0 + 1.0, autograph=False),
    "branch_on_a_constant": lambda x: tf.cond(tf.constant(True), lambda: x, lambda: -x),
}


@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_an_op_along_other_axes_runs_ghost_clipping(name):
    assert refusal(between_dense(L.Lambda(ROW_WISE[name], name="row_wise")), x4()) is None


# --- Activations: a built-in norm function is trusted with Keras' own only.

def _centred(x):
    return x - tf.reduce_mean(x, axis=0, keepdims=True)


def test_a_user_activation_mixing_rows_is_refused():
    # Review round 22: the Dense norm function called it trusted, 8 C at B = 9.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, activation=_centred), L.Dense(3)])
    assert "(Mean)" in refusal(model, x4())


def test_a_row_wise_user_activation_keeps_ghost_clipping():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4, activation=tf.nn.gelu), L.Dense(3)])
    assert refusal(model, x4()) is None


def test_a_recurrent_layer_with_a_user_activation_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 4)), L.SimpleRNN(3, activation=_centred),
                              L.Dense(3)])
    x = rng().normal(size=(8, 5, 4)).astype("float32")
    assert "not one of Keras' activations" in refusal(model, x)


# --- What a built-in norm function reads besides its inputs.

class _BatchValue:
    """A layer setting (an epsilon) whose value a layer before sets from the batch."""
    value = 1e-3

    def __radd__(self, tensor):
        return tensor + tf.cast(self.value, tensor.dtype)


class _KeepsTheLargestRow(L.Layer):
    def __init__(self, kept, **kwargs):
        super().__init__(**kwargs)
        self.kept = kept

    def call(self, x):
        self.kept.value = tf.reduce_max(tf.reduce_sum(tf.square(x), axis=1))
        return x


def test_a_norm_function_reading_a_value_of_the_batch_besides_its_inputs_is_refused():
    # Review round 24: LayerNormalization's epsilon, such an object: 5.75 C at B = 9.
    kept = _BatchValue()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(4), _KeepsTheLargestRow(kept),
                              L.LayerNormalization(epsilon=kept), L.Dense(3)])
    assert "a value of the batch that is not one of its inputs" in refusal(model, x4())


# --- Values set by position, reaching the batch outside element-wise ops.

_ALTERNATING = np.array([[(-1.0) ** i] for i in range(8)], "float32")


class _AlternatingMask(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def compute_mask(self, inputs, mask=None):
        return tf.constant(_ALTERNATING[:, 0] > 0)

    def call(self, x):
        return x


@pytest.mark.parametrize("combine", [
    lambda h: tf.einsum("bi,bi->bi", h, tf.constant(_ALTERNATING)),
    lambda h: tf.matmul(h[:, :, None], tf.constant(_ALTERNATING)[:, :, None])[:, :, 0],
    lambda h: tf.reduce_prod(tf.stack([h, tf.constant(_ALTERNATING)], 1), 1),
    lambda h: tf.concat([h, tf.constant(_ALTERNATING)], axis=1),
    lambda h: _rows_as_the_bias_of_a_value_set_by_position(h),
], ids=["einsum", "batch matmul", "stack", "concat", "NCHW bias of rows"])
def test_a_value_set_by_position_is_refused_whatever_combines_it(combine):
    # Review round 31: under Poisson sampling an added example moves every
    # later one to another row, so to another sign: 12.6 C.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(1), L.Lambda(combine), L.Dense(3)])
    assert "depends on its position" in refusal(model, x4(), static=True)


def _bias_on_the_batch_axis(values):
    # Review round 50: NCHW's BiasAdd adds its bias along axis 1, here the
    # batch's, which was read as the last axis: 5.7 C.
    return lambda h: tf.transpose(tf.nn.bias_add(
        tf.transpose(h)[:, :, None], tf.constant(values), data_format="NCHW")[:, :, 0])


def _batch_norm_on_the_batch_axis(values):
    # The same through FusedBatchNorm's offset, the batch on its channel axis: 5.7 C.
    def combine(h):
        ones = tf.ones([len(values)])
        normalized, _, _ = tf.compat.v1.nn.fused_batch_norm(
            tf.transpose(h)[None, None], scale=ones, offset=tf.constant(values),
            mean=tf.zeros([len(values)]), variance=ones, epsilon=0.0, is_training=False)
        return tf.transpose(normalized[0, 0])
    return combine


@pytest.mark.parametrize("lined_up", [_bias_on_the_batch_axis, _batch_norm_on_the_batch_axis],
                         ids=["NCHW bias", "batch norm offset"])
def test_a_per_channel_value_on_a_batch_moved_to_the_channel_axis(lined_up):
    keras.utils.set_random_seed(0)
    by_position = keras.Sequential([keras.Input((4,)), L.Dense(1),
                                    L.Lambda(lined_up(_ALTERNATING[:, 0])), L.Dense(3)])
    assert "depends on its position" in refusal(by_position, x4(), static=True)
    same = keras.Sequential([keras.Input((4,)), L.Dense(1),
                             L.Lambda(lined_up(np.full(8, 0.5, "float32"))), L.Dense(3)])
    assert refusal(same, x4(), static=True) is None


def test_the_diagonal_of_a_free_value_along_the_batch_is_refused():
    # Review round 63: a constant whose rows agree but whose diagonal
    # alternates in sign, taken along the batch by einsum, 14 C.
    keras.utils.set_random_seed(0)
    diagonal = tf.constant(np.tile(_ALTERNATING[:, 0], (8, 1)))
    model = keras.Sequential([keras.Input((4,)), L.Dense(1),
                              L.Lambda(lambda h: tf.einsum("bi,bb->bi", h, diagonal)), L.Dense(3)])
    assert "takes a diagonal along the batch axis" in refusal(model, x4(), static=True)


def _rows_as_the_bias_of_a_value_set_by_position(h):
    # The mirror of round 50: a free value by position on axis 1, the batch's
    # rows as its NCHW bias.
    value = tf.constant(_ALTERNATING[:, 0].reshape(1, 8, 1))
    return tf.transpose(tf.nn.bias_add(value, h[:, 0], data_format="NCHW")[0])


def test_a_mask_set_by_position_is_refused():
    # Review round 31: an alternating mask weighed each example by its row, 6.3 C.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(3), _AlternatingMask()])
    assert "differ by position" in refusal(model, x4(), static=True)


_FLAG = keras.Variable(0.0, trainable=False)


def _branch_of_positions_or_rows(h):
    # Review round 36: 6.7 C through fit on Poisson batches, tagged as rows.
    return h * tf.cond(_FLAG > 0.5, lambda: h * 0.0 + 1.0, lambda: tf.constant(_ALTERNATING))


def _loop_from_positions(h):
    return tf.while_loop(lambda i, acc: i < 2, lambda i, acc: (i + 1, acc * h),
                         (tf.constant(0), tf.constant(_ALTERNATING)))[1]


@pytest.mark.parametrize("join", [_branch_of_positions_or_rows, _loop_from_positions],
                         ids=["cond", "while_loop"])
def test_a_value_set_by_position_is_refused_where_a_branch_or_loop_joins_it_with_rows(join):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(1), L.Lambda(join), L.Dense(3)])
    assert re.search("(depends on|differ by) its position", refusal(model, x4(), static=True))


def test_a_value_set_by_position_broadcast_to_the_batch_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(1), L.Lambda(
        lambda h: h * tf.broadcast_to(tf.constant(_ALTERNATING), tf.shape(h))), L.Dense(3)])
    assert "differ by its position" in refusal(model, x4())


def test_a_branch_or_loop_joining_rows_with_zeros_keeps_ghost_clipping():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(1), L.Lambda(
        lambda h: tf.cond(_FLAG > 0.5, lambda: h, lambda: tf.zeros_like(h))), L.Dense(3)])
    assert refusal(model, x4(), static=True) is None


def _warp_by_position(x):
    # Review round 40: odd rows moved out of frame by a constant transform
    # per position (keras.ops.image.affine_transform), 10.5 C.
    transforms = np.tile(np.array([1, 0, 0, 0, 1, 0, 0, 0], "float32"), (x.shape[0], 1))
    transforms[1::2, 2] = 100.0
    return keras.ops.image.affine_transform(x, transforms, interpolation="nearest",
                                            fill_mode="constant")


def test_an_image_transform_set_by_position_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 4, 1)), L.Lambda(_warp_by_position),
                              L.Flatten(), L.Dense(1)])
    images = rng().normal(size=(8, 4, 4, 1)).astype("float32")
    assert "depends on its position" in refusal(model, images, static=True)


def _resized_to_a_size_from_the_rows(x):
    # Review round 54: at a batch of two, a size read from the rows (one
    # value per example) let one example set the size of the other's image, 3 C.
    return tf.image.resize(x, tf.cast(tf.reduce_mean(x, axis=[1, 2, 3]) > 0, tf.int32) + 2,
                           method="nearest")


def test_a_resize_to_a_size_from_the_batch_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4, 4, 1)), L.Lambda(_resized_to_a_size_from_the_rows),
                              L.GlobalAveragePooling2D(), L.Dense(1)])
    images = rng().normal(size=(2, 4, 4, 1)).astype("float32")
    assert "transforms images across the batch" in refusal(model, images, static=True)


def _from_the_rows(h):
    # One value per example: at a batch of two, a parameter of two entries.
    return tf.cast(h[:, 0] > 0, tf.int32)


@pytest.mark.parametrize("scale", [
    lambda h: tf.reshape(tf.slice(tf.constant([[1.0, -1.0], [-1.0, 1.0]]),
                                  _from_the_rows(h), [1, 1]), []),
    lambda h: tf.pad([[1.0]], tf.stack([_from_the_rows(h)] * 2, axis=1),
                     constant_values=-1.0)[0, 0],
    lambda h: tf.reduce_sum(tf.split(h, _from_the_rows(h) + 1, axis=1)[0], axis=1,
                            keepdims=True),
], ids=["slice begin", "pad paddings", "split sizes"])
def test_a_parameter_read_from_the_rows_is_refused(scale):
    # Review round 55: a constant sliced (or padded) by a parameter read from
    # a batch of two rows scaled every example by what the other held, 3 C;
    # the batch split at sizes its rows give cuts each example where another says.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(2),
                              L.Lambda(lambda h: h * scale(h)), L.Dense(3)])
    assert re.search("into a value shared by every example|at sizes read from the batch",
                     refusal(model, x4(2), static=True))


class RecurrentFromPositions(keras.Model):
    """A recurrent layer whose initial state is set by position (review
    round 45: alternating signs per row, 12.1 C under ghost), or zeros."""

    def __init__(self, by_position):
        super().__init__()
        self.by_position = by_position
        self.rnn, self.head = L.SimpleRNN(2), L.Dense(3)

    def call(self, x):
        rows = x.shape[0]
        signs = np.where(np.arange(rows)[:, None] % 2 == 0, 3.0, -3.0)
        state = tf.constant(signs * np.ones((1, 2)) if self.by_position else np.zeros((rows, 2)),
                            tf.float32)
        return self.head(self.rnn(x, initial_state=state))


@pytest.mark.parametrize("by_position", [True, False])
def test_a_trusted_layer_given_a_value_set_by_position_is_refused(by_position):
    keras.utils.set_random_seed(0)
    model = RecurrentFromPositions(by_position)
    sequences = rng().normal(size=(8, 3, 2)).astype("float32")
    model(sequences)
    message = refusal(model, sequences, static=True)
    if by_position:
        assert "differ by its position" in message
    else:
        assert message is None


class DiagonalOfTwoDraws(L.Layer):
    """Review round 188: two draws of one seed, laid out as [B, 1, B] and
    [B, B, 1] (or one flat draw of B * B reshaped both ways), are equal
    exactly on the diagonal: the identity, which gives each example its
    position in the batch (x_j times (-1) ** j: 17 C under ghost)."""

    def __init__(self, flat=False, **kwargs):
        super().__init__(**kwargs)
        self.flat = flat
        self.seed = keras.random.SeedGenerator()

    def call(self, h):
        rows = h.shape[0]
        if rows is None:
            return h
        seed = tf.cast(self.seed.next(), tf.int32)
        if self.flat:
            draw = tf.random.stateless_uniform([rows * rows], seed=seed)
            a, b = tf.reshape(draw, [rows, 1, rows]), tf.reshape(draw, [rows, rows, 1])
        else:
            a = tf.random.stateless_uniform([rows, 1, rows], seed=seed)
            b = tf.random.stateless_uniform([rows, rows, 1], seed=seed)
        eye = tf.cast(tf.equal(a, b), h.dtype)  # [i, j, k] = (j == k)
        by_row = tf.reduce_mean(h[None, :, :1] * eye, axis=0)
        signs = tf.constant([(-1.0) ** k for k in range(rows)])
        return tf.reduce_sum(by_row * signs, axis=1, keepdims=True) + h


@pytest.mark.parametrize("flat", [False, True])
def test_two_draws_joined_element_wise_are_known_by_position(flat):
    message = refusal(between_dense(DiagonalOfTwoDraws(flat)), x4(), static=True)
    assert message is not None and re.search("position in the batch|mixes the examples",
                                             message)


class FirstRowOfTwoLayouts(L.Layer):
    """Review round 193: one seed drawn as [B] and as [B, 2] gives row i
    entry i of its stream in one and entry 2i in the other: equal at row 0
    alone, whatever the seed (3 C under ghost). Round 194: the same with a
    flat [2B] draw reshaped to [B, 2], whose shape past its first axis is
    the [B] draw's."""

    def __init__(self, flat=False, deep=False, **kwargs):
        super().__init__(**kwargs)
        self.flat, self.deep = flat, deep
        self.seed = keras.random.SeedGenerator()

    def call(self, h):
        rows = tf.shape(h)[0]
        seed = tf.cast(self.seed.next(), tf.int32)
        one = tf.random.stateless_uniform(tf.stack([rows]), seed=seed)
        for _ in range(300 if self.deep else 0):  # Past the walk's reach.
            seed = seed + tf.zeros_like(seed)
        if self.flat:
            two = tf.reshape(tf.random.stateless_uniform(tf.stack([2 * rows]), seed=seed),
                             tf.stack([rows, 2]))[:, 0]
        else:
            two = tf.random.stateless_uniform(tf.stack([rows, 2]), seed=seed)[:, 0]
        return h * (1.0 - 2.0 * tf.cast(tf.equal(one, two), h.dtype))[:, None]


@pytest.mark.parametrize("flat, deep", [(False, False), (True, False), (False, True)])
def test_draws_of_one_seed_laid_out_otherwise_are_refused(flat, deep):
    message = refusal(between_dense(FirstRowOfTwoLayouts(flat, deep)), x4())
    assert message is not None and "tells examples' positions apart" in message


def test_draws_of_one_generator_laid_out_alike_keep_ghost_clipping():
    # Keras' RandomZoom draws its height and width factors, [B, 1] each, from
    # one SeedGenerator (two next() calls).
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)), L.RandomZoom(0.2), L.Flatten(),
                              L.Dense(3)])
    assert refusal(model, rng().normal(size=(4, 8, 8, 1)).astype("float32")) is None


class FirstExampleAsASize(L.Layer):
    """Review round 197: tf.concat of the batch's shape with a row tensor
    was read as a shape of unknown sizes; its entry 1 (example 0's value)
    then scaled every example as a free value: 16.03 C under ghost."""

    def call(self, x):
        values = tf.cast(tf.sign(x[:, 0]), tf.int32)
        joined = tf.concat([tf.shape(x)[:1], values], 0)
        return x * tf.cast(joined[1], x.dtype)


def test_values_of_the_examples_are_never_read_as_sizes():
    message = refusal(between_dense(FirstExampleAsASize()), x4())
    assert message is not None and "ConcatV2" in message
