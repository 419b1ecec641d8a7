"""`pip install .`: the wheel's contents and metadata, installed in a fresh venv.

The wheel is built without build isolation (no downloads: setuptools >= 77
comes with the `test` extra) from a copy of the checkout, so no build
artefact of an earlier run can slip into it and none is left behind. The
venv sees this interpreter's site-packages for TensorFlow and the other
dependencies, and gets keras-dp from the wheel alone (--no-deps).
"""

import email
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

# Packaging does not depend on TensorFlow's CPU kernel set.
pytestmark = [pytest.mark.program, pytest.mark.once]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setuptools_version():
    try:
        return tuple(int(part) for part in
                     importlib.metadata.version("setuptools").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The path of the wheel `pip wheel .` builds from a copy of the checkout."""
    if _setuptools_version() < (77, 0):
        pytest.skip("needs setuptools >= 77 (pip install -e '.[test]' installs it)")
    source = tmp_path_factory.mktemp("source") / "keras-dp"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--quiet", "-w", str(out), str(source)])
    (path,) = out.glob("keras_dp-*.whl")
    return path


def test_wheel_holds_the_package_only_with_its_marker_and_readme(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(
            next(name for name in names if name.endswith(".dist-info/METADATA"))))
        entry_points = archive.read(
            next(name for name in names if name.endswith(".dist-info/entry_points.txt")))
    assert "keras_dp/py.typed" in names and "keras_dp/audit/statistics.py" in names
    assert {name.split("/")[0] for name in names} == {
        "keras_dp", wheel.name.split("-py3")[0] + ".dist-info"}
    assert not [name for name in names if "tests/" in name or "examples/" in name]
    assert metadata["Name"] == "keras-dp" and metadata["Requires-Python"] == ">=3.10"
    version = re.search(r'^__version__ = "(.+)"', (ROOT / "keras_dp" / "__init__.py")
                        .read_text(encoding="utf-8"), re.M).group(1)
    assert metadata["Version"] == version
    first_line = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[0]
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert first_line in metadata.get_payload()
    requirements = metadata.get_all("Requires-Dist")
    assert "tensorflow>=2.16" in requirements and "dp-accounting>=0.4" in requirements
    # Lower bounds, not pins (the markers after ";" have their own ==).
    assert not [r for r in requirements if "==" in r.split(";")[0]]
    assert b"keras-dp = keras_dp.cli:main" in entry_points


# Half a minute (pip into a fresh venv); the wheel's contents and entry point
# are checked above, and `make install` installs the package on every run.
@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_with_the_command(wheel, tmp_path):
    environment = tmp_path / "venv"
    venv.create(environment, system_site_packages=True, with_pip=False)
    python, command = environment / "bin" / "python", environment / "bin" / "keras-dp"
    # This venv's pip is the system one, seen through system_site_packages.
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
          "--ignore-installed", str(wheel)])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ""}
    help_text = _run([str(command), "--help"], cwd=tmp_path, env=env).stdout
    assert "keras-dp calibrate: " in help_text
    imported = _run([str(python), "-c", "import keras_dp; print(keras_dp.__file__)"],
                    cwd=tmp_path, env=env).stdout.strip()
    # From the venv, not from the checkout or the editable install.
    assert pathlib.Path(imported).is_relative_to(environment), imported
