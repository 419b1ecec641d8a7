"""Packaging for keras-dp: differentially private training (DP-SGD) for Keras 3."""

import os
import re

import setuptools

_HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(_HERE, "keras_dp", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE)
    return match.group(1) if match else "0.0.0"


def _long_description():
    path = os.path.join(_HERE, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


setuptools.setup(
    name="keras-dp",
    version=_version(),
    description="Differentially private training (DP-SGD) for Keras 3 on TensorFlow.",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=setuptools.find_packages(include=["keras_dp", "keras_dp.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.16",
        "keras>=3",
        "dp-accounting>=0.4",
        "numpy",
        "absl-py",
    ],
    extras_require={
        # Norm functions for Keras Hub's text backbones (keras_dp/clipping/layers/hub.py);
        # keras-hub needs Python 3.11 or later.
        "hub": ["keras-hub; python_version >= '3.11'"],
        "test": ["pytest", "tensorboard"],
    },
    entry_points={"console_scripts": ["keras-dp=keras_dp.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
