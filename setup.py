"""Packaging for keras-dp: the metadata is in pyproject.toml.

Kept for tools that still run `python setup.py ...`.
"""

import setuptools

setuptools.setup()
