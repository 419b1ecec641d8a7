"""Private training under `tf.distribute`: one private step over all replicas.

With R replicas (devices of one machine under `MirroredStrategy`, of several
under `MultiWorkerMirroredStrategy`), a logical step is still ONE DP-SGD
step on one global batch:

1. Each replica clips its own examples (ghost or vectorized engine) and
   sums them.
2. The clipped sums are all-reduced (SUM) before any noise, so every replica
   holds the global clipped sum.
3. Every replica adds the SAME Gaussian noise of std sigma * C to it: drawn
   from the block of the keyed stream given by the step count of the privacy
   ledger, with the noise key of the chief, which every worker receives when
   the optimizer is created. The noise is thus drawn once per logical step
   (R identical copies, one per replica's weights, never summed) and never
   crosses the network.
4. The noisy sum is divided by the GLOBAL (expected) batch, and each replica
   applies the same update to its copy of the weights.

With gradient accumulation over k batches, every replica adds each step's
global clipped sum to its copy of the optimizer's accumulators, and the
k-th batch noises the accumulated sum once (block t of the stream, t the
logical step), divides it by k times the global batch, and applies it on
every replica (`run_if`).

Poisson batches are drawn over the whole training set, with a seed shared
by every worker, and each physical batch is split evenly over the replicas
(`keras_dp.data.poisson_dataset(..., num_replicas=R)`).
"""

import tensorflow as tf
from keras.src.losses import loss as loss_module

from keras_dp import sampling_schemes

# Strategies whose replicas take one synchronous step together, with
# replica-context all-reduce: the private step's requirements.
_SYNCHRONOUS_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.OneDeviceStrategy,
    tf.distribute.TPUStrategy,
)


def sum_over_replicas(structure):
    """Sums a structure of tensors over all replicas (identity with one).

    Called in replica context (the train step); every replica receives the
    same sums.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return structure
    return context.all_reduce(tf.distribute.ReduceOp.SUM, structure)


def batches_of_replicas(batch_size, even_rows):
    """What a step needs of every replica's batch, in one all-gather (TF has
    no MIN or MAX all-reduce): whether `even_rows` holds on every replica,
    and the sum and the largest of their `batch_size`s (the inputs
    themselves with one replica)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return even_rows, batch_size, batch_size
    mine = tf.stack([tf.cast(batch_size, tf.int64),
                     tf.cast(tf.logical_not(even_rows), tf.int64)])
    gathered = context.all_gather(mine[None], axis=0)
    sizes = tf.cast(gathered[:, 0], batch_size.dtype)
    return (tf.equal(tf.reduce_sum(gathered[:, 1]), 0), tf.reduce_sum(sizes),
            tf.reduce_max(sizes))


def on_every_replica(holds):
    """Whether a bool tensor holds on every replica (itself with one).

    A step's checks read each replica's own batch, and a custom loop may give
    each replica a batch of its own (review round 27: uneven rows on
    replica 1 went unread, 15 C at 16 rows; its microbatches of two were
    recorded at replica 0's sensitivity, 4.73 reported against 10.7)."""
    return tf.equal(sum_over_replicas(tf.cast(tf.logical_not(holds), tf.int32)), 0)


def run_if(predicate, fn, *args):
    """Runs `fn(*args)` on every replica when `predicate` holds (the same on all).

    `fn` may synchronize the replicas (Keras' optimizer applies through
    `merge_call`), which TensorFlow refuses inside a `tf.cond` of the
    replicas' own graphs. So the replicas first meet in cross-replica
    context, where the condition is taken once and `fn` runs on every
    replica inside it. Per-replica tensors must reach `fn` through `args`.
    Without a strategy this is a plain `tf.cond`.
    """
    def on_all_replicas(strategy, predicate, *args):
        def run():
            strategy.run(fn, args=args)
            return tf.constant(True)

        # Every replica counted the same batches, so holds the same predicate.
        first = strategy.experimental_local_results(predicate)[0]
        tf.cond(first, run, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(on_all_replicas, args=(predicate, *args))


def split_over_replicas(strategy, batch):
    """Per-replica values: replica r of R gets rows [r B / R, (r + 1) B / R).

    `batch` is a tuple of structures of arrays of B rows (or None), the same
    on every worker.
    """
    num_rows = int(tf.nest.flatten([part for part in batch if part is not None])[0].shape[0])
    replicas = strategy.num_replicas_in_sync

    def share_of(part):
        def share(context):
            replica = context.replica_id_in_sync_group
            rows = slice(replica * num_rows // replicas, (replica + 1) * num_rows // replicas)
            return tf.nest.map_structure(lambda leaf: tf.convert_to_tensor(leaf)[rows], part)
        return strategy.experimental_distribute_values_from_function(share)

    return tuple(None if part is None else share_of(part) for part in batch)


def first_replica_share(strategy, batch):
    """This worker's first replica's share of a distributed batch."""
    return tf.nest.map_structure(
        lambda value: None if value is None else strategy.experimental_local_results(value)[0],
        batch)


def unscaled_loss_fn(loss_fn):
    """`loss_fn` without Keras' division by the number of replicas.

    Keras scales compiled losses by 1 / R under a strategy, for replicas
    whose mean gradients it then sums. DP-SGD clips each example's own
    gradient, which must not shrink with R.
    """
    def unscaled(*args):
        return loss_module.unscale_loss_for_distribution(loss_fn(*args))

    return unscaled


def num_replicas(strategy=None):
    """Replicas that take each step together (1 without a strategy)."""
    return (strategy or tf.distribute.get_strategy()).num_replicas_in_sync


def chief_value(strategy, value):
    """An int64 `value` as the chief computed it, on every worker of `strategy`.

    The initial value of a variable created under a multi-worker strategy is
    broadcast from the chief (worker 0), so workers that drew different
    random keys or seeds end up with the chief's. Only the Python int is
    kept: the variable would otherwise be saved in checkpoints.
    """
    if num_workers(strategy) == 1:
        return value
    with strategy.scope():
        variable = tf.Variable(value, dtype=tf.int64, trainable=False)
    return int(variable.numpy())


def same_on_every_worker(strategy, value):
    """Whether every worker holds the same int `value` (a collective: every
    worker must call it at the same point, and all get the same answer)."""
    if num_workers(strategy) == 1:
        return True
    differs = float(value != chief_value(strategy, value))
    count = strategy.reduce(tf.distribute.ReduceOp.SUM,
                            strategy.run(lambda: tf.constant(differs)), axis=None)
    return float(count) == 0


def reducible_logs(logs):
    """A train or test step's logs in a shape Keras can reduce over workers.

    Under several workers Keras 3 averages each log with
    `strategy.reduce("MEAN", value, axis=0)` (`reduce_per_replica` of its
    TensorFlow trainer), which refuses the scalars its own steps return;
    the mean of a one-element vector is the same number.
    """
    if num_workers(tf.distribute.get_strategy()) == 1:
        return logs
    return {name: tf.reshape(value, [1]) for name, value in logs.items()}


def num_workers(strategy):
    """Processes that train together (1 on one machine)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    return max(1, sum(len(tasks) for job, tasks in resolver.cluster_spec().as_dict().items()
                      if job in ("chief", "worker")))


def is_chief(strategy=None):
    """Whether this process is the chief of its cluster (True on one machine)."""
    resolver = getattr(strategy or tf.distribute.get_strategy(), "cluster_resolver", None)
    jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not jobs:
        return True
    if "chief" in jobs:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def check_strategy(model):
    """Refuses, before any step, a distribution the private step cannot keep private.

    Called while the train step is traced: the strategy must run synchronous
    replicas, and the weights, the privacy ledger and the DP optimizer must
    all belong to it.
    """
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, _SYNCHRONOUS_STRATEGIES) and tf.distribute.has_strategy():
        raise ValueError(
            f"keras-dp cannot train privately under {type(strategy).__name__}: its "
            "workers would apply updates that did not each add the noise once to "
            "the sum of all clipped gradients. Use tf.distribute.MirroredStrategy "
            "(one machine) or tf.distribute.MultiWorkerMirroredStrategy (several).")
    if not tf.distribute.has_strategy():  # A strategy of one device is one still.
        _check_no_replicated_weights(model, strategy)
        return
    if model.optimizer._distribution_strategy is not strategy:
        raise ValueError(
            f"The DP optimizer was created outside {type(strategy).__name__}.scope(), "
            "so its replicas would not share the noise key. Create the model, "
            "make_private and the optimizer inside `with strategy.scope():`.")
    state = model.privacy_ledger.variables + model.step_mechanism.variables
    outside = [getattr(v, "path", v.name) for v in model.trainable_variables + state
               if not _is_distributed(v)]
    if outside:
        raise ValueError(
            f"Variables {outside[:3]} were created outside "
            f"{type(strategy).__name__}.scope(), so each replica would update them "
            "(the ledger would count a step once per replica). Build the model "
            "and call keras_dp.make_private inside `with strategy.scope():`.")


def _check_no_replicated_weights(model, strategy):
    """Refuses weights of a strategy's replicas trained outside it (the model
    built in its scope, make_private and compile outside): Keras' optimizer
    failed on them inside the step with a TypeError (review round 130)."""
    replicated = [getattr(v, "path", v.name) for v in model.trainable_variables
                  if _is_distributed(v)]
    if replicated:
        raise ValueError(
            f"Variables {replicated[:3]} were created in a tf.distribute strategy's scope, "
            f"but the private model trains under {type(strategy).__name__} (make_private or "
            "compile ran outside the scope). Build the model, call keras_dp.make_private "
            "and compile inside `with strategy.scope():`.")


def _is_distributed(variable):
    """Whether a tf.Variable, or a Keras variable's value, belongs to a strategy."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return True
    return isinstance(getattr(variable, "value", None), tf.distribute.DistributedValues)


def check_fit_data(strategy, info, sampling):
    """Refuses, before any step, data several workers cannot share privately.

    Each worker reads its own copy of the data and keeps its replicas' rows
    of every batch: the copies must yield the same batches. Poisson batches
    drawn with one seed do; shuffled batches (shuffled apart on each
    worker) could put an example in one step twice, or in one pass more
    than once.
    """
    if num_workers(strategy) == 1:
        return
    if info is None and sampling is sampling_schemes.PoissonSampling:
        return  # fit() draws the batches, with the chief's seed.
    if info is None:
        raise ValueError(
            "Under several workers keras-dp trains on Poisson batches only: each "
            "worker would shuffle its own copy of the data differently, and an "
            "example could join one step (or pass) twice. Use fit on arrays with "
            "sampling='poisson', or keras_dp.data.poisson_dataset(..., "
            "num_replicas=strategy.num_replicas_in_sync, seed=S) with the same S "
            "on every worker.")
    if not same_on_every_worker(strategy, info.seed):
        raise ValueError(
            "The workers' Poisson datasets were drawn with different seeds, so "
            "they would train on different batches and an example could join "
            "one step twice. Pass the same seed to keras_dp.data.poisson_dataset "
            "on every worker (e.g. one drawn with secrets.randbits(62) on the "
            "chief and shared), or fit on arrays, which shares the chief's.")
