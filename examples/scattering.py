"""A 2-D scattering transform (Mallat 2012) with a fixed Morlet filter bank.

The scattering transform is a data-independent feature extractor: cascades of
wavelet convolutions and complex moduli, averaged by a low-pass filter. With
J scales and L orientations an image gives

    S0 x = x * phi,
    S1 x = |x * psi_(j1, t1)| * phi,
    S2 x = ||x * psi_(j1, t1)| * psi_(j2, t2)| * phi     (j2 > j1),

1 + J L + L^2 J (J - 1) / 2 channels (81 for J = 2, L = 8), each subsampled
by 2^J. Tramer & Boneh (ICLR 2021) train private linear models and CNNs on
these features. Its filters are fixed, so computing it costs no privacy.

Every convolution is a product in the Fourier domain of the reflect-padded
image, at full resolution (no intermediate subsampling); the filters follow
the usual Morlet construction (Gaussian envelope of width 0.8 * 2^j, centre
frequency 3 pi / 4 / 2^j, slant 4 / L, zero mean), periodized on the padded
grid.
"""

import math

import numpy as np
import tensorflow as tf


def _gabor(size, sigma, theta, xi, slant):
    """A Gabor filter on a `size x size` grid, periodized over 5 x 5 copies."""
    rotation = np.array([[math.cos(theta), -math.sin(theta)],
                         [math.sin(theta), math.cos(theta)]])
    curvature = rotation @ np.diag([1.0, slant ** 2]) @ rotation.T / (2 * sigma ** 2)
    filt = np.zeros((size, size), np.complex128)
    for shift_x in range(-2, 3):
        for shift_y in range(-2, 3):
            xx, yy = np.mgrid[shift_x * size:(shift_x + 1) * size,
                              shift_y * size:(shift_y + 1) * size]
            envelope = -(curvature[0, 0] * xx ** 2
                         + (curvature[0, 1] + curvature[1, 0]) * xx * yy
                         + curvature[1, 1] * yy ** 2)
            phase = xi * (xx * math.cos(theta) + yy * math.sin(theta))
            filt += np.exp(envelope + 1j * phase)
    return filt * slant / (2 * math.pi * sigma ** 2)


def _morlet(size, sigma, theta, xi, slant):
    """A Morlet wavelet: a Gabor filter minus its envelope, so its mean is 0."""
    wave = _gabor(size, sigma, theta, xi, slant)
    envelope = _gabor(size, sigma, theta, 0.0, slant)
    return wave - envelope * (wave.sum() / envelope.sum())


def filter_bank(size, scales, orientations):
    """Fourier transforms of the wavelets and of the low-pass filter.

    Args:
        size: side of the (padded) square grid.
        scales: J.
        orientations: L.

    Returns:
        `(psi, phi)`: `psi` a `[J, L, size, size]` float64 array (the wavelets'
        Fourier transforms, real because the wavelets are symmetric under
        x -> -x up to conjugation), `phi` a `[size, size]` one.
    """
    psi = np.empty((scales, orientations, size, size))
    for j in range(scales):
        for t in range(orientations):
            theta = (int(orientations - orientations / 2 - 1) - t) * math.pi / orientations
            wavelet = _morlet(size, 0.8 * 2 ** j, theta, 3.0 / 4.0 * math.pi / 2 ** j,
                              4.0 / orientations)
            psi[j, t] = np.real(np.fft.fft2(wavelet))
    phi = np.real(np.fft.fft2(_gabor(size, 0.8 * 2 ** (scales - 1), 0.0, 0.0, 1.0)))
    return psi, phi


class Scattering2D:
    """The scattering transform of square grayscale images.

    Args:
        image_size: side of the input images (28 for Fashion-MNIST).
        scales: J, the number of dyadic scales (output subsampled by 2^J).
        orientations: L, the number of wavelet orientations.

    Example:
    ```python
    features = Scattering2D(28)(images)   # [N, 28, 28] -> [N, 7, 7, 81]
    ```
    """

    def __init__(self, image_size, scales=2, orientations=8):
        step = 2 ** scales
        self.image_size = image_size
        self.scales = scales
        self.orientations = orientations
        # Reflect-pad by at least 2^J on each side, to a multiple of 2^J.
        self.padded_size = (image_size // step + 2) * step
        self.pad_before = (self.padded_size - image_size) // 2
        self.output_size = -(-image_size // step)
        psi, phi = filter_bank(self.padded_size, scales, orientations)
        # Each filter at every resolution r (grid subsampled by 2^r) it meets.
        # On the coarse grid a sample stands for 4^r pixels, hence the factor.
        def at(filt, r):
            return tf.constant(4 ** r * _fold(filt, 2 ** r), tf.complex64)
        self._psi = [[at(psi[j], r) for r in range(j + 1)] for j in range(scales)]
        self._phi = [at(phi, r) for r in range(scales + 1)]

    @property
    def num_channels(self):
        j, l = self.scales, self.orientations
        return 1 + j * l + l * l * j * (j - 1) // 2

    def __call__(self, images, chunk_size=500):
        """Features of `images` ([N, H, W], any real dtype) as `[N, h, w, C]` float32."""
        images = np.asarray(images, np.float32)
        chunks = [self._transform(tf.constant(images[start:start + chunk_size])).numpy()
                  for start in range(0, len(images), chunk_size)]
        return np.concatenate(chunks) if chunks else np.zeros(
            (0, self.output_size, self.output_size, self.num_channels), np.float32)

    @tf.function(reduce_retracing=True)
    def _transform(self, images):
        after = self.padded_size - self.image_size - self.pad_before
        padded = tf.pad(images, [[0, 0], [self.pad_before, after], [self.pad_before, after]],
                        mode="REFLECT")
        x_hat = tf.signal.fft2d(tf.cast(padded, tf.complex64))[:, None]  # [N, 1, M, M]
        first_order, second_order = [], []
        for j1 in range(self.scales):
            # |x * psi_j1| sampled every 2^j1 pixels, where its band ends.
            u1_hat = _modulus_hat(_fold(x_hat * self._psi[j1][0], 2 ** j1))
            first_order.append(self._average(u1_hat, j1))
            for j2 in range(j1 + 1, self.scales):
                u2_hat = _modulus_hat(_fold(u1_hat[:, :, None] * self._psi[j2][j1],
                                            2 ** (j2 - j1)))  # [N, L, L, m, m]
                size = u2_hat.shape[-1]
                second_order.append(self._average(
                    tf.reshape(u2_hat, [-1, self.orientations ** 2, size, size]), j2))
        outputs = [self._average(x_hat, 0)] + first_order + second_order
        features = tf.concat(outputs, axis=1)  # [N, C, M / 2^J, M / 2^J]
        first = self.pad_before // 2 ** self.scales  # Unpad.
        features = features[:, :, first:first + self.output_size, first:first + self.output_size]
        return tf.transpose(features, [0, 2, 3, 1])

    def _average(self, u_hat, resolution):
        """Maps at `resolution`, low-pass filtered and subsampled to 2^J."""
        folded = _fold(u_hat * self._phi[resolution], 2 ** (self.scales - resolution))
        return tf.math.real(tf.signal.ifft2d(folded))


def _modulus_hat(u_hat):
    """Fourier transform of |ifft(u_hat)|."""
    return tf.signal.fft2d(tf.cast(tf.abs(tf.signal.ifft2d(u_hat)), tf.complex64))


def _fold(spectrum, factor):
    """The spectrum of a signal subsampled by `factor` along both last axes:
    the average of the spectrum's aliases (exact for a DFT)."""
    if factor == 1:
        return spectrum
    size = spectrum.shape[-1] // factor
    lead = list(spectrum.shape[:-2]) if isinstance(spectrum, np.ndarray) else None
    if lead is not None:
        return spectrum.reshape(lead + [factor, size, factor, size]).mean(axis=(-4, -2))
    shape = tf.concat([tf.shape(spectrum)[:-2], [factor, size, factor, size]], axis=0)
    return tf.reduce_mean(tf.reshape(spectrum, shape), axis=[-4, -2])
