"""The privacy ledger: the mechanism of every private step, as it ran.

A ledger is a short list of segments. A segment is a run of consecutive
steps with one mechanism: how batches were sampled, the noise multiplier,
the sensitivity (in multiples of the clipping norm C) and the per-step
truncation delta. The private train step appends to it in the graph the
row that `keras_dp.mechanism` fixed for the step: a step whose row equals
the last segment's extends it, any other starts a new segment. So every
path that trains (fit, train_on_batch, a custom loop calling `train_step`)
is recorded. fit() states where each pass over the data starts
(`PassStarts`).

The ledger belongs to the variables it protects (`for_variables`): every
private model whose trainable variables include them records into the same
ledger (a re-wrap, an alias `keras.Model(base.inputs, base.outputs)`, a
larger model around a privately trained one), and a model whose variables
carry several ledgers composes them. Its `counter` numbers the steps taken
on those variables: the noise block of each step, so it only moves forward,
on every path, also when the table of segments is full (those steps are
then counted as `unrecorded`, and epsilon is infinite: never less than what
ran). No guarantee rests on an in-graph assertion, which XLA removes.

Epsilon (`keras_dp.budget`) is the `dp_accounting` composition of the
segments' events. The ledger is saved with the private model and its
checkpoints (not among its weights); a restore never lowers it.
"""

from keras_dp.ledger.files import absolute_path
from keras_dp.ledger.files import is_legacy_h5
from keras_dp.ledger.files import load_whole
from keras_dp.ledger.files import refuse_legacy_h5_save
from keras_dp.ledger.ownership import for_variables
from keras_dp.ledger.ownership import remember_values
from keras_dp.ledger.rows import CAPACITY
from keras_dp.ledger.rows import FIELDS
from keras_dp.ledger.rows import COLUMN
from keras_dp.ledger.rows import UNKNOWN_SAMPLING
from keras_dp.ledger.rows import Segment
from keras_dp.ledger.rows import Selection
from keras_dp.ledger.rows import extended
from keras_dp.ledger.rows import full_row
from keras_dp.ledger.rows import releases_of
from keras_dp.ledger.rows import sampling_mechanism
from keras_dp.ledger.rows import sampling_row
from keras_dp.ledger.rows import segment_of_row
from keras_dp.ledger.rows import unit_of
from keras_dp.ledger.table import LedgerCheckpoint
from keras_dp.ledger.table import PrivacyLedger
from keras_dp.ledger.table import budget_in_force_anywhere
from keras_dp.ledger.table import full_row_in_graph
from keras_dp.ledger.table import load_from
from keras_dp.ledger.table import save_to
from keras_dp.ledger.table import seed_key
