"""Entry point of the Bazel py_test targets: runs pytest on the given files."""

import os
import sys

import pytest

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]]))
