"""Who owns a ledger: the variables it protects.

A ledger belongs to the variables of the private models that train them
(`for_variables`), so a re-wrap, an alias or a larger model around a
privately trained one records into the same ledger.
"""

import hashlib
import weakref

import numpy as np
import tensorflow as tf

from keras_dp.ledger.table import PrivacyLedger
from keras_dp.ledger.table import check_independent_draws

# The ledger of each variable trained privately in this process, by id, with
# a weak reference that removes the entry when the variable goes.
_LEDGER_OF_VARIABLE = {}
# Each set of variables given to `for_variables`, with their values then:
# `(weak references, values, ledger)`.
_REGISTERED = []
# The ledger states of values private steps produced, by a digest of the
# values (`remember_values`): at most this many, the latest kept.
_REMEMBERED = {}
_MAX_REMEMBERED = 64


def for_variables(variables, prior=None):
    """The ledger of `variables`: the one that records their spending.

    Variables nobody trained privately yet join `prior` (or a new ledger),
    unless their values are those that private steps produced on another
    set of variables of the same shapes in this process (a copy:
    `keras.models.load_model` of a base model saved on its own, `clone_model`
    plus `set_weights`): they then start from a copy of that ledger. Values
    that no step changed (the initial weights of a seeded model) are never
    taken for a history. Variables that carry several ledgers (two
    privately trained models put together) get one ledger composing all of
    them: each history's spending counts, and its counter keeps the largest
    value, so no noise block of either is drawn again. Every variable then
    belongs to the result.

    Args:
        variables: the weights of a private model.
        prior: the ledger to use when none of `variables` has one.

    Returns:
        A `PrivacyLedger`.
    """
    with tf.init_scope():  # Reads values eagerly, also while a step is traced.
        return _for_variables(list(variables), prior)


def _for_variables(variables, prior):
    keys = [id(v) for v in variables]
    found = []
    for key in keys:
        entry = _LEDGER_OF_VARIABLE.get(key)
        if entry is not None and entry[0]() is not None and all(
                entry[1] is not other for other in found):
            found.append(entry[1])
    if found:
        check_independent_draws(found)
        _check_no_budget_in_force(found)
        result = found[0]
        result.add_all(found[1:])
        for other in found[1:]:
            other.retire()  # Its traced steps now refuse themselves.
    else:
        result = prior if prior is not None and not prior.is_retired() else PrivacyLedger()
        if prior is not None and prior is not result:
            result.add(prior)
        copied = _history_of_values(variables)
        if copied is not None and copied is not result:
            result.add(copied)
    new = [v for v, key in zip(variables, keys) if key not in _LEDGER_OF_VARIABLE]
    for variable, key in zip(variables, keys):
        _LEDGER_OF_VARIABLE[key] = (weakref.ref(variable, _forget(key)), result)
    if new:
        _REGISTERED.append(([weakref.ref(v) for v in variables],
                            [np.array(v.numpy()) for v in variables], result))
    return result


def _check_no_budget_in_force(ledgers):
    """Refuses to join `ledgers` while a fit with a budget runs on any of
    them: the joined ledger would hold the steps of no budget (review round
    163: a larger private model made around the fitting base model in a
    callback trained 200 steps, 8.82 against a target of 3.0)."""
    if len(ledgers) > 1 and any(ledger.fit_budgets() for ledger in ledgers):
        raise ValueError(
            "These weights would join another private model's privacy history (a larger "
            "private model around them, or an ensemble) while a fit with "
            "PrivacyCallback(target_epsilon=...) runs on them: the joined ledger's steps "
            "would be outside that budget. Make the larger private model after that fit "
            "ends.")


def remember_values(variables, privacy_ledger):
    """Remembers that `privacy_ledger`'s steps produced the variables' current
    values (at the end of a fit, and when a private model is saved), so a
    copy of them made later (a base model saved and loaded back) still
    finds that spending after the original trained on."""
    with tf.init_scope():
        values = [np.asarray(v.numpy()) for v in variables]
    if not privacy_ledger.total_steps() or _unchanged_since_registration(variables, values):
        return  # Values no step changed (a seeded model's initial weights).
    digest = _digest(values)
    _REMEMBERED.pop(digest, None)
    _REMEMBERED[digest] = privacy_ledger.state()
    while len(_REMEMBERED) > _MAX_REMEMBERED:
        _REMEMBERED.pop(next(iter(_REMEMBERED)))


def _unchanged_since_registration(variables, values):
    for references, at_registration, _ in _REGISTERED:
        if len(references) == len(variables) and all(
                reference() is variable for reference, variable in zip(references, variables)):
            return _same_arrays(values, at_registration)
    return False


def _digest(values):
    digest = hashlib.sha256()
    for value in values:
        digest.update(str((value.shape, value.dtype)).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _history_of_values(variables):
    """The ledger whose steps produced these variables' values, or None."""
    values = [np.asarray(v.numpy()) for v in variables]
    state = _REMEMBERED.get(_digest(values))
    if state is not None and len(state["table"]):
        remembered = PrivacyLedger()
        remembered.restore(state)
        return remembered
    # Sets whose variables are gone are forgotten.
    _REGISTERED[:] = [entry for entry in _REGISTERED
                      if all(reference() is not None for reference in entry[0])]
    for references, at_registration, privacy_ledger in _REGISTERED:
        others = [reference() for reference in references]
        if not privacy_ledger.total_steps() or not _same_shapes(values, others):
            continue  # Shapes first: reading every registered set's values is slow.
        current = [np.asarray(other.numpy()) for other in others]
        if _same_arrays(values, current) and not _same_arrays(current, at_registration):
            return privacy_ledger
    return None


def _same_shapes(values, variables):
    return len(values) == len(variables) and all(
        value.shape == tuple(variable.shape) for value, variable in zip(values, variables))


def _same_arrays(first, second):
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, second))


def _forget(key):
    def forget(_):
        _LEDGER_OF_VARIABLE.pop(key, None)
    return forget
