"""A GAN whose discriminator is the private model (issue 45, docs/migrating_from_tf_privacy.md).

keras-io's GAN of "Customizing what happens in fit()" on generated data of
MNIST's layout (28 x 28 x 1 images of two kinds: a bright top half or a
bright bottom half), split as the recipe does: the discriminator's steps on
real images are the private model's, on keras-dp's Poisson draws; its steps
on generated images (labelled 0) and the generator's steps through it are
ordinary Keras steps on public data, post-processing. The private
discriminator's epsilon is dp_accounting's for exactly its real steps, no
real image reaches an ordinary step, and the generator learns the real
images' layout.
"""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp

pytestmark = pytest.mark.program

NUM_REAL, BATCH_SIZE, LATENT_DIM, STEPS = 512, 64, 8, 150
CLIP, SIGMA, DELTA = 1.0, 1.0, 1e-5
D_LEARNING_RATE, G_LEARNING_RATE = 1e-2, 2e-2
LOSS = keras.losses.BinaryCrossentropy(from_logits=True)


def real_images(num_images=NUM_REAL, seed=0):
    """Half the images bright on top, half bright at the bottom, in [0, 1]."""
    rng = np.random.default_rng(seed)
    images = np.full((num_images, 28, 28, 1), 0.1, "float32")
    images[: num_images // 2, :14] = 0.9
    images[num_images // 2:, 14:] = 0.9
    noise = rng.normal(0.0, 0.05, images.shape).astype("float32")
    return np.clip(images + noise, 0.0, 1.0)


def half_contrast(images):
    """|mean of the top half - mean of the bottom half|, averaged over images:
    0.8 for the real images, 0 for uniform grey ones."""
    images = np.asarray(images)
    return float(np.mean(np.abs(images[:, :14].mean(axis=(1, 2, 3))
                                - images[:, 14:].mean(axis=(1, 2, 3)))))


def extremeness(images):
    """Mean |pixel - 0.5|: 0.4 for the real images, 0 for uniform grey ones."""
    return float(np.mean(np.abs(np.asarray(images) - 0.5)))


def get_discriminator():
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.AveragePooling2D(7),
        keras.layers.Flatten(),
        keras.layers.Dense(16),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Dense(1),
    ], name="discriminator")


def get_generator():
    return keras.Sequential([
        keras.Input(shape=(LATENT_DIM,)),
        keras.layers.Dense(32),
        keras.layers.LeakyReLU(negative_slope=0.2),
        keras.layers.Dense(28 * 28, activation="sigmoid"),
        keras.layers.Reshape((28, 28, 1)),
    ], name="generator")


def generator_step_of(generator, discriminator, optimizer):
    """The guide's generator step, through the discriminator (not trained by it)."""

    @tf.function
    def train_generator(random_latent_vectors):
        with tf.GradientTape() as tape:
            predictions = discriminator(generator(random_latent_vectors))
            g_loss = LOSS(tf.ones_like(predictions), predictions)  # "Real", to fool it.
        grads = tape.gradient(g_loss, generator.trainable_weights)
        optimizer.apply_gradients(zip(grads, generator.trainable_weights))
        return g_loss

    return train_generator


def record_inputs(model, seen):
    """Makes `model.train_on_batch` append its inputs to `seen` first."""
    train_on_batch = model.train_on_batch

    def recorded(x, *args, **kwargs):
        seen.append(np.asarray(x))
        return train_on_batch(x, *args, **kwargs)

    model.train_on_batch = recorded


def train_gan(x_real):
    """The recipe's loop at fixed seeds.

    Returns:
        The private discriminator, the real rows of its draws and the inputs
        of the base discriminator's (ordinary) steps, one array per step.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)  # The latent noise: public.
    discriminator, generator = get_discriminator(), get_generator()
    discriminator_private = keras_dp.make_private(discriminator)
    discriminator_private.compile(optimizer=keras_dp.DPKerasAdam(
        l2_norm_clip=CLIP, noise_multiplier=SIGMA, learning_rate=D_LEARNING_RATE, seed=2),
        loss=LOSS)
    real_batches = keras_dp.custom_loops.PoissonBatches(keras_dp.data.poisson_dataset(
        x_real, np.ones((len(x_real), 1), "float32"), expected_batch_size=BATCH_SIZE, seed=3))
    discriminator.compile(optimizer=keras.optimizers.Adam(D_LEARNING_RATE), loss=LOSS)
    train_generator = generator_step_of(
        generator, discriminator, keras.optimizers.Adam(G_LEARNING_RATE))
    real_seen, fake_seen = [], []
    record_inputs(discriminator, fake_seen)
    for _ in range(STEPS):
        discriminator_private.train_on_batch(real_batches)
        real_seen.append(np.asarray(real_batches.last_batch[0]))
        generated_images = generator(rng.normal(size=(BATCH_SIZE, LATENT_DIM)))
        discriminator.train_on_batch(generated_images, np.zeros((BATCH_SIZE, 1), "float32"))
        train_generator(rng.normal(size=(BATCH_SIZE, LATENT_DIM)).astype("float32"))
    return discriminator_private, real_seen, fake_seen


def dp_accounting_epsilon(steps):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        BATCH_SIZE / NUM_REAL, dp_accounting.GaussianDpEvent(SIGMA)), steps)
    return accountant.get_epsilon(DELTA)


def rows_in(batches, images):
    """How many rows of `batches` equal (bit for bit) one of `images`."""
    known = {image.tobytes() for image in images}
    return sum(row.tobytes() in known for batch in batches for row in batch)


# A whole GAN (11 s): make test-all; make test runs the custom-loop guide's
# program, whose private step the recipe's discriminator takes.
@pytest.mark.slow
def test_the_private_discriminator_spends_only_its_real_steps_and_the_generator_learns():
    x_real = real_images()
    discriminator_private, real_seen, fake_seen = train_gan(x_real)

    # (a), (b): the ledger holds the real steps alone, Poisson-sampled at q = B / N.
    assert discriminator_private.privacy_steps == STEPS
    assert [s.sampling for s in discriminator_private.privacy_ledger.segments()] == [
        "poisson"]
    assert discriminator_private.privacy_spent(DELTA)[0] == pytest.approx(
        dp_accounting_epsilon(STEPS), rel=1e-2)

    # (c): the private steps trained on real images, the ordinary steps on none.
    assert rows_in(real_seen, x_real) == sum(len(batch) for batch in real_seen) > 0
    assert len(fake_seen) == STEPS
    assert rows_in(fake_seen, x_real) == 0

    # (d): the fakes of the last 50 steps against the first step's (the
    # generator untrained): pixels near 0.1 or 0.9 rather than 0.5, and one
    # half of each image brighter than the other, as in the real images.
    # Averaged over 50 steps, as the generator swaps between the two kinds.
    first, last = fake_seen[0], np.concatenate(fake_seen[-50:])
    real_extremeness = extremeness(x_real)
    assert abs(extremeness(last) - real_extremeness) < 0.25 * abs(
        extremeness(first) - real_extremeness)
    assert half_contrast(first) < 0.01 and half_contrast(last) > 0.03
