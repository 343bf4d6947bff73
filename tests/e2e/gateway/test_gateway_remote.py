"""A gateway in front of kernels on other hosts: ``symphony-kernel --listen`` over TLS with a
shared secret, ``symphony-gateway --kernel tls://HOST:PORT``.

Kernel A listens on loopback; kernel B runs in a network namespace of its own (as root,
where ``ip netns`` works: its traffic crosses a veth link, a network as far as TLS and the
kernel can tell; otherwise on loopback too) and demands a client certificate as well
(mutual TLS).  Each kernel syncs stored conversations to its own durable directory and may
adopt the other's (--peer-durable-dir: shared storage).  Checked:

  * requests are routed over both, conversations stay where their KV is;
  * the port admits nobody without the secret (a client that skips the handshake, a wrong
    secret, no client certificate where one is demanded, plain TCP to a TLS port), and the
    kernel logs each refusal;
  * kernel B killed: the gateway takes it out and serves everything else from A; a stored
    conversation B served continues on A, its durable KV adopted there (cached tokens > 0);
  * a kernel drained (``drain``, root): new requests go to the other, and a stored
    conversation on it continues on the other, its files exported and imported over TLS;
  * bad remote settings are refused at start-up with the flag named.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import IS_ROOT, REPO, KernelProc
from .test_gateway import free_port

GATEWAY_UID = 2190
NS_IP, HOST_IP = "10.213.77.2", "10.213.77.1"
KERNEL = [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())"]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> dict:
    """A CA, a kernel certificate for 127.0.0.1 and NS_IP, and a client certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=symphony-test-ca", cwd=d)
    for name, san in (("kernel", f"subjectAltName=IP:127.0.0.1,IP:{NS_IP}"), ("client", "subjectAltName=DNS:gw")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(san + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    secret = d / "secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    return {k: str(d / f) for k, f in (("ca", "ca.pem"), ("cert", "kernel.pem"), ("key", "kernel.key"),
                                       ("ccert", "client.pem"), ("ckey", "client.key"), ("secret", "secret"))}


def make_netns() -> str | None:
    """A network namespace joined to this one by a veth pair (None where that is not possible)."""
    if not IS_ROOT:
        return None
    for old in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n"):
        pid = old.split(" ")[0].removeprefix("symt")              # one an aborted run left (its pid gone):
        if old.startswith("symt") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "link", "del", f"vs{pid}a"], capture_output=True)   # its address is ours
            subprocess.run(["ip", "netns", "del", f"symt{pid}"], capture_output=True)
    ns, a, b = f"symt{os.getpid()}", f"vs{os.getpid()}a", f"vs{os.getpid()}b"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
             ["ip", "link", "set", b, "netns", ns], ["ip", "addr", "add", f"{HOST_IP}/30", "dev", a],
             ["ip", "link", "set", a, "up"], ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{NS_IP}/30", "dev", b],
             ["ip", "netns", "exec", ns, "ip", "link", "set", b, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    for s in steps:
        if subprocess.run(s, capture_output=True).returncode != 0:
            drop_netns(ns)
            return None
    return ns


def drop_netns(ns):
    subprocess.run(["ip", "link", "del", f"vs{os.getpid()}a"], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class NsKernel:
    """A kernel started inside network namespace ``ns`` (or here, when ``ns`` is None)."""

    def __init__(self, d: Path, ns, *flags):
        d.mkdir(exist_ok=True)
        self.socket = str(d / "k.sock")
        self.log = open(d / "kernel.log", "w+")
        pre = ["ip", "netns", "exec", ns] if ns else []
        self.proc = subprocess.Popen([*pre, *KERNEL, "--socket", self.socket, "--kv-memory-mb", "192", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        deadline = time.time() + 180
        while "ready on" not in self.read_log():
            assert self.proc.poll() is None and time.time() < deadline, self.read_log()[-3000:]
            time.sleep(0.2)
        self.address = re.search(r"listening on (tls://\S+)", self.read_log()).group(1)

    def read_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self):
        from symphony.client import Client
        return Client(self.socket)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    from modelfiles import write_tiny_gguf
    d = tmp_path_factory.mktemp("remote")
    pki = make_pki(d)
    model = str(write_tiny_gguf(d, seed=1))
    da, db = d / "durable-a", d / "durable-b"
    for x in (da, db):
        x.mkdir(mode=0o700)
    ns = make_netns()
    listen = ["--listen-secret", pki["secret"], "--listen-tls-cert", pki["cert"], "--listen-tls-key", pki["key"]]
    trust = ["--gateway-uid", str(GATEWAY_UID)] if IS_ROOT else []
    a = NsKernel(d / "a", None, "--model", model, "--listen", "127.0.0.1:0", *listen, "--durable-dir", str(da),
                 "--peer-durable-dir", str(db), *trust)
    b_flags = ["--model", model, "--listen", f"{NS_IP if ns else '127.0.0.1'}:0", *listen,
               "--listen-tls-client-ca", pki["ca"], "--durable-dir", str(db), "--peer-durable-dir", str(da), *trust]
    b = NsKernel(d / "b", ns, *b_flags)
    port = free_port()
    glog = open(d / "gateway.log", "w+")
    cmd = [sys.executable, "-m", "symphony.gateway", "--http", f"127.0.0.1:{port}", "--kernel", a.address,
           "--kernel", b.address, "--kernel-secret", pki["secret"], "--kernel-ca", pki["ca"],
           "--kernel-cert", pki["ccert"], "--kernel-key", pki["ckey"], "--durable-responses"]
    gw = subprocess.Popen(cmd + (["--run-as", str(GATEWAY_UID)] if IS_ROOT else []), stdout=glog,
                          stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))

    class R:
        pass
    r = R()
    r.a, r.b, r.ns, r.pki, r.model, r.dir, r.b_flags, r.gw = a, b, ns, pki, model, d, b_flags, gw
    r.url = f"http://127.0.0.1:{port}"
    r.read_log = lambda: (glog.flush(), Path(glog.name).read_text())[1]
    r.extra = []
    try:
        deadline = time.time() + 60
        while "symphony-gateway: serving" not in r.read_log():
            assert gw.poll() is None and time.time() < deadline, r.read_log()
            time.sleep(0.1)
        r.model_id = httpx.get(r.url + "/v1/models").json()["data"][0]["id"]
        yield r
    finally:
        gw.terminate()
        gw.wait(20)
        for k in [a, b, *r.extra]:
            k.stop()
        glog.close()
        if ns:
            drop_netns(ns)


def finished(k) -> int:
    """LIPs the kernel ran or runs (its own ps, as root)."""
    with k.client() as c:
        ps = c.ps()
    return len(ps["lips"]) + len(ps["finished"])


def respond(r, text: str, prev: str | None = None) -> httpx.Response:
    body = {"model": r.model_id, "input": text, "max_output_tokens": 4, "temperature": 0}
    if prev:
        body["previous_response_id"] = prev
    return httpx.post(r.url + "/v1/responses", json=body, timeout=120)


def on_kernel(r, k, tag: str) -> dict:
    """A stored conversation of two turns served by kernel ``k`` (new conversations until one
    lands there); the second turn's response.  (A continuation's cached tokens count from
    the second one on: the first turn's answer was cut by max_output_tokens.)"""
    for i in range(12):
        before = finished(k)
        resp = respond(r, f"Conversation {tag} {i}: tell me about the sea.")
        assert resp.status_code == 200, resp.text
        if finished(k) > before:
            resp = respond(r, "And then?", resp.json()["id"])
            assert resp.status_code == 200 and finished(k) == before + 2, resp.text
            return resp.json()
    raise AssertionError(f"no conversation landed on {k.address}")


def test_requests_reach_both_remote_kernels_over_tls(remote):
    r = remote
    health = httpx.get(r.url + "/health").json()
    assert [k["state"] for k in health["kernels"]] == ["up", "up"], health
    assert [k["socket"] for k in health["kernels"]] == [r.a.address, r.b.address]
    if r.ns:
        assert r.b.address.startswith(f"tls://{NS_IP}:")           # across the veth link
    on_kernel(r, r.a, "a")
    first = on_kernel(r, r.b, "b")
    before = finished(r.b)
    cont = respond(r, "Go on.", first["id"])
    assert cont.status_code == 200 and finished(r.b) == before + 1       # it stayed where its KV is
    assert cont.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_the_port_admits_nobody_without_the_secret(remote):
    from symphony.client import Client
    from symphony.ipc.protocol import encode_frame, recv_frame_sync
    from symphony.ipc.transport import AuthError, Credentials
    r, p = remote, remote.pki
    host, port = r.a.address[len("tls://"):].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=p["ca"])
    with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10), server_hostname=host) as s:
        assert recv_frame_sync(s)["hello"]                       # the challenge, then nothing without an answer
        s.sendall(encode_frame({"op": "spawn", "source": "x", "user": "alice"}))
        refused = recv_frame_sync(s)
        assert refused["error"] == "EACCES" and "authentication failed" in refused["message"]
        assert s.recv(1) == b""                                  # and closed
    with pytest.raises(ConnectionError, match="authentication failed"):
        Client(r.a.address, user="alice", credentials=Credentials(b"wrong" * 8, ca=p["ca"]))
    good = Credentials.load(p["secret"], ca=p["ca"])
    with pytest.raises((ConnectionError, ssl.SSLError, AuthError)):
        Client(r.b.address, user="alice", credentials=good).ps()   # B demands a client certificate
    with socket.create_connection((host, int(port)), timeout=10) as s:   # plain TCP to the TLS port
        s.sendall(encode_frame({"op": "ps", "user": "alice"}))
        s.settimeout(10)
        try:
            assert not s.recv(4096).startswith(b"\x00\x00")      # no frame: a TLS alert at most
        except (ConnectionResetError, socket.timeout):
            pass
    with Client(r.a.address, user="alice", credentials=good) as c:
        assert c.ps()["lips"] == [] or isinstance(c.ps()["lips"], list)
        with pytest.raises(Exception, match="never root"):
            Client(r.a.address, credentials=good).ps()           # a remote peer must name a user
    assert "remote connection from 127.0.0.1" in r.a.read_log() and "refused" in r.a.read_log()


def test_a_dead_remote_kernel_fails_over_and_its_durable_conversation_continues(remote):
    r = remote
    conv = on_kernel(r, r.b, "doomed")
    r.b.proc.send_signal(signal.SIGKILL)
    r.b.proc.wait(20)
    t0 = time.time()
    ok = 0
    for i in range(4):                                           # everything else is served by A
        resp = respond(r, f"A new conversation after the loss, {i}.")
        assert resp.status_code == 200, resp.text
        ok += 1
    assert ok == 4 and time.time() - t0 < 60
    before = finished(r.a)
    cont = respond(r, "Go on.", conv["id"])                      # B's durable files, adopted by A
    assert cont.status_code == 200, cont.text
    assert finished(r.a) == before + 1
    assert cont.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0, cont.json()["usage"]
    assert "moved" in r.read_log() and "out of rotation" in r.read_log()
    # B comes back on the same address's host: a fresh kernel, probed back into rotation
    b2 = NsKernel(r.dir / "b2", r.ns, *[f if not f.endswith(":0") else f.replace(":0", ":" + r.b.address.rsplit(":", 1)[1])
                                         for f in r.b_flags])
    r.extra.append(b2)
    r.b = b2
    deadline = time.time() + 60
    while [k["state"] for k in httpx.get(r.url + "/health").json()["kernels"]] != ["up", "up"]:
        assert time.time() < deadline, r.read_log()[-2000:]
        time.sleep(0.3)


def test_a_drained_kernel_hands_its_conversations_to_the_other(remote):
    r = remote
    conv = on_kernel(r, r.a, "drained")
    with r.a.client() as c:
        c.drain()
    with pytest.raises(Exception, match="draining"):
        with r.a.client() as c:
            c.spawn("def main():\n    pass\n")
    deadline = time.time() + 30
    while httpx.get(r.url + "/health").json()["kernels"][0]["state"] != "draining":
        assert time.time() < deadline
        time.sleep(0.3)
    before = finished(r.b)
    cont = respond(r, "Go on.", conv["id"])
    assert cont.status_code == 200, cont.text
    assert finished(r.b) == before + 1
    assert cont.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0, cont.json()["usage"]
    assert re.search(rf"moved \d+ KV files of local from kernel 0 \({re.escape(r.a.address)}\) to kernel 1",
                     r.read_log()), r.read_log()[-3000:]
    assert "imported /home/local/serve-cache/" in r.b.read_log()         # exported by A, imported by B


@pytest.mark.parametrize("flags, words", [
    (["--listen", "0.0.0.0:0", "--listen-secret", "SECRET"], "needs TLS"),
    (["--listen", "127.0.0.1:0"], "needs --listen-secret"),
    (["--listen-secret", "SECRET"], "go with --listen"),
    (["--listen", "127.0.0.1:0", "--listen-secret", "OPEN"], "readable by other users"),
])
def test_bad_listen_settings_are_refused_before_loading(tmp_path, flags, words):
    s = tmp_path / "s"
    s.write_text("x" * 40)
    s.chmod(0o600)
    o = tmp_path / "o"
    o.write_text("x" * 40)
    o.chmod(0o644)
    flags = [str(s) if f == "SECRET" else str(o) if f == "OPEN" else f for f in flags]
    p = subprocess.run([*KERNEL, "--socket", str(tmp_path / "k.sock"), *flags], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert p.returncode == 2 and words in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("flags, words", [
    (["--kernel", "tcp://10.0.0.1:7000"], "serves loopback addresses only"),
    (["--kernel", "tls://127.0.0.1:7000"], "needs --kernel-secret"),
])
def test_bad_remote_kernel_settings_are_refused_by_the_gateway(flags, words):
    p = subprocess.run([sys.executable, "-m", "symphony.gateway", "--http", "127.0.0.1:0", *flags],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode != 0 and words in p.stderr, p.stderr[-2000:]
