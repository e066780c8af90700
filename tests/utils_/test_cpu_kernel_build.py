"""Building a CPU kernel library: each build in a fresh folder, copied into place, and one
build at a time per library (processes that start together wait and load the result), so a
library some process has loaded is never rewritten under it. The compiler is replaced by a
stand-in that writes a file; loading is recorded."""
from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch
import torch.utils.cpp_extension

from vllm.utils import cpu_kernels

SOURCE = "// a kernel source\n"


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """(build folders the stand-in compiler was given, libraries loaded by path)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))  # the default root: empty
    folders: list[str] = []
    loaded: list[str] = []

    def compile_and_load(name, sources, build_directory, **kwargs):
        assert open(sources[0]).read().endswith(SOURCE)
        folders.append(build_directory)
        with open(os.path.join(build_directory, f"{name}.so"), "w") as f:
            f.write("library")
        loaded.append(os.path.join(build_directory, f"{name}.so"))

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_and_load)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    return folders, loaded


def build(name="k"):
    return cpu_kernels._build_and_load(name, "/src/k.cpp", SOURCE, "native")


def test_each_build_runs_in_its_own_folder_and_is_copied_into_place(builds):
    folders, loaded = builds
    assert build()
    (folder,) = folders
    directory = os.path.dirname(folder)
    library = [f for f in os.listdir(directory) if f.endswith(".so")]
    assert len(library) == 1 and os.path.basename(folder).startswith("build-")
    assert not os.path.exists(folder)  # the build folder is gone, its library copied
    # A later start loads the library in place and builds nothing.
    assert build()
    assert len(folders) == 1 and loaded[-1] == os.path.join(directory, library[0])


def test_a_start_waits_for_the_build_under_way_and_loads_its_result(builds):
    folders, loaded = builds
    assert build()
    (folder,) = folders
    directory = os.path.dirname(folder)
    (library,) = [f for f in os.listdir(directory) if f.endswith(".so")]
    os.rename(os.path.join(directory, library), os.path.join(directory, "aside"))
    loaded.clear()
    result = []
    with open(os.path.join(directory, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process is building
        waiter = threading.Thread(target=lambda: result.append(build()))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not loaded  # it waits: no build, nothing loaded
        os.rename(os.path.join(directory, "aside"), os.path.join(directory, library))
    waiter.join(10)
    assert result == [True]
    assert len(folders) == 1  # it built nothing: it loaded what the other process built
    assert loaded == [os.path.join(directory, library)]


def test_a_failed_build_leaves_no_library_and_the_next_start_builds(builds, monkeypatch):
    folders, loaded = builds

    def failing(name, sources, build_directory, **kwargs):
        folders.append(build_directory)
        with open(os.path.join(build_directory, f"{name}.so"), "w") as f:
            f.write("half")
        raise RuntimeError("compile error")

    real = torch.utils.cpp_extension.load
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing)
    assert not build()
    directory = os.path.dirname(folders[0])
    assert not [f for f in os.listdir(directory) if f.endswith(".so") or f.startswith("build-")]
    monkeypatch.setattr(torch.utils.cpp_extension, "load", real)
    assert build() and len(folders) == 2
