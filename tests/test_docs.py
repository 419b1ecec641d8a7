"""The documentation's code runs, and every error keras-dp raises is documented.

- docs/getting_started.md: all its ```python blocks run, in order, in one
  namespace, on a small random stand-in for Fashion-MNIST.
- docs/migrating_from_tf_privacy.md and docs/clipping.md run the same way.
- README.md and the other docs/*.md: every ```python block compiles.
- docs/errors.md: every message keras-dp raises (or warns) appears in it
  (criterion in `test_every_error_message_is_documented`).
- docs/index.md links every other page of docs/.
"""

import ast
import pathlib
import re
import time

import keras
import numpy as np
import pytest

import keras_dp

# Does not depend on TensorFlow's CPU kernel set (the documentation's code runs
# and its text is complete; the numbers it shows are checked elsewhere):
# `make test` runs it once (the markers in pytest.ini), the guides' code with
# the example programs (oneDNN on, as most users run it), the rest with oneDNN off.
pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

# Training examples of the random stand-in for Fashion-MNIST (10,000 test
# images become 128): enough for every block, small enough for < 30 s.
NUM_TRAIN = 512
NUM_TEST = 128


def python_blocks(path):
    return PYTHON_BLOCK.findall(path.read_text(encoding="utf-8"))


def _fake_fashion_mnist():
    """Fashion-MNIST's shapes and dtypes (uint8 images 28 x 28, labels 0-9)."""
    rng = np.random.default_rng(0)

    def split(n):
        return (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                rng.integers(0, 10, n, dtype=np.uint8))

    return split(NUM_TRAIN), split(NUM_TEST)


def _run_blocks(name, monkeypatch, minimum):
    """Runs every python block of docs/`name`, in order, in one namespace.

    The only substitution: `keras.datasets.fashion_mnist.load_data` returns
    512 random training and 128 random test images instead of downloading.
    """
    blocks = python_blocks(DOCS / name)
    assert len(blocks) >= minimum, f"{name} lost its code"
    monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data", _fake_fashion_mnist)
    namespace = {"__name__": name}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"{name}, python block {number}", "exec")
        exec(code, namespace)  # noqa: S102  (the doc's own code)
    return namespace


@pytest.mark.program
def test_getting_started_runs(monkeypatch):
    start = time.perf_counter()
    namespace = _run_blocks("getting_started.md", monkeypatch, minimum=8)
    assert namespace["N"] == NUM_TRAIN
    assert 0.0 < namespace["epsilon"] <= namespace["TARGET_EPSILON"] + 1e-9
    # "Your tf.data pipeline": the epsilon of the same examples as arrays.
    assert namespace["pipeline_epsilon"] == pytest.approx(namespace["arrays_epsilon"], rel=1e-2)
    assert time.perf_counter() - start < 120  # 10-20 s on 2 cores


# 18 s; its custom loop and GAN run in make test as test_custom_loop_guide's
# and test_gan_recipe's programs: make test-all.
@pytest.mark.slow
@pytest.mark.program
def test_the_migration_guide_runs(monkeypatch):
    namespace = _run_blocks("migrating_from_tf_privacy.md", monkeypatch, minimum=5)
    assert namespace["history"].history["epsilon"][-1] == namespace["epsilon"] > 0
    # fit's steps, two drawn Poisson steps, then one full release.
    private = namespace["private"]
    assert private.privacy_steps == 2 * 3 + 2 + 1
    assert [s.sampling for s in private.privacy_ledger.segments()[-2:]] == ["poisson", "unknown"]
    # keras-io's loop from scratch, private: fit's Poisson epsilon for its steps.
    assert namespace["loop_epsilon"] == pytest.approx(
        keras_dp.compute_epsilon(NUM_TRAIN, 64, 1.1, 1e-5, epochs=2), rel=1e-2)
    # The GAN: one pass of real steps is the whole GAN's spending.
    discriminator = namespace["discriminator_private"]
    assert discriminator.privacy_steps == NUM_TRAIN // 64
    assert namespace["gan_epsilon"] == pytest.approx(
        keras_dp.compute_epsilon(NUM_TRAIN, 64, 1.1, 1e-5, epochs=1), rel=1e-2)


@pytest.mark.program
def test_the_clipping_guide_runs(monkeypatch):
    namespace = _run_blocks("clipping.md", monkeypatch, minimum=1)
    clips = namespace["history"].history["l2_norm_clip"]
    assert len(clips) == 2 and clips[0] != 1.0  # C moved from its initial value.
    assert namespace["adaptive"].optimizer.l2_norm_clip > 0


@pytest.mark.program
def test_the_user_level_guide_runs(monkeypatch):
    namespace = _run_blocks("user_level.md", monkeypatch, minimum=1)
    model, history = namespace["model"], namespace["history"]
    assert model.privacy_unit == "user" and "epsilon" not in history.history
    assert history.history["user_epsilon"][-1] == model.privacy_spent(delta=1e-4)[0] > 0


def _other_markdown_files():
    files = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
    return [f for f in files if f.name != "getting_started.md"]


@pytest.mark.parametrize("path", _other_markdown_files(), ids=lambda p: p.name)
def test_python_blocks_compile(path):
    """Every ```python block of README.md and docs/*.md is valid Python."""
    for number, block in enumerate(python_blocks(path), 1):
        compile(block, f"{path.name}, python block {number}", "exec")


def test_index_links_every_page():
    """docs/index.md links every other page of docs/ by its file name."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    # Pages the lead writes in parallel may not exist yet: only missing links fail.
    assert pages <= linked, f"index.md does not link {sorted(pages - linked)}"


# ----------------------------------------------------------- error messages

_PLACEHOLDER = "\0"  # Stands for a value formatted into the message.


def _string_of(node, strings, functions):
    """The text of a message expression, `_PLACEHOLDER` for each variable part.

    Returns a list of texts (a call to a module function gives one per
    `return`), or [] when the expression is not a string.
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        texts = [""]
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts = [value.value]
            elif (isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name)
                  and value.value.id in strings):
                parts = (_string_of(strings[value.value.id], strings, functions)
                         or [_PLACEHOLDER])
            else:
                parts = [_PLACEHOLDER]
            texts = [t + p for t in texts for p in parts]
        return texts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _string_of(node.left, strings, functions)
                for b in _string_of(node.right, strings, functions)]
    if isinstance(node, ast.Name) and node.id in strings:
        return _string_of(strings[node.id], strings, functions)
    if (isinstance(node, ast.Attribute) and node.attr == "message"
            and ast.unparse(node.value) in strings):  # `Refusal.OTHER_LAYOUT.message`.
        return _string_of(strings[ast.unparse(node.value)], strings, functions)
    called = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        called = node.func.id
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        called = node.func.attr  # A method of the module's classes (`self.message(...)`).
    if called in functions:
        function = functions[called]
        return [text for ret in ast.walk(function) if isinstance(ret, ast.Return)
                and ret.value is not None
                for text in _string_of(ret.value, _local_strings(function), functions)]
    return []


def _local_strings(function):
    """{name: value} of the string assignments `name = "..."` in a function."""
    found = {}
    for node in ast.walk(function):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, (ast.Constant, ast.JoinedStr, ast.BinOp))):
            found[node.targets[0].id] = node.value
    return found


def _keyed_strings(tree):
    """{key: value} of a module's dicts of strings keyed by names
    (`_REFUSAL_MESSAGES = {Refusal.OTHER_LAYOUT: "..."}`)."""
    return {ast.unparse(key): value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            for key, value in zip(node.value.keys, node.value.values)
            if isinstance(key, (ast.Name, ast.Attribute))}


def _message_nodes(function):
    """Message expressions of raise sites, TF assertions and warnings."""
    for node in ast.walk(function):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            yield node.lineno, node.exc.args[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = ast.unparse(node.func)
            if name == "warnings.warn" and node.args:
                yield node.lineno, node.args[0]
            elif name.startswith("tf.debugging.assert_"):
                for keyword in node.keywords:
                    if keyword.arg == "message":
                        yield node.lineno, keyword.value


def raised_messages():
    """(place, message text) of every message in keras_dp/**/*.py."""
    found = []
    for path in sorted((ROOT / "keras_dp").rglob("*.py")):
        name = path.relative_to(ROOT / "keras_dp")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        # Methods too, for messages built by `self.message(...)`.
        functions.update({f.name: f for c in tree.body if isinstance(c, ast.ClassDef)
                          for f in c.body if isinstance(f, ast.FunctionDef)})
        scopes = [f for f in ast.walk(tree)
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        seen, keyed = set(), _keyed_strings(tree)
        for scope in scopes:
            strings = {**keyed, **_local_strings(scope)}
            for lineno, node in _message_nodes(scope):
                if lineno in seen:
                    continue  # Already found in an enclosing function.
                seen.add(lineno)
                texts = _string_of(node, strings, functions)
                assert texts, (f"{name}:{lineno}: the message is not a string "
                               "literal; teach tests/test_docs.py to read it")
                found += [(f"{name}:{lineno}", text) for text in texts]
    return found


def message_key(text):
    """The words of `text` that docs/errors.md must contain.

    The literal text is split at its placeholders into runs, and a word
    touching a placeholder (e.g. the `'` of `'{name}'`) is dropped from its
    run. The key is the first 6 words of the first run of at least 4 words,
    or, when no run has 4, the longest run.
    """
    runs = []
    pieces = text.split(_PLACEHOLDER)
    for number, piece in enumerate(pieces):
        words = piece.split()
        if number > 0 and piece[:1].strip():
            words = words[1:]
        if number < len(pieces) - 1 and piece[-1:].strip():
            words = words[:-1]
        runs.append(words)
    long_runs = [run for run in runs if len(run) >= 4]
    return " ".join(long_runs[0][:6] if long_runs else max(runs, key=len))


def _normalized(text):
    return " ".join(text.split()).lower()


def test_every_error_message_is_documented():
    """Every error, TF assertion and warning message of keras_dp/**/*.py is in errors.md.

    Criterion: the message's key (`message_key`: the first 6 literal words
    of its first run of at least 4 literal words) appears in
    docs/errors.md, ignoring case and line breaks. A new error without a
    line in errors.md fails here.
    """
    documented = _normalized((DOCS / "errors.md").read_text(encoding="utf-8"))
    messages = raised_messages()
    assert len(messages) > 80
    missing = [f"{place}: {message_key(text)!r}" for place, text in messages
               if _normalized(message_key(text)) not in documented]
    assert not missing, "not in docs/errors.md:\n" + "\n".join(missing)


def test_message_key():
    key = message_key(f"Layer 'dense' ({_PLACEHOLDER}) mixes examples of a batch in "
                      "training, so ...")
    assert key == "mixes examples of a batch in"
    assert message_key(f"--{_PLACEHOLDER} is required.") == "is required."
