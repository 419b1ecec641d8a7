"""Per-example clipping: the transforms of DP-SGD and the two clipping engines.

Layout:

* `transforms`: the pure clipping steps of DP-SGD (gradients, global norm,
  clip; the noise is `keras_dp.noise`'s); `bounds`: the clipping rule of a step (flat, per-layer,
  normalization) as both engines apply it, and what they return;
  `onednn`: which CPU kernels TensorFlow runs.
* `vectorized`: the engine for every model, per-example gradients with
  `tf.vectorized_map`.
* `ghost`: the engine for models whose trainable layers all have a norm
  function: one forward and one backward pass. Its parts: `registry` (which
  norm function handles which layer), `recorder` (the forward pass through
  the norm functions), `factors` (how a norm function describes a
  per-example gradient), `contributions` (norms and clipped sums from
  factors), `losses` (per-example losses from the compiled loss).
* `layers`: the built-in norm functions, one module per layer family.
* `engine`: a private model's choice between the two engines (its
  `clipping_engine`), and the run of the chosen one, per example or per
  user (`rows_per_unit`: the summed gradient of a user's rows, bounded once).

Adding a built-in layer: one module in `layers/` (e.g. `layers/conv.py`),
whose norm function (see `registry.register_norm_function`) returns a
factor for every trainable weight it reads and which registers it at import,
imported by `layers/__init__.py`; and one test file in tests/clipping/ that
checks the layer against the brute-force per-example loop (`check` in
tests/brute_force.py) for each option the norm function branches on.
"""

from keras_dp.clipping import layers  # noqa: F401  Registers the built-in norm functions.
from keras_dp.clipping.bounds import Bound
from keras_dp.clipping.bounds import ClippedSum
from keras_dp.clipping.factors import GatheredRows
from keras_dp.clipping.factors import OuterProduct
from keras_dp.clipping.factors import PerExample
from keras_dp.clipping.onednn import runs_on_onednn
from keras_dp.clipping.registry import UnsupportedModelError
from keras_dp.clipping.registry import register_norm_function
from keras_dp.clipping.transforms import clip_by_global_norm
from keras_dp.clipping.transforms import global_norm
from keras_dp.clipping.transforms import gradients
from keras_dp.clipping.vectorized import clipped_gradient_sum
