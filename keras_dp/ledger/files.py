"""The ledger inside a saved file: written again when later training
decided to keep that file (`keras_dp.callbacks.KeptFiles`), and loaded with
the weights or not at all (`load_whole`)."""

import io
import os
import zipfile

import h5py
import tensorflow as tf

from keras_dp.ledger import table

# Where Keras keeps the top-level model's own variables in its weights file
# (`save_own_variables`), and the weights file inside a `.keras` archive.
_VARS = "vars"
_WEIGHTS_IN_ARCHIVE = "model.weights.h5"


def write_ledger_into(path, privacy_ledger, composed=False):
    """Replaces the ledger saved in the file `path` (a `.keras` archive or a
    `.weights.h5` file a private model wrote) by `privacy_ledger`'s state
    where it continues the file's, or, if `composed`, by the two composed
    (`table.kept_state`).

    Args:
        path: the file.
        privacy_ledger: the ledger of the training that decided to keep it.
        composed: whether that training decided it even where its ledger
            does not continue the file's (a checkpoint whose comparison
            carried over from an earlier fit); if False such a file (another
            history, or more steps) is left as it is.

    Returns:
        True when the file held a ledger, which now holds `privacy_ledger`'s.
    """
    # Through tf.io.gfile, as Keras saves a path of another file system
    # (gs://, s3://): review round 89, a checkpoint kept in a bucket carried
    # its own 5 steps where 20 decided it (4.54 reported against 7.52).
    if not tf.io.gfile.exists(path):
        return False
    # As saved and loaded, so that it compares with the file's.
    ours = table.unflat_state(table.flat_state(privacy_ledger.state()))
    with tf.io.gfile.GFile(path, "rb") as file:
        buffer = io.BytesIO(file.read())
    replaced = (_replaced_in_archive if zipfile.is_zipfile(buffer)
                else _replaced_in_weights)(buffer, ours, composed)
    if replaced is None:
        return False
    # Written aside, then renamed over the file: no half-written file on a
    # crash (and TensorFlow's ram:// file system appends on "wb").
    written = f"{path}.keras_dp_ledger"
    with tf.io.gfile.GFile(written, "wb") as file:
        file.write(replaced)
    tf.io.gfile.rename(written, path, overwrite=True)
    return True


def _replaced_in_weights(buffer, ours, composed):
    """The bytes of the weights file in `buffer` with its ledger replaced
    (`_replace`), or None when it holds no ledger to replace."""
    with h5py.File(buffer, "r+") as weights:
        if not _replace(weights, ours, composed):
            return None
    return buffer.getvalue()


def _replaced_in_archive(buffer, ours, composed):
    """The bytes of the `.keras` archive in `buffer` with its ledger
    replaced, or None when it holds no ledger to replace."""
    with zipfile.ZipFile(buffer) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    if _WEIGHTS_IN_ARCHIVE not in members:
        return None
    weights = _replaced_in_weights(io.BytesIO(members[_WEIGHTS_IN_ARCHIVE]), ours, composed)
    if weights is None:
        return None
    members[_WEIGHTS_IN_ARCHIVE] = weights
    archived = io.BytesIO()
    with zipfile.ZipFile(archived, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return archived.getvalue()


def _replace(weights, ours, composed):
    """Writes the ledger state `ours` (or, if `composed`, it composed with
    the file's) over the ledger entries of an open weights file."""
    group = weights.get(_VARS)
    if group is None or "ledger_counter" not in group:
        return False
    names = table.flat_state(ours)
    saved = table.unflat_state({name: group[name][()] for name in names if name in group})
    if not composed and not table.continues(saved, ours):
        return False
    for name, value in table.flat_state(table.kept_state(saved, ours)).items():
        if name in group:
            del group[name]
        group.create_dataset(name, data=value)
    return True


def absolute_path(path):
    """A local path made absolute; another file system's (gs://) as it is."""
    path = str(path)
    return path if "://" in path else os.path.abspath(path)


def is_legacy_h5(filepath):
    """Whether `filepath` names Keras' legacy HDF5 format (.h5, .hdf5, not
    .weights.h5), whose files hold a model's weights layer by layer and never
    its own state: a private model's ledger is not in them (review round 25:
    saved and loaded back, epsilon 0 against 6.04)."""
    name = str(filepath) if isinstance(filepath, (str, os.PathLike)) else ""
    return name.endswith((".h5", ".hdf5")) and not name.endswith(".weights.h5")


def refuse_legacy_h5_save(filepath):
    """Refuses to save a private model to `filepath` in Keras' legacy HDF5
    format (`is_legacy_h5`)."""
    if is_legacy_h5(filepath):
        raise ValueError(
            f"Keras' legacy HDF5 format ({filepath}) saves a private model's weights "
            "without its privacy ledger. Save it as .keras (model.save), or its weights "
            "as .weights.h5 (save_weights; ModelCheckpoint(..., save_weights_only=True) "
            "with a .weights.h5 path).")


def load_whole(model, load):
    """Runs `load()`, a Keras load into `model`, whole or not at all.

    Keras goes on loading a file's other weights when one object refuses
    its part, as this ledger refuses a file of the other unit: without the
    undo, the model would keep weights trained on spending its ledger never
    took. On any error every variable of `model` and of its optimizer gets
    back the value it had, and the error is raised.

    Args:
        model: the private model loaded into.
        load: the call that loads, e.g. Keras' `load_weights` of a file.

    Returns:
        What `load()` returns.
    """
    optimizer = getattr(model, "optimizer", None)
    variables = (list(model.variables) + list(getattr(optimizer, "variables", []))
                 + list(model.privacy_ledger.variables))
    values = [v.numpy() for v in variables]
    try:
        return load()
    except BaseException:
        for variable, value in zip(variables, values):
            variable.assign(value)
        raise
