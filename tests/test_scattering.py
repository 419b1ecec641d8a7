"""The demo's scattering transform against its definition."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import scattering  # noqa: E402

# Whole private steps, whose kernel-level parts (each layer family's
# per-example gradients, the engines, noise) tests/clipping checks under
# both oneDNN settings: `make test` runs each test, and each parametrized
# case, in one of its two runs (pytest.ini's marker).
pytestmark = pytest.mark.alternating

SIZE = 28


def blob_images(count, seed):
    """Smooth random shapes away from the border (so circular shifts stay inside)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:SIZE, :SIZE]
    images = np.zeros((count, SIZE, SIZE), np.float32)
    for image in images:
        for _ in range(3):
            cy, cx = rng.uniform(9, 19, 2)
            sy, sx = rng.uniform(1.5, 4, 2)
            image += rng.uniform(0.3, 1) * np.exp(-((yy - cy) / sy) ** 2 - ((xx - cx) / sx) ** 2)
    return images


def reference_features(image, transform):
    """The definition at full resolution in numpy: S0 = x * phi,
    S1 = |x * psi_j1| * phi, S2 = ||x * psi_j1| * psi_j2| * phi, each
    sampled every 2^J pixels over the image (circular convolutions of the
    reflect-padded image)."""
    psi, phi = scattering.filter_bank(transform.padded_size, 2, 8)
    before = transform.pad_before
    after = transform.padded_size - SIZE - before
    x = np.pad(image.astype(np.float64), [(before, after)] * 2, mode="reflect")

    def conv(signal, filt_hat):
        return np.fft.ifft2(np.fft.fft2(signal) * filt_hat)

    def average(u):
        return np.real(conv(u, phi))[before:before + SIZE:4, before:before + SIZE:4]

    channels = [average(x)]
    first = [[np.abs(conv(x, psi[j, t])) for t in range(8)] for j in range(2)]
    channels += [average(u) for j in range(2) for u in first[j]]
    channels += [average(np.abs(conv(u, psi[1, t2]))) for u in first[0] for t2 in range(8)]
    return np.stack(channels, axis=-1)


def test_shape_and_channels():
    transform = scattering.Scattering2D(SIZE)
    features = transform(blob_images(3, 0))
    assert features.shape == (3, 7, 7, 81) and features.dtype == np.float32
    assert transform.num_channels == 81 == 1 + 2 * 8 + 8 * 8


def test_matches_the_definition_at_full_resolution():
    # The transform samples |x * psi_1| every 2 pixels before its next
    # convolution (where psi_1's band ends): a small, stated approximation.
    transform = scattering.Scattering2D(SIZE)
    images = blob_images(4, 1)
    features = transform(images)
    for image, got in zip(images, features):
        expected = reference_features(image, transform)
        # S0 and the first-order j1 = 0 channels involve no subsampling.
        np.testing.assert_allclose(got[..., :9], expected[..., :9], rtol=1e-4,
                                   atol=1e-5 * np.abs(expected).max())
        error = np.linalg.norm(got - expected, axis=(0, 1)) / np.linalg.norm(expected, axis=(0, 1))
        assert error.max() < 0.02, error


def test_the_first_layer_is_a_contraction_that_keeps_most_energy():
    # Littlewood-Paley: for a real image, ||x * phi||^2 + sum ||x * psi||^2
    # lies between 0.12 and 1.0 times ||x||^2 on the padded grid.
    psi, phi = scattering.filter_bank(36, 2, 8)
    x = np.random.default_rng(2).normal(size=(36, 36))
    spectrum = np.abs(np.fft.fft2(x)) ** 2
    energy = np.sum(spectrum * (phi ** 2 + np.sum(psi ** 2, axis=(0, 1)))) / 36 ** 2
    assert 0.12 * np.sum(x ** 2) < energy <= 1.0 * np.sum(x ** 2)
    # The symmetrized Littlewood-Paley sum never exceeds 1 at any frequency.
    mirrored = np.roll(np.flip(psi, (-2, -1)), 1, (-2, -1))
    littlewood_paley = phi ** 2 + 0.5 * np.sum(psi ** 2 + mirrored ** 2, axis=(0, 1))
    assert littlewood_paley.max() <= 1.0 + 1e-9
    assert np.all(np.abs(psi[:, :, 0, 0]) < 1e-9)  # Wavelets have zero mean.


@pytest.mark.parametrize("shift", [(1, 0), (0, 1), (1, 1)])
def test_small_translations_move_the_features_less_than_the_pixels(shift):
    # Invariance holds up to the averaging scale 2^J = 4 pixels: a one-pixel
    # shift moves the features by ~0.7 of the pixels' relative change (0.2
    # to 0.3 here), about a quarter of the distance to other images.
    transform = scattering.Scattering2D(SIZE)
    images, others = blob_images(8, 3), blob_images(8, 4)
    shifted = np.roll(images, shift, axis=(1, 2))

    def relative(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    features = transform(images)
    feature_change = relative(transform(shifted), features)
    assert relative(shifted, images) > 0.2
    assert feature_change < 0.8 * relative(shifted, images)
    assert feature_change < 0.4 * relative(transform(others), features)
