"""`symphony run NAME` (stock programs by name), `symphony run --list`, and where the op
sources are found and staged for the build (symphony/programs.py, engine/ops/build.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from symphony import programs
from symphony.engine.ops import build

REPO = Path(__file__).resolve().parents[3]


def _cli(*args, cwd=REPO, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(REPO), SYMPHONY_SOCKET="/nonexistent/symphony.sock")
    return subprocess.run([sys.executable, "-m", "symphony.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_every_stock_program_is_listed_with_its_docstring():
    names = programs.available()
    files = sorted(p.stem for p in (REPO / "userland").glob("*.py"))
    assert list(names) == files and {"chat", "rag", "generate"} <= set(names)
    for name, doc in names.items():
        assert doc and "\n" not in doc, f"userland/{name}.py needs a module docstring"
    assert names["chat"].startswith("Chat, streamed")


def test_a_name_resolves_to_the_stock_program_and_a_path_stays_a_path():
    assert programs.resolve("chat") == programs.programs_dir() / "chat.py"
    assert programs.programs_dir() == REPO / "userland"         # a checkout uses its own userland/
    for path in ("./chat", "chat.py", "userland/chat.py", "/tmp/x/rag", "no_such.py"):
        assert programs.resolve(path) == Path(path)               # a path is never looked up by name
    with pytest.raises(programs.ProgramError, match=r"no stock program named 'chats'.*chat, codecomplete"):
        programs.resolve("chats")
    with pytest.raises(programs.ProgramError, match="no program given"):
        programs.resolve("")


def test_run_list_and_programs_print_the_listing_without_a_kernel():
    r = _cli("run", "--list")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == programs.listing()
    assert [ln.split()[0] for ln in r.stdout.splitlines()] == list(programs.available())
    r2 = _cli("programs")
    assert r2.returncode == 0 and r2.stdout == r.stdout


def test_run_refuses_an_unknown_name_or_no_program_before_connecting(tmp_path):
    r = _cli("run", "chatt", "hello")
    assert r.returncode == 2 and "no stock program named 'chatt'" in r.stderr and "rag" in r.stderr
    assert "no kernel" not in r.stderr                          # refused before connecting
    r = _cli("run")
    assert r.returncode == 2 and "no program given" in r.stderr


def test_a_file_named_like_a_stock_program_runs_by_path_only(tmp_path):
    """`chat` is the stock program even where ./chat exists; ./chat is the file (it gets as far as
    connecting, which fails here: no kernel)."""
    (tmp_path / "chat").write_text("from symphony.lip import send\nsend('mine')\n")
    by_name = programs.resolve("chat")
    assert by_name.parent == programs.programs_dir()
    r = _cli("run", "./chat", cwd=tmp_path)
    assert r.returncode == 2 and "no kernel is listening" in r.stderr
    r = _cli("run", "chat.py", "hi", cwd=tmp_path)                    # a path, and no such file: a hint
    assert r.returncode == 2 and "cannot read chat.py" in r.stderr and "symphony run chat" in r.stderr


def test_csrc_dir_prefers_a_packaged_copy_then_the_checkout(tmp_path, monkeypatch):
    assert build.csrc_dir() == REPO / "csrc"
    packaged = tmp_path / "_csrc"
    packaged.mkdir()
    (packaged / "ops.cpp").write_text("// packaged\n")
    monkeypatch.setattr(build, "_PACKAGED_CSRC", packaged)
    assert build.csrc_dir() == packaged
    monkeypatch.setattr(build, "_PACKAGED_CSRC", tmp_path / "none")
    monkeypatch.setattr(build, "_CHECKOUT_CSRC", tmp_path / "none2")
    with pytest.raises(RuntimeError, match="C\\+\\+ op sources were not found.*none.*none2"):
        build.csrc_dir()


def test_sources_are_staged_once_by_content(tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    (src / "cpu").mkdir(parents=True)
    (src / "ops.cpp").write_text("int a;\n")
    (src / "cpu" / "k.cpp").write_text("int k;\n")
    (src / "cpu" / "k.h").write_text("#pragma once\n")
    (src / "notes.txt").write_text("not a source\n")
    staged = build._stage_sources(src, cache)
    assert staged.parent == cache and staged.name == build._read_sources(src)[0][:16]
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == \
        ["cpu/k.cpp", "cpu/k.h", "ops.cpp"]
    assert (staged / "cpu" / "k.cpp").read_text() == "int k;\n"
    mtime = (staged / "ops.cpp").stat().st_mtime_ns
    copy = tmp_path / "elsewhere"
    import shutil
    shutil.copytree(src, copy)
    assert build._stage_sources(copy, cache) == staged                  # same bytes elsewhere: same copy,
    assert (staged / "ops.cpp").stat().st_mtime_ns == mtime             # untouched (ninja: up to date)
    (copy / "cpu" / "k.cpp").write_text("int k2;\n")
    other = build._stage_sources(copy, cache)
    assert other != staged and (other / "cpu" / "k.cpp").read_text() == "int k2;\n"
    assert (staged / "cpu" / "k.cpp").read_text() == "int k;\n"        # a staged copy never changes
    assert sorted(p.name for p in cache.iterdir()) == sorted([staged.name, other.name])   # no temp left
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert build._stage_sources(src, blocked / "cache") == src          # cannot stage: build in place


def test_the_build_dir_depends_on_the_sources_bytes_not_their_location(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMPHONY_BUILD_DIR", raising=False)
    here = build._build_dir(False)
    copy = tmp_path / "_csrc"
    import shutil
    shutil.copytree(REPO / "csrc", copy)
    monkeypatch.setattr(build, "_PACKAGED_CSRC", copy)
    assert build.csrc_dir() == copy and build._build_dir(False) == here   # same bytes elsewhere: same build
    with open(copy / "ops.cpp", "a") as f:
        f.write("// changed\n")
    assert build._build_dir(False) != here                                 # other bytes: another build


def test_a_stock_program_by_name_runs_the_same_as_by_path(kernel):
    by_name = kernel.run("generate", "What is the capital of France?", "16")
    by_path = kernel.run(REPO / "userland" / "generate.py", "What is the capital of France?", "16")
    assert by_name.returncode == 0, by_name.stderr
    assert by_path.returncode == 0, by_path.stderr
    assert by_name.stdout == by_path.stdout and "Paris" in by_name.stdout          # greedy: the same text
    ps = kernel.run("no_such_program")
    assert ps.returncode == 2 and "no stock program named" in ps.stderr
