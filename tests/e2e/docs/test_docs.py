"""The documentation stays true: README.md and docs/ checked against the code.

* the reference pages (system calls, kernel flags, error codes) equal a fresh generation by
  docs/gen_reference.py, so a schema, flag or error changed without them fails here;
* ``mkdocs build --strict`` passes (a broken link or anchor between pages fails it);
* every relative link of README.md and docs/ resolves, anchors included, and every source file
  the pages name (``tests/test_x.py``, ``kernel/daemon.py``, ``userland/rag.py``, ...) exists;
* the README's first LIP runs, as written, on a real kernel and prints what the README shows;
* the README's curl examples (run against a real gateway by tests/test_gateway_model.py) are
  the serving guide's, verbatim.
"""
from __future__ import annotations

import glob
import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from conftest import KERNEL_DEVICE, REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (links and paths there are examples)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs (Python-Markdown's toc) makes it."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)}


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


# ---------------------------------------------------------------- generated pages
def test_reference_pages_equal_a_fresh_generation():
    gen = _gen_reference()
    pages = gen.generate()
    assert set(pages) == {"syscalls.md", "client-rpc.md", "kernel-flags.md", "errors.md", "serving.md"}
    stale = [name for name, text in pages.items()
             if not (DOCS / "reference" / name).exists() or (DOCS / "reference" / name).read_text() != text]
    assert not stale, f"docs/reference/{stale} differ from the code: run python docs/gen_reference.py"
    # they say what the code has: every op, every flag of the kernel's parser, every error type
    from symphony.ipc import abi
    from symphony.lip import errors
    for op, name in abi.OP_NAMES.items():
        assert f"| {op} | `{name}` |" in pages["syscalls.md"]
    parser = gen.kernel_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}" in pages["kernel-flags.md"], flag
    for name in errors.BY_NAME:
        assert f"| `{name}` |" in pages["errors.md"]


# ---------------------------------------------------------------- the site
def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'; scripts/quickstart.sh test installs it)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "syscalls" / "index.html").exists()


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


# ---------------------------------------------------------------- links and names
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue                                      # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no {path})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor})")
    assert not bad, "\n".join(bad)


# a path the pages name: from the repository's root, or a module under symphony/ by its package
_CITED = re.compile(r"(?<![\w/.~<$-])((?:symphony|tests|perf|userland|csrc|scripts|docs)/[\w./*-]*[\w*/]"
                    r"|(?:engine|kernel|kvfs|sched|ipc|lip|gateway)/[\w/*-]+\.py)")


def test_cited_source_files_exist():
    """Every file or folder the README and the docs name exists (a glob matches something): a
    module that moved must take its mentions with it."""
    missing = set()
    for page in PAGES:
        for name in _CITED.findall(page.read_text()):
            if name.startswith("symphony/_"):                 # inside an installed wheel, not a checkout
                continue
            root = REPO if "/" in name and name.split("/", 1)[0] in (
                "symphony", "tests", "perf", "userland", "csrc", "scripts", "docs") else REPO / "symphony"
            if not glob.glob(str(root / name)):
                missing.add(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(sorted(missing))


def test_the_readme_is_short_and_self_contained():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    assert "../" not in "".join(_LINK.findall(text)), "the README links outside the repository"
    for heading in ("Quick start", "Writing a LIP", "Serving over HTTP", "Architecture"):
        assert f"\n## {heading}\n" in text                 # named by tests, docstrings and the docs
    quick = _section(text, "Quick start")
    assert "bash scripts/quickstart.sh          #" in quick and "bash scripts/quickstart.sh test     #" in quick


def test_readme_curl_examples_are_the_serving_guides():
    readme = _section((REPO / "README.md").read_text(), "Serving over HTTP")
    guide = (DOCS / "guide" / "serving.md").read_text()
    blocks = [b for lang, b in _code_blocks(readme) if lang == "bash" and "curl" in b]
    assert blocks and all(b in guide for b in blocks)


# ---------------------------------------------------------------- the first LIP
def test_readme_first_lip_runs(kernel, tmp_path):
    """The README's first LIP, as written, with the command line the README shows."""
    section = _section((REPO / "README.md").read_text(), "Writing a LIP")
    source = next(b for lang, b in _code_blocks(section) if lang == "python")
    assert len(source.strip().splitlines()) <= 20
    shown = [re.fullmatch(r"\$ symphony-kernel.*?\n\$ symphony run (\S+) (.*?)\n(.*?)\n", b, re.S)
             for lang, b in _code_blocks(section) if not lang]
    assert any(shown), "the README shows how to run its first LIP and what it prints"
    name, args, printed = next(m for m in shown if m).groups()
    (tmp_path / name).write_text(source)
    args = subprocess.run(["bash", "-c", f"printf '%s\\n' {args}"], capture_output=True, text=True).stdout.split("\n")[:-1]
    out = kernel.run(str(tmp_path / name), *args)
    assert out.returncode == 0, out.stderr
    if KERNEL_DEVICE == "cpu":          # a bfloat16 GPU kernel may answer another way (a near-tie)
        assert out.stdout.strip() == printed.strip(), (out.stdout, printed)
    else:
        assert out.stdout.strip()


def _tree_paths(block: str) -> list[str]:
    """The paths a folder map names: ``name/`` opens a folder at its indent; ``a.py, b.py`` are
    files in the folder above; description lines (indented past the names) name nothing."""
    stack: list[tuple[int, str]] = []
    out = []
    for line in block.splitlines():
        m = re.match(r"( *)(\S.*?)(?:\s{2,}|$)", line)
        if not m or len(m.group(1)) >= 16:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        base = "".join(name for _, name in stack)
        names = [n.strip() for n in m.group(2).split(",")]
        if not all(re.fullmatch(r"[\w.-]+/?|[\w-]+/[\w./-]+", n) for n in names):
            continue
        for n in names:
            out.append(base + n)
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, names[0]))
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/design/architecture.md"])
def test_folder_maps_name_existing_modules(page):
    text = (REPO / page).read_text()
    block = next(b for _, b in _code_blocks(text) if b.startswith("csrc/"))
    paths = _tree_paths(block)
    assert "symphony/kernel/" in paths and "symphony/ipc/" in paths, paths
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"{page}'s folder map names what is not in the tree: {missing}"
