"""The in-graph ledger: the table of segments the train step appends to,
and its saving with the private model and its checkpoints."""

import contextlib
import dataclasses
import hashlib
import secrets
import threading

import numpy as np
import tensorflow as tf

from keras_dp import distribute
from keras_dp import sampling_schemes
from keras_dp.ledger import rows
from keras_dp.ledger.rows import CAPACITY
from keras_dp.ledger.rows import FIELDS
from keras_dp.ledger.rows import Segment

# Seeds of keras-dp's Poisson draws a ledger records the spent passes of.
SEED_CAPACITY = 64
# The seed row of stated Poisson steps (`PrivacyLedger.add` of segments):
# seeds are integers >= 0, so this one names no dataset's; its passes are 1.
STATED_SEEDS = -1
# `PrivacyLedger.permitted`: (steps, entry point, the table row checked);
# while no budget is in force any step records, and once one is, none until
# a check.
_UNLIMITED = (np.inf, 0.0) + (0.0,) * len(FIELDS)
_NOTHING = (0.0,) * (2 + len(FIELDS))
_ONE_STEP = (1.0,) + _NOTHING[1:]
# The ledgers a fit with a budget runs on, in this process, while it runs
# (`PrivacyLedger.budgets_in_force`; `budget_in_force_anywhere`).
_LEDGERS_UNDER_BUDGET = []


def seed_key(seed):
    """The key a ledger keeps the spent passes of a Poisson seed under: a
    one-way digest of it (62 bits), so a saved file never holds the seed,
    which given to `poisson_dataset(seed=...)` replays every draw (review
    round 177: the OS-entropy seed read from a .keras file showed which
    examples each batch held: epsilon 5.80 against 0.71 reported).

    Args:
        seed: an integer >= 0.

    Returns:
        An int in [0, 2**62).
    """
    digest = hashlib.sha256(b"keras-dp Poisson seed " + str(int(seed)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def budget_in_force_anywhere():
    """Whether a fit with `PrivacyCallback(target_epsilon=...)` runs in this
    process: a release `keras_dp.adapt` made meanwhile could be recorded in
    its ledger outside its checks (review round 173: a callback's adapt took
    the ledger to 4.84 against a target of 4.0)."""
    return bool(_LEDGERS_UNDER_BUDGET)


class PrivacyLedger:
    """The segments of the steps taken on some variables, in variables the
    train step updates.

    `table[i]` is segment i's mechanism (see `FIELDS`), `counts[i]` its
    (steps, releases), `size` the number of segments. `counter` numbers
    every step taken (the next noise block), `unrecorded` the steps that
    found the table full. `steps_left_in_pass` tells the step whether a
    shuffled pass is still open. None of them is a model weight: the private
    model saves them beside its weights (`state` / `restore`).
    """

    def __init__(self):
        def variable(name, shape, dtype):
            return tf.Variable(np.zeros(shape, dtype), dtype=dtype, trainable=False,
                               name=name)

        self.table = variable("privacy_ledger", (CAPACITY, len(FIELDS)), "float64")
        self.counts = variable("privacy_ledger_counts", (CAPACITY, 2), "int64")
        # The ledger that recorded each segment (`Segment.history`): this
        # one's id, from OS entropy (the chief's on every worker), marks
        # the steps it records; a restored segment keeps its own.
        self.histories = variable("privacy_ledger_histories", (CAPACITY,), "int64")
        self.history = distribute.chief_value(tf.distribute.get_strategy(),
                                              secrets.randbits(62) + 1)
        self.size = variable("privacy_ledger_size", (), "int64")
        self.counter = variable("privacy_ledger_counter", (), "int64")
        self.unrecorded = variable("privacy_ledger_unrecorded", (), "int64")
        self.steps_left_in_pass = variable("privacy_steps_left_in_pass", (), "float64")
        # The trial of a search kept as best (`select`): not updated in the step.
        self.selection = variable("privacy_ledger_selection", (6,), "float64")
        # Segments surely left, spent by every check before a step; writes
        # from Python (add, restore) reset it.
        self._room_estimate = 0
        # The passes spent with each seed of keras-dp's Poisson draws, as
        # rows (seed_key(seed), passes), saved (`draw_fresh`); and the `Passes` of the
        # datasets trained on in this process, read into it when saved.
        self.seeds = variable("privacy_ledger_seeds", (SEED_CAPACITY, 2), "int64")
        self._drawing = []
        # 1 once another ledger absorbed this one (`retire`): a step traced
        # to record here refuses itself.
        self.retired = variable("privacy_ledger_retired", (), "int64")
        # The user id space of the user-level fits (`check_unit`); not saved.
        self._users_digest = None
        self._unit_checked = None
        # The lists of files saved by private models of these variables, one
        # for each fit under way on them (`noting_saves`).
        self._saves_noted = []
        # The PrivacyCallbacks with a budget of the fits under way on these
        # variables (`budgets_in_force`).
        self._fit_budgets = []
        # What the last check of the budgets in force allowed (`permit`): how
        # many more steps, of which entry point, of which mechanism;
        # unlimited while no fit with a budget runs on these variables. Read
        # and spent by the step; not saved.
        self.permitted = tf.Variable(_UNLIMITED, dtype=tf.float64, trainable=False,
                                     name="privacy_ledger_permitted")
        # The thread training these variables, and its entry points under way
        # (`training_thread`).
        self._turn = threading.Lock()
        self._thread, self._entries = None, 0

    @property
    def variables(self):
        """The saved state, in a fixed order."""
        return [self.table, self.counts, self.histories, self.size, self.counter,
                self.unrecorded, self.steps_left_in_pass]

    @contextlib.contextmanager
    def training_thread(self):
        """Within: the calling thread trains these variables; an entry point
        of any private model of them in another thread is refused. The step's
        record (`next_block`, `record_step`) reads and writes the ledger's
        variables, which two threads' steps would interleave (review round
        51: two private models of one base fitting in two threads lost 29 of
        2000 steps from the ledger, and two steps drew one noise block)."""
        thread = threading.get_ident()
        with self._turn:
            if self._thread not in (None, thread):
                raise ValueError(
                    "These weights are training in another thread (a fit or "
                    "train_on_batch of a private model of them): their steps take turns, "
                    "one thread at a time. Wait for that training to end, or train "
                    "other weights.")
            self._thread, self._entries = thread, self._entries + 1
        try:
            yield
        finally:
            with self._turn:
                self._entries -= 1
                if not self._entries:
                    self._thread = None

    def _check_writer(self):
        """Refuses a write of the table from a thread other than the one
        training these variables: it reads the table, then writes it whole,
        and a step recorded in between would be lost, its noise block drawn
        again (review round 168: from a PyDataset's __getitem__, 4 of 399
        steps lost, one noise block drawn twice)."""
        with self._turn:
            if self._thread not in (None, threading.get_ident()):
                raise ValueError(
                    "These weights are training in another thread, and their privacy "
                    "ledger changes only from that thread (loading weights or a ledger, "
                    "prior_ledger, composing models). Do it between fits, or from a "
                    "callback.")

    # -- In the train step.

    def in_use(self):
        """Whether steps may record here (graph code): False once the
        ledger was absorbed into another (`retire`)."""
        return tf.equal(tf.convert_to_tensor(self.retired), 0)

    def holds_only_unit(self, unit_code):
        """Whether every recorded step protects the unit `unit_code` (graph
        code; True before any step): a ledger's steps protect one unit.
        Rows without steps (stated with `prior_ledger`) protect nothing and
        may name either unit."""
        with_steps = tf.convert_to_tensor(self.counts)[:, 0] > 0
        units = tf.convert_to_tensor(self.table)[:, rows.COLUMN["unit"]]
        return tf.reduce_all(tf.logical_or(tf.logical_not(with_steps),
                                           tf.equal(units, unit_code)))

    def permits(self, opener, row, records=True):
        """Whether a step of the entry point `opener` recording `row` is one
        the last budget check allowed (graph code; always, while no budget
        is in force): a step is left (for the batch that `records` the
        logical step; an earlier physical batch of it, which only
        accumulates, spends none: review round 173, accumulation k = 3
        with steps_per_execution 5 was refused at the batch opening a step
        after the execution's permits were spent), it is the checked entry
        point's, and it records the row checked. Exactly that row: a step of another (a
        noise multiplier raised while the execution ran, from a pipeline)
        opens a segment, which under a scheme of one release per pass is a
        release the check did not price (review round 161: sigma raised by
        1e-6 at each step of a shuffled pass, 10 releases where the check
        priced 1, 19.05 against a target of 5.90)."""
        permitted = tf.convert_to_tensor(self.permitted)
        steps, checked_opener, checked = permitted[0], permitted[1], permitted[2:]
        checked_step = tf.reduce_all(tf.stack([
            tf.logical_or(steps >= 1.0, tf.logical_not(records)),
            tf.equal(opener, checked_opener),
            tf.reduce_all(tf.equal(row, checked))]))
        return tf.logical_or(tf.math.is_inf(steps), checked_step)

    def next_block(self):
        """The noise block of the step about to be recorded: the counter
        (graph code; read before `record_step` advances it)."""
        return tf.convert_to_tensor(self.counter)

    def record_step(self, row):
        """Appends one private step with the table row `row` (graph code).

        Returns:
            The op that has recorded it. A step that finds the table full
            still advances the counter, and counts as unrecorded, which
            makes epsilon infinite; `check_room` refuses such a step in
            Python before it runs.
        """
        size = tf.convert_to_tensor(self.size)
        last = tf.gather(tf.convert_to_tensor(self.table), tf.maximum(size - 1, 0))
        histories = tf.convert_to_tensor(self.histories)
        ours = tf.equal(tf.gather(histories, tf.maximum(size - 1, 0)), self.history)
        same_row = tf.logical_and(size > 0, tf.reduce_all(tf.equal(last, row)))
        # A segment restored from another ledger (a resumed run) is not
        # extended, but its open pass goes on.
        same = tf.logical_and(same_row, ours)
        index = tf.where(same, size - 1, size)
        fits = index < CAPACITY
        index = tf.minimum(index, CAPACITY - 1)
        steps_per_pass = row[rows.COLUMN["steps_per_pass"]]
        # The scheme's rule (`keras_dp.sampling_schemes.SamplingScheme.releases`):
        # every step a release, or one per pass of `steps_per_pass` steps.
        every_step = tf.gather(tf.constant(sampling_schemes.RELEASES_EVERY_STEP, tf.float64),
                               tf.cast(row[rows.COLUMN["sampling"]], tf.int32)) > 0
        left = tf.convert_to_tensor(self.steps_left_in_pass)
        # A changed mechanism re-counts the open pass: conservative.
        new_pass = tf.logical_or(tf.logical_not(same_row), left <= 0)
        release = tf.logical_or(every_step, new_pass)
        pass_length = tf.where(steps_per_pass > 0, steps_per_pass,
                               tf.constant(np.inf, tf.float64))
        table = tf.convert_to_tensor(self.table)
        counts = tf.convert_to_tensor(self.counts)
        one = tf.cast(fits, tf.int64)
        recorded = tf.group(
            self.counter.assign_add(1),
            self.permitted.assign_sub(_ONE_STEP),
            self.unrecorded.assign_add(1 - one),
            self.steps_left_in_pass.assign(tf.where(new_pass, pass_length, left) - 1),
            self.table.assign(tf.where(fits, tf.tensor_scatter_nd_update(
                table, [[index]], [row]), table)),
            self.counts.assign(tf.tensor_scatter_nd_add(
                counts, [[index]], [tf.stack([one, one * tf.cast(release, tf.int64)])])),
            self.histories.assign(tf.where(fits, tf.tensor_scatter_nd_update(
                histories, [[index]], [tf.constant(self.history, tf.int64)]), histories)),
            self.size.assign(tf.where(fits, index + 1, size)))
        return recorded

    # -- In Python.

    def total_steps(self):
        """Private steps taken on this ledger's variables (an int)."""
        return int(self.counter.numpy())

    def check_room(self, row_of_next_step):
        """Refuses, before a step, a step whose mechanism would need a new
        segment in a full table (its spending could not be recorded).

        A step (or an execution of steps) adds one segment at most, and every
        private model on these variables checks before each: the table is
        read only once it could be nearly full.

        Args:
            row_of_next_step: returns the table row of the next step.

        Raises:
            ValueError: naming the fix.
        """
        if self._room_estimate > 2:
            self._room_estimate -= 1
            return
        size = int(self.size.numpy())
        self._room_estimate = CAPACITY - size
        row = row_of_next_step()
        if size < CAPACITY or (np.array_equal(self.table.numpy()[size - 1], row)
                               and self.histories.numpy()[size - 1] == self.history):
            return
        raise ValueError(
            f"The privacy ledger is full: {CAPACITY} segments, one per change of "
            "noise multiplier, clipping norm, sampling or batch size. Keep these "
            "settings fixed within a training run (a change takes effect per "
            "fit, not per step).")

    def draw_fresh(self, seed, passes, chosen=False):
        """Makes a Poisson dataset's next pass one never drawn with `seed`
        on these variables: raises its `passes` (a
        `keras_dp.data.poisson.Passes`) to the passes the ledger records
        as spent with that seed. The ledger then follows them: what it saves
        counts every pass they drew.

        Args:
            seed: the dataset's seed.
            passes: its `Passes`.
            chosen: whether the user chose the seed (not OS entropy).

        Raises:
            ValueError: when the ledger records `SEED_CAPACITY` other seeds,
                or for a chosen seed, when it holds stated Poisson steps,
                whose seeds it does not know.
        """
        spent, key = self.spent_passes(), seed_key(seed)
        if chosen and STATED_SEEDS in spent:
            # Review round 107: the stated history of a run in another process,
            # then its seed given again, drew its batches again (2.04 reported
            # against 3.37).
            raise ValueError(
                "This model's ledger holds Poisson steps you stated (prior_ledger= or "
                "privacy_ledger.add of segments), without the seeds their batches were "
                f"drawn with, so seed={seed} may draw the same batches again. Build the "
                "keras_dp.data.poisson_dataset without seed= (drawn from OS entropy), or "
                "state the history as the trained model's privacy_ledger, which holds "
                "its seeds.")
        if key not in spent and len(spent) >= SEED_CAPACITY:
            raise ValueError(
                f"This model's ledger records the draws of {SEED_CAPACITY} Poisson seeds, "
                "its most. Keep training on one keras_dp.data.poisson_dataset (each pass "
                "draws anew) instead of building a new one for every fit.")
        passes.skip_to(spent.get(key, 0))
        if all(drawing is not passes for _, drawing in self._drawing):  # Once each.
            self._drawing.append((key, passes))

    @contextlib.contextmanager
    def noting_saves(self, saved):
        """While a fit runs on these variables: appends to the list `saved`
        every file a private model of them saves (`note_saved`), whichever
        wrapper saves it (review round 109: a second wrapper of the fitting
        base model saved a file later scores kept, with 10 of the 40 steps
        that kept it, 3.44 reported against 5.39)."""
        self._saves_noted.append(saved)
        try:
            yield
        finally:
            self._saves_noted.remove(saved)

    @contextlib.contextmanager
    def budgets_in_force(self, budgets):
        """While a fit runs on these variables: its `PrivacyCallback`s with a
        budget, which every entry point of any private model of them started
        meanwhile respects too (`fit_budgets`; review round 115: a fit run by
        a callback, 3.24 against a target of 2.0; round 123: train_on_batch
        of a second wrapper of the base model, 8.09 against 6.0)."""
        self._fit_budgets.append(list(budgets))
        if budgets:
            self.permitted.assign(_NOTHING)  # Until its step guard checks.
            _LEDGERS_UNDER_BUDGET.append(self)
        try:
            yield
        finally:
            self._fit_budgets.pop()
            if budgets:
                _LEDGERS_UNDER_BUDGET.remove(self)
                self.permitted.assign(_NOTHING if any(self._fit_budgets) else _UNLIMITED)

    def permit(self, steps, opener, row):
        """While budgets are in force (`budgets_in_force`): lets the next
        `steps` steps of the entry point `opener` record, each of the table
        row `row`, as a check of every budget in
        force found they may: fit's step guard before each execution, and
        train_on_batch for its one step (`permitting`); `revoke` ends it.

        Any other step refuses itself (`permits`): one no check saw (a
        train_step called directly while such a fit runs, also on the steps
        an execution left: review round 159, from a callback after an
        execution of 1 step of 3, 7.65 against a target of 4.0), or one whose
        mechanism changed after the check, while the execution ran (review
        round 158: sigma lowered from a PyDataset's __getitem__, epsilon
        10.15 against a target of 4.5).
        """
        if any(self._fit_budgets):
            self.permitted.assign([float(steps), opener, *row])

    def revoke(self):
        """Ends what `permit` allowed (no step records until the next check)."""
        if any(self._fit_budgets):
            self.permitted.assign(_NOTHING)

    @contextlib.contextmanager
    def permitting(self, steps, opener, row):
        """Within: `permit(steps, opener, row)`; then `revoke`."""
        self.permit(steps, opener, row)
        try:
            yield
        finally:
            self.revoke()

    def fit_budgets(self):
        """The `PrivacyCallback`s with a budget of every fit under way on
        these variables (`budgets_in_force`)."""
        return [callback for budgets in self._fit_budgets for callback in budgets]

    def notes_saves(self):
        """Whether a fit under way on these variables notes the files saved."""
        return bool(self._saves_noted)

    def note_saved(self, path):
        """Notes a file a private model of these variables saved (for every
        fit under way on them: `noting_saves`)."""
        for saved in self._saves_noted:
            saved.append(path)

    def spent_passes(self):
        """`{seed_key(seed): passes}`: the passes of keras-dp's Poisson draws
        spent with each seed, saved or drawn since (a pass may be counted as
        spent before its first batch, never after); `STATED_SEEDS` for
        stated steps."""
        spent = _seeds_of(self.seeds.numpy())
        for key, passes in self._drawing:
            spent[key] = max(spent.get(key, 0), passes.count())
        return spent

    def unit(self):
        """What the recorded steps protect: `"example"`, `"user"`, or None
        before any step (`unit_of`)."""
        return rows.unit_of(rows.segments_of(self.state()))

    def check_unit(self, segment, users_digest=None):
        """Refuses a step whose unit or user id space differs from the
        recorded steps': their composition would have no sound reading.

        Example-level steps bound one row, user-level steps one user: one row
        changed inside a user is neither, so a ledger keeps one unit. Two
        user-level fits over different users (another id mapping) would
        protect different groups of rows.

        Args:
            segment: the `Segment` the next step would record.
            users_digest: `keras_dp.data.user_digest` of the next step's
                user ids (user-level steps), kept in this process beside the
                ledger: an earlier user-level fit's must match.

        Raises:
            ValueError: naming the fix.
        """
        checked = (segment.unit, segment.num_examples, users_digest)
        if checked == self._unit_checked:  # Steps since recorded this unit only.
            return
        recorded = self.unit()
        if recorded is not None and recorded != segment.unit:
            # keras_dp.adapt releases are example-level: a fresh model holding
            # an adapted layer carries one.
            adapted = (" A layer adapted with keras_dp.adapt carries an example-level "
                       "release: adapt it on public data instead." if segment.unit == "user"
                       else "")
            raise ValueError(
                f"This model's privacy ledger records {recorded}-level steps, and this "
                f"step would be {segment.unit}-level: one ledger cannot soundly compose "
                "both (one row changed inside a user is neither adding nor removing "
                f"one {recorded}). Train a fresh model for {segment.unit}-level privacy; "
                "to state spending of the same unit made elsewhere, use "
                "make_private(model, prior_ledger=[keras_dp.ledger.Segment(..., "
                f"unit={segment.unit!r})]).{adapted}")
        if segment.unit == "user":
            self._check_users(segment, users_digest)
        # Until a write from Python (`_write`), only steps checked here are
        # recorded: a check before every batch of fit() reads nothing again.
        self._unit_checked = checked

    def _check_users(self, segment, users_digest):
        """The user-level part of `check_unit`."""
        counts = {int(s.num_examples) for s in rows.segments_of(self.state()) if s.steps}
        other = counts - {segment.num_examples}
        if other or self._users_digest not in (None, users_digest):
            earlier = (f"{other.pop()} users, this fit {int(segment.num_examples)}" if other
                       else "the same number of users, but other rows per user")
            raise ValueError(
                f"This model's earlier user-level steps sampled another set of users "
                f"({earlier}): one person could then be two users, each with its own "
                "budget. Fit again with the same user_ids for the same rows, or "
                "train a fresh model.")
        self._users_digest = users_digest

    def start_pass(self):
        """Marks the start of a pass over shuffled data (each epoch)."""
        self.steps_left_in_pass.assign(0.0)

    def segments(self):
        """The segments, oldest first, as a list of `Segment`.

        Steps that found the table full come last, as a segment without
        noise: their mechanism is unknown, so epsilon is infinite for every
        reader (privacy_spent, PrivacyCallback's budget, the command line).
        """
        state = self.state()
        segments = _selected(rows.segments_of(state), state["selection"])
        unrecorded = self.num_unrecorded()
        if unrecorded:
            segments.append(Segment(sampling_schemes.UnknownBatches.name, 0.0, unrecorded,
                                    unit=rows.unit_of(segments) or "example"))
        return segments

    def num_unrecorded(self):
        """Steps taken when the table was full, and loads refused part-way:
        epsilon is then infinite."""
        return int(self.unrecorded.numpy())

    def count_refused_load(self):
        """Counts a load whose ledger this one refused as unrecorded spending:
        Keras goes on loading a file's other objects after one refuses its
        part (`keras.saving.load_weights`), so weights no ledger accounts
        for may follow (review round 29: another unit's weights under this
        ledger, 1.45 reported against 4.02). `load_whole` puts this back
        with every variable when it undoes the load."""
        self.unrecorded.assign_add(1)

    def steps_left_in_open_pass(self):
        """How many more shuffled steps fall in the pass already counted
        (0 if none is open; inf for a pass that lasts the epoch)."""
        return max(float(self.steps_left_in_pass.numpy()), 0.0)

    def add(self, segments):
        """Appends segments (a statement of privacy spent elsewhere).

        Args:
            segments: a list of `Segment`, or another `PrivacyLedger`.
        """
        state = self.state()
        if not isinstance(segments, PrivacyLedger):
            segments = [self._stated(segment) for segment in segments]
            if any(issubclass(sampling_schemes.scheme_type(segment.sampling),
                              sampling_schemes.PoissonSampled) for segment in segments):
                state["seeds"] = _union_of_seeds(state["seeds"], {STATED_SEEDS: 1})
        else:
            check_independent_draws([self, segments])
            self._users_digest = self._same_users(segments)
            other = segments.state()
            segments = rows.segments_of(other)
            state["counter"] = max(state["counter"], other["counter"])
            state["unrecorded"] += other["unrecorded"]
            state["selection"] = _combined_selection(state, other, len(state["table"]))
            state["seeds"] = _union_of_seeds(state["seeds"], other["seeds"])
        # _write keeps the counter at least the steps of all segments.
        self._write(rows.segments_of(state) + list(segments), state)

    def add_all(self, ledgers):
        """Composes `ledgers` into this one, all or none: a composition that
        one of them refuses (too many segments, another unit) leaves this
        ledger as it was.

        Args:
            ledgers: a list of `PrivacyLedger`.
        """
        if not ledgers:
            return  # No read: a private model's ledger is looked up every step.
        before, users_digest = self.state(), self._users_digest
        try:
            for other in ledgers:
                self.add(other)
        except ValueError:
            self._write(rows.segments_of(before), before)
            self._users_digest = users_digest
            raise

    def _stated(self, segment):
        """A stated segment, as this ledger's history unless it names one
        (a segment of another ledger's `segments()`): two ledgers stating
        the same spending are two histories, composed when their files meet,
        not one (review round 52: two models each stating the same 200
        pretraining steps, loaded into an ensemble, counted them once, 11.35
        reported against 16.25)."""
        return segment if segment.history else dataclasses.replace(segment, history=self.history)

    def _same_users(self, other):
        """The user id mapping of this ledger's and `other`'s user-level
        steps, which must be one (review round 34: two models fit over
        different mappings of the same rows, composed, were reported as one
        history of users, 6.6 against 42 for a person split over four users
        by the second); refuses when both hold user-level steps over
        mappings not known to be the same."""
        if self.unit() == other.unit() == "user" and (
                self._users_digest is None or self._users_digest != other._users_digest):
            raise ValueError(
                "These privacy ledgers both record user-level steps, over user id "
                "mappings keras-dp cannot tell are the same (in this process, one fit's "
                "user_ids each): one person could be several users, each with its own "
                "budget. Combine models trained with the same user_ids for the same rows, "
                "or train the combined model fresh.")
        return self._users_digest or other._users_digest

    def retire(self):
        """Marks this ledger as absorbed into another (its variables joined
        another history's): a step traced to record here, in a function no
        one can retrace (a custom loop), then refuses itself instead of
        leaving its steps outside the variables' ledger or drawing a noise
        block the other ledger's counter will draw again."""
        self.retired.assign(1)

    def is_retired(self):
        """Whether `retire` was called."""
        return bool(self.retired.numpy())

    def state(self):
        """The ledger's content as numpy arrays (what is saved)."""
        size = int(self.size.numpy())
        return {"table": self.table.numpy()[:size], "counts": self.counts.numpy()[:size],
                "histories": self.histories.numpy()[:size],
                "counter": int(self.counter.numpy()),
                "unrecorded": int(self.unrecorded.numpy()),
                "left": float(self.steps_left_in_pass.numpy()),
                "selection": self.selection.numpy(),
                "seeds": self.spent_passes()}

    def select(self, start, mean, shape):
        """Marks the segments from `start` on as the trial a search of a
        random number of trials (`mean`, `shape`) kept as best
        (`keras_dp.ledger.Selection`); later steps count outside it.

        Raises:
            ValueError: when the ledger already holds a search's trial, or
                holds no steps.
        """
        if self.selection.numpy()[1]:
            raise ValueError("This model's ledger already holds the trial of a "
                             "hyperparameter search; a ledger holds one. Search with "
                             "a fresh model (built by the hypermodel).")
        if not self.size.numpy():
            raise ValueError("This ledger holds no steps, so no trial to mark as a "
                             "search's: select after the trial's training.")
        last = rows.segments_of(self.state())[-1]
        self.selection.assign([start, self.size.numpy(), mean, shape, last.steps,
                               last.releases])

    def restore(self, state):
        """Merges a saved `state` into this ledger, never lowering it.

        Restoring an older state of the same history (an earlier checkpoint)
        keeps the current one; a state of another history is composed with
        this one. The counter keeps the larger value, so no noise block of
        either history is drawn again.
        """
        self._write_merged(self.state(), state)

    def _write_merged(self, ours, theirs):
        merged = rows.merged(rows.segments_of(ours), rows.segments_of(theirs))
        same_history = len(merged) < len(rows.segments_of(ours)) + len(rows.segments_of(theirs))
        unrecorded = (max if same_history else sum)((ours["unrecorded"], theirs["unrecorded"]))
        selection = _combined_selection(ours, theirs, 0 if same_history else len(ours["table"]))
        self._write(merged, {"counter": max(ours["counter"], theirs["counter"]),
                             "unrecorded": unrecorded,
                             "selection": selection,
                             "seeds": _union_of_seeds(ours["seeds"], theirs.get("seeds", {}))})

    def _write(self, segments, state):
        self._check_writer()
        rows.unit_of(segments)  # Refuses spending of both units.
        if len(segments) > CAPACITY:
            raise ValueError(f"The privacy ledger holds at most {CAPACITY} segments; "
                             f"this would make {len(segments)}.")
        if len(state.get("seeds", {})) > SEED_CAPACITY:
            raise ValueError(
                f"The privacy ledger records the draws of at most {SEED_CAPACITY} Poisson "
                f"seeds; this would make {len(state['seeds'])}. Combine models that each "
                "kept training on one keras_dp.data.poisson_dataset.")
        arrays = flat_state(dict(_arrays_of(segments), counter=0, unrecorded=0, left=0.0))
        table, counts = arrays["ledger_table"], arrays["ledger_counts"]
        histories = arrays["ledger_histories"]
        self._room_estimate = 0
        self._unit_checked = None
        self.table.assign(table)
        self.counts.assign(counts)
        self.histories.assign(histories)
        self.size.assign(len(segments))
        self.counter.assign(max(state["counter"], int(counts[:, 0].sum())))
        self.unrecorded.assign(state["unrecorded"])
        # The table's last row may now be another history's or a stated one,
        # which a step of the same mechanism would extend inside the open
        # pass, without the release its own pass owes (review round 165: a
        # lowered sigma continued a pass opened at 5.0 after load_weights
        # put a history of 0.5 last, 10.79 reported against 16.51): the next
        # step opens a pass.
        self.steps_left_in_pass.assign(0.0)
        self.selection.assign(state.get("selection", rows.NO_SELECTION))
        self.seeds.assign(_seed_rows(state.get("seeds", {})))


class LedgerCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger as a `tf.train.Checkpoint` saves and restores it.

    Keras' own saving (`model.save`, `save_weights`, `BackupAndRestore`)
    goes through the private model's `save_own_variables`; TensorFlow's
    checkpoints reach the model only through its trackable children, so a
    private model holds one of these. Restoring never lowers the ledger.

    Args:
        get_ledger: returns the ledger to save or restore into (the model's
            current one: it follows the model's variables).
    """

    def __init__(self, get_ledger):
        self._get_ledger = get_ledger
        # A child, so that checkpoints saved before it existed still restore.
        self._track_trackable(_SelectionCheckpoint(get_ledger), name="selection")
        self._track_trackable(_SeedsCheckpoint(get_ledger), name="seeds")

    def _serialize_to_tensors(self):
        state = self._get_ledger().state()
        return {name: tf.constant(value) for name, value in flat_state(state).items()
                if name not in ("ledger_selection", "ledger_seeds")}

    def _restore_from_tensors(self, restored_tensors):
        _restore_or_count(self._get_ledger(), unflat_state(
            {name: tensor.numpy() for name, tensor in restored_tensors.items()}))
        return tf.no_op()


class _SelectionCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger's selection (`PrivacyLedger.select`) in TensorFlow checkpoints."""

    def __init__(self, get_ledger):
        self._get_ledger = get_ledger

    def _serialize_to_tensors(self):
        return {"ledger_selection": tf.constant(self._get_ledger().state()["selection"])}

    def _restore_from_tensors(self, restored_tensors):
        privacy_ledger = self._get_ledger()
        state = privacy_ledger.state()
        state["selection"] = _combined_selection(
            state, {"selection": restored_tensors["ledger_selection"].numpy()}, 0)
        _restore_or_count(privacy_ledger, state)
        return tf.no_op()


class _SeedsCheckpoint(tf.__internal__.tracking.Trackable):
    """A ledger's spent Poisson passes (`PrivacyLedger.draw_fresh`) in
    TensorFlow checkpoints (a child: older checkpoints restore without it)."""

    def __init__(self, get_ledger):
        self._get_ledger = get_ledger

    def _serialize_to_tensors(self):
        return {"ledger_seeds": tf.constant(_seed_rows(self._get_ledger().spent_passes()))}

    def _restore_from_tensors(self, restored_tensors):
        privacy_ledger = self._get_ledger()
        state = privacy_ledger.state()
        state["seeds"] = _union_of_seeds(state["seeds"],
                                         _seeds_of(restored_tensors["ledger_seeds"].numpy()))
        _restore_or_count(privacy_ledger, state)
        return tf.no_op()


def _restore_or_count(privacy_ledger, state):
    """Restores a TensorFlow checkpoint's ledger `state`, or counts one this
    ledger refuses as unrecorded spending (epsilon infinite) before raising:
    TensorFlow restores a checkpoint's objects one by one, in the order of
    their names, so weights of that history may already be in place, and
    nothing undoes them (review round 41: another model's weights under a
    full ledger, 1.29 reported against 136)."""
    try:
        privacy_ledger.restore(state)
    except ValueError:
        privacy_ledger.count_refused_load()
        raise


def check_independent_draws(ledgers):
    """Refuses to compose histories that drew passes of one Poisson seed.

    Composition counts each history's steps as drawn independently of the
    others'; two models trained on the same draws (one seed given to both
    datasets) release two noisy sums of one sample per step, which that
    count under-states.

    Args:
        ledgers: the `PrivacyLedger`s to compose.

    Raises:
        ValueError: naming a shared seed and the fix, or when together they
            hold more than `SEED_CAPACITY` seeds.
    """
    seen = {}
    for privacy_ledger in ledgers:
        for key in privacy_ledger.spent_passes():
            if key != STATED_SEEDS and seen.setdefault(key, privacy_ledger) is not (
                    privacy_ledger):
                raise ValueError(
                    "These variables come from private models whose ledgers both drew "
                    "Poisson batches with one seed: they may have trained on the same "
                    "draws, which composing their ledgers would count as independent "
                    "samples and so under-state epsilon. Train models you will combine "
                    "on datasets with different seeds (or none: each then draws its own "
                    "from OS entropy); a model whose weights copy another's in this "
                    "process already carries its ledger (drop prior_ledger).")
    if len(seen) > SEED_CAPACITY:
        raise ValueError(
            f"Together these privacy ledgers record the draws of {len(seen)} Poisson "
            f"seeds, more than the {SEED_CAPACITY} one ledger holds. Combine models that "
            "each kept training on one keras_dp.data.poisson_dataset.")


def flat_state(state):
    """The arrays of a saved ledger, by name: a fixed set of fixed shapes, as
    TensorFlow checkpoints need at save and restore."""
    table = np.zeros((CAPACITY, len(FIELDS)))
    counts = np.zeros((CAPACITY, 2), np.int64)
    histories = np.zeros(CAPACITY, np.int64)
    table[:len(state["table"])], counts[:len(state["counts"])] = state["table"], state["counts"]
    histories[:len(state["table"])] = state.get("histories", 0)
    return {"ledger_table": table, "ledger_counts": counts, "ledger_histories": histories,
            "ledger_size": np.int64(len(state["table"])),
            "ledger_counter": np.int64(state["counter"]),
            "ledger_unrecorded": np.int64(state["unrecorded"]),
            "ledger_left": np.float64(state["left"]),
            "ledger_selection": np.asarray(state.get("selection", rows.NO_SELECTION)),
            "ledger_seeds": _seed_rows(state.get("seeds", {}))}


def _arrays_of(segments):
    """The table, counts and histories of a state holding `segments`."""
    return {"table": np.reshape([s.row() for s in segments], (-1, len(FIELDS))),
            "counts": np.reshape([(s.steps, s.releases) for s in segments], (-1, 2)),
            "histories": np.array([s.history for s in segments], np.int64)}


def kept_state(saved, ours):
    """The ledger state to save in a file whose keeping the training of
    the ledger state `ours` decided (`keras_dp.callbacks.KeptFiles`).

    `ours` where it continues the file's ledger `saved`; else the file's
    spending followed by `ours` from where it branched off
    (`rows.first_continued`: a run resumed from an earlier backup of the
    file's history, or another model a checkpoint's comparison carried
    over to): an over-count where they share steps, never less. Where the
    two cannot compose (steps of both units, more than `CAPACITY`
    segments, two searches' trials) the later training counts as
    unrecorded spending, epsilon infinite.

    Args:
        saved: the file's ledger state (`PrivacyLedger.state()`'s layout).
        ours: the ledger state of the model whose training decided it.

    Returns:
        The state to write into the file, in the same layout.
    """
    file_segments, our_segments = rows.segments_of(saved), rows.segments_of(ours)
    if rows.is_prefix(our_segments, file_segments):
        return saved  # Nothing trained since the file's state.
    start = rows.first_continued(file_segments, our_segments)
    if start == 0:
        # The same history, later; a mark the file took since (another
        # model's training it could not compose, review round 87: erased
        # by the next write, 5.76 reported against 8.25 or more) stays.
        return dict(ours, counter=max(saved["counter"], ours["counter"]),
                    unrecorded=max(saved["unrecorded"], ours["unrecorded"]),
                    left=min(saved["left"], ours["left"]),
                    seeds=_union_of_seeds(saved["seeds"], ours["seeds"]))
    segments = file_segments[:start] + our_segments
    try:
        rows.unit_of(segments)
        selection = _combined_selection(saved, ours, start)
        composes = len(segments) <= CAPACITY
    except ValueError:
        composes = False
    if not composes:
        return dict(saved, unrecorded=saved["unrecorded"] + 1)
    return dict(_arrays_of(segments), counter=max(saved["counter"], ours["counter"]),
                unrecorded=saved["unrecorded"] + ours["unrecorded"],
                left=min(saved["left"], ours["left"]), selection=selection,
                seeds=_union_of_seeds(saved["seeds"], ours["seeds"]))


def continues(saved, ours):
    """Whether the ledger state `ours` is a later state of `saved`'s history."""
    file_segments, our_segments = rows.segments_of(saved), rows.segments_of(ours)
    return (not rows.is_prefix(our_segments, file_segments)
            and rows.first_continued(file_segments, our_segments) == 0)


def _seed_rows(seeds):
    """`{seed: passes}` as the saved table of `SEED_CAPACITY` rows."""
    table = np.zeros((SEED_CAPACITY, 2), np.int64)
    table[:len(seeds)] = np.reshape(sorted(seeds.items()), (-1, 2))
    return table


def _seeds_of(table):
    """The saved table of seeds as `{seed: passes}`."""
    return {int(seed): int(count) for seed, count in np.asarray(table) if count}


def _union_of_seeds(ours, theirs):
    """The passes spent with each seed by either history: the larger."""
    union = dict(ours)
    for seed, passes in theirs.items():
        union[seed] = max(union.get(seed, 0), passes)
    return union


def unflat_state(arrays):
    size = int(arrays["ledger_size"])
    return {"table": rows.with_all_columns(np.asarray(arrays["ledger_table"])[:size]),
            "counts": np.asarray(arrays["ledger_counts"])[:size],
            # Ledgers saved before ids were: 0 (`Segment.history`).
            "histories": np.asarray(arrays.get("ledger_histories",
                                               np.zeros(CAPACITY, np.int64)))[:size],
            "counter": int(arrays["ledger_counter"]),
            "unrecorded": int(arrays["ledger_unrecorded"]),
            "left": float(arrays["ledger_left"]),
            "selection": np.asarray(arrays.get("ledger_selection", rows.NO_SELECTION)),
            # Ledgers saved before the seeds were: none recorded.
            "seeds": _seeds_of(arrays.get("ledger_seeds", np.zeros((0, 2), np.int64)))}


def save_to(store, privacy_ledger):
    """Writes a ledger into a Keras weights store (`save_own_variables`)."""
    for name, value in flat_state(privacy_ledger.state()).items():
        store[name] = value


def load_from(store, privacy_ledger):
    """Merges the ledger of a Keras weights store into `privacy_ledger`.

    Returns:
        The store's other entries, as a dict (the model's own weights).
    """
    names = set(flat_state(privacy_ledger.state()))
    present = [name for name in store.keys() if name in names]
    if present:
        privacy_ledger.restore(unflat_state({name: store[name] for name in present}))
    return {name: store[name] for name in store.keys() if name not in names}


def full_row_in_graph(sampling_row, noise_multiplier, step_sensitivity, num_weights):
    """`keras_dp.ledger.rows.full_row` on tensors: the train step's fixed row."""
    return tf.tensor_scatter_nd_update(
        sampling_row, [[rows.COLUMN["noise_multiplier"]], [rows.COLUMN["sensitivity"]],
                       [rows.COLUMN["num_weights"]]],
        tf.cast(tf.stack([noise_multiplier, step_sensitivity, num_weights]), tf.float64))


def _selected(segments, selection):
    """`segments` with those of a search's kept trial as one `Selection`."""
    start, end, mean, shape, steps, releases = (float(v) for v in selection)
    if not end:
        return segments
    start, end = int(start), int(end)
    last = segments[end - 1]
    trial = segments[start:end - 1] + [dataclasses.replace(
        last, steps=int(steps), releases=int(releases))]
    since = [dataclasses.replace(last, steps=last.steps - int(steps),
                                 releases=last.releases - int(releases))]
    return (segments[:start] + [rows.Selection(tuple(trial), mean, shape)]
            + since[:last.steps > steps] + segments[end:])


def _combined_selection(first, second, offset):
    """The selection of `first`'s segments followed by `second`'s (from
    `offset`): a ledger holds one search's trial.

    Raises:
        ValueError: when both hold one.
    """
    ours, theirs = np.asarray(first["selection"]), np.asarray(second["selection"])
    if ours[1] and theirs[1] and offset:
        raise ValueError("These two privacy ledgers each hold the trial of a "
                         "hyperparameter search, which one ledger cannot compose. "
                         "Keep the models apart, or train one without a search.")
    if theirs[1] and not ours[1]:
        return theirs + [offset, offset, 0.0, 0.0, 0.0, 0.0]
    return ours
