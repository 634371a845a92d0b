"""Shared memory stays on this host, and a caller's object cannot kill the server.

- Who: registering, unregistering, listing and every use of a region (a request naming
  one, a request ring) need a local peer — a unix-domain socket or loopback — else
  PERMISSION_DENIED naming the peer. The predicate on many peer forms; the registry's
  refusal before it says whether a region exists; end to end, a server bound to one end
  of a veth pair in a network namespace this test creates, called from inside the
  namespace (another host, as far as the server can tell) and from this machine's own
  non-loopback address (both refused, the victim object untouched), and through its
  ``--unix-socket`` (served).
- SIGBUS: a thread shrinks the objects under WriteCache, PrefillContext (q read, results
  written) and request rings, again and again; the server survives (GetServerInfo
  answers), each affected request fails with FAILED_PRECONDITION naming the region, the
  others are exact, and the cache holds what the successful writes wrote.
- The cost of reading through the descriptor instead of a mapping, printed (25 MB q).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from context_layout import BS, LSE_BYTES, NB, OUT_BYTES, Q_BYTES, SEQS, SLOTS, TQ, D, H, L, R
from ctxprefill.errors import PermissionDenied
from ctxprefill.service.request_ring import RingTable
from ctxprefill.service.shared_memory import SharedMemoryRegistry, peer_is_local, require_local
from ctxprefill_api import pb
from ctxprefill_client import (
    BF16,
    INT64,
    PrefillContextClient,
    SharedMemoryRef,
    SharedMemoryTensor,
    SystemSharedMemoryRegion,
    float32_to_bf16_bits,
)
from rpc_errors import expect
from service_process import SHARED_MEMORY_MARKS, ServerProcess, env_with_sources, free_port

pytestmark = SHARED_MEMORY_MARKS

COMMON = {"heads": H, "block_size": BS, "num_blocks": NB, "workspace_tokens": 64, "seed": 5,
          "shared_memory": "system", "request_ring": True}
RNG = np.random.default_rng(17)
KV_C = float32_to_bf16_bits(RNG.standard_normal((len(SLOTS), L), dtype=np.float32))
K_PE = float32_to_bf16_bits(RNG.standard_normal((len(SLOTS), R), dtype=np.float32))
Q = float32_to_bf16_bits(RNG.standard_normal((TQ, H, D), dtype=np.float32))
#: requests per storm, and a bound on its time
STORM_REQUESTS, STORM_S = 120, 60.0


def key() -> str:
    return f"ctxprefill-safety-{uuid.uuid4().hex[:12]}"


class ShmObject:
    """A /dev/shm object this test owns through a descriptor only: never mapped here, so
    that shrinking it cannot SIGBUS the test process either."""

    def __init__(self, content: bytes):
        self.key, self.content = key(), content
        self.path = f"/dev/shm/{self.key}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(self.fd, content, 0)

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


@contextlib.contextmanager
def registered(client: PrefillContextClient, **contents: bytes) -> Iterator[dict[str, ShmObject]]:
    """An ShmObject per name holding its bytes, registered under that name whole; afterwards
    every region unregistered (where the server still answers) and the objects removed."""
    objs: dict[str, ShmObject] = {}
    try:
        for name, content in contents.items():
            objs[name] = ShmObject(content)
            client.register_system_shared_memory(name, objs[name].key, len(content))
        yield objs
    finally:
        with contextlib.suppress(Exception):  # a dead server must not leave the objects behind
            client.unregister_shared_memory("")
        for obj in objs.values():
            obj.close()


class Shrinker(threading.Thread):
    """Shrinks objects to nothing and grows them back, whole, in one write, until stopped:
    a reader sees its bytes, or an object too short for them (whole pages go, none is
    zeroed under a reader)."""

    def __init__(self, *objs: ShmObject, seed: int = 0):
        super().__init__(daemon=True)
        self.objs, self.rng = objs, random.Random(seed)
        self.stop, self.cycles = threading.Event(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            for o in self.objs:
                os.ftruncate(o.fd, 0)
            time.sleep(self.rng.uniform(0, 0.001))
            for o in self.objs:
                os.pwrite(o.fd, o.content, 0)
            time.sleep(self.rng.uniform(0, 0.003))
            self.cycles += 1

    def __enter__(self) -> Shrinker:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(10)
        for o in self.objs:
            os.pwrite(o.fd, o.content, 0)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(COMMON) as proc:
        yield proc


@pytest.fixture()
def client(server):
    with PrefillContextClient(server.target, retries=0, timeout=60) as c:
        c.unregister_shared_memory("")
        yield c
        c.unregister_shared_memory("")


def outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the client's error, classified below
        code = getattr(e, "code", None)  # CtxPrefillRpcError: a grpc.StatusCode
        return getattr(code, "name", type(e).__name__), str(getattr(e, "details", e))
    return "OK", ""


def storm(server, requests) -> dict[str, int]:
    """Run ``requests`` (callables) one after the other (bounded in count and time) and
    count their outcomes: OK, or FAILED_PRECONDITION naming a region that shrank."""
    counts: dict[str, int] = {}
    t_end = time.monotonic() + STORM_S
    for i in range(STORM_REQUESTS):
        if time.monotonic() > t_end:
            break
        code, msg = outcome(requests[i % len(requests)])
        assert server.proc.poll() is None, f"the server died ({server.proc.returncode}):\n{server.log()[-4000:]}"
        if code != "OK":
            assert code == "FAILED_PRECONDITION" and ".region" in msg and "shrank" in msg, (code, msg)
        counts[code] = counts.get(code, 0) + 1
    return counts


# ----------------------------------------------------------------------------- who may


@pytest.mark.parametrize("peer", [
    "unix:", "unix:/run/ctxprefill/grpc.sock", "unix-abstract:ctxprefill",
    "ipv4:127.0.0.1:50051", "ipv4:127.255.3.4:1", "ipv4:127.0.0.1:0",
    "ipv6:[::1]:50051", "ipv6:%5B::1%5D:47766", "ipv6:[::ffff:127.0.0.1]:80", "ipv6:%5B::ffff:127.9.9.9%5D:80",
])
def test_local_peers(peer):
    assert peer_is_local(peer)
    require_local(peer)


@pytest.mark.parametrize("peer", [
    None, "", "ipv4:192.0.2.2:50051", "ipv4:10.0.0.1:1", "ipv4:0.0.0.0:1", "ipv4:128.0.0.1:1", "ipv4:126.255.255.255:1",
    "ipv4:localhost:1", "ipv4:127.0.0.1", "ipv4:127.1:5", "ipv6:[::]:1", "ipv6:[fd00::2]:1", "ipv6:%5Bfd00::2%5D:1",
    "ipv6:[::ffff:10.0.0.1]:1", "ipv6:[::127.0.0.1]:1", "ipv6:[fe80::1%25lo]:1", "ipv6:::1:5000", "ipv6:[::1:5000",
    "dns:localhost:1", "localhost:1", "127.0.0.1:1", "unknown",
])
def test_other_peers_are_refused_by_name(peer):
    assert not peer_is_local(peer)
    with pytest.raises(PermissionDenied, match="this host") as ei:
        require_local(peer, "q.shared_memory.region")
    assert ei.value.field == "q.shared_memory.region" and repr((peer or "no gRPC peer")[:200]) in ei.value.message


def test_the_registry_refuses_a_remote_lease_before_looking_the_region_up():
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4096) as shm:
        reg.register_system("r", shm.key, 0, 4096)
        remote = reg.lease("ipv4:192.0.2.7:41000")
        for name in ("r", "no-such-region"):  # the same answer: nothing tells whether it exists
            with pytest.raises(PermissionDenied, match="192.0.2.7"):
                remote.resolve(pb.SharedMemoryRef(region=name, offset=0, byte_size=8), "q.shared_memory", 8)
        assert reg.status("r")[0]["requests_in_flight"] == 0
        with pytest.raises(PermissionDenied, match="no gRPC peer"):  # a lease off any call
            reg.lease().resolve(pb.SharedMemoryRef(region="r", offset=0, byte_size=8), "q.shared_memory", 8)
        rings = RingTable(reg, 4)
        with pytest.raises(PermissionDenied, match="192.0.2.7"):
            rings.attach("r", 0, 1, 4096, "ipv4:192.0.2.7:41000")
        ring = rings.attach("r", 0, 1, 4096, "unix:")
        assert ring.peer == "unix:"
        ring.detach()
        assert not ring.usable() and ring.stopped.result() is None
        reg.unregister("")


def test_loopback_callers_are_served(client):
    """The module's server listens on 127.0.0.1: registration and use succeed."""
    with SystemSharedMemoryRegion("lo", Q_BYTES) as shm:
        client.register_system_shared_memory(shm)
        q_in = shm.write(Q, 0, BF16)
        res = client.prefill_context(q_in, SEQS)
        assert np.array_equal(res.output_bits, client.prefill_context(Q, SEQS).output_bits)
        assert [r.name for r in client.shared_memory_status()] == ["lo"]
        client.unregister_shared_memory("lo")


# A caller elsewhere: plain gRPC (a few calls, each one's code and details as JSON).
REMOTE_CALLER = r"""
import json, sys
import grpc
from ctxprefill_api import pb, pb_grpc
target, victim_key, victim_name, n_slots = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
stub = pb_grpc.PrefillContextServiceStub(grpc.insecure_channel(target))
ref = lambda off, n: pb.SharedMemoryRef(region=victim_name, offset=off, byte_size=n)
calls = {
    "GetServerInfo": lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=20),
    "RegisterSystemSharedMemory": lambda: stub.RegisterSystemSharedMemory(pb.RegisterSystemSharedMemoryRequest(
        name="stolen", key=victim_key, offset=0, byte_size=4096), timeout=20),
    "GetSharedMemoryStatus": lambda: stub.GetSharedMemoryStatus(pb.GetSharedMemoryStatusRequest(), timeout=20),
    "UnregisterSharedMemory": lambda: stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=""),
                                                                  timeout=20),
    "WriteCache": lambda: stub.WriteCache(pb.WriteCacheRequest(
        slot_mapping=pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[n_slots], shared_memory=ref(0, 8 * n_slots)),
        kv_c=pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=[n_slots, 512], shared_memory=ref(0, n_slots * 1024)),
        k_pe=pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=[n_slots, 64], shared_memory=ref(0, n_slots * 128))),
        timeout=20),
    "ReadCache": lambda: stub.ReadCache(pb.ReadCacheRequest(slot_mapping=pb.Tensor(
        dtype=pb.DATA_TYPE_INT64, shape=[1], shared_memory=ref(0, 8))), timeout=20),
    "PrefillContext": lambda: stub.PrefillContext(pb.PrefillContextRequest(
        q=pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=[1, 2, 192], data=bytes(768)),
        sequences=[pb.Sequence(query_len=1, context_len=0)], output_region=ref(0, 512)), timeout=20),
    "AttachRequestRing": lambda: next(stub.AttachRequestRing(pb.AttachRequestRingRequest(
        region=victim_name, offset=0, num_slots=1, slot_bytes=4096), timeout=20)),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = ["OK", ""]
    except grpc.RpcError as e:
        out[name] = [e.code().name, e.details()]
print(json.dumps(out))
"""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class NetNs:
    """A network namespace joined to this one by a veth pair: ``host_ip`` here,
    ``peer_ip`` inside. Made and removed by the test (root, iproute2)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.name, self.veth, self.inner = f"ctxp{tag}", f"cxh{tag}", f"cxn{tag}"
        net = random.randrange(1, 250)
        self.host_ip, self.peer_ip = f"10.213.{net}.1", f"10.213.{net}.2"
        self.made = False

    def __enter__(self) -> NetNs:
        _run("ip", "netns", "add", self.name)
        self.made = True
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.inner)
        _run("ip", "link", "set", self.inner, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth)
        _run("ip", "link", "set", self.veth, "up")
        _run("ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.peer_ip}/30", "dev", self.inner)
        _run("ip", "netns", "exec", self.name, "ip", "link", "set", self.inner, "up")
        _run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30)
        if self.made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


def _netns_why_not() -> str:
    if shutil.which("ip") is None:
        return "no iproute2 (ip) on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ctxpprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"ip netns add fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return ""


def _own_address() -> str:
    """A non-loopback IPv4 address of this machine ('' when it has none)."""
    r = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                       timeout=30) if shutil.which("ip") else None
    for line in (r.stdout.splitlines() if r is not None and r.returncode == 0 else []):
        return line.split()[3].split("/")[0]
    return ""


def test_remote_callers_get_permission_denied_and_the_unix_socket_is_served():
    """The attack: a caller that is not on this host names a /dev/shm object it may not
    touch. With a network namespace (this test makes one and removes it) the caller is
    truly elsewhere; this machine's own non-loopback address is refused as well. The
    server's --unix-socket serves the same RPCs to a same-host caller."""
    why = _netns_why_not()
    own = _own_address()
    if why and not own:
        pytest.skip(f"{why}, and this machine has no non-loopback address to call from")
    victim = ShmObject(bytes(range(256)) * 64)  # another process's object
    sock_dir = tempfile.mkdtemp(prefix="ctxp-sock-")
    sock = os.path.join(sock_dir, "grpc.sock")
    ns = NetNs() if not why else None
    try:
        if ns is not None:
            ns.__enter__()
        host = ns.host_ip if ns is not None else own
        port = free_port()
        proc = ServerProcess({**COMMON, "host": host, "metrics_host": "127.0.0.1", "allow_insecure": True,
                              "unix_socket": sock}, port=port, metrics_port=free_port())
        try:
            proc.wait_ready()
            callers = {"this machine's own address": [sys.executable]}
            if ns is not None:
                callers["inside a network namespace"] = ns.command(sys.executable)
            with PrefillContextClient(f"unix:{sock}", retries=0, timeout=60) as local:
                # a same-host caller through the socket: registers the victim's neighbour and computes
                with SystemSharedMemoryRegion("mine", Q_BYTES) as shm:
                    local.register_system_shared_memory(shm)
                    res = local.prefill_context(shm.write(Q, 0, BF16), SEQS)
                    assert np.array_equal(res.output_bits, local.prefill_context(Q, SEQS).output_bits)
                    for where, argv in callers.items():
                        got = subprocess.run([*argv, "-c", REMOTE_CALLER, f"{host}:{port}", victim.key, "mine",
                                              str(len(SLOTS))], capture_output=True, text=True, timeout=120,
                                             env=env_with_sources())
                        assert got.returncode == 0, got.stderr[-3000:]
                        out = json.loads(got.stdout)
                        assert out.pop("GetServerInfo") == ["OK", ""], where  # the rest of the API is served
                        peer_ip = ns.peer_ip if ns is not None and argv[0] == "ip" else host
                        for method, (code, details) in out.items():
                            assert code == "PERMISSION_DENIED", (where, method, code, details)
                            assert f"ipv4:{peer_ip}:" in details and "this host" in details, (where, method, details)
                    # nothing changed: the victim's bytes, the regions registered, the cache
                    assert os.pread(victim.fd, len(victim.content), 0) == victim.content
                    assert [r.name for r in local.shared_memory_status()] == ["mine"]
                    assert not local.read_cache([0]).any()
                    local.unregister_shared_memory("")
        finally:
            proc.terminate(15)
            proc.kill()
        assert not os.path.exists(sock)  # the server removes its socket when it stops
    finally:
        if ns is not None:
            ns.__exit__(None, None, None)
        victim.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_unix_socket_refuses_to_replace_a_file():
    with tempfile.NamedTemporaryFile(prefix="ctxp-not-a-socket-") as f:
        proc = ServerProcess({**COMMON, "unix_socket": f.name})
        try:
            assert proc.proc.wait(timeout=120) == 2
            assert "--unix-socket" in proc.log()
        finally:
            proc.kill()
        assert os.path.isfile(f.name)


# ----------------------------------------------------------------------------- SIGBUS


def test_write_cache_survives_objects_shrinking_under_it(server, client):
    """What killed the server with SIGBUS within 0.1-1.4 s: WriteCache reading slot_mapping,
    kv_c and k_pe from objects that a thread shrinks and grows back meanwhile."""
    T = len(SLOTS)
    sentinel_slots = np.arange(NB * BS - 8, NB * BS)  # written inline first; nothing may touch them
    sentinel = (np.arange(8 * L).reshape(8, L) % 997).astype(np.uint16), (np.arange(8 * R).reshape(8, R) % 89).astype(
        np.uint16)
    client.write_cache(sentinel_slots, *sentinel)
    before = client.read_cache(sentinel_slots)
    client.write_cache(SLOTS, np.zeros_like(KV_C), np.zeros_like(K_PE))
    with registered(client, slots=np.asarray(SLOTS, np.int64).tobytes(), lat=KV_C.tobytes() + K_PE.tobytes()) as objs:
        s_in = SharedMemoryTensor(INT64, (T,), SharedMemoryRef("slots", 0, T * 8))
        kv_in = SharedMemoryTensor(BF16, (T, L), SharedMemoryRef("lat", 0, T * L * 2))
        pe_in = SharedMemoryTensor(BF16, (T, R), SharedMemoryRef("lat", T * L * 2, T * R * 2))
        with Shrinker(objs["slots"], objs["lat"], seed=1) as sh:
            counts = storm(server, [lambda: client.write_cache(s_in, kv_in, pe_in)])
        print(f"\nWriteCache storm: {counts}, {sh.cycles} shrink cycles")
        assert counts.get("FAILED_PRECONDITION", 0) > 0 and counts.get("OK", 0) > 0, counts
        client.server_info()
        # every successful write wrote the objects' bytes; nothing else changed
        expect_rows = client.read_cache(SLOTS)
        client.write_cache(SLOTS, KV_C, K_PE)
        assert np.array_equal(client.read_cache(SLOTS), expect_rows)
        assert np.array_equal(client.read_cache(sentinel_slots), before)
        assert client.write_cache(s_in, kv_in, pe_in) == T  # the objects whole again: the regions work


def test_prefill_survives_objects_shrinking_under_q_and_the_results(server, client):
    """PrefillContext reading q from one object and writing its output and LSE into
    another while both shrink and grow back: every answer is exact or FAILED_PRECONDITION."""
    client.write_cache(SLOTS, KV_C, K_PE)
    ref = client.prefill_context(Q, SEQS)
    with registered(client, q=Q.tobytes(), res=bytes(OUT_BYTES + 4096 + LSE_BYTES)) as objs:
        q_obj, res_obj = objs["q"], objs["res"]
        q_in = SharedMemoryTensor(BF16, (TQ, H, D), SharedMemoryRef("q", 0, Q_BYTES))
        out_at, lse_at = SharedMemoryRef("res", 0, OUT_BYTES), SharedMemoryRef("res", OUT_BYTES + 4096, LSE_BYTES)
        exact = []

        def q_only() -> None:
            res = client.prefill_context(q_in, SEQS)
            exact.append(np.array_equal(res.output_bits, ref.output_bits)
                         and np.array_equal(res.lse.view(np.uint32), ref.lse.view(np.uint32)))

        with Shrinker(q_obj, res_obj, seed=2) as sh:
            counts = storm(server, [q_only, lambda: client.prefill_context(q_in, SEQS, output_region=out_at,
                                                                           lse_region=lse_at)])
        print(f"\nPrefillContext storm: {counts}, {sh.cycles} shrink cycles")
        assert counts.get("FAILED_PRECONDITION", 0) > 0 and exact and all(exact), (counts, exact.count(False))
        client.prefill_context(q_in, SEQS, output_region=out_at, lse_region=lse_at)
        out = np.frombuffer(os.pread(res_obj.fd, OUT_BYTES, 0), np.uint16)
        assert np.array_equal(out, ref.output_bits.reshape(-1))  # the results land whole once it stays whole
        assert np.array_equal(client.prefill_context(Q, SEQS).output_bits, ref.output_bits)


def test_a_shrinking_ring_ends_the_ring_not_the_server(server, client):
    """The engine thread polls a ring hot (it just answered a request) while its object
    shrinks to nothing and grows back, again and again, then stays empty: each ring ends
    with FAILED_PRECONDITION naming the region, the server goes on. (Polling through a
    mapping, a shrink between the size check and the load was SIGBUS.)"""
    ref = client.prefill_context(Q, SEQS)
    rng = random.Random(3)
    for rep in range(24):
        r = SystemSharedMemoryRegion(f"ring{rep}", 4 * 8192)
        fd = os.open(os.path.join("/dev/shm", r.key), os.O_RDWR)
        try:
            client.register_system_shared_memory(r)
            ring = client.attach_request_ring(r, num_slots=4, slot_bytes=8192)
            assert np.array_equal(ring.prefill_context(Q, SEQS).output_bits, ref.output_bits)
            t_end = time.monotonic() + rng.uniform(0.005, 0.03)  # within the engine thread's hot polling
            while time.monotonic() < t_end:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, 4 * 8192)  # back, zeros: every slot FREE
            os.ftruncate(fd, 0)
            t_end = time.monotonic() + 10
            while ring.is_open and time.monotonic() < t_end:
                time.sleep(0.01)
            assert not ring.is_open
            with expect(grpc.StatusCode.FAILED_PRECONDITION, "region", "shrank"):
                ring.prefill_context(Q, SEQS)  # the ended call's status, raised before any slot is touched
            ring.close()
            assert server.proc.poll() is None, server.log()[-4000:]
        finally:
            os.close(fd)
            with contextlib.suppress(Exception):
                client.unregister_shared_memory("")
            r.close()
            r.unlink()
    assert np.array_equal(client.prefill_context(Q, SEQS).output_bits, ref.output_bits)


# ----------------------------------------------------------------------------- cost


def test_reading_through_the_descriptor_costs_about_what_the_mapping_did():
    """25 MB of q (4,096 tokens x 16 heads x 192, BF16) read as a request does: through
    the descriptor (``os.preadv`` into private memory) against a copy out of a mapping of
    the object. Figures printed; the bytes must agree."""
    n = 4096 * 16 * 192 * 2
    reg = SharedMemoryRegistry(("system",), max_regions=2, max_bytes=1 << 30)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("big", n) as shm:
        shm.ndarray(np.uint8, (n,))[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        region = reg.register_system("big", shm.key, 0, n)
        fd = os.open(f"/dev/shm/{shm.key}", os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, n, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mapped = torch.frombuffer(mm, dtype=torch.uint8)

        def best(fn, k=7) -> tuple[float, torch.Tensor]:
            times, out = [], None
            for _ in range(k):
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            return min(times), out

        t_read, via_fd = best(lambda: region.read(0, n, "q.shared_memory"))
        t_map, via_map = best(mapped.clone)
        assert torch.equal(via_fd, via_map)
        print(f"\n25 MB q: preadv {t_read * 1e3:.2f} ms ({n / t_read / 1e9:.1f} GB/s), "
              f"mmap copy {t_map * 1e3:.2f} ms ({n / t_map / 1e9:.1f} GB/s)")
        mapped = via_map = torch.empty(0)  # the views go before the mapping is closed
        mm.close()
        reg.unregister("")
