"""What a non-editable install (`pip install .`, a wheel) carries: every file the package reads
at run time that is not Python, i.e. the C++ kernel sources and headers it builds on the
user's machine and the demo model, is matched by setup.py's package_data."""
from __future__ import annotations

import fnmatch
import os
import runpy
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "vllm")
RUNTIME_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def package_data_patterns() -> list[str]:
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return setup.call_args.kwargs["package_data"]["vllm"]


def shipped(relative: str, patterns: list[str]) -> bool:
    # setuptools' package_data globs: '*' does not cross a '/'
    parts = relative.split("/")
    return any(len(p.split("/")) == len(parts)
               and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, p.split("/")))
               for p in patterns)


def test_every_kernel_source_and_header_is_package_data():
    patterns = package_data_patterns()
    needed = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(RUNTIME_SUFFIXES):
                needed.append(os.path.relpath(os.path.join(directory, name), PACKAGE)
                              .replace(os.sep, "/"))
    assert any(n.endswith(".h") for n in needed)  # the walk sees the headers
    missing = [n for n in needed if not shipped(n, patterns)]
    assert not missing, f"not in setup.py's package_data (a wheel would lack them): {missing}"


def test_demo_model_is_package_data():
    patterns = package_data_patterns()
    demo = os.path.join(PACKAGE, "demo_model")
    assert all(shipped(f"demo_model/{name}", patterns) for name in os.listdir(demo)
               if os.path.isfile(os.path.join(demo, name)))
