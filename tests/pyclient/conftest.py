"""pytest fixtures for the kvdwire suite: a real kvd per test, and helpers for forked children.

The daemon binary is $KVD_BIN, by default bazel-bin/daemon/kvd under the repository root. Each
daemon gets its own directory under one short, world-traversable base (so that socket paths stay
far below the 108 bytes of sun_path and children running as other uids can reach the socket):
$KVDPY_BASE when run.sh made one, else a fresh directory under /tmp (never $TMPDIR, which under
Bazel is a long path below a 0700 home). Everything made there is removed afterwards.
"""

import atexit
import ctypes
import json
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback

import pytest

import kvdwire

DEFAULT_KVD_BIN = os.path.join(kvdwire.REPO_ROOT, "bazel-bin", "daemon", "kvd")

# Unprivileged uids of the two-tenant tests (no passwd entry needed).
UID_A, UID_B = 61001, 61002

# Options every test daemon gets (a test's own options override them). A small initial prefix
# index keeps start-up fast (the index grows with the pools, PROTOCOL.md/--help); the rest keeps
# pools small so that budgets are easy to reach.
BASE_OPTIONS = {"backend": "host", "socket_dir_mode": "0755", "socket_mode": "0666",
                "pool_memory": "8M", "segment_bytes": "256K", "log_level": "warn",
                "index_entries": "16K"}

_BASE = None


def base_dir():
    """The directory all daemon directories of this run live in (made on first use)."""
    global _BASE
    if _BASE is None:
        given = os.environ.get("KVDPY_BASE")
        if given:
            _BASE = (given, False)
        else:
            _BASE = (tempfile.mkdtemp(prefix="kvdpy.", dir="/tmp"), True)
            os.chmod(_BASE[0], 0o755)
            pid = os.getpid()  # forked children (Child) leave with os._exit, but be sure
            atexit.register(lambda: os.getpid() == pid and shutil.rmtree(_BASE[0], True))
    return _BASE[0]


# Bazel shards (tests/pyclient/BUILD shard_count): shard i of n runs the tests whose position in
# the collected order is i modulo n, so the long remote and event tests spread over the cores,
# and takes only loopback ports whose half, counted within its ten thousand, is i modulo n, so
# two shards never pick the same one (not the port itself: Linux hands bind(0) odd ports, and one
# shard would wait forever; within its ten thousand: a Redis Cluster node's port p and its bus
# port p + 10000 belong to the same shard).
SHARDS = int(os.environ.get("TEST_TOTAL_SHARDS", "1") or 1)
SHARD = int(os.environ.get("TEST_SHARD_INDEX", "0") or 0)


def shard_owns_port(port):
    """Whether this shard may use loopback port `port` (all of them when not sharded)."""
    return ((port % 10000) >> 1) % SHARDS == SHARD


def pytest_collection_modifyitems(config, items):
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:  # tells Bazel this test knows about sharding
        open(status, "a").close()
    if SHARDS <= 1:
        return
    keep = [it for i, it in enumerate(items) if i % SHARDS == SHARD]
    gone = [it for i, it in enumerate(items) if i % SHARDS != SHARD]
    if gone:
        config.hook.pytest_deselected(items=gone)
    items[:] = keep


def pytest_unconfigure(config):
    if _BASE is not None and _BASE[1]:
        shutil.rmtree(_BASE[0], ignore_errors=True)


def world_traversable(path):
    """True if a process of another uid can reach entries of `path` (o+x on it and above)."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no daemon outlives a killed pytest


def daemon_args(binary, tmp, options):
    """The kvd command line for a daemon in directory tmp with BASE_OPTIONS + options."""
    opts = dict(BASE_OPTIONS)
    opts.update({"socket": os.path.join(tmp, "run", "kvd.sock"),
                 "admin_socket": os.path.join(tmp, "run", "admin.sock")})
    opts.update(options)
    return [binary] + ["--%s=%s" % (k.replace("_", "-"), v) for k, v in opts.items()
                       if v is not None]


class Daemon:
    """A kvd process with its sockets; `admin` speaks the admin socket's line protocol."""

    def __init__(self, binary, tmp, options, files=None, env=None):
        self.dir = tmp
        if env is not None:  # "{dir}" in the environment's values too
            env = {k: v.replace("{dir}", tmp) for k, v in env.items()}
        options = {k: (None if v is None else str(v).replace("{dir}", tmp))
                   for k, v in options.items()}
        for name, data in (files or {}).items():  # extra files in the daemon's directory
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        if "tenants" in options:  # the text of a tenants file (docs/TENANCY.md)
            path = os.path.join(tmp, "tenants")
            with open(path, "w") as f:
                f.write(options.pop("tenants"))
            options["tenants_file"] = path
        self.sock = options.get("socket", os.path.join(tmp, "run", "kvd.sock"))
        if self.sock is None:  # the default path (§1), from the daemon's environment
            e = os.environ if env is None else env
            self.sock = (os.path.join(e["XDG_RUNTIME_DIR"], "kvd", "kvd.sock")
                         if e.get("XDG_RUNTIME_DIR") else "/tmp/kvd-%d/kvd.sock" % os.geteuid())
        self.admin_sock = options.get("admin_socket", os.path.join(tmp, "run", "admin.sock"))
        if self.admin_sock is None:  # admin.sock beside the client socket (docs/ADMIN.md)
            self.admin_sock = os.path.join(os.path.dirname(self.sock), "admin.sock")
        self.log_path = os.path.join(tmp, "kvd.log")
        self.args = daemon_args(binary, tmp, options)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     env=env)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("kvd exited with %s: %s" % (self.proc.returncode,
                                                               self.read_log()))
            try:
                kvdwire.Conn(self.sock, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # kvd binds the admin socket just after the client socket (both before its loop runs),
        # so a connect to the client socket can succeed before admin.sock exists: wait for it
        # too (a daemon that cannot make it exits, which the loop sees).
        while self.admin_sock and not os.path.exists(self.admin_sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # The file exists from bind(); it accepts from listen() on, a moment later: under load
        # a test's first admin command landed in between (ECONNREFUSED). Wait until it accepts.
        while self.admin_sock and os.path.exists(self.admin_sock):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.admin_sock)
                break
            except ConnectionRefusedError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            finally:
                s.close()

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def connect(self, hello=True, **kw):
        c = kvdwire.Conn(self.sock)
        if hello:
            c.hello(**kw)
        return c

    def admin(self, command):
        """One admin command; returns the parsed JSON reply object."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self.admin_sock)
        s.sendall(command.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
        s.close()
        return json.loads(data)

    def admin_result(self, command):
        r = self.admin(command)
        assert r["ok"], r
        return r["result"]

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        """Kills the daemon on purpose (a crash the test wants); the end-of-test check of dead
        daemons leaves it out."""
        self.killed = True
        self.stop()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def kvd_factory():
    """start(files=None, env=None, setup=None, **options) -> Daemon. Options are kvd flags
    (underscores for dashes; None leaves a BASE_OPTIONS flag out); `tenants` is the text of a
    tenants file; "{dir}" in values is the daemon's directory; setup(dir) runs before kvd
    starts. Every daemon is checked alive at the end of the test, then killed."""
    binary = kvd_binary()
    started = []

    def start(files=None, env=None, setup=None, **options):
        tmp = new_dir()
        if setup is not None:  # prepares the daemon's directory before kvd starts
            setup(tmp)
        try:
            d = Daemon(binary, tmp, options, files, env)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        started.append(d)
        return d

    yield start
    dead = [d for d in started if not d.alive() and not getattr(d, "killed", False)]
    for d in started:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)
    assert not dead, "kvd died during the test: rc %s\n%s" % (
        dead[0].proc.returncode, dead[0].read_log()[-4000:])


def kvd_binary():
    return os.environ.get("KVD_BIN") or DEFAULT_KVD_BIN


def new_dir():
    """A fresh world-traversable directory under the base."""
    tmp = tempfile.mkdtemp(prefix="d", dir=base_dir())
    os.chmod(tmp, 0o755)
    return tmp


def run_kvd_expecting_refusal(options, timeout=5.0, setup=None, env=None):
    """Runs kvd with BASE_OPTIONS + options ("{dir}" in values: its fresh directory, prepared
    by setup(dir)); returns (exit code, output) once it exits, or (None, output) if it was still
    running (serving) after `timeout`."""
    tmp = new_dir()
    options = {k: (None if v is None else str(v).replace("{dir}", tmp))
               for k, v in options.items()}
    if env is not None:
        env = {k: v.replace("{dir}", tmp) for k, v in env.items()}
    if setup is not None:
        setup(tmp)
    try:
        proc = subprocess.Popen(daemon_args(kvd_binary(), tmp, options), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, env=env)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out.decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return None, out.decode(errors="replace")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def kvd(kvd_factory):
    """A daemon with the default test options (8 MiB pool memory, 256 KiB segments)."""
    return kvd_factory()


class Child:
    """A forked child running fn(*args) (optionally as another uid); result comes back pickled."""

    def __init__(self, fn, *args, uid=None):
        r, w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            os.close(r)
            os.close(self.ready_r)
            code = 0
            try:
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                out = ("ok", fn(ready_w, *args))
            except BaseException as e:  # report everything to the parent
                out = ("err", "%r\n%s" % (e, traceback.format_exc()))
                code = 1
            try:
                os.write(w, pickle.dumps(out))
            finally:
                os._exit(code)
        os.close(w)
        os.close(ready_w)
        self.r = r

    def wait_ready(self, timeout=10):
        """Waits until the child called signal_ready; returns the value it passed."""
        ready, _, _ = select.select([self.ready_r], [], [], timeout)
        assert ready, "child not ready in time"
        data = b""
        while True:
            chunk = os.read(self.ready_r, 1 << 16)
            if not chunk:
                break
            data += chunk
            if len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "little"):
                break
        assert len(data) >= 4, "child ended before it was ready"
        return pickle.loads(data[4:])

    def result(self, timeout=20):
        """The child's return value; raises if it failed."""
        data = b""
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.r], [], [], max(0, deadline - time.monotonic()))
            assert ready, "child timed out"
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                break
            data += chunk
        os.waitpid(self.pid, 0)
        os.close(self.r)
        os.close(self.ready_r)
        status, value = pickle.loads(data)
        assert status == "ok", "child failed: " + value
        return value

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.r)
        os.close(self.ready_r)


def signal_ready(ready_w, value=None):
    """Called by a child function to tell the parent it reached its checkpoint (with a
    picklable value for the parent's wait_ready)."""
    data = pickle.dumps(value)
    os.write(ready_w, len(data).to_bytes(4, "little") + data)


def allocate_blocks(conn, pool, count):
    """Allocate of count blocks; returns the (id, gen) pairs; the pool follows the reply's
    segments. (Blocks whose copies down to a lower tier are in flight are leased until the copy
    lands; an Allocate that meets them waits for the copies rather than fail: no retry here.)"""
    r = conn.allocate(pool.pool_id, count)
    pool.follow(r)
    return kvdwire.reply_blocks(r)


def token_chain(pool, nblocks, base):
    """The pool's block hashes of tokens base, base + 1, ... (nblocks full blocks)."""
    t = pool.layout.tokens_per_block
    toks = list(range(base, base + nblocks * t))
    return kvdwire.hash_chain(pool.hash_seed, toks, t, b"", pool.hash_algo)


def wait_until(pred, timeout=5.0, step=0.01):
    """Polls pred() until true; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)
