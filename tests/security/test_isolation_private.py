"""No user can read another's data from disk, forge what others see, or make
another pay for pages only they use.

A root kernel whose durable directory was left open (0755, a 0644 file in it)
before it started; Alice and Bob are ordinary Unix users (tests/security/isolation.py)."""
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from conftest import ALICE_UID, BOB_UID, REPO, requires_root
from .isolation import start_kernel, wait_until

BOUNDS = []
QUOTA = 300                 # pages per user (--user-quota)

pytestmark = requires_root


@pytest.fixture(scope="module")
def pk(tmp_path_factory):
    durable = tmp_path_factory.mktemp("opendurable")
    os.chmod(durable, 0o755)
    (durable / "old.kvf").write_bytes(b"SYMKV001 left by a kernel before")
    os.chmod(durable / "old.kvf", 0o644)
    k = start_kernel(tmp_path_factory, "isopriv", "--durable-dir", str(durable), "--user-quota", str(QUOTA),
                     "--host-pages", "256", *BOUNDS)
    k.durable = durable
    yield k
    k.stop()
    assert k.proc.returncode == 0, k.read_log()[-3000:]
    assert k.shm_names() == []


SYNCER = '''
from symphony.lip import info, kv, pred, send

def main():
    with kv.create(f"/home/{info()['user']}/kept.kv", mode=0o644) as f:
        pred(f, list(range(3, 40)))
        f.sync()
    send("synced\\n")
'''


def test_durable_files_are_private_on_disk(pk):
    """Durable files were 0644 in a 0755 directory: any local user read another
    user's KV file (0600 in KVFS) from disk."""
    d = pk.durable
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "old.kvf").st_mode) == 0o600
    log = pk.read_log()
    assert f"durable directory {d} was mode 755; now 0700" in log, log[-2000:]
    assert f"durable directory {d}: 1 files were readable by others; now 0600" in log
    with pk.client_as(ALICE_UID) as a:
        a.spawn(SYNCER)
        assert [e["data"] for e in a.events(timeout=60) if e["event"] == "out"] == ["synced\n"]
    ident = d / "kernel-id"                              # the directory's identity (a gateway adopting from it)
    assert stat.S_IMODE(os.stat(ident).st_mode) & 0o077 == 0
    files = [f for f in d.iterdir() if f.name not in ("old.kvf", "kernel-id")]
    assert len(files) == 1 and stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600, files
    assert os.stat(files[0]).st_uid == 0
    pk.client().kv_rm(f"/home/uid{ALICE_UID}/kept.kv")
    assert wait_until(lambda: not files[0].exists(), 10)


FORGED = "2026-01-01 00:00:00,000 CRITICAL symphony.kernel: FATAL: forged"


def test_control_characters_are_escaped(pk):
    """A LIP's name and arguments reached `symphony ps` (root's too) and the
    kernel's log raw: ANSI escapes, a forged ps row, a forged FATAL log line."""
    sleeper = "import time\n\ndef main(*args):\n    time.sleep(60)\n"
    with pk.client_as(ALICE_UID) as a:
        lip = a.spawn(sleeper, ["\x1b[2J\x1b[31mred", f"a\n{FORGED}"], filename=f"x.py\n{FORGED}\r\x1b[1A")
        r = subprocess.run([sys.executable, "-m", "symphony.cli", "ps"], capture_output=True, text=True,
                           env=pk.env, cwd=REPO, timeout=60)
        a.kill(lip)
    assert r.returncode == 0, r.stderr
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", r.stdout), r.stdout
    assert not any(line.startswith(FORGED[:10]) for line in r.stdout.splitlines()), r.stdout
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == [str(lip)])
    assert "\\x1b[2J" in row and "x.py\\n2026" in row, row
    time.sleep(0.5)
    log = pk.read_log()
    assert not re.search(r"^" + re.escape(FORGED), log, re.M), "a forged line in the kernel's log"
    assert "\\x1b" in log and "\x1b" not in log


SHARER = '''
from symphony.lip import kv, pred, recv, send

def main(n):
    with kv.create("/shared/big.kv", mode=0o644) as f:
        for i in range(0, int(n), 480):
            pred(f, [(i + j) % 200 + 3 for j in range(min(480, int(n) - i))])
    send("shared\\n")
    recv()
    kv.remove("/shared/big.kv")
    with kv.create() as g:                                 # its own work, now that its file is gone
        for i in range(0, 2000, 500):
            pred(g, [(i + j) % 200 + 3 for j in range(500)])
    send("computed\\n")
'''
FORKER = '''
from symphony.lip import kv, recv, send

def main():
    src = kv.open("/shared/big.kv")
    forks = [src.fork() for _ in range(3)]
    src.close()
    send("forked\\n")
    recv()
'''


def test_a_users_quota_is_not_held_by_others_forks(pk):
    """Bob shares a 180-page file read-only, Alice forks it and keeps the forks,
    Bob removes his file: the pages stayed charged to Bob, and his own next
    2,000-token computation failed with QuotaExceeded."""
    with pk.client_as(BOB_UID, timeout=60) as b, pk.client_as(ALICE_UID, timeout=60) as a:
        lip_b = b.spawn(SHARER, ["2880"])                   # 180 pages of 16
        eb = b.events(timeout=60)
        assert next(eb)["data"] == "shared\n"
        a.spawn(FORKER)
        ea = a.events(timeout=60)
        assert next(ea)["data"] == "forked\n"
        b.send_input(lip_b, "go")
        out = [e for e in eb]
        assert out[0].get("data") == "computed\n", out
        assert out[-1]["status"] == 0
        a.kill(next(l["lip"] for l in pk.client().ps()["lips"] if l["user"] == f"uid{ALICE_UID}"))
