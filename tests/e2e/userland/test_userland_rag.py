"""End to end: userland/rag.py and userland/codecomplete.py on the real kernel (SmolLM2)."""
import json
import os
import pwd

from conftest import REPO, KernelProc
from symphony.client import KernelError

DOCS = {
    "lighthouse.txt": "The Zorblat Lighthouse stands on Kessel Island. It was built in 1847 by the engineer "
                      "Mira Tolvane. Its lamp is painted emerald green and can be seen from 40 kilometres away.",
    "bakery.txt": "Quenton's Bakery is a small shop in the town of Varnholm. Its most famous pastry is the "
                  "glimmerloaf, which is made with blue honey. The bakery opens every day at six in the morning.",
    "planet.txt": "Ossivar is a cold planet in the Hadra system. Ossivar has three moons, named Tib, Rell and "
                  "Oona. A day on Ossivar lasts 31 hours.",
    "river.txt": "The Dunmarrow River flows through the Ketter Valley. The Dunmarrow River is 412 kilometres "
                 "long. Its water is famous for its red colour, caused by iron in the rocks.",
    "cat.txt": "Professor Ilsa Brandt teaches astronomy at Helmsworth College. Professor Brandt has a grey cat "
               "named Pepperjack. Pepperjack sleeps on the telescope every night.",
    "chess.txt": "The Kestrel Cup is a chess tournament held every summer in Lunsby. The 2019 Kestrel Cup was "
                 "won by Amara Okonjo. The prize was a silver knight statue.",
}
QUESTIONS = [("What are the names of the moons of Ossivar?", "planet.txt", "Tib"),
             ("Who won the 2019 Kestrel Cup?", "chess.txt", "Okonjo"),
             ("How long is the Dunmarrow River?", "river.txt", "412")]
TWO_DOCS = "What pastry is Quenton's Bakery famous for, and what is Professor Brandt's cat called?"


def _me():
    return pwd.getpwuid(os.getuid()).pw_name


def lip_session(kernel, name, args, grant):
    """Spawn a userland LIP through the client; returns (client, lip id, event iterator)."""
    c = kernel.client()
    lip = c.spawn((REPO / "userland" / name).read_text(), args, filename=name,
                  grants={"http": [], "read": [str(grant)]})
    return c, lip, c.events(timeout=120)


def run_lip(kernel, name, *args, grant):
    c, _, events = lip_session(kernel, name, args, grant)
    with c:
        evs = list(events)
    assert evs[-1]["event"] == "exit" and evs[-1]["status"] == 0, evs
    return [e["data"] for e in evs if e["event"] == "out"]


def rag(kernel, docs, question, *opts):
    out = run_lip(kernel, "rag.py", "--docs", str(docs), "--keep-after", "2", "--max-tokens", "24",
                  *opts, question, grant=docs)
    return "".join(o for o in out if isinstance(o, str)), out[-1]


def test_rag_reuses_document_kv_files_and_applies_policy(kernel, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    c = kernel.client()

    # the first question through the real CLI
    r = kernel.run(REPO / "userland/rag.py", "--docs", str(docs), "--keep-after", "2", "--max-tokens", "24",
                   QUESTIONS[0][0], extra=["--grant", f"read:{docs}"])
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.rstrip("\n").rsplit("\n", 1)
    first = {QUESTIONS[0][0]: (answer + "\n", json.loads(stats))}
    for q, _, _ in QUESTIONS[1:]:
        first[q] = rag(kernel, docs, q)
    for q, doc, fact in QUESTIONS:
        answer, st = first[q]
        assert st["docs"] == [doc]                            # the retriever found the right document
        assert fact in answer, (q, answer)
        assert st["kv_created"] >= 1 and st["prefill_computed"] > 0
        assert st["policy"] == {st["files"][0].split("/")[-1][:-3]: "expire"}
        s = c.kv_stat(st["files"][0])
        assert s["expire_at"] is not None and s["advice"] != "keep"

    for q, doc, fact in QUESTIONS:                            # again: every module is reused
        answer, st = rag(kernel, docs, q)
        assert answer == first[q][0]
        assert st["kv_created"] == 0 and st["kv_reused"] == 2      # the instruction and the document
        assert st["prefill_reused"] > 0
        assert st["prefill_reused"] + st["prefill_computed"] == first[q][1]["prefill_computed"] + \
            first[q][1]["prefill_reused"]
        assert st["prefill_computed"] < first[q][1]["prefill_computed"]
        assert list(st["policy"].values()) == ["keep"]        # the second hit makes it popular

    # two documents merged (each at its own positions): the same answer as recomputing them
    answer, st = rag(kernel, docs, TWO_DOCS)
    base_answer, base = rag(kernel, docs, TWO_DOCS, "--no-cache")
    assert sorted(st["docs"]) == ["bakery.txt", "cat.txt"] and base["docs"] == st["docs"]
    assert answer == base_answer
    assert base["prefill_reused"] == 0 and base["kv_created"] == base["kv_reused"] == 0
    assert base["prefill_computed"] == st["prefill_computed"] + st["prefill_reused"]
    assert list(st["policy"].values()) == ["expire", "expire"]

    cache_dir = first[QUESTIONS[0][0]][1]["files"][0].rsplit("/", 1)[0]
    assert cache_dir == f"/home/{_me()}/rag"                  # the runner's own, private cache
    names = {e["name"] for e in c.kv_ls(cache_dir)}
    for q, _, _ in QUESTIONS:                                 # popular: no expiry (a cache file)
        path = first[q][1]["files"][0]
        assert path.split("/")[-1] in names
        s = c.kv_stat(path)
        assert s["advice"] == "cache" and s["expire_at"] is None
    for path in st["files"]:                                  # used once: expiring
        assert path.split("/")[-1] in names
        s = c.kv_stat(path)
        assert s["advice"] == "cache" and s["expire_at"] is not None
    # composed exactly (--compose prefix): the first document a module, the second computed after it
    exact, ex = rag(kernel, docs, TWO_DOCS, "--compose", "prefix")
    exact_base, exb = rag(kernel, docs, TWO_DOCS, "--compose", "prefix", "--no-cache")
    assert exact == exact_base and ex["docs"] == st["docs"] and len(ex["files"]) == 1
    assert ex["files"][0] == st["files"][0] and ex["kv_created"] == 0         # the first module reused
    assert ex["prefill_computed"] + ex["prefill_reused"] == exb["prefill_computed"]
    c.close()


def test_rag_lfu_pins_the_most_hit_documents_within_a_budget(kernel, tmp_path):
    """--policy lfu with the documents handed over (--doc): the most-hit module
    that fits --pin-tokens is pinned ("keep"), and unpinned when another
    document overtakes it; the rest are cache files."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    c = kernel.client()
    (q1, d1, f1), (q2, d2, f2) = QUESTIONS[:2]
    cache = f"/home/{_me()}/rag"
    for sub in ("hits", "pinned"):                # the counts of this kernel's earlier questions
        try:
            for e in c.kv_ls(f"{cache}/{sub}"):
                c.kv_rm(f"{cache}/{sub}/{e['name']}")
        except KernelError:                       # not made yet
            pass

    def ask(q, d, budget):
        out = run_lip(kernel, "rag.py", "--docs", str(docs), "--doc", d, "--policy", "lfu",
                      "--pin-tokens", str(budget), "--max-tokens", "24", q, grant=docs)
        answer, st = "".join(o for o in out if isinstance(o, str)), out[-1]
        assert st["docs"] == [d] and len(st["files"]) == 1
        return answer, st

    a1, s1 = ask(q1, d1, 0)                       # a budget of 0: nothing pinned
    a2, s2 = ask(q2, d2, 0)
    assert f1 in a1 and f2 in a2
    assert list(s1["policy"].values()) == ["cache"] and list(s2["policy"].values()) == ["cache"]
    p1, p2 = s1["files"][0], s2["files"][0]
    n1, n2 = c.kv_stat(p1)["length"], c.kv_stat(p2)["length"]
    budget = n1 + n2 - 1                          # room for either module, not both
    _, s = ask(q1, d1, budget)                    # d1: 2 hits, d2: 1
    assert list(s["policy"].values()) == ["pin"] and s["kv_created"] == 0
    assert c.kv_stat(p1)["advice"] == "keep" and c.kv_stat(p2)["advice"] == "cache"
    ask(q2, d2, budget)                           # 2 and 2: the tie goes by name
    _, s = ask(q2, d2, budget)                    # d2 overtakes d1: pinned, d1 unpinned
    assert list(s["policy"].values()) == ["pin"]
    assert c.kv_stat(p2)["advice"] == "keep" and c.kv_stat(p1)["advice"] == "cache"
    pins = {e["name"] for e in c.kv_ls(p1.rsplit("/", 1)[0] + "/pinned")}
    assert pins == {f"{p2.split('/')[-1][:-3]}.{n2}"}
    c.kv_rm(p2)                                   # a pinned module gone, its marker left behind:
    _, s = ask(q2, d2, budget)                    # recomputed, and pinned again
    assert s["kv_created"] == 1 and list(s["policy"].values()) == ["pin"]
    assert c.kv_stat(p2)["advice"] == "keep"
    # misuse: a clear error, nothing run
    for bad in (["--policy", "lfu"], ["--pin-tokens", "5"], ["--policy", "lru"], ["--doc", "../x"],
                ["--policy", "lfu", "--pin-tokens", "-1"]):
        s3, _, events = lip_session(kernel, "rag.py", ["--docs", str(docs), *bad, q1], docs)
        with s3:
            evs = list(events)
        assert evs[-1]["event"] == "exit" and evs[-1]["status"] != 0, (bad, evs)
    c.close()


PRESSURE = """from symphony.lip import kv, pred, send


def main(n):
    with kv.create() as f:
        pred(f, [1] * int(n), output="argmax")
    send("done")
"""


def test_rag_modules_are_cache_files_dropped_under_pressure_and_recomputed(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    # a small pool, no host or disk tier: only deleting cache files can make room
    k = KernelProc(tmp_path, "--kv-memory-mb", "24", "--host-pages", "0", "--user-quota", "100%")
    try:
        c = k.client()
        q, doc, fact = QUESTIONS[1]
        answer, st = rag(k, docs, q)
        assert fact in answer and st["kv_created"] == 2          # the instruction and the document
        cache_dir = st["files"][0].rsplit("/", 1)[0]
        modules = {e["name"] for e in c.kv_ls(cache_dir) if e["type"] == "file"}
        assert len(modules) == 2 and all(c.kv_stat(f"{cache_dir}/{m}")["advice"] == "cache" for m in modules)
        stats = c.stats()
        total, used = stats["kv_pages_total"], stats["kv_pages_used"]
        assert used > 0                                           # the modules hold pages
        # another LIP fills the whole pool: the unused modules are deleted to make room
        lip = c.spawn(PRESSURE, [str(total * 16)], filename="pressure.py")
        evs = list(c.events(timeout=300))
        assert evs[-1]["event"] == "exit" and evs[-1]["status"] == 0, (evs, k.read_log()[-3000:])
        assert [e["data"] for e in evs if e["event"] == "out"] == ["done"] and lip
        assert {e["name"] for e in c.kv_ls(cache_dir) if e["type"] == "file"} == set()
        again, st2 = rag(k, docs, q)                              # a cache miss: computed again
        assert again == answer and st2["kv_created"] == 2 and st2["prefill_reused"] == 0
        assert st2["prefill_computed"] == st["prefill_computed"]
        c.close()
    finally:
        k.stop()


SOURCE = """import math


class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return math.pi * self.radius ** 2

    def perimeter(self):
        return 2 * math.pi * self.radius


class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side ** 2

    def perimeter(self):
        return 4 * self.side


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
"""


def test_codecomplete_edit_delete_undo(kernel, tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    src = root / "pkg" / "shapes.py"
    src.write_text(SOURCE)
    code = f"/home/{_me()}/code/pkg"
    c = kernel.client()

    # one request from the command line: the whole prefix is computed
    r = kernel.run(REPO / "userland/codecomplete.py", "--root", str(root), "--file", "pkg/shapes.py",
                   "--line", "33", extra=["--grant", f"read:{root}"])
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["prefill_reused"] == 0 and first["prefill_computed"] == first["kv_tokens"] + 1
    assert isinstance(first["completion"], str) and "\n" not in first["completion"]
    assert c.kv_stat(f"{code}/shapes.py.kv")["length"] == first["kv_tokens"]

    # an editor session: requests on stdin, one JSON answer each
    s, lip, events = lip_session(kernel, "codecomplete.py", ["--root", str(root)], root)

    def ask(**req):
        s.send_input(lip, json.dumps(req))
        ev = next(events)
        assert ev["event"] == "out", ev
        return ev["data"]

    a = ask(file="pkg/shapes.py", line=33, event="complete")  # unchanged: everything reused
    assert a["prefill_reused"] == first["kv_tokens"] and a["prefill_computed"] == 1
    assert a["completion"] == first["completion"]

    edited = SOURCE.replace("return self.width * self.height", "return self.height * self.width")
    src.write_text(edited)
    a = ask(file="pkg/shapes.py", line=33, event="complete")  # line 32 of 33 edited
    assert a["prefill_reused"] >= 0.85 * a["kv_tokens"], a
    assert a["prefill_computed"] < 0.15 * a["kv_tokens"] + 1, a
    assert a["prefill_reused"] + a["prefill_computed"] == a["kv_tokens"] + 1

    src.unlink()
    a = ask(file="pkg/shapes.py", event="delete")
    assert a["kv"] == f"{code}/shapes.py.prev.kv"
    names = {e["name"] for e in c.kv_ls(code)}
    assert "shapes.py.kv" not in names and "shapes.py.prev.kv" in names
    prev = c.kv_stat(f"{code}/shapes.py.prev.kv")
    assert prev["expire_at"] is not None and prev["advice"] == "drop_first"

    src.write_text(edited)                                    # undo: the file is back within 30 s
    a = ask(file="pkg/shapes.py", line=33, event="complete")
    assert a["prefill_reused"] == a["kv_tokens"] and a["prefill_computed"] == 1, a   # restored
    names = {e["name"] for e in c.kv_ls(code)}
    assert "shapes.py.kv" in names and "shapes.py.prev.kv" not in names
    assert c.kv_stat(f"{code}/shapes.py.kv")["expire_at"] is None

    s.send_input(lip, None)
    assert list(events)[-1]["status"] == 0
    s.close()
    c.close()
