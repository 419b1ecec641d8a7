"""Ghost clipping against a brute-force per-example reference.

`check` runs `ghost.clipped_gradient_sum` (in a tf.function, as in
training) and an eager loop that differentiates every example alone, clips
its gradient and sums in float64. The clip is the 30% quantile of the
per-example norms, so clipping is active for about 70% of the examples.

Tolerance: float32 computations of the same quantity in a different order
(one batched matmul over all examples vs. one small gradient per example)
differ by rounding, about 1e-7 relative per operation. We compare each
variable's clipped sum by its L2 error: ||ghost - ref|| <= 1e-5 ||ref|| +
1e-7 ||ref of all variables|| (elementwise relative errors are meaningless
for entries near zero; the absolute term is for weights whose exact gradient
is zero, e.g. the key bias of attention, to which softmax is invariant, so
that only rounding noise remains), and the per-example norms with rtol 1e-5.
A float64 run checks the same algebra to 1e-10 relative, which only an
exact formula can meet. `check_vectorized` holds the vectorized engine to
the same loop.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_dp import mechanism
from keras_dp.clipping import ghost
from keras_dp.clipping import vectorized


RTOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def per_example_loss(batch, y_pred):
    return LOSS(batch["y"], y_pred, sample_weight=batch.get("sample_weight"))


def rng(seed=0):
    return np.random.default_rng(seed)


def take(batch, i):
    return tf.nest.map_structure(lambda t: t[i:i + 1], batch)


def per_example_gradients(model, batch, loss_fn=per_example_loss):
    """Eager loop: each example's gradient (float64), its norm and its loss."""
    variables = model.trainable_variables
    size = len(tf.nest.flatten(batch["y"])[0])
    gradients, norms, losses = [], [], []
    for i in range(size):
        example = take(batch, i)
        with tf.GradientTape() as tape:
            loss = loss_fn(example, model(example["x"], training=True))[0]
        # The backend's variables: TensorFlow cannot make the zeros of an
        # unconnected Keras Variable (its dtype is a string).
        grads = tape.gradient(loss, [v.value for v in variables],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads]
        gradients.append(grads)
        norms.append(np.sqrt(sum(np.sum(g ** 2) for g in grads)))
        losses.append(float(loss))
    return gradients, np.array(norms), np.array(losses)


def clipped_sum(gradients, norms, clip):
    """The sum of the per-example gradients clipped to `clip` (non-finite ones left out)."""
    total = [np.zeros(g.shape, np.float64) for g in gradients[0]]
    for grads, norm in zip(gradients, norms):
        if np.isfinite(norm):
            total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads)]
    return total


def brute_force(model, batch, clip, loss_fn=per_example_loss):
    """Eager loop: per-example gradient, its norm, clip, sum (float64)."""
    gradients, norms, losses = per_example_gradients(model, batch, loss_fn)
    return clipped_sum(gradients, norms, clip), norms, losses


def check(model, batch, rtol=RTOL, xla=False, loss_fn=per_example_loss, norms=True, **kwargs):
    """Asserts ghost clipping equals brute force; returns the clip used.

    `norms=False` leaves out the comparison of `ghost.per_example_norms`,
    which traces the model a second time: the clipped sum, with most
    examples clipped, already depends on each clipped example's norm.
    """
    variables = model.trainable_variables
    gradients, norms_wanted, losses = per_example_gradients(model, batch, loss_fn)
    finite = np.isfinite(norms_wanted)
    clip = float(np.quantile(norms_wanted[finite], 0.3))
    expected = clipped_sum(gradients, norms_wanted, clip)
    assert np.mean(norms_wanted > clip) >= 0.5  # Clipping is active for most examples.

    @tf.function(jit_compile=xla, autograph=False)  # As Keras traces its train step.
    def run(batch):
        clipped = ghost.clipped_gradient_sum(model, batch, variables, clip, loss_fn, **kwargs)
        if not norms:
            return clipped, ()
        return clipped, ghost.per_example_norms(model, batch, variables, loss_fn,
                                                kwargs.get("outer_method", "auto"))

    clipped, ghost_norms = with_unknown_rows(run, batch)
    grad_sum, ghost_losses, outputs, num_nonfinite = clipped[:4]
    assert_sums_close(grad_sum, expected, variables, rtol)
    if norms:
        np.testing.assert_allclose(ghost_norms.numpy()[finite], norms_wanted[finite], rtol=rtol)
    np.testing.assert_allclose(ghost_losses.numpy()[finite], losses[finite], rtol=rtol, atol=1e-6)
    assert tf.nest.flatten(outputs)[0].shape[0] == len(norms_wanted)
    assert int(num_nonfinite) == int(np.sum(~finite))
    assert ghost.supports(model)
    return clip


def with_unknown_rows(function, batch):
    """Runs the tf.function `function` on `batch`, traced with an unknown batch
    size, as fit traces bucketed Poisson batches."""
    batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
    unknown_rows = tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + t.shape[1:], t.dtype), batch)
    return function.get_concrete_function(unknown_rows)(batch)


def assert_sums_close(grad_sum, expected, variables, rtol=RTOL):
    """Asserts each clipped sum has its variable's static shape and is within
    the module's tolerance of the brute-force one."""
    assert len(grad_sum) == len(variables)
    scale = np.sqrt(sum(np.sum(e ** 2) for e in expected))
    for g, e, v in zip(grad_sum, expected, variables):
        assert g.shape == v.shape
        error = np.linalg.norm(np.asarray(g, np.float64) - e)
        assert error <= rtol * np.linalg.norm(e) + rtol * 1e-2 * scale, (v.path, error)


def labels(n, classes=3):
    return rng(1).integers(0, classes, n)


def check_vectorized(model, batch, loss_fn=per_example_loss):
    """Asserts the vectorized engine, one microbatch per example and traced
    with an unknown batch size, equals brute force; returns the clip used."""
    variables = model.trainable_variables
    gradients, norms, _ = per_example_gradients(model, batch, loss_fn)
    clip = float(np.quantile(norms, 0.3))
    static_shapes = []

    @tf.function(autograph=False)
    def run(batch):
        def microbatch_loss(microbatch):
            y_pred = model(microbatch["x"], training=True)
            return tf.reduce_sum(loss_fn(microbatch, y_pred)), y_pred

        size = tf.shape(tf.nest.flatten(batch["y"])[0])[0]
        grad_sum = vectorized.clipped_gradient_sum(microbatch_loss, variables, batch, size,
                                                   clip)[0]
        static_shapes.extend(g.shape for g in grad_sum)
        return grad_sum

    grad_sum = with_unknown_rows(run, batch)
    assert static_shapes == [v.shape for v in variables]  # The noise needs them.
    assert_sums_close(grad_sum, clipped_sum(gradients, norms, clip), variables)
    return clip


def train_on_laid_out_batch(private, x, y, sample_weight=None):
    """One step of `private` on (x, y, sample_weight) as on a batch keras-dp
    laid out for its optimizer's microbatches (as `poisson_dataset` puts
    each example in a random group), with the rows where the test put them:
    train_on_batch refuses microbatches of several examples on a batch it
    did not lay out (review round 150), whose arithmetic this still checks."""
    batch = tuple(tf.convert_to_tensor(part) for part in (x, y, sample_weight)
                  if part is not None)
    private._maybe_symbolic_build(data_batch=batch)
    train_function = private.make_train_function()
    laid_out = mechanism.Sampling(tuple(mechanism.OUTSIDE_FIT.row),
                                  layout=mechanism.layout_of(private.optimizer.dp_settings))
    with private.step_mechanism.using(laid_out):
        train_function([batch])
    private.step_mechanism.raise_refusals()
