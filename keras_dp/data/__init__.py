"""Poisson-sampled datasets: the batching that DP-SGD's privacy analysis assumes.

keras-dp draws the batches its accountant vouches for:

* `poisson_dataset` (`keras_dp.data.poisson`): each example in each batch
  independently with probability q = B / N, padded to a few sizes;
* `truncated_poisson_dataset` (`keras_dp.data.truncated`): the same draw
  truncated to a fixed maximum, one compiled shape;
* `user_dataset` (`keras_dp.data.users`): Poisson sampling over users, at
  most k rows each.

Each takes arrays or an unbatched tf.data pipeline of examples
(`keras_dp.data.examples`), and attaches to the dataset it returns a
`SamplingInfo` (`keras_dp.data.info`) that the private model's fit and the
accountant read.
"""

from keras_dp.data.batch_maps import check_batch_map
from keras_dp.data.examples import DEFAULT_MAX_DATASET_BYTES
from keras_dp.data.examples import examples_of
from keras_dp.data.examples import is_batched
from keras_dp.data.info import SEED_SOURCES
from keras_dp.data.info import UNITS
from keras_dp.data.info import SamplingInfo
from keras_dp.data.info import check_secure_sampling
from keras_dp.data.info import sampling_info_of
from keras_dp.data.info import source_functions_of
from keras_dp.data.poisson import DEFAULT_TRUNCATION_PROBABILITY
from keras_dp.data.poisson import poisson_dataset
from keras_dp.data.poisson import truncation_probability
from keras_dp.data.truncated import truncated_poisson_dataset
from keras_dp.data.users import DEFAULT_MAX_EXAMPLES_PER_USER
from keras_dp.data.users import user_dataset
from keras_dp.data.users import user_digest
from keras_dp.data.users import user_indices
