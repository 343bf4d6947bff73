"""The ops' build directory is keyed by everything that changes the build (ops/build.py,
`build_hash` / `toolchain`): each interpreter, torch install, compiler or flag set gets its own
directory, and the same environment always finds the same one, so that switching between
environments (virtualenvs, interpreters) never rebuilds what was built before."""
import os
import stat
import sys
import types

import pytest
import torch

from symphony.engine.ops import build


@pytest.fixture(autouse=True)
def _fresh_compiler_ids(monkeypatch):
    monkeypatch.setattr(build, "_compiler_ids", {})


def test_the_same_environment_gives_the_same_directory():
    assert build.build_hash(False) == build.build_hash(False)
    assert build.build_hash(False) != build.build_hash(True)


@pytest.mark.parametrize("change", ["python", "python_include", "torch", "torch_git", "torch_dir",
                                    "abi", "cflags", "cpu"])
def test_each_part_of_the_toolchain_moves_the_directory(monkeypatch, change):
    before = build.build_hash(False)
    if change == "python":
        monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    elif change == "python_include":
        real = build.sysconfig.get_paths
        monkeypatch.setattr(build.sysconfig, "get_paths", lambda: dict(real(), include="/elsewhere/include"))
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    elif change == "torch_git":
        monkeypatch.setattr(torch, "version", types.SimpleNamespace(git_version="0" * 40, cuda=None))
    elif change == "torch_dir":                          # the same torch, another virtualenv's copy
        monkeypatch.setattr(torch, "__file__", "/work/venvs/other/site-packages/torch/__init__.py")
    elif change == "abi":
        monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    elif change == "cflags":
        monkeypatch.setattr(build, "_cpu_arch_flags", lambda: ["-march=x86-64-v3"])
    else:
        monkeypatch.setattr(build, "_cpu_signature", lambda: "x86_64|another CPU")
    assert build.build_hash(False) != before


def _fake_compiler(tmp_path, name, version):
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\necho '{version}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_the_compiler_moves_the_directory_and_a_link_to_it_does_not(tmp_path, monkeypatch):
    """$CXX is resolved on PATH and through links, and its --version read: another compiler is
    another directory; a second name for the same compiler is not."""
    monkeypatch.delenv("CXX", raising=False)
    base = build.build_hash(False)
    gcc = _fake_compiler(tmp_path, "g++-x", "g++ (Fake) 99.1")
    clang = _fake_compiler(tmp_path, "clang++-x", "clang version 99.2")
    (tmp_path / "c++-alias").symlink_to(gcc)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    keys = {}
    for cxx in ("g++-x", "clang++-x", "c++-alias"):
        monkeypatch.setenv("CXX", cxx)
        build._compiler_ids.clear()
        keys[cxx] = build.build_hash(False)
    assert len({base, keys["g++-x"], keys["clang++-x"]}) == 3
    assert keys["c++-alias"] == keys["g++-x"]
    build._compiler_ids.clear()
    monkeypatch.setenv("CXX", "c++-alias")
    assert build.toolchain(False)["cxx"] == f"{os.path.realpath(gcc)} (g++ (Fake) 99.1)"


def test_a_missing_compiler_is_named_not_raised(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    assert build.toolchain(False)["cxx"] == "no-such-compiler-anywhere (not found)"
