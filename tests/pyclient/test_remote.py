"""The remote tier on Redis (`remote-redis`, docs/TIERS.md) against a real kvd and a real
redis-server (a single server, or a 3-master + 3-replica Redis Cluster, all on loopback).

Redis is read and written by a tiny RESP client in this file (no redis-py), so every key and
value is checked independently of kvd's code: keys are `<prefix>:<domain>:<layout key, 32 hex>:
<block hash, 32 hex>`, values a 56-byte header (b"KVDR", version 1, format, flags, layout key,
block hash lo LE / hi LE, body length, XXH3-64 of the body) then the body: the payload, or with
flag 1 (hash-mode vllm) the vLLM digest's last 16 bytes and then the payload.

What it checks:
- `remote-redis` without `tier1-memory` is refused at start, naming both options;
- write-through from tier 1: a chain node A commits lands in Redis under A's domain (`uid-N` with
  no tenants file), with well-formed values (raw and zstd tier formats); node B (another kvd,
  same uid) Fetches the chain from Redis and reads back A's bytes; the remote counters and the
  admin `tiers` state say so; `remote-key-prefix` names the namespace; `remote-fetch-max` caps
  what one Fetch asks Redis for;
- another domain (a tenants file naming the same uid as tenant `other`) never hits A's keys;
- KV events: A's puts that landed are BlockStored on medium REMOTE, a quarantined block's DEL a
  BlockRemoved on REMOTE; B's Fetch from Redis publishes the chain on B's medium with parents;
- hash-mode vllm with KV events on both nodes: A's values carry the digest tail, and B's Fetch
  from Redis publishes the chain with vLLM's hashes (no gaps);
- planted bad values (truncated, wrong magic / version / format / flags / layout key / hash / length /
  checksum, corrupted payload, another block's value, a key of the wrong type) and a missing key
  end the served run right before them, are never served, are counted, and kvd keeps serving;
- Redis killed, SIGSTOPped, not there at start, full (maxmemory + noeviction), AUTH with a good
  or a wrong password (read from remote-password-file, never on the command line): kvd keeps
  answering promptly (Ping latency measured while a Fetch waits on a stopped Redis), a Fetch is
  bounded by about remote-timeout-ms, the state and error counters say what happened (puts
  while Redis is known down are drops), it retries with a backoff capped at about 5 s, and it
  reconnects and writes again once Redis is back;
- remote-ttl-s: keys expire and a Fetch then misses;
- a host name whose DNS server never answers (kvd in a mount namespace; root only) costs a Fetch
  about one remote-timeout-ms, and a name's addresses are tried in turn;
- Redis Cluster: a Fetch whose keys are on three SIGSTOPped masters is answered within about
  one remote-timeout-ms (the request's, not one per node or per map refresh);
  blocks spread over the masters' slots, served with equal bytes; after a master
  is SIGKILLed, a Fetch during the failover is bounded and nothing served is ever wrong; after
  the replica took over, every block written lands and is served.

Redis helpers start every redis-server with PR_SET_PDEATHSIG and kill them (SIGCONT first, then
SIGKILL) at the end of each test. Needs redis-server and redis-cli (skipped otherwise).
"""

import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

import pytest
import xxhash

import kvdwire as kw
from conftest import (allocate_blocks as allocate, token_chain as chain, _die_with_parent,
                      run_kvd_expecting_refusal, shard_owns_port, wait_until)
from kvdwire import pb

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"

pytestmark = pytest.mark.skipif(
    not (os.access(REDIS_SERVER, os.X_OK) and os.access(REDIS_CLI, os.X_OK)),
    reason="needs redis-server and redis-cli")

# 2 layers x 2 heads x 8 dims x 16 tokens fp16: 2048-byte blocks (as test_tiers.py).
LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)
T = LAYOUT.tokens_per_block
MODEL = "m-remote"

HEADER = 56
MAGIC = b"KVDR"
# Header fields: (offset, struct format)
F_MAGIC, F_VERSION, F_FORMAT, F_FLAGS = 0, 4, 6, 7
FLAG_TAIL = 0x01  # the body opens with the vLLM digest's last 16 bytes (hash-mode vllm)
TAIL = 16
F_LAYOUT, F_HASH, F_LEN, F_SUM = 8, 24, 40, 48

# Daemon options (the conftest turns underscores into dashes: --remote-redis=...).
OPT_REDIS = "remote_redis"
OPT_PREFIX = "remote_key_prefix"
OPT_PASSWORD_FILE = "remote_password_file"
OPT_TTL = "remote_ttl_s"
OPT_TIMEOUT = "remote_timeout_ms"
OPT_FETCH_MAX = "remote_fetch_max"

STATE_OFF, STATE_UP, STATE_DOWN = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# A tiny RESP2 client

class RespError(Exception):
    """An error reply (-ERR ..., -MOVED ..., -OOM ...)."""


class Redis:
    """One connection to one redis-server. `pipeline` returns error replies as RespError
    values; `call` raises them."""

    def __init__(self, port, host="127.0.0.1", password=None, timeout=5.0):
        self.addr = (host, port)
        self.sock = socket.create_connection(self.addr, timeout=timeout)
        self.buf = bytearray()
        if password is not None:
            self.call("AUTH", password)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def encode(args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            if isinstance(a, str):
                a = a.encode()
            elif isinstance(a, int):
                a = str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def _fill(self):
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("redis at %s:%d closed the connection" % self.addr)
        self.buf += data

    def _line(self):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return line
            self._fill()

    def _exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n + 2]
        return data

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise ConnectionError("not RESP: %r" % line[:80])

    def pipeline(self, cmds):
        self.sock.sendall(b"".join(self.encode(c) for c in cmds))
        return [self._reply() for _ in cmds]

    def call(self, *args):
        r = self.pipeline([args])[0]
        if isinstance(r, RespError):
            raise r
        return r

    # conveniences (single server)
    def keys(self, pattern):
        return sorted(k.decode() for k in self.call("KEYS", pattern))

    def get(self, key):
        return self.call("GET", key)

    def set(self, key, value):
        return self.call("SET", key, value)

    def exists_many(self, keys):
        return [r == 1 for r in self.pipeline([("EXISTS", k) for k in keys])]


def crc16_xmodem(data):
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key):
    """Redis Cluster's slot of a key (CRC16/XMODEM mod 16384, with {hash tags})."""
    k = key.encode() if isinstance(key, str) else key
    s = k.find(b"{")
    if s >= 0:
        e = k.find(b"}", s + 1)
        if e > s + 1:
            k = k[s + 1:e]
    return crc16_xmodem(k) & 16383


class ClusterClient:
    """Routes single-key commands by slot (CLUSTER SLOTS), follows MOVED / ASK, refreshes its
    map when a node is unreachable."""

    def __init__(self, ports, password=None):
        self.ports = list(ports)
        self.password = password
        self.conns = {}
        self.table = []  # (first slot, last slot, master port)
        self.refresh()

    def close(self):
        for c in self.conns.values():
            c.close()
        self.conns = {}

    def conn(self, port):
        c = self.conns.get(port)
        if c is None:
            c = self.conns[port] = Redis(port, password=self.password, timeout=2.0)
        return c

    def drop(self, port):
        c = self.conns.pop(port, None)
        if c is not None:
            c.close()

    def refresh(self):
        last = None
        for port in self.ports:
            try:
                slots = self.conn(port).call("CLUSTER", "SLOTS")
            except (OSError, RespError) as e:
                self.drop(port)
                last = e
                continue
            self.table = sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in slots)
            return
        raise ConnectionError("no cluster node answered CLUSTER SLOTS: %r" % last)

    def master_of(self, key):
        slot = key_slot(key)
        for first, last, port in self.table:
            if first <= slot <= last:
                return port
        return None

    def masters(self):
        return sorted({port for _, _, port in self.table})

    def call(self, key, *args):
        port = self.master_of(key)
        for _ in range(8):
            if port is None:
                self.refresh()
                port = self.master_of(key)
                if port is None:
                    time.sleep(0.2)
                    continue
            try:
                r = self.conn(port).pipeline([args])[0]
            except OSError:
                self.drop(port)
                time.sleep(0.2)
                try:
                    self.refresh()
                except ConnectionError:
                    pass
                port = self.master_of(key)
                continue
            if isinstance(r, RespError):
                msg = str(r)
                if msg.startswith("MOVED "):
                    port = int(msg.split()[2].rsplit(":", 1)[1])
                    try:
                        self.refresh()
                    except ConnectionError:
                        pass
                    continue
                if msg.startswith("ASK "):
                    p = int(msg.split()[2].rsplit(":", 1)[1])
                    r = self.conn(p).pipeline([("ASKING",), args])[1]
                    if isinstance(r, RespError):
                        raise r
                    return r
                if msg.startswith(("TRYAGAIN", "CLUSTERDOWN")):
                    time.sleep(0.2)
                    continue
                raise r
            return r
        raise ConnectionError("cluster command %r on %r did not settle" % (args[0], key))

    def keys(self, pattern):
        out = set()
        for port in self.masters():
            try:
                out.update(k.decode() for k in self.conn(port).call("KEYS", pattern))
            except OSError:
                self.drop(port)
        return sorted(out)

    def get(self, key):
        return self.call(key, "GET", key)

    def set(self, key, value):
        return self.call(key, "SET", key, value)

    def exists_many(self, keys):
        return [self.call(k, "EXISTS", k) == 1 for k in keys]


# ---------------------------------------------------------------------------------------------
# redis-server processes

_USED_PORTS = set()


def _port_free(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(cluster=False):
    """A loopback port nothing listens on (for a cluster node: port + 10000 too, its bus)."""
    for _ in range(500):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        if port in _USED_PORTS or not shard_owns_port(port):
            continue
        if cluster and (port + 10000 > 65535 or not shard_owns_port(port + 10000) or
                        not _port_free(port + 10000)):
            continue
        _USED_PORTS.add(port)
        if cluster:
            _USED_PORTS.add(port + 10000)
        return port
    raise RuntimeError("no free loopback port")


class RedisServer:
    """One redis-server on 127.0.0.1:port, in the foreground, without persistence."""

    def __init__(self, port, workdir, args=(), password=None):
        self.port, self.dir, self.args, self.password = port, workdir, list(args), password
        self.proc = None
        self.stopped = False
        self.log_path = os.path.join(workdir, "redis-%d.log" % port)
        self.start()

    @property
    def addr(self):
        return "127.0.0.1:%d" % self.port

    def start(self):
        """Starts (or restarts, on the same port) and waits until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None
        # repl-diskless-sync-delay 0: a replica's first sync starts at once, not after Redis 7's
        # default 5 s wait for more replicas (4 s of every cluster's start).
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", self.dir,
                "--repl-diskless-sync-delay", "0"] + self.args
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.stopped = False
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("redis-server exited with %s: %s" % (self.proc.returncode,
                                                                        self.read_log()[-2000:]))
            try:
                with Redis(self.port, timeout=1.0) as r:
                    pong = r.pipeline([("PING",)])[0]
                if pong == "PONG" or (isinstance(pong, RespError) and "NOAUTH" in str(pong)):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server on %d never answered PING" % self.port)
            time.sleep(0.02)

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def client(self, password=None, timeout=5.0):
        return Redis(self.port, password=password or self.password, timeout=timeout)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def sigstop(self):
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self):
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self):
        """SIGKILL (SIGCONT first, so that a stopped server can go); waits for it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.stopped = False
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None


@pytest.fixture
def redis_factory():
    """start(args=(), password=None, port=None) -> RedisServer; all killed afterwards."""
    workdir = tempfile.mkdtemp(prefix="kvdredis.", dir="/tmp")
    started = []

    def start(args=(), password=None, port=None):
        args = list(args)
        if password is not None:
            args += ["--requirepass", password]
        srv = RedisServer(port or free_port(), workdir, args, password)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.kill()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis(redis_factory):
    return redis_factory()


def cluster_info(port):
    with Redis(port, timeout=1.0) as r:
        text = r.call("CLUSTER", "INFO").decode()
    return dict(line.split(":", 1) for line in text.split("\r\n") if ":" in line)


class RedisCluster:
    """Six redis-servers made one cluster of 3 masters, each with one replica."""

    def __init__(self, workdir):
        self.dir = workdir
        self.nodes = {}
        self.client = None

    def start(self):
        for _ in range(6):
            port = free_port(cluster=True)
            self.nodes[port] = RedisServer(
                port, self.dir, ["--cluster-enabled", "yes", "--cluster-config-file",
                                 os.path.join(self.dir, "nodes-%d.conf" % port),
                                 "--cluster-node-timeout", "1000"])
        self.ports = sorted(self.nodes)
        out = subprocess.run([REDIS_CLI, "--cluster", "create"]
                             + ["127.0.0.1:%d" % p for p in self.ports]
                             + ["--cluster-replicas", "1", "--cluster-yes"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, timeout=60)
        assert out.returncode == 0, out.stdout.decode(errors="replace")[-3000:]
        assert self.wait_ok(timeout=30), "cluster never became ok"
        self.client = ClusterClient(self.ports)
        assert len(self.client.masters()) == 3, self.client.table
        assert self.wait_replicas(timeout=20), "replicas never came in sync"
        return self

    @property
    def seeds(self):
        return ",".join("127.0.0.1:%d" % p for p in self.ports)

    def alive_ports(self):
        return [p for p, n in self.nodes.items() if n.alive()]

    def ok_everywhere(self, ports=None):
        """cluster_state:ok on every (live) node, all 16384 slots served by live masters."""
        ports = self.alive_ports() if ports is None else ports
        live = set(self.alive_ports())
        try:
            for p in ports:
                info = cluster_info(p)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                    return False
                with Redis(p, timeout=1.0) as r:
                    slots = r.call("CLUSTER", "SLOTS")
                covered = 0
                for s in slots:
                    if int(s[2][1]) not in live:
                        return False
                    covered += int(s[1]) - int(s[0]) + 1
                if covered != 16384:
                    return False
        except (OSError, RespError):
            return False
        return True

    def wait_ok(self, timeout):
        return wait_until(self.ok_everywhere, timeout=timeout, step=0.1)

    def replicas_in_sync(self):
        try:
            for p in self.alive_ports():
                with Redis(p, timeout=1.0) as r:
                    text = r.call("INFO", "replication").decode()
                info = dict(l.split(":", 1) for l in text.split("\r\n") if ":" in l)
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
                if info.get("role") == "master" and info.get("connected_slaves") != "1":
                    return False
        except (OSError, RespError):
            return False
        return True

    def wait_replicas(self, timeout):
        return wait_until(self.replicas_in_sync, timeout=timeout, step=0.1)

    def replication_caught_up(self):
        """Every live master's replica has its offset (replicas have what masters have)."""
        try:
            for p in self.alive_ports():
                with Redis(p, timeout=1.0) as r:
                    text = r.call("INFO", "replication").decode()
                info = dict(l.split(":", 1) for l in text.split("\r\n") if ":" in l)
                if info.get("role") != "master":
                    continue
                off = int(info["master_repl_offset"])
                for k, v in info.items():
                    if k.startswith("slave") and "offset=" in v:
                        fields = dict(f.split("=", 1) for f in v.split(","))
                        if int(fields["offset"]) < off:
                            return False
        except (OSError, RespError, KeyError, ValueError):
            return False
        return True

    def kill_node(self, port):
        self.nodes[port].kill()
        self.client.drop(port)

    def close(self):
        if self.client is not None:
            self.client.close()
        for n in self.nodes.values():
            n.kill()


@pytest.fixture
def redis_cluster():
    """A started RedisCluster; every node killed (SIGCONT, SIGKILL) afterwards."""
    workdir = tempfile.mkdtemp(prefix="kvdcluster.", dir="/tmp")
    cluster = RedisCluster(workdir)
    try:
        yield cluster.start()
    finally:
        cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# kvd side

def node_opts(redis_addr, writer=True, **extra):
    """Options of a kvd with a remote tier. writer: tier-write write-through (every commit goes
    to T1 at once, hence soon to Redis)."""
    o = {"pool_memory": "1M", "segment_bytes": "64K", "tier1_memory": "8M",
         "fetch_min_tokens": "0", OPT_REDIS: redis_addr}
    if writer:
        o["tier_write"] = "write-through"
    o.update(extra)
    return o


def connect(d):
    return d.connect(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)


def patterns(layout, hashes, compressible=False):
    out = []
    for h in hashes:
        p = kw.block_pattern(layout, kw.hash_hex(h))
        if compressible:  # mostly zeros: an encoder that saves bytes keeps its format
            p = p[:128] + bytes(layout.block_bytes - 128)
        out.append(p)
    return out


def commit_chain(conn, pool, nblocks, base, compressible=False):
    """Allocates, writes, commits and releases a chain of nblocks (at most 32 a request; a
    part's first entry has no parent, which is only an eviction hint); returns (hashes,
    patterns)."""
    hashes = chain(pool, nblocks, base)
    pats = patterns(pool.layout, hashes, compressible)
    for done in range(0, nblocks, 32):
        part = min(32, nblocks - done)
        blocks = allocate(conn, pool, part)
        entries, parent = [], kw.NO_PARENT
        for b, h, p in zip(blocks, hashes[done:done + part], pats[done:done + part]):
            pool.write_block(b[0], p)
            entries.append((b, h, parent))
            parent = b[0]
        conn.release(pool.pool_id, conn.commit(pool.pool_id, entries))
    return hashes, pats


def fetch(conn, pool, hashes):
    """One Fetch; returns (FetchReply, blocks) (the blocks stay referenced: release them)."""
    r = conn.fetch(pool.pool_id, hashes)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    return r, blocks


def check_prefix(pool, blocks, pats, what=""):
    """blocks is a prefix of the chain whose patterns are pats: every block has its bytes."""
    assert len(blocks) <= len(pats), (what, len(blocks), len(pats))
    for i, (bid, _) in enumerate(blocks):
        assert pool.read_block(bid) == pats[i], "%s: block %d of the chain has wrong bytes" % (
            what, i)


def fetch_checked(conn, pool, hashes, pats, what=""):
    """Fetch, check every served block's bytes, release; returns (reply, number served)."""
    r, blocks = fetch(conn, pool, hashes)
    check_prefix(pool, blocks, pats, what)
    if blocks:
        conn.release(pool.pool_id, blocks)
    return r, len(blocks)


def tiers(d):
    return d.admin_result("stats")["tiers"]


def rem(d_or_stats):
    """The remote_* fields (of a daemon's stats, or of a tiers dict) and the state line: what an
    assertion message should show."""
    st = d_or_stats if isinstance(d_or_stats, dict) else tiers(d_or_stats)
    return "remote " + " ".join("%s=%s" % (k[len("remote_"):], v) for k, v in sorted(st.items())
                                if k.startswith("remote_")) + " [%s]" % st.get("state")


def msg(*parts):
    """An assertion message as one string (pytest shortens the repr of anything else)."""
    return " | ".join(str(p) for p in parts)


def rstat(d, name):
    return tiers(d)["remote_" + name]


def idle(conn, pool):
    """No block of the pool is WRITING or referenced: nothing a Fetch allocated is left over."""
    s = conn.stats(pool.pool_id)
    return s["pool.blocks_writing"] == 0 and s["pool.blocks_committed"] == 0


def domain_of(d, pool_id):
    for p in d.admin_result("pools")["pools"]:
        if p["id"] == pool_id:
            return p["domain"]
    raise AssertionError("pool %d not in admin pools" % pool_id)


def log_tail(d, n=3000):
    return d.read_log()[-n:]


def ping_ms(conn, nonce=7):
    t = time.perf_counter()
    assert conn.ping(nonce=nonce).nonce == nonce
    return (time.perf_counter() - t) * 1000


def pings_while_waiting(conn, rid, reply_name, count, since):
    """Sends count Pings, one at a time 10 ms apart, while request rid waits for Redis; returns
    (each Ping's round trip in ms, rid's reply body or KvdError if it came meanwhile, else None,
    and the seconds from since to it)."""
    lat, reply, took = [], None, None
    for i in range(count):
        t = time.perf_counter()
        conn.send("ping", pb.Ping(nonce=i + 1))
        while True:
            try:
                which, body, _ = conn.recv()
            except kw.KvdError as e:  # an Error reply to the waiting request also completes it
                assert e.req_id == rid, e
                reply, took = e, time.monotonic() - since
                continue
            if which == "pong":
                assert body.nonce == i + 1
                break
            assert which == reply_name, which
            reply, took = body, time.monotonic() - since
        lat.append((time.perf_counter() - t) * 1000)
        time.sleep(0.01)
    return lat, reply, took


class Namespace:
    """Where one domain's blocks live in Redis: `<prefix>:<domain>:<layout key>:<hash>`."""

    def __init__(self, client, prefix, domain):
        self.client, self.prefix, self.domain = client, prefix, domain
        self.layout_key = None  # 32 hex, learned from the first key seen

    def pattern(self):
        return "%s:%s:*" % (self.prefix, self.domain)

    def present(self, hashes):
        """{hash index: full key} of the chain's keys in Redis (any layout key)."""
        want = {kw.hash_hex(h): i for i, h in enumerate(hashes)}
        out = {}
        for k in self.client.keys(self.pattern()):
            parts = k.split(":")
            if len(parts) == 4 and parts[3] in want:
                out[want[parts[3]]] = k
        return out

    def wait_landed(self, hashes, timeout=10.0):
        """Waits until every hash of the chain has its key; learns the layout key."""
        got = wait_until(lambda: len(self.present(hashes)) == len(hashes) and True,
                         timeout=timeout, step=0.05)
        if not got:
            return False
        keys = self.present(hashes)
        lks = {k.split(":")[2] for k in keys.values()}
        assert len(lks) == 1, "one pool, one layout key: %r" % lks
        lk = lks.pop()
        assert len(lk) == 32 and all(c in "0123456789abcdef" for c in lk), lk
        if self.layout_key is None:
            self.layout_key = lk
        assert self.layout_key == lk
        return True

    def key(self, h):
        assert self.layout_key is not None
        return "%s:%s:%s:%s" % (self.prefix, self.domain, self.layout_key, kw.hash_hex(h))


def parse_value(v):
    """The header fields of a remote value as a dict (with the digest tail, or None), and its
    payload."""
    assert len(v) >= HEADER, len(v)
    ver, = struct.unpack_from("<H", v, F_VERSION)
    blen, csum = struct.unpack_from("<QQ", v, F_LEN)
    body = v[HEADER:]
    tail = body[:TAIL] if v[F_FLAGS] & FLAG_TAIL else None
    return {"magic": v[:4], "version": ver, "format": v[F_FORMAT], "flags": v[F_FLAGS],
            "layout_key": v[F_LAYOUT:F_LAYOUT + 16], "hash": v[F_HASH:F_HASH + 16],
            "body_len": blen, "checksum": csum, "body": body,
            "tail": tail}, body[TAIL:] if tail is not None else body


def check_value(v, h, layout_key_hex, block_bytes, raw_pattern=None):
    """A value as the contract writes it, for block hash h of the pool with that layout key."""
    f, payload = parse_value(v)
    assert f["magic"] == MAGIC and f["version"] == 1, f
    assert f["flags"] & ~FLAG_TAIL == 0, f
    assert f["layout_key"].hex() == layout_key_hex, (f["layout_key"].hex(), layout_key_hex)
    assert f["hash"] == struct.pack("<QQ", h[0], h[1]), f
    assert f["body_len"] == len(f["body"]), (f["body_len"], len(f["body"]))
    assert f["checksum"] == xxhash.xxh3_64_intdigest(f["body"]), f["checksum"]
    if raw_pattern is not None:
        assert f["format"] == 0 and payload == raw_pattern, f["format"]
    if f["format"] == 0:
        assert len(payload) == block_bytes, len(payload)
    return f


def commit_until_landed(conn, pool, ns, nblocks, base, timeout=20.0, per_try=2.0):
    """Commits fresh chains (bases base, base+1M, ...) until one chain's keys all appear in
    Redis: a kvd that just reconnected may have dropped what it had queued while Redis was
    away. Returns (hashes, patterns) of the chain that landed."""
    deadline = time.monotonic() + timeout
    k = 0
    while True:
        hs, pats = commit_chain(conn, pool, nblocks, base + k * 1000000)
        if ns.wait_landed(hs, timeout=per_try):
            return hs, pats
        k += 1
        assert time.monotonic() < deadline, "nothing kvd wrote after the fault reached Redis"


def fetch_until(conn, pool, hashes, pats, want, timeout=15.0, what=""):
    """Fetches (checking every served block) until `want` blocks are served or the timeout;
    returns the last count."""
    deadline = time.monotonic() + timeout
    while True:
        _, n = fetch_checked(conn, pool, hashes, pats, what)
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def two_nodes(kvd_factory, redis_addr, b_extra=None, **a_extra):
    """Node A (writer) and node B (reader) on one Redis, both attached to MODEL."""
    a = kvd_factory(**node_opts(redis_addr, **a_extra))
    b = kvd_factory(**node_opts(redis_addr, writer=False, **(b_extra or {})))
    ca, cb = connect(a), connect(b)
    pa, pb_ = ca.attach(MODEL, LAYOUT), cb.attach(MODEL, LAYOUT)
    assert pa.hash_seed == pb_.hash_seed  # same model and layout: same chain on both nodes
    return a, b, ca, cb, pa, pb_


# ---------------------------------------------------------------------------------------------
# Tests

def test_remote_needs_tier1():
    """remote-redis with tier1-memory 0: kvd refuses to start, naming both options."""
    rc, out = run_kvd_expecting_refusal({"tier1_memory": "0", OPT_REDIS: "127.0.0.1:1"})
    assert rc not in (None, 0), out
    assert "remote-redis" in out and "tier1-memory" in out, out


def test_remote_key_prefix_without_colon():
    """remote-key-prefix with ':' could meet a domain's keys: refused, naming the rule."""
    rc, out = run_kvd_expecting_refusal({OPT_REDIS: "127.0.0.1:1", "tier1_memory": "1M",
                                         "remote_key_prefix": "kvd:a"})
    assert rc not in (None, 0), out
    assert "remote-key-prefix" in out, out


def test_short_run_with_nothing_in_redis(kvd_factory, redis):
    """fetch-min-tokens still holds with a remote tier: a prefix Redis has none of, whose local
    run is shorter, is answered FETCH_SHORT without copying (the client recomputes)."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr,
                                      b_extra={"fetch_min_tokens": "100000"})
    hs, pats = commit_chain(ca, pa, 4, 777000)
    missing = kw.hash_chain(pb_.hash_seed, list(range(5000, 5000 + 4 * LAYOUT.tokens_per_block)),
                            LAYOUT.tokens_per_block, b"", pb_.hash_algo)
    fr = cb.fetch(pb_.pool_id, missing)
    assert fr.status == pb.FETCH_SHORT, fr
    assert kw.reply_blocks(fr) == []


@pytest.mark.parametrize("fmt", ["raw", "zstd"])
def test_write_through_and_fetch_from_other_node(kvd_factory, redis, fmt):
    """A commits a 16-block chain: it lands in Redis under `kvd:uid-N:<layout key>:<hash>` with
    well-formed values; B (another kvd, same uid) Fetches it and reads A's bytes."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, tier_format=fmt)
    dom = domain_of(a, pa.pool_id)
    assert dom == "uid-%d" % os.geteuid(), dom
    assert domain_of(b, pb_.pool_id) == dom

    hs, pats = commit_chain(ca, pa, 16, 1, compressible=(fmt != "raw"))
    assert wait_until(lambda: rstat(a, "puts") >= 16, timeout=10), msg(rem(a), log_tail(a))
    st = tiers(a)
    assert st["remote_state"] == STATE_UP, st  # (a kvd may connect on first use only)
    assert "remote" in a.admin_result("tiers")["state"]
    assert st["remote_put_errors"] == 0 and st["remote_put_drops"] == 0, rem(st)
    assert st["remote_put_bytes"] >= 16 * HEADER, rem(st)

    r = redis.client()
    ns = Namespace(r, "kvd", dom)
    assert ns.wait_landed(hs, timeout=5), r.keys("*")[:20]
    assert len(r.keys(ns.pattern())) == 16
    formats = set()
    for h, p in zip(hs, pats):
        v = r.get(ns.key(h))
        f = check_value(v, h, ns.layout_key, LAYOUT.block_bytes,
                        raw_pattern=p if fmt == "raw" else None)
        formats.add(f["format"])
        assert r.call("PTTL", ns.key(h)) == -1  # remote-ttl-s 0: no TTL
    if fmt == "zstd":
        assert formats == {2}, formats  # mostly-zero blocks compress: the zstd format byte

    # B has nothing locally: its Fetch goes to Redis and returns A's bytes.
    assert len(kw.reply_blocks(cb.lookup(pb_.pool_id, hs))) == 0
    fr, blocks = fetch(cb, pb_, hs)
    assert len(blocks) == 16 and fr.t0_hits == 0, msg(fr, rem(b), log_tail(b))
    assert fr.status == pb.FETCH_DONE, fr
    check_prefix(pb_, blocks, pats, "B's fetch")
    st = tiers(b)
    assert st["remote_hits"] == 16 and st["remote_gets"] >= 16, rem(st)
    assert st["remote_bad"] == 0 and st["remote_errors"] == 0, rem(st)
    # Raw values are read straight into their T0 blocks; compressed ones come through T1.
    if fmt == "raw":
        assert st["remote_direct"] == 16 and st["remote_promoted"] == 0, rem(st)
    else:
        assert st["remote_direct"] == 0 and st["remote_promoted"] == 16, rem(st)
    cb.release(pb_.pool_id, blocks)
    assert idle(cb, pb_), cb.stats(pb_.pool_id)
    # Now they are ordinary T0 hits on B.
    r2 = cb.lookup(pb_.pool_id, hs)
    assert len(kw.reply_blocks(r2)) == 16
    assert a.alive() and b.alive()


def test_events_name_the_remote_medium(kvd_factory, redis):
    """KV events with a remote tier: each block A's write-through put landed in Redis is a
    BlockStored on medium REMOTE (no parent, no tokens: a copy), a quarantined block's DEL a
    BlockRemoved on REMOTE; B's Fetch from Redis publishes the chain on B's own medium (CPU),
    each block's parent the previous one, as a Commit's chain."""
    import zmq
    from test_kv_events import (BlockRemoved, BlockStored, Schema, Sub, chain_parents,
                                tcp_endpoints, xxh3_form)
    ctx = zmq.Context()
    try:
        ea, eb = tcp_endpoints(2)
        ev = {"kv_events_flush_ms": "0"}
        a, b, ca, cb, pa, pb_ = two_nodes(
            kvd_factory, redis.addr, b_extra=dict(ev, kv_events_endpoint=eb),
            kv_events_endpoint=ea, verify_blocks="true", **ev)
        sa, sb = Sub(ctx, ea, name="A"), Sub(ctx, eb, name="B")
        hs = chain(pa, 3, 424200)
        pats = patterns(pa.layout, hs)
        blocks = allocate(ca, pa, 3)
        entries, parent = [], kw.NO_PARENT
        for bl, h, p in zip(blocks, hs, pats):
            pa.write_block(bl[0], p)
            entries.append((bl, h, parent))
            parent = bl[0]
        canon = ca.commit(pa.pool_id, entries)
        ca.release(pa.pool_id, canon)
        want = [xxh3_form(h, Schema()) for h in hs]

        def on(sub, cls, medium, start=0):
            return [e for x in sub.batches[start:] for e in x.events
                    if isinstance(e, cls) and e.medium == medium]
        sa.until("REMOTE for the chain", lambda x: set(want) <= sa.stored("REMOTE"), timeout=10)
        for e in on(sa, BlockStored, "REMOTE"):
            assert e.parent_block_hash is None and e.token_ids == [], e

        fr, got = fetch(cb, pb_, hs)
        assert len(got) == 3 and fr.status == pb.FETCH_DONE, msg(fr, rem(b))
        cb.release(pb_.pool_id, got)
        sb.until("B's chain on CPU", lambda x: set(want) <= sb.stored("CPU"))
        assert chain_parents(on(sb, BlockStored, "CPU")) == {
            want[0]: None, want[1]: want[0], want[2]: want[1]}, on(sb, BlockStored, "CPU")
        assert not on(sb, BlockStored, "REMOTE"), "B wrote nothing to Redis"

        # A's block 1 changes after its commit: quarantined, deleted from Redis, and said so.
        n0 = len(sa.batches)
        bad = bytearray(pats[1])
        bad[0] ^= 0xFF
        pa.write_block(canon[1][0], bytes(bad))
        assert len(kw.reply_blocks(ca.lookup(pa.pool_id, hs))) == 1
        sa.until("BlockRemoved on REMOTE", lambda x: any(
            want[1] in e.block_hashes for e in on(sa, BlockRemoved, "REMOTE", n0)))
        assert [h for e in on(sa, BlockRemoved, "REMOTE", n0) for h in e.block_hashes] == [
            want[1]]
        r = redis.client()
        ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
        assert wait_until(lambda: 1 not in ns.present(hs), timeout=5), ns.present(hs)
        assert a.admin_result("stats")["kv_events"]["kv_events_gaps"] == 0
        sa.close()
        sb.close()
    finally:
        ctx.destroy(0)


def _commit_one(c, p, base):
    """One block committed and released: (its chain of one hash, its block id, its bytes)."""
    hx = chain(p, 1, base)
    px = patterns(p.layout, hx)[0]
    (bx,) = allocate(c, p, 1)
    p.write_block(bx[0], px)
    canon = c.commit(p.pool_id, [(bx, hx[0], kw.NO_PARENT)])
    c.release(p.pool_id, canon)
    return hx, canon[0][0], px


def _quarantine(c, p, hx, block, px):
    """The committed block's bytes change (verify-blocks): the next Lookup quarantines it."""
    bad = bytearray(px)
    bad[0] ^= 0xFF
    p.write_block(block, bytes(bad))
    assert kw.reply_blocks(c.lookup(p.pool_id, hx)) == []


def test_quarantine_delete_runs_after_the_write_queued_before_it(kvd_factory, redis):
    """A block quarantined while its write-through put waits in the remote thread's queue (Redis
    stopped with SIGSTOP, the thread stuck on an earlier write): the put and the DEL leave in one
    batch, and the DEL runs after the put, so Redis ends without the value. (The DELs of a batch
    used to run before its puts: the SET then stored the value again for every node.) A get
    queued behind the DEL waits for it."""
    a = kvd_factory(**node_opts(redis.addr, verify_blocks="true", remote_timeout_ms="8000"))
    c = connect(a)
    p = c.attach(MODEL, LAYOUT)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, p.pool_id))
    hw, _ = commit_chain(c, p, 1, 616100)
    assert ns.wait_landed(hw), rem(a)
    puts0 = tiers(a)["remote_puts"]
    redis.sigstop()
    try:
        hw2, _ = commit_chain(c, p, 1, 616200)  # its SET waits on the stopped server
        assert wait_until(lambda: tiers(a)["tier1_blocks"] >= 2, timeout=10), rem(a)
        hx, block, px = _commit_one(c, p, 616300)
        # X's copy lands in T1 (its put queued behind W2's), then X changes: quarantined.
        assert wait_until(lambda: tiers(a)["tier1_blocks"] >= 3, timeout=10), rem(a)
        _quarantine(c, p, hx, block, px)
    finally:
        redis.sigcont()
    assert wait_until(lambda: tiers(a)["remote_puts"] >= puts0 + 2, timeout=15), rem(a)
    assert ns.wait_landed(hw2), rem(a)
    # The DEL, after the put (the old order left the value there for good).
    assert wait_until(lambda: ns.present(hx) == {} and tiers(a)["remote_dels_pending"] == 0,
                      timeout=10), (ns.present(hx), rem(a))
    assert a.alive() and c.ping(nonce=5).nonce == 5


def test_quarantine_delete_is_tried_again_until_it_lands(kvd_factory, redis):
    """A quarantined block's DEL that Redis does not answer (stopped: the DEL times out) is kept
    (remote_dels_pending 1) and tried again; once Redis answers, it lands and the value is
    gone. (It used to be dropped, the value left for every node to be served.)"""
    a = kvd_factory(**node_opts(redis.addr, verify_blocks="true", remote_timeout_ms="300"))
    c = connect(a)
    p = c.attach(MODEL, LAYOUT)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, p.pool_id))
    hx, block, px = _commit_one(c, p, 626100)
    assert ns.wait_landed(hx), rem(a)
    redis.sigstop()
    try:
        _quarantine(c, p, hx, block, px)  # DEL queued
        assert wait_until(lambda: tiers(a)["remote_dels_pending"] == 1, timeout=10), rem(a)
        assert c.ping(nonce=4).nonce == 4  # the loop serves meanwhile
    finally:
        redis.sigcont()
    assert wait_until(lambda: tiers(a)["remote_dels_pending"] == 0, timeout=10), rem(a)
    assert ns.present(hx) == {}, (ns.present(hx), rem(a))
    assert a.alive()


def test_remote_lookup_hits_released_before_its_pool_detach_answer(kvd_factory, redis):
    """A Lookup.remote over the linked pools holds its T0 hit while it waits for Redis (stopped);
    the client then detaches the commons and releases the hit block twice (its own Commit's
    reference and the Lookup's, which the ledger counts). When the wait ends the Lookup answers
    ESTATE and gives back what the session still holds of its hits: nothing here (kvd used to
    assert that the reference was still there, and abort)."""
    a = kvd_factory(**node_opts(redis.addr, remote_timeout_ms="300",
                                tenants="tenant alice uid=%d\ncommons\n" % os.geteuid()))
    c = connect(a)
    p = c.attach(MODEL, LAYOUT)
    (link,) = list(p.attach_reply.linked)
    hs = chain(p, 2, 636100)
    (bx,) = allocate(c, p, 1)
    p.write_block(bx[0], patterns(p.layout, hs[:1])[0])
    (held,) = c.commit(p.pool_id, [(bx, hs[0], kw.NO_PARENT)])  # the session holds it
    redis.sigstop()
    try:
        lid = c.send("lookup", c.lookup_msg(p.pool_id, hs, search_domains=True, remote=True))
        did = c.send("detach_pool", pb.DetachPool(pool_id=link.pool_id))
        rid = c.send("release", c.blocks_msg("Release", p.pool_id, [held, held]))
        got = {}
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            env, fds = c.recv_frame()  # (KvdError ECLOSED if kvd went away)
            for fd in fds:
                os.close(fd)
            got[env.id] = env
        assert set(got) == {lid, did, rid}, got
        assert got[did].WhichOneof("body") == "detach_pool_reply" and \
            got[rid].WhichOneof("body") == "release_reply", got
        assert got[lid].WhichOneof("body") == "error" and \
            got[lid].error.code == pb.ESTATE, got[lid]
    finally:
        redis.sigcont()
    assert a.alive() and c.ping(nonce=6).nonce == 6


def test_fetch_keeps_its_local_run_in_tier1(kvd_factory, redis):
    """B's Fetch of a 16-block chain whose first 8 blocks are in B's T1 only and whose next 8
    are in Redis as zstd values (which land in T1 before they are copied up), T1 with room for
    about 11 such values: the values landing do not make their room of the run they extend (they
    used to evict it, the oldest in T1, and the Fetch came back with fewer blocks than B held)."""
    a = kvd_factory(**node_opts(redis.addr, tier_format="zstd"))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, pats = commit_chain(ca, pa, 16, 818000, compressible=True)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs), rem(a)
    vlen = max(r.call("STRLEN", ns.key(h)) for h in hs) - HEADER
    assert vlen < LAYOUT.block_bytes // 2, vlen  # zstd values: they come through T1
    b = kvd_factory(**node_opts(redis.addr, writer=False, tier_format="zstd",
                                pool_memory="128K", tier1_memory=str(vlen * 11)))
    cb = connect(b)
    p = cb.attach(MODEL, LAYOUT)
    fr, got = fetch(cb, p, hs[:8])
    assert len(got) == 8, msg(fr, rem(b))
    cb.release(p.pool_id, got)
    # Every T0 block taken and given back: the run's T0 copies are evicted, T1 keeps the run.
    n = [q for q in b.admin_result("pools")["pools"] if q["id"] == p.pool_id][0]["blocks_total"]
    taken = []
    while len(taken) < n:
        taken += allocate(cb, p, min(32, n - len(taken)))
    cb.release(p.pool_id, taken)
    assert kw.reply_blocks(cb.lookup(p.pool_id, hs)) == []
    assert tiers(b)["tier1_blocks"] == 8, rem(b)
    fr, got = fetch(cb, p, hs)
    assert len(got) >= 8, msg(fr, rem(b))
    check_prefix(p, got, pats[:len(got)], "B's fetch past its T1 run")
    cb.release(p.pool_id, got)
    assert a.alive() and b.alive()


def test_vllm_digest_travels_through_redis(kvd_factory, redis):
    """hash-mode vllm, KV events on both nodes: A's value of each block carries the last 16
    bytes of its vLLM digest (flag 1; the first 16 are the key), so B, which never saw the
    tokens, publishes the chain it fetched from Redis with vLLM's hashes and parents, and counts
    no gap."""
    import zmq
    from test_kv_events import (BlockStored, SEED, Sub, chain_parents, key_of, ref,
                                tcp_endpoints, toks, vllm_commit)
    ctx = zmq.Context()
    try:
        ea, eb = tcp_endpoints(2)
        ev = {"kv_events_flush_ms": "0", "hash_mode": "vllm", "vllm_hash_seed": SEED}
        a, b, ca, cb, pa, pb_ = two_nodes(
            kvd_factory, redis.addr, b_extra=dict(ev, kv_events_endpoint=eb),
            kv_events_endpoint=ea, **ev)
        sb = Sub(ctx, eb, name="B")
        _, digests = vllm_commit(ca, pa, toks(3, 5))
        keys = [key_of(dg) for dg in digests]
        r = redis.client()
        ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(keys), r.keys("*")[:10]
        for k, dg in zip(keys, digests):
            f = check_value(r.get(ns.key(k)), k, ns.layout_key, LAYOUT.block_bytes)
            assert f["flags"] == FLAG_TAIL and f["tail"] == dg[16:], f["flags"]
        fr, got = fetch(cb, pb_, keys)
        assert len(got) == 3, msg(fr, rem(b))
        cb.release(pb_.pool_id, got)
        want = [ref.to_u64(dg) for dg in digests]
        evs = sb.until("B's chain", lambda x: set(want) <= sb.stored())
        stored_ev = [e for x in evs for e in x.events if isinstance(e, BlockStored)]
        assert chain_parents(stored_ev) == {want[0]: None, want[1]: want[0], want[2]: want[1]}, (
            stored_ev)
        assert b.admin_result("stats")["kv_events"]["kv_events_gaps"] == 0
        sb.close()
    finally:
        ctx.destroy(0)


def test_other_domain_never_hits(kvd_factory, redis):
    """B's tenants file makes our uid tenant `other`: B's pool is in domain `other`, it gets no
    hit from A's `uid-N` keys, and what B writes lands under `kvd:other:`."""
    uid = os.geteuid()
    a = kvd_factory(**node_opts(redis.addr))
    b = kvd_factory(tenants="tenant other uid=%d\n" % uid, **node_opts(redis.addr))
    ca, cb = connect(a), connect(b)
    pa, pb_ = ca.attach(MODEL, LAYOUT), cb.attach(MODEL, LAYOUT)
    assert domain_of(b, pb_.pool_id) == "other"
    assert domain_of(a, pa.pool_id) == "uid-%d" % uid
    hs, pats = commit_chain(ca, pa, 8, 1)
    r = redis.client()
    ns_a = Namespace(r, "kvd", "uid-%d" % uid)
    assert ns_a.wait_landed(hs)
    lr = cb.lookup(pb_.pool_id, hs, remote=True)
    assert lr.remote_hits == 0 and lr.remote_failure == pb.OK, lr  # asked, under B's domain
    fr, blocks = fetch(cb, pb_, hs)
    assert blocks == [], fr
    st = tiers(b)
    assert st["remote_hits"] == 0, rem(st)
    # B's own writes go to its own domain; A does not hit them.
    hs2, pats2 = commit_chain(cb, pb_, 4, 5000)
    ns_b = Namespace(r, "kvd", "other")
    assert ns_b.wait_landed(hs2)
    assert not Namespace(r, "kvd", "uid-%d" % uid).present(hs2)
    fr, blocks = fetch(ca, pa, hs2)
    assert blocks == [], fr
    assert rstat(a, "hits") == 0


def test_key_prefix_is_the_namespace(kvd_factory, redis):
    """remote-key-prefix names the keys' first part; a node with another prefix never hits them,
    a node with the same prefix does."""
    a = kvd_factory(**node_opts(redis.addr, **{OPT_PREFIX: "kvdtest"}))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, pats = commit_chain(ca, pa, 6, 1)
    r = redis.client()
    dom = domain_of(a, pa.pool_id)
    assert Namespace(r, "kvdtest", dom).wait_landed(hs)
    assert not r.keys("kvd:*")
    other = kvd_factory(**node_opts(redis.addr, writer=False))  # default prefix "kvd"
    co = connect(other)
    po = co.attach(MODEL, LAYOUT)
    _, n = fetch_checked(co, po, hs, pats, "default-prefix node")
    assert n == 0
    same = kvd_factory(**node_opts(redis.addr, writer=False, **{OPT_PREFIX: "kvdtest"}))
    cs = connect(same)
    ps = cs.attach(MODEL, LAYOUT)
    _, n = fetch_checked(cs, ps, hs, pats, "same-prefix node")
    assert n == 6


def test_fetch_max_caps_one_fetch(kvd_factory, redis):
    """remote-fetch-max 4: a Fetch of a 16-block chain held only in Redis brings 4 blocks; the
    next Fetch brings 4 more after the 4 T0 hits."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, b_extra={OPT_FETCH_MAX: "4"})
    hs, pats = commit_chain(ca, pa, 16, 1)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    fr, n = fetch_checked(cb, pb_, hs, pats, "first fetch")
    assert n == 4, msg(fr, rem(b))
    assert rstat(b, "gets") <= 4, rem(b)
    fr, n = fetch_checked(cb, pb_, hs, pats, "second fetch")
    assert n == 8 and fr.t0_hits == 4, fr


BAD_KINDS = ["empty", "short10", "header_only", "magic", "version2", "format200", "flags2",
             "tail_flag",
             "layout_key", "hash_other", "value_other", "len_plus1", "len_minus1", "checksum",
             "payload_flip", "trailing_byte", "short_consistent"]


def bad_value(kind, good, other):
    """A corrupt variant of `good` (the value at the planted position); `other` is the value of
    another block of the same chain."""
    v = bytearray(good)
    if kind == "empty":
        return b""
    if kind == "short10":
        return bytes(good[:10])
    if kind == "header_only":
        return bytes(good[:HEADER])
    if kind == "magic":
        v[0:4] = b"KVDX"
    elif kind == "version2":
        struct.pack_into("<H", v, F_VERSION, 2)
    elif kind == "format200":
        v[F_FORMAT] = 200
    elif kind == "flags2":  # a flag this version does not know
        v[F_FLAGS] |= 0x02
    elif kind == "tail_flag":  # says a digest tail opens the body: its bytes are the payload's
        v[F_FLAGS] |= FLAG_TAIL
    elif kind == "layout_key":
        v[F_LAYOUT] ^= 0xFF
    elif kind == "hash_other":  # the header names another block (payload and checksum intact)
        v[F_HASH:F_HASH + 16] = other[F_HASH:F_HASH + 16]
    elif kind == "value_other":  # another block's whole, well-formed value
        return bytes(other)
    elif kind == "len_plus1":
        struct.pack_into("<Q", v, F_LEN, struct.unpack_from("<Q", v, F_LEN)[0] + 1)
    elif kind == "len_minus1":
        struct.pack_into("<Q", v, F_LEN, struct.unpack_from("<Q", v, F_LEN)[0] - 1)
    elif kind == "checksum":
        v[F_SUM] ^= 0x01
    elif kind == "payload_flip":  # payload changed, checksum not
        v[HEADER + 100] ^= 0xFF
    elif kind == "trailing_byte":  # one byte more than the header's payload length
        v += b"\0"
    elif kind == "short_consistent":  # a whole, self-consistent value of the wrong size
        payload = bytes(v[HEADER:-8])
        v = v[:HEADER] + payload
        struct.pack_into("<Q", v, F_LEN, len(payload))
        struct.pack_into("<Q", v, F_SUM, xxhash.xxh3_64_intdigest(payload))
    else:
        raise AssertionError(kind)
    return bytes(v)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_planted_bad_value_never_served(kvd_factory, redis, kind):
    """The value of chain position 4 replaced by a bad one: B's Fetch returns positions 0..3
    with A's bytes and never position 4 (or later), remote_bad counts it, kvd keeps serving."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr)
    hs, pats = commit_chain(ca, pa, 8, 1)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    assert wait_until(lambda: rstat(a, "puts") >= 8)
    good, other = r.get(ns.key(hs[4])), r.get(ns.key(hs[5]))
    check_value(good, hs[4], ns.layout_key, LAYOUT.block_bytes, raw_pattern=pats[4])
    r.set(ns.key(hs[4]), bad_value(kind, good, other))
    bad0 = rstat(b, "bad")
    fr, blocks = fetch(cb, pb_, hs)
    assert len(blocks) == 4, msg(kind, fr, rem(b))
    check_prefix(pb_, blocks, pats, kind)
    cb.release(pb_.pool_id, blocks)
    # The blocks the bad value and those after it were read into went back, uncommitted.
    assert idle(cb, pb_), msg(kind, cb.stats(pb_.pool_id))
    assert len(kw.reply_blocks(cb.lookup(pb_.pool_id, hs))) == 4
    st = tiers(b)
    assert st["remote_bad"] > bad0, msg(kind, rem(st))
    # (remote_hits may count the good values past the bad one too: asked, found, not served)
    assert st["remote_hits"] <= st["remote_gets"], msg(kind, rem(st))
    # Again: now 4 T0 hits, and the bad value is still not served.
    fr, n = fetch_checked(cb, pb_, hs, pats, kind + " (again)")
    assert n == 4 and fr.t0_hits == 4, (kind, fr)
    assert ping_ms(cb) < 1000 and b.alive()
    assert len(kw.reply_blocks(cb.lookup(pb_.pool_id, hs))) == 4


def test_fetch_without_room_for_every_key_comes_through_t1(kvd_factory, redis):
    """B's pool (32 blocks) cannot take a T0 block for each of the 48 keys its Fetch asks Redis
    for, so none is read in directly: the 8 that Redis holds come through T1 (remote_promoted)
    with A's bytes, and nothing is left allocated."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr,
                                      b_extra={"pool_memory": "80K", "segment_bytes": "64K"})
    hs = chain(pa, 48, 5)
    h8, pats = commit_chain(ca, pa, 8, 5)
    assert h8 == hs[:8]
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(h8)
    fr, blocks = fetch(cb, pb_, hs)
    assert len(blocks) == 8, msg(fr, rem(b), log_tail(b))
    check_prefix(pb_, blocks, pats, "through T1")
    st = tiers(b)
    assert st["remote_direct"] == 0 and st["remote_promoted"] == 8, rem(st)
    cb.release(pb_.pool_id, blocks)
    assert idle(cb, pb_), cb.stats(pb_.pool_id)
    assert b.alive()


def test_session_dies_while_its_direct_fetch_waits(kvd_factory, redis):
    """Redis stopped while B's Fetch waits on it (its T0 blocks allocated for the values to be
    read into); the client dies. After SIGCONT the values read are in B's T0, cached (none
    WRITING, none referenced): another client's plain Lookup hits them with A's bytes; then a
    Fetch in flight at SIGTERM: kvd exits 0."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, b_extra={OPT_TIMEOUT: "2000"})
    hs, pats = commit_chain(ca, pa, 8, 9)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    redis.sigstop()
    try:
        k = connect(b)
        kp = k.attach(MODEL, LAYOUT)
        k.send("fetch", k.fetch_msg(kp.pool_id, hs))
        assert wait_until(lambda: cb.stats(pb_.pool_id)["pool.blocks_writing"] == 8, timeout=5), \
            cb.stats(pb_.pool_id)
        k.sock.close()  # dies with its Fetch unanswered
        time.sleep(0.1)
    finally:
        redis.sigcont()
    assert wait_until(lambda: idle(cb, pb_), timeout=10), cb.stats(pb_.pool_id)
    assert ping_ms(cb) < 1000
    # Nothing lost: what the dead client's Fetch read is cached in T0 (no Redis needed).
    assert wait_until(lambda: cb.stats(pb_.pool_id)["pool.blocks_cached"] >= 8, timeout=10), \
        msg(cb.stats(pb_.pool_id), rem(b))
    gets = rstat(b, "gets")
    lr = cb.lookup(pb_.pool_id, hs)
    pb_.follow(lr)
    held = kw.reply_blocks(lr)
    assert len(held) == 8, msg(lr, rem(b))
    check_prefix(pb_, held, pats, "cached after the death")
    cb.release(pb_.pool_id, held)
    assert rstat(b, "gets") == gets
    assert idle(cb, pb_), cb.stats(pb_.pool_id)
    # SIGTERM with a direct Fetch waiting on a stopped Redis: a clean exit.
    hs2, _ = commit_chain(ca, pa, 8, 19)
    assert ns.wait_landed(hs2)
    redis.sigstop()
    try:
        cb.send("fetch", cb.fetch_msg(pb_.pool_id, hs2))
        assert wait_until(lambda: cb.stats(pb_.pool_id)["pool.blocks_writing"] == 8, timeout=5)
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(timeout=20) == 0, log_tail(b)
        b.killed = True
    finally:
        redis.sigcont()
    assert a.alive()


def puts_settled(d):
    """No copy in flight, and every block that went down to T1 was written to Redis, refused,
    dropped or skipped."""
    st = tiers(d)
    return st["jobs_inflight"] == 0 and st["remote_puts"] + st["remote_put_errors"] + \
        st["remote_put_drops"] + st["remote_put_skips"] >= st["demotions_t1"]


@pytest.mark.parametrize("ttl", [0, 3600])
def test_block_from_redis_not_written_back(kvd_factory, redis, ttl):
    """B reads A's 8 blocks from Redis straight into T0, then its own commits push them out
    (write-back: they go down to T1 first). With remote-ttl-s 0 Redis has their values already:
    B writes none of them again (remote_put_skips 8, every other block that lands in T1 is
    written); with a TTL B writes them again (the write refreshes it)."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, b_extra={OPT_TTL: str(ttl)},
                                      **{OPT_TTL: str(ttl)})
    hs, pats = commit_chain(ca, pa, 8, 31)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    fr, n = fetch_checked(cb, pb_, hs, pats, "from Redis")
    assert n == 8 and rstat(b, "direct") == 8, msg(fr, rem(b))
    blocks = cb.stats(pb_.pool_id)["pool.blocks_total"]
    commit_chain(cb, pb_, blocks + 64, 77000)  # more than the pool: the 8 go down and out
    assert wait_until(lambda: puts_settled(b), timeout=15), msg(tiers(b))
    st = tiers(b)
    assert st["demotions_t1"] > 8, msg(st)
    assert st["remote_put_skips"] == (8 if ttl == 0 else 0), rem(st)
    assert st["remote_puts"] == st["demotions_t1"] - st["remote_put_skips"], msg(st)
    # Redis still serves the 8 to another node, with A's bytes.
    c = kvd_factory(**node_opts(redis.addr, writer=False))
    cc = connect(c)
    pc = cc.attach(MODEL, LAYOUT)
    assert fetch_checked(cc, pc, hs, pats, "a third node")[1] == 8, rem(c)


def remote_quiet(d, settle=0.3):
    """No copy and no remote write in flight, and the counters still for `settle` seconds."""
    def snap():
        st = tiers(d)
        return (st["jobs_inflight"] + st["remote_puts_inflight"], st["remote_puts"],
                st["remote_put_errors"], st["remote_put_drops"], st["demotions_t1"])
    a = snap()
    time.sleep(settle)
    return a[0] == 0 and snap() == a


def test_remote_write_back_writes_what_leaves_tier1(kvd_factory, redis):
    """remote-write write-back: A's blocks go to Redis only as they come up for eviction from
    its T1 (128 blocks here, the next 16 written ahead), not as they land there: while T1 has
    room nothing is written; once it overflows, every block that left T1 is in Redis (no dirty
    drop when the commits give the writes time), B fetches them with A's bytes, and the newest
    blocks (still in A's T1) are not in Redis. Then Redis is killed: T1 keeps evicting, the
    blocks it gives up unwritten are counted as dirty drops, A keeps serving, and the failed
    writes are not retried in a storm."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, tier1_memory="256K",
                                      remote_write="write-back", tier_clean_ahead="16")
    assert "(write-back)" in a.admin_result("tiers")["state"], a.admin_result("tiers")
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    first, first_pats = commit_chain(ca, pa, 64, 880000)
    assert wait_until(lambda: tiers(a)["demotions_t1"] >= 64 and remote_quiet(a),
                      timeout=10), msg(tiers(a))
    st = tiers(a)
    assert st["remote_puts"] == 0 and st["drops_t1"] == 0, rem(st)
    assert ns.present(first) == {}, "write-back wrote blocks T1 still had room for"

    chains = []
    for k in range(16):  # 256 more blocks, 16 at a time: T1 (128) overflows
        chains.append(commit_chain(ca, pa, 16, 881000 + k * 1000))
        assert wait_until(lambda: remote_quiet(a, 0.1), timeout=10), msg(tiers(a))
    assert wait_until(lambda: remote_quiet(a), timeout=10), msg(tiers(a))
    st = tiers(a)
    left = st["drops_t1"]
    assert left >= 320 - 128, msg(st)
    assert st["remote_dirty_drops"] == 0, rem(st)
    assert st["remote_put_errors"] == 0 and st["remote_put_drops"] == 0, rem(st)
    # Written: what left T1, and at most the next 16 it gives up (written ahead).
    assert left <= st["remote_puts"] <= left + 16, msg(st)
    keys = redis.client().keys(ns.pattern())
    assert len(keys) == st["remote_puts"], (len(keys), rem(st))
    assert ns.wait_landed(first, timeout=1), "the oldest blocks left T1 but are not in Redis"
    newest, _ = chains[-1]
    assert ns.present(newest) == {}, "write-back wrote the newest blocks, which T1 still holds"
    fr, n = fetch_checked(cb, pb_, first, first_pats, "B from what A wrote back")
    assert n == 64 and rstat(b, "hits") == 64, msg(fr, rem(b))

    # Redis gone: what T1 gives up now is lost to the remote tier, and counted.
    redis.kill()
    before = tiers(a)
    t0 = time.monotonic()
    for k in range(8):
        commit_chain(ca, pa, 16, 900000 + k * 1000)
    assert ping_ms(ca) < 500
    assert wait_until(lambda: remote_quiet(a), timeout=10), msg(tiers(a))
    took = time.monotonic() - t0
    st = tiers(a)
    assert st["drops_t1"] >= before["drops_t1"] + 128 - 16, msg(st)
    assert st["remote_dirty_drops"] >= 64, rem(st)
    tries = (st["remote_put_errors"] + st["remote_put_drops"] + st["remote_puts"]) - \
        (before["remote_put_errors"] + before["remote_put_drops"] + before["remote_puts"])
    # At most a window (16) of writes ahead per 100 ms pause: a storm would try each landing.
    bound = min(128, 16 * (took / 0.1 + 2))
    assert tries <= bound, msg("failed writes retried in a storm:", tries, bound, rem(st))
    assert a.alive() and b.alive()


def test_remote_write_back_writes_tier1_at_stop(kvd_factory, redis):
    """remote-write write-back: what T1 holds and Redis lacks is written when kvd stops (SIGTERM),
    so another node still finds it; with Redis paused the stop gives up at the first write that
    fails and kvd exits at once, saying how many blocks went unwritten."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, remote_write="write-back",
                                      log_level="info")
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    hs, pats = commit_chain(ca, pa, 40, 960000)
    assert wait_until(lambda: tiers(a)["demotions_t1"] >= 40 and remote_quiet(a),
                      timeout=10), msg(tiers(a))
    assert ns.present(hs) == {} and rstat(a, "puts") == 0, rem(a)  # T1 has room: none yet
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=20) == 0, log_tail(a)
    a.killed = True
    log = log_tail(a, 20000)
    assert "stop: wrote 40 tier-1 blocks Redis lacked" in log, log_tail(a)
    assert "(40 listed at the start; 0 failed, 0 left unwritten)" in log, log_tail(a)
    assert ns.wait_landed(hs, timeout=1), sorted(ns.present(hs))
    fr, n = fetch_checked(cb, pb_, hs, pats, "B after A stopped")
    assert n == 40, msg(fr, rem(b))

    # Redis paused: the first write times out, the stop gives up and kvd exits.
    c = kvd_factory(**node_opts(redis.addr, remote_write="write-back", remote_timeout_ms="300"))
    cc = connect(c)
    pc = cc.attach(MODEL, LAYOUT)
    commit_chain(cc, pc, 20, 970000)
    assert wait_until(lambda: tiers(c)["demotions_t1"] >= 20 and remote_quiet(c),
                      timeout=10), msg(tiers(c))
    redis.sigstop()
    try:
        t = time.monotonic()
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(timeout=20) == 0, log_tail(c)
        took = time.monotonic() - t
        c.killed = True
    finally:
        redis.sigcont()
    assert took < 5, "a stop with Redis paused took %.1f s (remote-drain-s 10)" % took
    log = log_tail(c, 20000)
    assert "20 listed at the start" in log and "Redis took no more" in log, log


def test_remote_write_per_pool(kvd_factory, redis):
    """remote-write per pool: a tenants-file `tiers` line makes model m-wb's pool write-back on a
    write-through node (admin `tiers` says so); admin `tiers pool=ID remote-write=write-back`
    switches the other pool at run time; the stop's drain writes both pools' unwritten blocks."""
    a = kvd_factory(tenants="tiers model=m-wb remote-write=write-back\n", log_level="info",
                    **node_opts(redis.addr))
    ca = connect(a)
    p_thr, p_wb = ca.attach(MODEL, LAYOUT), ca.attach("m-wb", LAYOUT)
    pol = {x["pool"]: x for x in a.admin_result("tiers")["pools"]}
    assert pol[p_thr.pool_id]["remote_write"] == "write-through", pol
    assert pol[p_wb.pool_id]["remote_write"] == "write-back", pol
    assert pol[p_wb.pool_id]["own_settings"] and not pol[p_thr.pool_id]["own_settings"], pol
    # `default` goes back to the daemon's option (write-through here), and back again.
    a.admin_result("tiers pool=%d remote-write=default" % p_wb.pool_id)
    pol = {x["pool"]: x for x in a.admin_result("tiers")["pools"]}
    assert pol[p_wb.pool_id]["remote_write"] == "write-through", pol
    assert not pol[p_wb.pool_id]["own_settings"], pol
    a.admin_result("tiers pool=%d remote-write=write-back" % p_wb.pool_id)
    ns = Namespace(redis.client(), "kvd", domain_of(a, p_thr.pool_id))
    h1, _ = commit_chain(ca, p_thr, 12, 990000)
    h2, _ = commit_chain(ca, p_wb, 12, 991000)
    assert ns.wait_landed(h1), sorted(ns.present(h1))
    assert wait_until(lambda: remote_quiet(a), timeout=10), msg(tiers(a))
    assert ns.present(h2) == {}, "the write-back pool wrote blocks T1 had room for"
    a.admin_result("tiers pool=%d remote-write=write-back" % p_thr.pool_id)
    pol = {x["pool"]: x for x in a.admin_result("tiers")["pools"]}
    assert pol[p_thr.pool_id]["remote_write"] == "write-back", pol
    bad = a.admin("tiers pool=%d remote-write=sometimes" % p_thr.pool_id)
    assert not bad["ok"] and bad["error"]["code"] == "EINVAL", bad
    h3, _ = commit_chain(ca, p_thr, 8, 992000)
    assert wait_until(lambda: tiers(a)["demotions_t1"] >= 32 and remote_quiet(a),
                      timeout=10), msg(tiers(a))
    assert ns.present(h3) == {}, "written after the switch to write-back"
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=20) == 0, log_tail(a)
    a.killed = True
    assert "stop: wrote 20 tier-1 blocks Redis lacked" in log_tail(a, 20000), log_tail(a)
    assert len(ns.present(h2)) == 12 and len(ns.present(h3)) == 8, (ns.present(h2),
                                                                      ns.present(h3))


def test_missing_key_ends_the_run(kvd_factory, redis):
    """A chain position whose key is gone: the Fetch returns the blocks before it (a miss)."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr)
    hs, pats = commit_chain(ca, pa, 8, 1)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    assert r.call("DEL", ns.key(hs[3])) == 1
    fr, n = fetch_checked(cb, pb_, hs, pats, "missing key")
    assert n == 3, msg(fr, rem(b))
    st = tiers(b)
    assert st["remote_misses"] >= 1 and st["remote_hits"] >= 3 and st["remote_bad"] == 0, rem(st)


def test_wrong_type_key_never_served(kvd_factory, redis):
    """A chain position whose key holds a list (GET answers WRONGTYPE): never served, the run
    ends before it, kvd keeps serving and counts it somewhere."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr)
    hs, pats = commit_chain(ca, pa, 8, 1)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    r.call("DEL", ns.key(hs[2]))
    r.call("RPUSH", ns.key(hs[2]), "x")
    before = tiers(b)
    fr, n = fetch_checked(cb, pb_, hs, pats, "wrong type")
    assert n == 2, msg(fr, rem(b))
    after = tiers(b)
    assert sum(after["remote_" + k] - before["remote_" + k]
               for k in ("bad", "errors", "misses")) >= 1, after
    assert ping_ms(cb) < 1000


def test_redis_killed_then_back(kvd_factory, redis):
    """Redis SIGKILLed: B's Fetch completes at once with nothing from Redis, Pings answer, the
    state or the error counter says so; Redis restarted on the same port (empty): kvd
    reconnects and new puts land."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr)
    hs, pats = commit_chain(ca, pa, 8, 1)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    before_a, before_b = tiers(a), tiers(b)
    redis.kill()
    t = time.monotonic()
    fr, blocks = fetch(cb, pb_, hs)
    took = time.monotonic() - t
    assert blocks == [], fr
    assert took < 1.0, "a Fetch with Redis dead took %.2f s" % took
    assert ping_ms(cb) < 100 and ping_ms(ca) < 100

    def noticed(d, before):
        s = tiers(d)
        return s["remote_state"] == STATE_DOWN or s["remote_errors"] > before["remote_errors"]

    assert wait_until(lambda: noticed(b, before_b), timeout=3), rem(b)
    # A writes while Redis is gone: it keeps serving; what it would write fails at once (the
    # node is in its backoff) and is counted as a put error (docs/TIERS.md: remote_put_drops
    # is only for a full remote-queue-bytes).
    commit_chain(ca, pa, 4, 50000)
    assert ping_ms(ca) < 100
    assert wait_until(lambda: noticed(a, before_a), timeout=3), rem(a)
    assert wait_until(lambda: rstat(a, "state") == STATE_DOWN, timeout=3), rem(a)
    down = tiers(a)
    commit_chain(ca, pa, 4, 60000)
    assert ping_ms(ca) < 100
    assert wait_until(lambda: rstat(a, "put_errors") >= down["remote_put_errors"] + 4,
                      timeout=3), msg("puts while Redis is down are not counted as errors",
                                      "when down:", rem(down), "now:", rem(a))

    redis.start()  # same port, empty
    ns = Namespace(redis.client(), "kvd", ns.domain)
    hs3, pats3 = commit_until_landed(ca, pa, ns, 4, 100000, timeout=10)
    st = tiers(a)
    assert st["remote_reconnects"] > before_a["remote_reconnects"], rem(st)
    assert st["remote_puts"] > before_a["remote_puts"], rem(st)
    assert wait_until(lambda: rstat(a, "state") == STATE_UP, timeout=5), rem(a)
    # B reconnects too and serves what A wrote after the restart.
    n = fetch_until(cb, pb_, hs3, pats3, 4, timeout=15, what="after restart")
    assert n == 4, rem(b)
    assert rstat(b, "reconnects") > before_b["remote_reconnects"], rem(b)


def test_redis_absent_at_start(kvd_factory, redis_factory):
    """remote-redis names a port nothing listens on: kvd starts and serves (state down); once a
    redis-server starts there, kvd connects (backoff at most about 5 s) and puts land."""
    port = free_port()
    a = kvd_factory(**node_opts("127.0.0.1:%d" % port))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    commit_chain(ca, pa, 2, 1)
    assert ping_ms(ca) < 100
    assert wait_until(lambda: rstat(a, "state") == STATE_DOWN, timeout=3), rem(a)
    srv = redis_factory(port=port)
    ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
    commit_until_landed(ca, pa, ns, 2, 1000, timeout=10)
    # A key can be in Redis before kvd has read Redis's reply to it: the state follows.
    assert wait_until(lambda: rstat(a, "state") == STATE_UP, timeout=5), rem(a)


def test_reconnect_backoff_is_capped(kvd_factory, redis):
    """Redis dead for 4 s while A commits a block every 50 ms, remote-backoff-max-ms 800: kvd
    does not try to connect at every put (backoff: far fewer failed connects than commits), the
    tries come at most about 0.8 s apart once the backoff reached its cap (100, 200, 400, 800,
    800 ms...), and once Redis is back a put lands within about one maximal backoff."""
    a = kvd_factory(**node_opts(redis.addr, remote_backoff_max_ms="800"))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    hs, _ = commit_chain(ca, pa, 2, 1)
    assert ns.wait_landed(hs)
    redis.kill()
    t0 = time.monotonic()
    tries, last, commits = [], rstat(a, "errors"), 0
    while time.monotonic() - t0 < 4:
        commit_chain(ca, pa, 1, 1000 + commits * 100)
        commits += 1
        e = rstat(a, "errors")
        if e != last:
            tries.append(time.monotonic() - t0)
            last = e
        time.sleep(0.05)
    assert len(tries) >= 4, msg("kvd stopped trying", tries, rem(a))
    assert len(tries) <= commits // 4, ("no backoff: a connect per put", tries, commits)
    gaps = [y - x for x, y in zip([0.0] + tries, tries)] + [time.monotonic() - t0 - tries[-1]]
    assert max(gaps) <= 2.0, ("tries more than ~0.8 s apart", tries)
    redis.start()
    t = time.monotonic()
    ns = Namespace(redis.client(), "kvd", ns.domain)
    commit_until_landed(ca, pa, ns, 1, 500000, timeout=4, per_try=0.25)
    assert time.monotonic() - t <= 2.5, time.monotonic() - t
    assert wait_until(lambda: rstat(a, "reconnects") >= 1 and rstat(a, "state") == STATE_UP,
                      timeout=5), rem(a)


def test_redis_stopped_never_stalls_the_loop(kvd_factory, redis):
    """Redis SIGSTOPped (connections accept, nothing answers): while B's Fetch waits on it, 50
    Pings to B each come back within 50 ms; the Fetch completes within remote-timeout-ms * 3 +
    1 s; A's commits are prompt. After SIGCONT both nodes work with Redis again."""
    timeout_ms = 200
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr,
                                      b_extra={OPT_TIMEOUT: str(timeout_ms)},
                                      **{OPT_TIMEOUT: str(timeout_ms)})
    hs, pats = commit_chain(ca, pa, 8, 1)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    redis.sigstop()
    try:
        t_fetch = time.monotonic()
        fid = cb.send("fetch", cb.fetch_msg(pb_.pool_id, hs))
        lat, fetch_reply, fetch_took = pings_while_waiting(cb, fid, "fetch_reply", 50, t_fetch)
        assert max(lat) < 50, "Ping latency while Redis is stopped: max %.1f ms" % max(lat)
        limit = timeout_ms * 3 / 1000 + 1
        if fetch_reply is None:
            cb.sock.settimeout(limit + 1)
            try:
                which, body, _ = cb.recv(fid)
                fetch_reply = body
            except kw.KvdError as e:
                fetch_reply = e
            fetch_took = time.monotonic() - t_fetch
        assert fetch_took <= limit, "Fetch with Redis stopped took %.2f s" % fetch_took
        if not isinstance(fetch_reply, kw.KvdError):
            pb_.follow(fetch_reply)
            blocks = kw.reply_blocks(fetch_reply)
            check_prefix(pb_, blocks, pats, "fetch while stopped")
            if blocks:
                cb.release(pb_.pool_id, blocks)
        # A commits while Redis is stopped: prompt, and A keeps answering.
        t = time.monotonic()
        commit_chain(ca, pa, 8, 7000)
        assert time.monotonic() - t < 1.0, "a commit took %.2f s" % (time.monotonic() - t)
        assert max(ping_ms(ca, nonce=k + 1) for k in range(20)) < 50
        assert ping_ms(cb) < 50
    finally:
        redis.sigcont()
    # Redis answers again: A's new writes land and B serves them and the first chain.
    hs2, pats2 = commit_until_landed(ca, pa, ns, 4, 300000, timeout=20)
    assert fetch_until(cb, pb_, hs2, pats2, 4, timeout=15, what="after SIGCONT") == 4, rem(b)
    assert fetch_until(cb, pb_, hs, pats, 8, timeout=15, what="first chain") == 8, rem(b)
    assert a.alive() and b.alive()


def test_lookup_asks_remote_when_told(kvd_factory, redis):
    """Lookup.remote: past the local tiers' run B asks Redis (STRLEN, nothing read) and the
    reply says how many leading blocks Redis holds; without the flag a Lookup never asks. A key
    deleted in Redis ends the run there; blocks B holds locally are not asked about; a daemon
    without a remote tier answers ENOTSUP at once."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr)
    hs, pats = commit_chain(ca, pa, 16, 1)
    r = redis.client()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    plain = cb.lookup(pb_.pool_id, hs)
    assert plain.remote_hits == 0 and rstat(b, "probes") == 0, msg(plain, rem(b))
    extra = kw.hash_chain(pb_.hash_seed, list(range(9000, 9000 + 4 * LAYOUT.tokens_per_block)),
                          LAYOUT.tokens_per_block, b"", pb_.hash_algo)
    lr = cb.lookup(pb_.pool_id, hs + extra, remote=True)
    assert kw.reply_blocks(lr) == [] and lr.tier_fetchable == 0, lr
    assert lr.remote_hits == 16 and lr.remote_failure == pb.OK, msg(lr, rem(b))
    st = tiers(b)
    assert st["remote_probes"] == 20 and st["remote_probe_hits"] == 16, rem(st)
    assert st["remote_gets"] == 0, rem(st)  # a probe reads no value
    # B brings the first 8 into T0: a Lookup holds them and asks Redis about the other 8.
    assert fetch_checked(cb, pb_, hs[:8], pats[:8], "first half")[1] == 8
    lr = cb.lookup(pb_.pool_id, hs, remote=True)
    pb_.follow(lr)
    held = kw.reply_blocks(lr)
    assert len(held) == 8 and lr.remote_hits == 8, msg(lr, rem(b))
    check_prefix(pb_, held, pats, "held while Redis was asked")
    cb.release(pb_.pool_id, held)
    # A key gone from Redis ends the run.
    r.call("DEL", ns.key(hs[12]))
    lr = cb.lookup(pb_.pool_id, hs, remote=True)
    pb_.follow(lr)
    assert len(kw.reply_blocks(lr)) == 8 and lr.remote_hits == 4, lr
    cb.release(pb_.pool_id, kw.reply_blocks(lr))
    # A prefix wholly in T0: nothing to ask.
    before = rstat(b, "probes")
    lr = cb.lookup(pb_.pool_id, hs[:8], remote=True)
    pb_.follow(lr)
    assert len(kw.reply_blocks(lr)) == 8 and lr.remote_hits == 0, lr
    assert lr.remote_failure == pb.OK and rstat(b, "probes") == before
    cb.release(pb_.pool_id, kw.reply_blocks(lr))
    assert idle(cb, pb_)
    # No remote tier: ENOTSUP in the reply, at once.
    c = kvd_factory(pool_memory="1M", segment_bytes="64K", tier1_memory="8M")
    cc = connect(c)
    pc = cc.attach(MODEL, LAYOUT)
    lr = cc.lookup(pc.pool_id, hs, remote=True)
    assert lr.remote_failure == pb.ENOTSUP and lr.remote_hits == 0, lr


def test_lookup_remote_with_redis_stopped(kvd_factory, redis):
    """Redis SIGSTOPped: a Lookup.remote whose pool is detached and attached again while it
    waits gets ESTATE and leaves nothing held; one is answered within remote-timeout-ms * 3 + 1 s
    with ESYS and no remote hits (its T0 hits good), Pings meanwhile within 50 ms; a session
    that closes while its Lookup waits leaves nothing held; after SIGCONT the answer is whole."""
    timeout_ms = 500
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr,
                                      b_extra={OPT_TIMEOUT: str(timeout_ms)},
                                      **{OPT_TIMEOUT: str(timeout_ms)})
    hs, pats = commit_chain(ca, pa, 8, 1)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    assert fetch_checked(cb, pb_, hs[:2], pats[:2], "two local")[1] == 2
    redis.sigstop()
    try:
        # First, while Redis is known up (its first request waits the whole timeout, later
        # ones find the node failed and answer at once): detached and attached again while a
        # Lookup waits, the Lookup gets ESTATE (its hits went with the detach) and the new
        # attach holds nothing of it.
        c3 = connect(b)
        p3 = c3.attach(MODEL, LAYOUT)
        lid3 = c3.send("lookup", c3.lookup_msg(p3.pool_id, hs, remote=True))
        did = c3.send("detach_pool", pb.DetachPool(pool_id=p3.pool_id))
        aid = c3.send("attach_pool", pb.AttachPool(model_id=MODEL, layout=LAYOUT.to_pb()))
        got = {}
        c3.sock.settimeout(timeout_ms * 3 / 1000 + 2)
        while len(got) < 3:
            try:
                which, body, fds = c3.recv()
                for fd in fds:
                    os.close(fd)
                got[which] = body
            except kw.KvdError as e:
                assert e.req_id == lid3, e
                got["lookup"] = e
        assert isinstance(got["lookup"], kw.KvdError) and got["lookup"].code == pb.ESTATE, got
        assert "detach_pool_reply" in got and "attach_pool_reply" in got, got
        assert c3.stats()["session.refs_held"] == 0, c3.stats()
        c3.close()
        # The probe above failed the node: past its backoff (100 ms) the next request connects
        # again and waits the whole timeout, so the Pings below overlap a Lookup that waits.
        time.sleep(0.3)
        t = time.monotonic()
        lid = cb.send("lookup", cb.lookup_msg(pb_.pool_id, hs, remote=True))
        lat, reply, took = pings_while_waiting(cb, lid, "lookup_reply", 20, t)
        assert not isinstance(reply, kw.KvdError), reply
        assert max(lat) < 50, "Ping latency while a Lookup waits on Redis: max %.1f ms" % max(lat)
        limit = timeout_ms * 3 / 1000 + 1
        if reply is None:
            cb.sock.settimeout(limit + 1)
            _, reply, _ = cb.recv(lid)
            took = time.monotonic() - t
        assert took <= limit, "Lookup.remote with Redis stopped took %.2f s" % took
        assert took >= timeout_ms / 2000, "the Lookup did not wait on Redis: %.3f s" % took
        pb_.follow(reply)
        held = kw.reply_blocks(reply)
        assert len(held) == 2 and reply.remote_hits == 0, reply
        assert reply.remote_failure == pb.ESYS, reply
        check_prefix(pb_, held, pats, "T0 hits while Redis is stopped")
        cb.release(pb_.pool_id, held)
        # A second session asks and goes away before the answer.
        gone = connect(b)
        pg = gone.attach(MODEL, LAYOUT)
        gone.send("lookup", gone.lookup_msg(pg.pool_id, hs, remote=True))
        time.sleep(0.05)
        gone.close()
    finally:
        redis.sigcont()
    deadline = time.monotonic() + 15
    while True:
        lr = cb.lookup(pb_.pool_id, hs, remote=True)
        pb_.follow(lr)
        cb.release(pb_.pool_id, kw.reply_blocks(lr))
        if lr.remote_hits == 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lr.remote_hits == 6 and lr.remote_failure == pb.OK, msg(lr, rem(b))
    assert wait_until(lambda: idle(cb, pb_), timeout=5), cb.stats(pb_.pool_id)
    assert b.alive()


def test_redis_full_keeps_serving(kvd_factory, redis_factory):
    """Redis at maxmemory with noeviction refuses writes (OOM): remote_put_errors counts them,
    A keeps committing and answering, nothing crashes."""
    srv = redis_factory(args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    a = kvd_factory(**node_opts(srv.addr, tier1_memory="16M"))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    deadline = time.monotonic() + 60
    k = 0
    while rstat(a, "put_errors") == 0:  # ~2 KiB values: some hundreds fill 2 MB
        assert time.monotonic() < deadline, rem(a)
        commit_chain(ca, pa, 32, 1 + k * 10000)
        k += 1
        if k % 8 == 0:
            wait_until(lambda: rstat(a, "put_errors") > 0, timeout=1)
        assert k < 400, msg("2 MB of Redis never filled", rem(a), srv.read_log()[-1000:])
    st = tiers(a)
    assert st["remote_put_errors"] > 0 and st["remote_puts"] > 0, rem(st)
    with srv.client() as r:
        info = r.call("INFO", "memory").decode()
    assert "maxmemory:2097152" in info
    # Still serving: a fresh chain commits and is a T0 hit; Pings are prompt.
    hs, _ = commit_chain(ca, pa, 4, 9999999)
    assert len(kw.reply_blocks(ca.lookup(pa.pool_id, hs))) == 4
    assert ping_ms(ca) < 100 and a.alive()


def test_ttl_expires_keys(kvd_factory, redis):
    """remote-ttl-s 1: a written key has a TTL of at most 1 s, is gone after ~2.5 s, and B's
    Fetch then misses."""
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, redis.addr, **{OPT_TTL: "1"})
    r = redis.client()
    hs, pats = commit_chain(ca, pa, 4, 1)
    t0 = time.monotonic()
    ns = Namespace(r, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    ttls = [r.call("PTTL", ns.key(h)) for h in hs]
    assert all(0 < t <= 1000 for t in ttls), ttls
    time.sleep(max(0, t0 + 2.5 - time.monotonic()))
    assert r.exists_many([ns.key(h) for h in hs]) == [False] * 4
    fr, n = fetch_checked(cb, pb_, hs, pats, "after expiry")
    assert n == 0, fr
    st = tiers(b)
    assert st["remote_hits"] == 0 and st["remote_misses"] >= 1, rem(st)


def _cmdline(d):
    with open("/proc/%d/cmdline" % d.proc.pid, "rb") as f:
        return f.read()


def test_auth_password_file(kvd_factory, redis_factory):
    """Redis with requirepass: kvd with remote-password-file holding the password writes and
    reads; the password is nowhere on kvd's command line (nor in its log)."""
    srv = redis_factory(password="secret")
    files = {"pw": b"secret\n"}
    a = kvd_factory(files=files, **node_opts(srv.addr, **{OPT_PASSWORD_FILE: "{dir}/pw"}))
    b = kvd_factory(files=files, **node_opts(srv.addr, writer=False,
                                             **{OPT_PASSWORD_FILE: "{dir}/pw"}))
    for d in (a, b):
        assert b"secret" not in _cmdline(d), _cmdline(d)
    ca, cb = connect(a), connect(b)
    pa, pb_ = ca.attach(MODEL, LAYOUT), cb.attach(MODEL, LAYOUT)
    hs, pats = commit_chain(ca, pa, 6, 1)
    assert wait_until(lambda: rstat(a, "puts") >= 6, timeout=10), msg(rem(a), log_tail(a))
    ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    _, n = fetch_checked(cb, pb_, hs, pats, "with AUTH")
    assert n == 6, rem(b)
    for d in (a, b):
        assert "secret" not in d.read_log()


def test_auth_wrong_password(kvd_factory, redis_factory):
    """A wrong password in remote-password-file: puts fail (counted), nothing lands in Redis,
    kvd keeps serving; the password is not on its command line."""
    srv = redis_factory(password="secret")
    a = kvd_factory(files={"pw": b"wrong-one\n"},
                    **node_opts(srv.addr, **{OPT_PASSWORD_FILE: "{dir}/pw"}))
    assert b"wrong-one" not in _cmdline(a) and b"secret" not in _cmdline(a)
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, _ = commit_chain(ca, pa, 4, 1)

    def failed():
        s = tiers(a)
        return s["remote_errors"] + s["remote_put_errors"] > 0

    assert wait_until(failed, timeout=8), rem(a)
    st = tiers(a)
    assert st["remote_puts"] == 0 and st["remote_state"] != STATE_UP, rem(st)
    with srv.client() as r:
        assert r.keys("kvd:*") == []
    assert len(kw.reply_blocks(ca.lookup(pa.pool_id, hs))) == 4
    assert ping_ms(ca) < 100 and a.alive()


def test_cluster_fetch_has_one_timeout(kvd_factory, redis_cluster):
    """Every master of a Redis Cluster SIGSTOPped: a Fetch whose keys are on all three is
    answered within about one remote-timeout-ms (the whole request's, not one per node: three
    would be 1.5 s here), serves nothing wrong, and kvd answers Pings meanwhile; after SIGCONT
    the chain is fetched whole."""
    timeout_ms = 500
    cl = redis_cluster
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, cl.seeds,
                                      b_extra={OPT_TIMEOUT: str(timeout_ms)})
    hs, pats = commit_chain(ca, pa, 24, 1)
    ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    owners = {cl.client.master_of(ns.key(h)) for h in hs}
    assert len(owners) == 3, owners
    # B learns the slot map (one Fetch of a chain Redis lacks), then every master stops.
    missing = kw.hash_chain(pb_.hash_seed, list(range(9000, 9000 + 2 * T)), T, b"",
                            pb_.hash_algo)
    fetch_checked(cb, pb_, missing, [b""] * 2, "warm-up")
    masters = [cl.nodes[p] for p in owners]
    for m in masters:
        m.sigstop()
    try:
        t = time.monotonic()
        fr, n = fetch_checked(cb, pb_, hs, pats, "masters stopped")
        took = time.monotonic() - t
        assert n == 0, n
        assert took < 2 * timeout_ms / 1000 + 0.2, "Fetch with 3 masters stopped: %.2f s" % took
        assert ping_ms(cb) < 100 and b.alive()
    finally:
        for m in masters:
            m.sigcont()
    n = fetch_until(cb, pb_, hs, pats, 24, timeout=15, what="after SIGCONT")
    assert n == 24, msg(n, rem(b))


def test_cluster_spread_failover_and_writes(kvd_factory, redis_cluster):
    """A Redis Cluster (3 masters + 3 replicas): A's 64 blocks spread over the masters and B
    fetches all 64 with A's bytes. A master SIGKILLed: while it fails over, a fresh node D's
    Fetch is bounded and its commits prompt; once its replica is promoted, a fresh node C
    serves the chain's leading run that still exists, never a wrong byte; the 32 blocks A
    writes after the failover all land and B fetches (most of) them."""
    cl = redis_cluster
    a, b, ca, cb, pa, pb_ = two_nodes(kvd_factory, cl.seeds)
    hs, pats = commit_chain(ca, pa, 64, 1)
    assert wait_until(lambda: rstat(a, "puts") >= 64, timeout=15), msg(rem(a), log_tail(a))
    ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
    assert ns.wait_landed(hs)
    owners = {}
    for h in hs:
        owners.setdefault(cl.client.master_of(ns.key(h)), []).append(h)
    assert len(owners) == 3, {p: len(v) for p, v in owners.items()}
    for h, p in zip(hs, pats):  # each key readable from its slot's master, well-formed
        check_value(cl.client.get(ns.key(h)), h, ns.layout_key, LAYOUT.block_bytes, p)
    lr = cb.lookup(pb_.pool_id, hs, remote=True)  # one STRLEN pipeline per master
    assert lr.remote_hits == 64 and lr.remote_failure == pb.OK, msg(lr, rem(b))
    fr, n = fetch_checked(cb, pb_, hs, pats, "cluster fetch")
    assert n == 64, msg(fr, rem(b), log_tail(b))
    assert rstat(b, "hits") == 64

    # Kill the master holding the chain's earliest block (so the failover matters at once).
    wait_until(cl.replication_caught_up, timeout=5)
    victim = cl.client.master_of(ns.key(hs[0]))
    cl.kill_node(victim)
    # Before the failover: a fresh node's Fetch is bounded and serves nothing wrong; A's
    # commits and Pings are prompt.
    # (D, not A, writes in this window: A meets the new topology only after the failover.)
    d = kvd_factory(**node_opts(cl.seeds))
    cd = connect(d)
    pd = cd.attach(MODEL, LAYOUT)
    t = time.monotonic()
    fetch_checked(cd, pd, hs, pats, "during failover")
    assert time.monotonic() - t <= 0.2 * 3 + 1, time.monotonic() - t
    t = time.monotonic()
    commit_chain(cd, pd, 4, 400000)
    assert time.monotonic() - t < 1.0 and ping_ms(cd) < 100 and ping_ms(ca) < 100
    assert wait_until(lambda: cl.ok_everywhere(), timeout=30, step=0.2), "no failover"
    cl.client.refresh()
    assert victim not in cl.client.masters()
    exists = cl.client.exists_many([ns.key(h) for h in hs])
    lead = next((i for i, e in enumerate(exists) if not e), len(hs))

    c = kvd_factory(**node_opts(cl.seeds, writer=False))
    cc = connect(c)
    pc = cc.attach(MODEL, LAYOUT)
    n = fetch_until(cc, pc, hs, pats, lead, timeout=15, what="after failover")
    assert n == lead, msg(n, lead, rem(c))

    # A writes 32 new blocks after the failover: all of them land (A follows the new
    # topology: MOVED, or CLUSTER SLOTS again after the dead node's errors).
    before = tiers(a)
    hs2, pats2 = commit_chain(ca, pa, 32, 500000)
    assert wait_until(lambda: rstat(a, "puts") - before["remote_puts"] >= 32, timeout=15), msg(
        "not all 32 blocks written after the failover landed", "before:", rem(before),
        "now:", rem(a), "keys there: %d" % len(ns.present(hs2)))
    assert ns.wait_landed(hs2, timeout=5)
    assert len({cl.client.master_of(ns.key(h)) for h in hs2}) >= 2
    n = fetch_until(cb, pb_, hs2, pats2, 32, timeout=15, what="new blocks")
    assert n >= 24, msg(n, rem(b))
    for node in (a, b, c, d):
        assert node.alive() and ping_ms(node.connect()) < 100


def _nodes_known(d):
    """The node count in the tiers state line ("... (cluster), N nodes; ...")."""
    import re
    m = re.search(r"(\d+) nodes;", tiers(d)["state"])
    assert m, tiers(d)["state"]
    return int(m.group(1))


def test_cluster_forgets_nodes_that_left(kvd_factory, redis_cluster):
    """One seed only: kvd learns the three masters from CLUSTER SLOTS. A master (not the seed)
    SIGKILLed and failed over: once kvd reads the map again it knows the seed and the current
    masters only (the dead one is forgotten, not kept as a fourth entry), and its writes land."""
    cl = redis_cluster
    seed = cl.ports[0]
    a = kvd_factory(**node_opts("127.0.0.1:%d" % seed))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, _ = commit_chain(ca, pa, 32, 3)
    assert wait_until(lambda: rstat(a, "puts") >= 32, timeout=15), msg(rem(a), log_tail(a))
    want = len(set(cl.client.masters()) | {seed})
    assert _nodes_known(a) == want, tiers(a)["state"]
    wait_until(cl.replication_caught_up, timeout=5)
    victim = next(p for p in cl.client.masters() if p != seed)
    cl.kill_node(victim)
    assert wait_until(lambda: cl.ok_everywhere(), timeout=30, step=0.2), "no failover"
    cl.client.refresh()
    assert victim not in cl.client.masters()
    ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
    hs2, _ = commit_until_landed(ca, pa, ns, 32, 700000, timeout=30, per_try=5.0)
    want = len(set(cl.client.masters()) | {seed})
    assert wait_until(lambda: _nodes_known(a) == want, timeout=10), (want, tiers(a)["state"])
    assert a.alive() and ping_ms(ca) < 100


# ---------------------------------------------------------------------------------------------
# remote-watch: Redis's own drops (TTL expiry, maxmemory eviction) reported as BlockRemoved

def _watch_node(kvd_factory, seeds, ea, writer=True, **extra):
    o = dict(kv_events_endpoint=ea, kv_events_flush_ms="0", remote_watch="true")
    o.update(extra)
    return kvd_factory(**node_opts(seeds, writer=writer, **o))


def _removed_on_remote(sub, start=0):
    from test_kv_events import BlockRemoved
    return [h for x in sub.batches[start:] for e in x.events
            if isinstance(e, BlockRemoved) and e.medium == "REMOTE" for h in e.block_hashes]


def _send_drops(ports):
    """Has every Redis node of ports send its expiries and evictions (notify-keyspace-events
    Exe; kvd never sets it)."""
    for p in ports:
        with Redis(p, timeout=2.0) as r:
            r.call("CONFIG", "SET", "notify-keyspace-events", "Exe")


def _watched_chain(kvd_factory, ctx, seeds, ea, nblocks, base, nodes=1, **opts):
    """A node with remote-watch subscribed on `nodes` Redis nodes, a subscriber to its KV events
    and a chain of nblocks it committed, each announced on REMOTE: (daemon, subscriber, conn,
    pool, hashes, the hashes as the events name them)."""
    from test_kv_events import Sub, xxh3_form, Schema
    a = _watch_node(kvd_factory, seeds, ea, **opts)
    assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == nodes, timeout=10), rem(a)
    sa = Sub(ctx, ea, name="A")
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, _ = commit_chain(ca, pa, nblocks, base)
    want = [xxh3_form(h, Schema()) for h in hs]
    sa.until("REMOTE stored", lambda x: set(want) <= sa.stored("REMOTE"), timeout=10)
    return a, sa, ca, pa, hs, want


class _ResetProxy:
    """A TCP proxy to a Redis port that can reset (RST) every connection through it."""

    def __init__(self, port):
        import threading
        self.up = port
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.stop = threading.Event()
        self.gen = 0  # bumped by reset_all: every connection opened before it is reset
        self.resets = 0
        self.th = _accept_loop(self.lsock, self.stop, self._serve)

    def _serve(self, conn):
        import select
        import threading
        up = socket.create_connection(("127.0.0.1", self.up))
        born = self.gen

        def pump():
            # One thread per connection, which alone closes it: an RST needs the last close of
            # the socket, which a recv blocked in another thread would delay.
            try:
                while not self.stop.is_set() and self.gen == born:
                    r, _, _ = select.select([conn, up], [], [], 0.05)
                    for a in r:
                        data = a.recv(65536)
                        if not data:
                            return
                        (up if a is conn else conn).sendall(data)
                if self.gen != born:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.resets += 1
            except OSError:
                pass
            finally:
                conn.close()
                up.close()
        threading.Thread(target=pump, daemon=True).start()

    def reset_all(self):
        self.gen += 1

    def close(self):
        self.stop.set()
        self.lsock.close()


def test_remote_watch_notices_a_reset_connection(kvd_factory, redis_factory):
    """The watch's connections reset by the network (an RST, as a proxy or a NAT sends): kvd
    notices (a gap counted, subscribed again). libhiredis's Debian adapter for libuv ignored the
    poll error a reset is: the watch stayed "up" on a dead subscriber and heard nothing."""
    from test_kv_events import tcp_endpoints
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    px = _ResetProxy(srv.port)
    try:
        (ea,) = tcp_endpoints(1)
        a = _watch_node(kvd_factory, "127.0.0.1:%d" % px.port, ea)
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 1, timeout=10), rem(a)
        gaps = tiers(a)["remote_watch_gaps"]
        px.reset_all()
        assert wait_until(lambda: px.resets >= 1, timeout=5)
        assert wait_until(lambda: tiers(a)["remote_watch_gaps"] > gaps, timeout=10), rem(a)
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 1, timeout=15), rem(a)
        assert a.alive()
    finally:
        px.close()


@pytest.mark.parametrize("seed", ["address", "name"])
def test_remote_watch_reports_expiry(kvd_factory, redis_factory, seed):
    """remote-watch on a Redis whose notify-keyspace-events holds Exe: the values A wrote with
    remote-ttl-s 1 expire, and each is a BlockRemoved on medium REMOTE (after its BlockStored);
    a key of another prefix expiring says nothing. The counters say one node, configured. The
    seed given as a host name ("localhost") is resolved off the loop thread."""
    import zmq
    from test_kv_events import tcp_endpoints
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        addr = srv.addr if seed == "address" else "localhost:%d" % srv.port
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, addr, ea, 3, 515100,
                                                 remote_ttl_s="1")
        with srv.client() as r:
            r.call("SET", "other:key", "x", "PX", "50")
        sa.until("REMOTE removed", lambda x: set(want) <= set(_removed_on_remote(sa)),
                 timeout=15)
        assert sorted(_removed_on_remote(sa)) == sorted(want), _removed_on_remote(sa)
        t = tiers(a)
        assert t["remote_watch_unconfigured"] == 0, t
        assert t["remote_watch_expired"] >= 4 and t["remote_watch_reported"] == 3, t
        sa.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_reports_eviction_and_writes_again(kvd_factory, redis_factory):
    """maxmemory eviction (the test makes Redis evict every key: allkeys-random, maxmemory 1
    byte, then a write): B's blocks, read from Redis straight into T0, are reported removed on
    REMOTE; and since Redis lost them, B writes them to Redis again when its own commits push
    them down (with remote-ttl-s 0 a block read from Redis is otherwise not written back:
    test_block_from_redis_not_written_back)."""
    import zmq
    from test_kv_events import Sub, tcp_endpoints, xxh3_form, Schema
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (eb,) = tcp_endpoints(1)
        a = kvd_factory(**node_opts(srv.addr))
        b = _watch_node(kvd_factory, srv.addr, eb, writer=False)
        assert wait_until(lambda: tiers(b)["remote_watch_nodes"] == 1, timeout=10), rem(b)
        ca, cb = connect(a), connect(b)
        pa, pb_ = ca.attach(MODEL, LAYOUT), cb.attach(MODEL, LAYOUT)
        hs, pats = commit_chain(ca, pa, 3, 525100)
        ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs)
        sb = Sub(ctx, eb, name="B")
        fr, n = fetch_checked(cb, pb_, hs, pats, "from Redis")
        assert n == 3 and rstat(b, "direct") == 3, msg(fr, rem(b))
        want = [xxh3_form(h, Schema()) for h in hs]
        with srv.client() as r:
            r.call("CONFIG", "SET", "maxmemory-policy", "allkeys-random")
            r.call("CONFIG", "SET", "maxmemory", "1")
            try:
                r.call("SET", "trigger", "x")
            except RespError:
                pass  # OOM once every key is gone: the evictions came first
            r.call("CONFIG", "SET", "maxmemory", "0")
        assert not ns.present(hs)
        sb.until("REMOTE removed", lambda x: set(want) <= set(_removed_on_remote(sb)),
                 timeout=10)
        t = tiers(b)
        assert t["remote_watch_evicted"] >= 3 and t["remote_watch_reported"] >= 3, t
        blocks = cb.stats(pb_.pool_id)["pool.blocks_total"]
        commit_chain(cb, pb_, blocks + 64, 77000)  # more than the pool: the 3 go down and out
        assert wait_until(lambda: puts_settled(b), timeout=15), msg(tiers(b))
        assert tiers(b)["remote_put_skips"] == 0, rem(b)
        assert wait_until(lambda: len(ns.present(hs)) == 3, timeout=10), ns.present(hs)
        sb.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_says_when_redis_is_not_configured(kvd_factory, redis):
    """A Redis with notify-keyspace-events empty (its default): kvd subscribes, counts the node
    as unconfigured, logs how to fix it (never changing the server), and serves as before."""
    from test_kv_events import tcp_endpoints
    (ea,) = tcp_endpoints(1)
    a = _watch_node(kvd_factory, redis.addr, ea, remote_ttl_s="1")
    assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 1, timeout=10), rem(a)
    assert tiers(a)["remote_watch_unconfigured"] == 1, tiers(a)
    assert wait_until(lambda: "notify-keyspace-events" in log_tail(a), timeout=5)
    assert "Exe" in log_tail(a)
    with redis.client() as r:
        assert r.call("CONFIG", "GET", "notify-keyspace-events")[1] in (b"", "")
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    commit_chain(ca, pa, 2, 535100)
    assert wait_until(lambda: rstat(a, "puts") >= 2, timeout=10), rem(a)
    assert ping_ms(ca) < 100


def test_remote_watch_cluster_masters_and_failover(kvd_factory, redis_cluster):
    """A Redis Cluster whose nodes the test configured (Exe): kvd subscribes on the 3 masters
    (learnt from one seed), hears expiries on each; a master SIGKILLed and failed over: kvd
    counts the gap (remote_watch_gaps), subscribes again on the 3 current masters, and an expiry
    on the promoted one is heard."""
    import zmq
    from test_kv_events import Sub, tcp_endpoints, xxh3_form, Schema
    cl = redis_cluster
    _send_drops(cl.ports)
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a = _watch_node(kvd_factory, "127.0.0.1:%d" % cl.ports[0], ea, remote_ttl_s="3")
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 3, timeout=10), rem(a)
        sa = Sub(ctx, ea, name="A")
        ca = connect(a)
        pa = ca.attach(MODEL, LAYOUT)
        hs, _ = commit_chain(ca, pa, 24, 545100)
        ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs, timeout=2.5), ns.present(hs)
        assert len({cl.client.master_of(ns.key(h)) for h in hs}) == 3
        want = [xxh3_form(h, Schema()) for h in hs]
        sa.until("REMOTE removed on every master",
                 lambda x: set(want) <= set(_removed_on_remote(sa)), timeout=20)
        wait_until(cl.replication_caught_up, timeout=5)
        assert tiers(a)["remote_watch_gaps"] == 0, tiers(a)
        victim = cl.client.masters()[0]
        cl.kill_node(victim)
        assert wait_until(lambda: cl.ok_everywhere(), timeout=30, step=0.2), "no failover"
        cl.client.refresh()
        promoted = set(cl.client.masters())
        assert victim not in promoted
        _send_drops(promoted)  # the promoted replica kept Exe (the test set it on every node)
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 3, timeout=20), msg(
            rem(a), [l for l in log_tail(a, 20000).splitlines() if "WATCH" in l][-12:])
        # The killed master's subscription was lost: one gap (drops in it went unheard).
        assert tiers(a)["remote_watch_gaps"] >= 1, tiers(a)
        n0 = len(sa.batches)
        hs2, _ = commit_chain(ca, pa, 24, 555100)
        want2 = [xxh3_form(h, Schema()) for h in hs2]
        sa.until("REMOTE removed after the failover",
                 lambda x: set(want2) <= set(_removed_on_remote(sa, n0)), timeout=25)
        assert tiers(a)["remote_watch_unconfigured"] == 0, tiers(a)
        sa.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_reconcile_on_demand(kvd_factory, redis_factory):
    """Admin `remote-watch reconcile`: after a FLUSHALL (no notification) with the periodic pass
    far off (its default 600 s), a pass asked for now reports every value, each once (asked
    again at once: started or queued behind the first, whichever the timing gives). ESTATE
    without the ledger, and without the watch."""
    import zmq
    from test_kv_events import tcp_endpoints
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, srv.addr, ea, 6, 605100,
                                                 log_level="info")
        ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs), ns.present(hs)
        r0 = tiers(a)["remote_watch_reconciles"]
        with srv.client() as r:
            r.call("FLUSHALL")
        time.sleep(0.3)
        assert _removed_on_remote(sa) == [], "a FLUSHALL is not heard: nothing yet"
        res = a.admin_result("remote-watch reconcile")
        assert res["pass"] in ("started", "queued") and res["ledger"] == 6, res
        again = a.admin_result("remote-watch reconcile")  # queued when the first still runs
        assert again["pass"] in ("started", "queued"), again
        sa.until("REMOTE removed after the admin's pass",
                 lambda x: set(want) <= set(_removed_on_remote(sa)), timeout=10)
        assert wait_until(lambda: tiers(a)["remote_watch_reconciles"] > r0, timeout=5), rem(a)
        assert "asked by the admin (remote-watch reconcile)" in log_tail(a, 20000)
        assert sorted(_removed_on_remote(sa)) == sorted(want), _removed_on_remote(sa)
        bad = a.admin("remote-watch reconcile now")
        assert not bad["ok"] and bad["error"]["code"] == "EINVAL", bad
        sa.close()
        # No ledger: ESTATE, the reason named; no watch at all: ESTATE too.
        (eb,) = tcp_endpoints(1)
        b = _watch_node(kvd_factory, srv.addr, eb, remote_watch_ledger="0")
        r = b.admin("remote-watch reconcile")
        assert not r["ok"] and r["error"]["code"] == "ESTATE", r
        assert "remote-watch-ledger 0" in r["error"]["message"], r
        c = kvd_factory(**node_opts(srv.addr))
        r = c.admin("remote-watch reconcile")
        assert not r["ok"] and r["error"]["code"] == "ESTATE", r
    finally:
        ctx.destroy(0)


def test_remote_write_back_idle_pool_written_before_eviction(kvd_factory, redis):
    """Two write-back pools share T1 (128 blocks, 16 written ahead): pool A's 80 blocks land
    while T1 has room (none written), then only pool B commits. T1 gives up A's blocks (A is
    over its share), and each is written before it goes: B's landings keep A's window written,
    not only B's own. No dirty drop; A's oldest blocks are in Redis."""
    a = kvd_factory(**node_opts(redis.addr, tier1_memory="256K", remote_write="write-back",
                                tier_clean_ahead="16"))
    ca = connect(a)
    pa, pb_ = ca.attach(MODEL, LAYOUT), ca.attach("m-wb-other", LAYOUT)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    ha, _ = commit_chain(ca, pa, 80, 995000)
    assert wait_until(lambda: tiers(a)["demotions_t1"] >= 80 and remote_quiet(a),
                      timeout=10), msg(tiers(a))
    assert rstat(a, "puts") == 0, rem(a)
    for k in range(6):  # 96 of B's: T1 (128) gives up at least 48 of A's
        commit_chain(ca, pb_, 16, 996000 + k * 1000)
        assert wait_until(lambda: remote_quiet(a, 0.1), timeout=10), msg(tiers(a))
    st = tiers(a)
    assert st["drops_t1"] >= 48, msg(st)
    assert st["remote_dirty_drops"] == 0, rem(st)
    assert len(ns.present(ha[:16])) == 16, sorted(ns.present(ha))


def test_remote_write_back_writes_again_what_redis_lost(kvd_factory, redis_factory):
    """remote-write write-back with remote-watch: the 16 oldest of A's T1 blocks (of its first
    64) are written ahead of their eviction; Redis then loses them (FLUSHALL, found by a reconciliation pass);
    when T1 does give them up, A writes them again rather than taking them for written."""
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    a = kvd_factory(**node_opts(srv.addr, tier1_memory="256K", remote_write="write-back",
                                tier_clean_ahead="16", remote_watch="true"))
    assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 1, timeout=10), rem(a)
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
    first, _ = commit_chain(ca, pa, 64, 930000)
    for k in range(3):  # 112 blocks in T1 (of 128): the next 16 it gives up are written ahead
        commit_chain(ca, pa, 16, 931000 + k * 1000)
        assert wait_until(lambda: remote_quiet(a, 0.1), timeout=10), msg(tiers(a))
    # (T1's order is the order the copies landed in, which two copy threads may swap.)
    assert wait_until(lambda: len(ns.present(first)) == 16, timeout=5), ns.present(first)
    time.sleep(0.2)
    assert len(ns.present(first)) == 16, sorted(ns.present(first))
    assert tiers(a)["drops_t1"] == 0, msg(tiers(a))
    with srv.client() as r:
        r.call("FLUSHALL")
    gone0 = tiers(a)["remote_watch_reconciled"]
    assert a.admin_result("remote-watch reconcile")["pass"] in ("started", "queued")
    assert wait_until(lambda: tiers(a)["remote_watch_reconciled"] >= gone0 + 16,
                      timeout=10), rem(a)
    for k in range(5):  # 80 more (192 in all): T1 gives up all of `first`
        commit_chain(ca, pa, 16, 940000 + k * 1000)
        assert wait_until(lambda: remote_quiet(a, 0.1), timeout=10), msg(tiers(a))
    st = tiers(a)
    assert st["drops_t1"] >= 64 and st["remote_dirty_drops"] == 0, rem(st)
    assert sorted(ns.present(first)) == list(range(64)), msg(
        "blocks Redis lost were taken for written:", sorted(ns.present(first)), rem(st))


def test_remote_watch_follows_a_master_added(kvd_factory, redis_cluster):
    """A fourth master joins the cluster (redis-cli --cluster add-node, then reshard moves 2000
    slots to it): within remote-watch-refresh-s (1 here; 30 by default) kvd's check of CLUSTER SLOTS sees the
    masters changed, subscribes on all four (remote_watch_changes, a gap), and an expiry of a
    value on the new master is reported (BlockRemoved on REMOTE)."""
    import zmq
    from test_kv_events import Sub, tcp_endpoints, xxh3_form, Schema
    cl = redis_cluster
    _send_drops(cl.ports)
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a = _watch_node(kvd_factory, "127.0.0.1:%d" % cl.ports[0], ea, remote_ttl_s="5",
                        remote_watch_refresh_s="1", log_level="info")
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 3, timeout=10), rem(a)
        assert wait_until(lambda: tiers(a)["remote_watch_checks"] >= 1, timeout=5), rem(a)
        assert tiers(a)["remote_watch_changes"] == 0, rem(a)
        # The new node: an empty master, then 2000 slots of the first master moved to it.
        port = free_port(cluster=True)
        cl.nodes[port] = RedisServer(
            port, cl.dir, ["--cluster-enabled", "yes", "--cluster-config-file",
                           os.path.join(cl.dir, "nodes-%d.conf" % port),
                           "--cluster-node-timeout", "1000",
                           "--notify-keyspace-events", "Exe"])
        seed = "127.0.0.1:%d" % cl.ports[0]
        cli = lambda *args: subprocess.run([REDIS_CLI] + list(args), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           timeout=60)
        out = cli("--cluster", "add-node", "127.0.0.1:%d" % port, seed)
        assert out.returncode == 0, out.stdout.decode(errors="replace")[-2000:]
        with Redis(port, timeout=2.0) as r:
            new_id = r.call("CLUSTER", "MYID").decode()
        with Redis(cl.ports[0], timeout=2.0) as r:
            from_id = r.call("CLUSTER", "MYID").decode()
        assert wait_until(lambda: cl.ok_everywhere(), timeout=20, step=0.2), "never joined"
        out = cli("--cluster", "reshard", seed, "--cluster-from", from_id, "--cluster-to", new_id,
                  "--cluster-slots", "2000", "--cluster-yes")
        assert out.returncode == 0, out.stdout.decode(errors="replace")[-2000:]
        cl.client.refresh()
        assert port in cl.client.masters(), cl.client.table
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 4, timeout=10), msg(
            rem(a), [l for l in log_tail(a, 20000).splitlines() if "WATCH" in l][-12:])
        t = tiers(a)
        assert t["remote_watch_changes"] >= 1 and t["remote_watch_gaps"] >= 1, rem(t)
        assert "the cluster's masters changed (4 now, 3 watched)" in log_tail(a, 20000)
        sa = Sub(ctx, ea, name="A")
        ca = connect(a)
        pa = ca.attach(MODEL, LAYOUT)
        hs, _ = commit_chain(ca, pa, 48, 595100)
        ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs, timeout=4), ns.present(hs)
        on_new = [h for h in hs if cl.client.master_of(ns.key(h)) == port]
        assert on_new, "no value on the new master (2000 of 16384 slots)"
        want = [xxh3_form(h, Schema()) for h in on_new]
        sa.until("REMOTE removed on the new master",
                 lambda x: set(want) <= set(_removed_on_remote(sa)), timeout=20)
        sa.close()
    finally:
        ctx.destroy(0)


def _kill_watch_subscribers(srv):
    """Closes every pub/sub connection of the server (kvd's watch): a gap in the watch."""
    with srv.client() as r:
        return r.call("CLIENT", "KILL", "TYPE", "pubsub")


@pytest.mark.parametrize("ledger", ["262144", "0"])
def test_remote_watch_reconciles_after_a_gap(kvd_factory, redis_factory, ledger):
    """Values deleted while nothing would tell kvd (a DEL is no expiry or eviction), then the
    watch's subscription killed (CLIENT KILL TYPE pubsub: a gap): when kvd is subscribed again
    it asks Redis about every value it announced on REMOTE (its ledger) and publishes
    BlockRemoved for exactly the deleted ones; a second gap finds the rest once deleted. With
    remote-watch-ledger 0 the gap is only counted, as before there was a ledger."""
    import zmq
    from test_kv_events import tcp_endpoints, xxh3_form, Schema
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, srv.addr, ea, 6, 565100,
                                                 remote_watch_ledger=ledger, log_level="info")
        assert tiers(a)["remote_watch_ledger"] == (6 if ledger != "0" else 0), rem(a)
        ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs), ns.present(hs)
        with srv.client() as r:
            for h in hs[1::2]:
                assert r.call("DEL", ns.key(h)) == 1
        time.sleep(0.3)
        assert _removed_on_remote(sa) == [], "a DEL is not heard: nothing yet"
        assert _kill_watch_subscribers(srv) >= 1
        assert wait_until(lambda: tiers(a)["remote_watch_gaps"] == 1, timeout=5), rem(a)
        assert wait_until(lambda: tiers(a)["remote_watch_nodes"] == 1, timeout=10), rem(a)
        gone = [xxh3_form(h, Schema()) for h in hs[1::2]]
        if ledger == "0":
            time.sleep(1.0)
            assert _removed_on_remote(sa) == [], _removed_on_remote(sa)
            t = tiers(a)
            assert t["remote_watch_reconciles"] == 0 and t["remote_watch_reconciled"] == 0, t
            sa.close()
            return
        sa.until("REMOTE removed after the gap",
                 lambda x: set(gone) <= set(_removed_on_remote(sa)), timeout=10)
        assert wait_until(lambda: tiers(a)["remote_watch_reconciles"] == 1, timeout=5), rem(a)
        time.sleep(0.3)
        assert sorted(_removed_on_remote(sa)) == sorted(gone), _removed_on_remote(sa)
        t = tiers(a)
        assert t["remote_watch_reconciled"] == 3 and t["remote_watch_ledger"] == 3, rem(t)
        assert t["remote_watch_reconcile_errors"] == 0, rem(t)
        assert "reconciled: 6 values asked about, 3 gone" in log_tail(a)
        # The rest deleted, a second gap: found too; nothing is reported twice.
        n0 = len(sa.batches)
        with srv.client() as r:
            for h in hs[0::2]:
                assert r.call("DEL", ns.key(h)) == 1
        assert _kill_watch_subscribers(srv) >= 1
        rest = [xxh3_form(h, Schema()) for h in hs[0::2]]
        sa.until("REMOTE removed after the second gap",
                 lambda x: set(rest) <= set(_removed_on_remote(sa, n0)), timeout=10)
        assert wait_until(lambda: tiers(a)["remote_watch_reconciles"] == 2, timeout=5), rem(a)
        assert sorted(_removed_on_remote(sa)) == sorted(want), _removed_on_remote(sa)
        t = tiers(a)
        assert t["remote_watch_gaps"] == 2 and t["remote_watch_ledger"] == 0, rem(t)
        assert ping_ms(ca) < 100
        sa.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_periodic_pass_finds_unheard_deletes(kvd_factory, redis_factory):
    """remote-watch-reconcile-s 1: with no gap in the watch, values deleted unheard (a DEL by
    another client, then a FLUSHALL) are reported by the next periodic pass, each exactly once.
    Redis then stopped (SIGSTOP: the watch stays subscribed, nothing answers): a pass's batch is
    asked again a second later and given up after three failed tries, the daemon answering
    throughout; once Redis runs again a later pass finds what was deleted just before it."""
    import zmq
    from test_kv_events import tcp_endpoints, xxh3_form, Schema
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, srv.addr, ea, 9, 575100,
                                                 remote_watch_reconcile_s="1", log_level="info",
                                                 remote_backoff_max_ms="500")
        ns = Namespace(srv.client(), "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs), ns.present(hs)
        form = lambda hl: [xxh3_form(h, Schema()) for h in hl]
        with srv.client() as r:
            for h in hs[0:3]:
                assert r.call("DEL", ns.key(h)) == 1
        sa.until("the DELs reported by a periodic pass",
                 lambda x: set(form(hs[0:3])) <= set(_removed_on_remote(sa)), timeout=5)
        with srv.client() as r:
            r.call("FLUSHALL")
        sa.until("the FLUSHALL reported by a periodic pass",
                 lambda x: set(want) <= set(_removed_on_remote(sa)), timeout=5)
        assert sorted(_removed_on_remote(sa)) == sorted(want), _removed_on_remote(sa)
        t = tiers(a)
        assert t["remote_watch_gaps"] == 0, rem(t)
        assert t["remote_watch_reconciled"] == 9 and t["remote_watch_ledger"] == 0, rem(t)
        assert "periodic pass (remote-watch-reconcile-s)" in log_tail(a)
        # A second chain; three of it deleted just before Redis stops.
        n0 = len(sa.batches)
        hs2, _ = commit_chain(ca, pa, 6, 585100)
        want2 = form(hs2)
        sa.until("REMOTE stored", lambda x: set(want2) <= sa.stored("REMOTE"), timeout=10)
        assert wait_until(lambda: tiers(a)["remote_watch_ledger"] == 6, timeout=5), rem(a)
        with srv.client() as r:
            for h in hs2[0:3]:
                assert r.call("DEL", ns.key(h)) == 1
        e0 = tiers(a)["remote_watch_reconcile_errors"]
        srv.sigstop()
        try:
            assert wait_until(lambda: "reconciliation given up after 3 failed tries"
                              in log_tail(a, 20000), timeout=10), rem(a)
            assert tiers(a)["remote_watch_reconcile_errors"] >= e0 + 3, rem(a)
            assert ping_ms(ca) < 100
        finally:
            srv.sigcont()
        sa.until("REMOTE removed once Redis answers again",
                 lambda x: set(want2[0:3]) <= set(_removed_on_remote(sa, n0)), timeout=15)
        time.sleep(1.2)  # a pass or more after: nothing else, nothing twice
        assert sorted(_removed_on_remote(sa)) == sorted(want + want2[0:3]), \
            _removed_on_remote(sa)
        assert tiers(a)["remote_watch_ledger"] == 3, rem(a)
        sa.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_reconciles_a_redis_restarted_empty(kvd_factory, redis_factory):
    """The Redis server killed and started again on its port without its data (no persistence):
    every value kvd announced on REMOTE is gone, and once its watch is subscribed again kvd
    says so (BlockRemoved for each, found by the reconciliation)."""
    import zmq
    from test_kv_events import tcp_endpoints
    srv = redis_factory(args=["--notify-keyspace-events", "Exe"])
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, srv.addr, ea, 24, 575100)
        srv.kill()
        srv.start()
        sa.until("REMOTE removed after the restart",
                 lambda x: set(want) <= set(_removed_on_remote(sa)), timeout=20)
        assert wait_until(lambda: tiers(a)["remote_watch_reconciles"] >= 1, timeout=5), rem(a)
        t = tiers(a)
        assert t["remote_watch_reconciled"] == 24 and t["remote_watch_ledger"] == 0, rem(t)
        assert t["remote_watch_gaps"] >= 1, rem(t)
        assert sorted(set(_removed_on_remote(sa))) == sorted(want)
        assert ping_ms(ca) < 100
        sa.close()
    finally:
        ctx.destroy(0)


def test_remote_watch_reconciles_a_cluster(kvd_factory, redis_cluster):
    """A Redis Cluster: values on all 3 masters, a third of them deleted unheard, then one
    master's pub/sub connections killed (a gap on one node): the reconciliation asks every
    master about its keys (one pipelined round trip per node and batch) and reports exactly the
    deleted ones."""
    import zmq
    from test_kv_events import tcp_endpoints, xxh3_form, Schema
    cl = redis_cluster
    _send_drops(cl.ports)
    ctx = zmq.Context()
    try:
        (ea,) = tcp_endpoints(1)
        a, sa, ca, pa, hs, want = _watched_chain(kvd_factory, ctx, "127.0.0.1:%d" % cl.ports[0],
                                                 ea, 24, 585100, nodes=3)
        ns = Namespace(cl.client, "kvd", domain_of(a, pa.pool_id))
        assert ns.wait_landed(hs), ns.present(hs)
        gone = hs[::3]
        assert len({cl.client.master_of(ns.key(h)) for h in gone}) == 3
        for h in gone:
            assert cl.client.call(ns.key(h), "DEL", ns.key(h)) == 1
        with Redis(cl.client.masters()[1], timeout=2.0) as r:
            assert r.call("CLIENT", "KILL", "TYPE", "pubsub") >= 1
        gone_x = [xxh3_form(h, Schema()) for h in gone]
        sa.until("REMOTE removed after the gap",
                 lambda x: set(gone_x) <= set(_removed_on_remote(sa)), timeout=15)
        assert wait_until(lambda: tiers(a)["remote_watch_reconciles"] >= 1, timeout=5), rem(a)
        time.sleep(0.3)
        assert sorted(set(_removed_on_remote(sa))) == sorted(gone_x), _removed_on_remote(sa)
        t = tiers(a)
        assert t["remote_watch_reconciled"] == len(gone), rem(t)
        assert t["remote_watch_ledger"] == len(hs) - len(gone), rem(t)
        assert t["remote_watch_nodes"] == 3, rem(t)
        sa.close()
    finally:
        ctx.destroy(0)


# ---------------------------------------------------------------------------------------------
# remote-uid-tenants: peers without a tenants-file line (uid-N) across nodes

def test_uid_tenants_node_keeps_each_nodes_uid_apart(kvd_factory, redis):
    """remote-uid-tenants node: a uid-N tenant's keys carry node-name, so node B's uid-N (the
    same number, maybe another person there) never hits node A's values; a node C of the same
    name as A does (the operator said they are one)."""
    opts = {"remote_uid_tenants": "node"}
    a = kvd_factory(**node_opts(redis.addr, node_name="alpha", **opts))
    b = kvd_factory(**node_opts(redis.addr, writer=False, node_name="beta", **opts))
    c = kvd_factory(**node_opts(redis.addr, writer=False, node_name="alpha", **opts))
    ca, cb, cc = connect(a), connect(b), connect(c)
    pa, pb_, pc = (x.attach(MODEL, LAYOUT) for x in (ca, cb, cc))
    dom = domain_of(a, pa.pool_id)
    assert dom.startswith("uid-"), dom
    hs, pats = commit_chain(ca, pa, 4, 565100)
    ns = Namespace(redis.client(), "kvd", dom + "@alpha")
    assert ns.wait_landed(hs), (redis.client().keys("kvd:*"), rem(a))
    assert not Namespace(redis.client(), "kvd", dom).present(hs)
    fr, n = fetch_checked(cb, pb_, hs, pats, "node beta")
    assert n == 0 and rstat(b, "hits") == 0, msg(fr, rem(b))
    fr, n = fetch_checked(cc, pc, hs, pats, "node alpha again")
    assert n == 4, msg(fr, rem(c))


def test_uid_tenants_off_stay_local(kvd_factory, redis):
    """remote-uid-tenants off: a uid-N tenant's blocks still go down to T1 but never to Redis,
    and its Fetch never asks Redis."""
    a = kvd_factory(**node_opts(redis.addr, remote_uid_tenants="off"))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    hs, pats = commit_chain(ca, pa, 4, 575100)
    assert wait_until(lambda: tiers(a)["demotions_t1"] >= 4, timeout=10), msg(tiers(a))
    time.sleep(0.3)
    assert rstat(a, "puts") == 0 and not redis.client().keys("kvd:*"), rem(a)
    fr, n = fetch_checked(ca, pa, [(7, 7), (8, 8)], [b"", b""], "unknown chain")
    assert n == 0 and rstat(a, "gets") == 0, msg(fr, rem(a))


def test_remote_uid_tenants_refuses_a_bad_value():
    """A value that is not shared, node or off, and a node-name with a ':' (keys are
    ':'-separated): kvd refuses to start and names the option."""
    for opt, val in (("remote-uid-tenants", "everyone"), ("node-name", "a:b")):
        rc, out = run_kvd_expecting_refusal({OPT_REDIS: "127.0.0.1:1", "tier1_memory": "1M",
                                             opt.replace("-", "_"): val})
        assert rc not in (None, 0) and opt in out, out


def hung_dns_kvd(tmp_base, options, resolver="timeout:3 attempts:2"):
    """A kvd whose name lookups go to a DNS server that never answers: it runs in a mount
    namespace of its own where /etc/resolv.conf names 127.0.0.N (the first of 127.0.0.77 to
    .126 whose port 53 is free, so shards or runs doing this at once do not meet), on whose port
    53 a UDP socket of this test reads and drops every query (resolver: the file's options, how
    long the resolver holds a lookup). Needs root (unshare, mount, port 53). Returns (daemon,
    the dropping socket)."""
    import conftest
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    dns, err = None, None
    for last in range(77, 127):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind(("127.0.0.%d" % last, 53))
            dns, addr = s, "127.0.0.%d" % last
            break
        except OSError as e:
            s.close()
            err = e
    if dns is None:
        pytest.skip("cannot bind port 53 on 127.0.0.77-126: %s" % err)
    resolv = os.path.join(tmp_base, "resolv.conf")
    with open(resolv, "w") as f:
        f.write("nameserver %s\noptions %s\n" % (addr, resolver))
    wrapper = os.path.join(tmp_base, "kvd-hung-dns")
    with open(wrapper, "w") as f:
        f.write("#!/bin/sh\nexec unshare --mount --propagation private sh -c "
                "'mount --bind \"$0\" /etc/resolv.conf && exec \"$@\"' %s %s \"$@\"\n"
                % (resolv, conftest.kvd_binary()))
    os.chmod(wrapper, 0o755)
    tmp = conftest.new_dir()
    try:
        d = conftest.Daemon(wrapper, tmp, options)
    except BaseException:
        dns.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d, dns


def test_dns_that_never_answers_costs_one_timeout(tmp_path):
    """remote-redis names a host whose DNS server never answers (the resolver's own timeouts
    would hold a lookup for seconds): a Fetch that asks the remote tier is answered within about
    remote-timeout-ms, Pings meanwhile are prompt, and the tier's state names the lookup."""
    timeout_ms = 200
    d, dns = hung_dns_kvd(str(tmp_path), node_opts("redis.kvd-test.invalid:6379",
                                                   **{OPT_TIMEOUT: str(timeout_ms)}))
    try:
        c = connect(d)
        p = c.attach(MODEL, LAYOUT)
        hs = kw.hash_chain(p.hash_seed, list(range(9000, 9000 + 4 * T)), T, b"", p.hash_algo)
        for k in range(2):  # the first lookup, then one that finds it still running
            t = time.monotonic()
            fid = c.send("fetch", c.fetch_msg(p.pool_id, hs))
            lat, reply, took = pings_while_waiting(c, fid, "fetch_reply", 20, t)
            if reply is None:
                c.sock.settimeout(10)
                try:
                    which, reply, _ = c.recv(fid)
                except kw.KvdError as e:
                    reply = e
                except (TimeoutError, socket.timeout):
                    pytest.fail(msg("Fetch %d with DNS hung: no answer in 10 s" % k, rem(d)))
                took = time.monotonic() - t
            limit = timeout_ms * 3 / 1000 + 1
            assert took <= limit, msg("Fetch %d with DNS hung took %.2f s" % (k, took), rem(d))
            assert max(lat) < 50, "Ping latency while DNS hangs: max %.1f ms" % max(lat)
            if not isinstance(reply, kw.KvdError):
                assert kw.reply_blocks(reply) == [], reply
        state = d.admin_result("tiers")["state"]
        assert "resolving redis.kvd-test.invalid" in state and "no answer within" in state, state
        assert rstat(d, "state") == STATE_DOWN, rem(d)
        assert d.alive()
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)
        dns.close()


def test_dns_lookup_keeps_to_the_request_deadline(tmp_path):
    """A Fetch's lookups keep to its one deadline: the first seed is a server that accepts and
    hangs up 300 ms later (the slot map read fails there), the second a name whose DNS never
    answers. That lookup waits only what the request has left, so the Fetch is answered within
    about one remote-timeout-ms (it waited a whole timeout more before), and a lookup the
    deadline cut short does not mark its node down."""
    import threading
    timeout_ms = 600
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    stop = threading.Event()

    th = _accept_loop(lsock, stop, lambda conn: threading.Timer(0.3, conn.close).start())
    seeds = "127.0.0.1:%d,b.kvd-test.invalid:6379" % lsock.getsockname()[1]
    d, dns = hung_dns_kvd(str(tmp_path), node_opts(seeds, **{OPT_TIMEOUT: str(timeout_ms)}))
    try:
        c = connect(d)
        p = c.attach(MODEL, LAYOUT)
        hs = kw.hash_chain(p.hash_seed, list(range(9100, 9100 + 4 * T)), T, b"", p.hash_algo)
        # The start's first discovery asks every seed with no request waiting (a timeout for the
        # name): it has ended when the name's lookup is the last error.
        assert wait_until(lambda: "b.kvd-test.invalid:6379: resolving" in
                          d.admin_result("tiers")["state"], timeout=10), rem(d)
        for k in range(3):
            t = time.monotonic()
            _fetch_ignoring_errors(c, p, hs, d)
            took = time.monotonic() - t
            assert took <= timeout_ms * 1.25 / 1000, msg(
                "Fetch %d took %.2f s (remote-timeout-ms %d)" % (k, took, timeout_ms), rem(d))
        assert d.alive()
    finally:
        _stop_hung(d, dns, lsock, stop, th)


def _hung_dns_kvd_over(lsock, stop, th, tmp_base, options, **kw_args):
    """hung_dns_kvd for a test that started a fake cluster (lsock, stop, th) first: when the
    daemon cannot start, or the test is skipped there (not root), the fake cluster stops too."""
    try:
        return hung_dns_kvd(tmp_base, options, **kw_args)
    except BaseException:
        stop.set()
        th.join(timeout=2)
        lsock.close()
        raise


def _threads(d):
    """The daemon's threads now."""
    return len(os.listdir("/proc/%d/task" % d.proc.pid))


def _fetch_ignoring_errors(c, p, hs, d):
    """One Fetch of hashes hs in pool p of daemon d, its answer awaited (no answer in 10 s fails
    the test) and an error answer ignored: what the hung-DNS tests drive kvd's remote lookups
    with."""
    fid = c.send("fetch", c.fetch_msg(p.pool_id, hs))
    c.sock.settimeout(10)
    try:
        c.recv(fid)
    except kw.KvdError:
        pass
    except (TimeoutError, socket.timeout):
        pytest.fail(msg("Fetch with DNS hung: no answer in 10 s", rem(d)))


def _stop_hung(d, dns, lsock, stop, th):
    """Ends a hung-DNS test: the daemon and its directory, the dropping DNS socket, and the fake
    cluster (_fake_cluster's socket, stop event and thread)."""
    stop.set()
    d.stop()
    shutil.rmtree(d.dir, ignore_errors=True)
    dns.close()
    th.join(timeout=2)
    lsock.close()


def _accept_loop(lsock, stop, on_conn):
    """A thread that accepts on lsock until stop is set, handing each connection to on_conn."""
    import threading

    def accept():
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except (TimeoutError, socket.timeout, OSError):
                continue
            on_conn(conn)

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    return th


def _resp_commands(buf):
    """The whole RESP commands (*N then N bulk strings) at the start of buf, as lists of bytes
    arguments, and the bytes after them (a command not all there yet stays in the rest)."""
    cmds = []
    while buf.startswith(b"*") and b"\r\n" in buf:
        head, rest = buf.split(b"\r\n", 1)
        args = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return cmds, buf
            ln, rest = rest.split(b"\r\n", 1)
            k = int(ln[1:])
            if len(rest) < k + 2:
                return cmds, buf
            args.append(rest[:k])
            rest = rest[k + 2:]
        cmds.append(args)
        buf = rest
    return cmds, buf


def _fake_redis(answer, lsock=None):
    """A RESP server on loopback: answer(conn, args, stop) answers each whole command (it may
    send its reply in pieces, and stop early when stop is set). lsock: a listening socket to
    serve (else a new one). Returns (listening socket, stop event, thread)."""
    import threading
    if lsock is None:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(16)
    stop = threading.Event()

    def serve(conn):
        buf = b""
        conn.settimeout(0.2)
        while not stop.is_set():
            try:
                data = conn.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                break
            if not data:
                break
            cmds, buf = _resp_commands(buf + data)
            try:
                for args in cmds:
                    answer(conn, args, stop)
            except OSError:
                break
        conn.close()

    th = _accept_loop(lsock, stop,
                      lambda conn: threading.Thread(target=serve, args=(conn,), daemon=True).start())
    return lsock, stop, th


def _fake_cluster(names, stable=False):
    """A RESP server that plays a Redis Cluster whose map keeps changing: CLUSTER SLOTS gives,
    in turn, half of the slots to itself and half to a port nothing listens on, then that half
    split between the nodes `names` ((host, port) pairs; each map has a node that fails, so kvd
    reads the map again at the next request); stable: always the second map. GET and STRLEN
    find nothing, SET is fine. Returns (listening socket, stop event, thread)."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    port = lsock.getsockname()[1]
    maps = [0]

    def bulk(s):
        b = s.encode()
        return b"$%d\r\n%s\r\n" % (len(b), b)

    def node(host, p):
        return b"*2\r\n" + bulk(host) + b":%d\r\n" % p

    def slots():
        maps[0] += 1
        if maps[0] % 2 and not stable:  # the other half on a port nothing listens on: refused, so read again
            return (b"*2\r\n*3\r\n:0\r\n:8191\r\n" + node("127.0.0.1", port) +
                    b"*3\r\n:8192\r\n:16383\r\n" + node("127.0.0.1", 1))
        out = b"*%d\r\n*3\r\n:0\r\n:8191\r\n" % (1 + len(names)) + node("127.0.0.1", port)
        each = 8192 // len(names)
        for i, (host, p) in enumerate(names):
            lo = 8192 + i * each
            hi = 16383 if i + 1 == len(names) else lo + each - 1
            out += b"*3\r\n:%d\r\n:%d\r\n" % (lo, hi) + node(host, p)
        return out

    def reply(cmd):
        c = [x.upper() for x in cmd[:2]]
        if c[:2] == [b"CLUSTER", b"SLOTS"]:
            return slots()
        if c[0] == b"GET":
            return b"$-1\r\n"
        if c[0] == b"STRLEN":
            return b":0\r\n"
        return b"+OK\r\n"

    return _fake_redis(lambda conn, args, stop: conn.sendall(reply(args)), lsock)


def test_trickling_value_keeps_to_the_timeout(kvd_factory):
    """A Redis that sends a GET's value a few bytes at a time (each read within remote-timeout-ms,
    the whole value in seconds): the Fetch's one timeout ends the read (each read had its own
    timeout, so the Fetch and the remote thread waited for the whole trickle)."""
    def answer(conn, args, stop):
        cmd = args[0].upper()
        if cmd == b"CLUSTER":
            conn.sendall(b"-ERR This instance has cluster support disabled\r\n")
        elif cmd == b"GET":
            body = b"KVDR" + bytes(HEADER - 4 + LAYOUT.block_bytes)
            conn.sendall(b"$%d\r\n" % len(body))
            for i in range(0, len(body), 16):  # ~7 s for the whole value
                if stop.is_set():
                    return
                conn.sendall(body[i:i + 16])
                time.sleep(0.05)
            conn.sendall(b"\r\n")
        else:
            conn.sendall(b"+OK\r\n")

    lsock, stop, th = _fake_redis(answer)
    try:
        d = kvd_factory(**node_opts("127.0.0.1:%d" % lsock.getsockname()[1], writer=False,
                                    **{OPT_TIMEOUT: "300"}))
        c = connect(d)
        p = c.attach(MODEL, LAYOUT)
        hs = chain(p, 1, 646100)
        t = time.monotonic()
        fr, got = fetch(c, p, hs)
        took = time.monotonic() - t
        assert got == [] and took < 2.5, (took, msg(fr, rem(d)))
        assert c.ping(nonce=2).nonce == 2 and d.alive()
    finally:
        stop.set()
        th.join(timeout=2)
        lsock.close()


def test_hung_dns_costs_one_thread_per_name(tmp_path):
    """A Cluster whose slot map keeps naming, then forgetting, a master by a host name whose DNS
    never answers (the resolver holds a lookup 6 s): each time the map names it again, kvd waits
    for the lookup still running instead of starting another thread, so its threads do not pile
    up; Fetches are answered meanwhile."""
    lsock, stop, th = _fake_cluster([("m.kvd-test.invalid", 6379)])
    d, dns = _hung_dns_kvd_over(lsock, stop, th, str(tmp_path),
                                node_opts("127.0.0.1:%d" % lsock.getsockname()[1],
                                          **{OPT_TIMEOUT: "150"}))
    try:
        c = connect(d)
        p = c.attach(MODEL, LAYOUT)
        base = _threads(d)
        most = base
        for k in range(24):  # about 4 s: the map changes every Fetch or two
            hs = kw.hash_chain(p.hash_seed, list(range(20000 + 100 * k, 20000 + 100 * k + 8 * T)),
                               T, b"", p.hash_algo)
            _fetch_ignoring_errors(c, p, hs, d)
            most = max(most, _threads(d))
        # The lookup of the name: one thread (two while one that ended is being reaped); at
        # least one, or the name was never looked up and the test shows nothing.
        assert base + 1 <= most <= base + 2, msg(
            "threads %d at the start, %d at most" % (base, most), rem(d))
        assert d.alive()
    finally:
        _stop_hung(d, dns, lsock, stop, th)


def test_hung_dns_lookups_shared_by_nodes_count_once(tmp_path):
    """A Cluster whose map (the same at every read) gives 4 masters one host name (a node per
    port) and 13 others a name each, all names hung in DNS (the resolver holds a lookup 20 s):
    the 4 nodes share one lookup, and it counts once against the 16 lookups kvd lets wait at a
    time, so all 14 names are looked up together (counted once per node, the last name would be
    refused: "16 host name lookups are still waiting for DNS"), and no more threads than names
    start."""
    names = [("shared.kvd-test.invalid", 7001 + i) for i in range(4)]
    names += [("n%d.kvd-test.invalid" % i, 6379) for i in range(13)]
    lsock, stop, th = _fake_cluster(names, stable=True)
    d, dns = _hung_dns_kvd_over(lsock, stop, th, str(tmp_path),
                                node_opts("127.0.0.1:%d" % lsock.getsockname()[1],
                                          **{OPT_TIMEOUT: "50"}),
                                resolver="timeout:20 attempts:1")
    try:
        c = connect(d)
        p = c.attach(MODEL, LAYOUT)
        base = _threads(d)
        most, refused = base, []
        # One block a Fetch: its key's slot picks one node (a Fetch's lookups share one
        # remote-timeout-ms, so a first hung name would keep it from the others); until all 14
        # lookups run (each holds a thread 20 s; about 200 Fetches, a quarter of them waiting
        # 50 ms for a name).
        for k in range(600):
            hs = kw.hash_chain(p.hash_seed, list(range(50000 + T * k, 50000 + T * (k + 1))), T,
                               b"", p.hash_algo)
            _fetch_ignoring_errors(c, p, hs, d)
            most = max(most, _threads(d))
            state = d.admin_result("tiers")["state"]
            if "still waiting for DNS" in state:
                refused.append(state)
            if most >= base + 14:
                break
        assert not refused, msg("a lookup was refused", refused[0], rem(d))
        assert base + 14 <= most <= base + 16, msg(
            "threads %d at the start, %d at most (14 names)" % (base, most), rem(d))
        assert d.alive()
    finally:
        _stop_hung(d, dns, lsock, stop, th)


def test_remote_redis_by_host_name(kvd_factory, redis):
    """remote-redis by name (the lookup thread's path, not a literal): "localhost", and the puts
    land. Where /etc/hosts gives ::1 before 127.0.0.1 (Redis listens on 127.0.0.1 only) this also
    shows the name's addresses tried in turn; where localhost is 127.0.0.1 alone it does not."""
    a = kvd_factory(**node_opts("localhost:%d" % redis.port))
    ca = connect(a)
    pa = ca.attach(MODEL, LAYOUT)
    ns = Namespace(redis.client(), "kvd", domain_of(a, pa.pool_id))
    hs, _ = commit_chain(ca, pa, 2, 1)
    assert ns.wait_landed(hs), rem(a)
    assert rstat(a, "state") == STATE_UP, rem(a)
