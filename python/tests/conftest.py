"""pytest fixtures of the kvclient suite: real kvd daemons on short sockets, connections, and
a subprocess runner for the tests that prove sharing between processes.

The daemon binary is $KVD_BIN (default bazel-bin/daemon/kvd), the library $KVCLIENT_LIBRARY
(default bazel-bin/client/shared/libkvclient.so); run_tests.sh sets both. Sockets live in a
short directory under /tmp ($KVCLIENT_TEST_BASE when run_tests.sh made one, else a fresh one
removed at the end): $TMPDIR under Bazel is too long for sun_path.
"""

import ctypes
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)                 # python/ (the kvclient package is below it)
REPO = os.path.dirname(PYROOT)
os.environ.setdefault("KVD_BIN", os.path.join(REPO, "bazel-bin", "daemon", "kvd"))
os.environ.setdefault("KVCLIENT_LIBRARY",
                      os.path.join(REPO, "bazel-bin", "client", "shared", "libkvclient.so"))
if PYROOT not in sys.path:
    sys.path.insert(0, PYROOT)

import kvclient  # noqa: E402  (after the environment above)

# Every test daemon gets these (a test's own override them): host memory, small segments so
# that pools grow, a small initial index for a fast start.
BASE_OPTIONS = {"backend": "host", "pool_memory": "64M", "segment_bytes": "256K",
                "log_level": "warn", "index_entries": "16K", "socket_mode": "0600"}

_base = None


def base_dir():
    global _base
    if _base is None:
        given = os.environ.get("KVCLIENT_TEST_BASE")
        if given:
            _base = (given, False)
        else:
            _base = (tempfile.mkdtemp(prefix="kvcpy.", dir="/tmp"), True)
    return _base[0]


def pytest_unconfigure(config):
    if _base is not None and _base[1]:
        shutil.rmtree(_base[0], ignore_errors=True)


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no kvd outlives a killed pytest


class Daemon:
    """A kvd process in its own directory; .sock is its client socket."""

    def __init__(self, **options):
        self.dir = tempfile.mkdtemp(prefix="d", dir=base_dir())
        opts = dict(BASE_OPTIONS)
        opts.update(socket=os.path.join(self.dir, "kvd.sock"),
                    admin_socket=os.path.join(self.dir, "admin.sock"))
        opts.update(options)
        self.sock, self.admin_sock = opts["socket"], opts["admin_socket"]
        self.killed = False
        self.log_path = os.path.join(self.dir, "kvd.log")
        args = [os.environ["KVD_BIN"]] + ["--%s=%s" % (k.replace("_", "-"), v)
                                          for k, v in opts.items()]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("kvd exited with %s: %s" % (self.proc.returncode,
                                                               self.read_log()))
            try:
                kvclient.Connection(self.sock, timeout_ms=2000).close()
                break
            except kvclient.KvdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # The admin socket is bound after the client socket and accepts from listen() on: wait
        # until it does (a first admin command could land in between under load).
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.admin_sock)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            finally:
                s.close()

    def read_log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def admin(self, command):
        """One admin command (docs/ADMIN.md line protocol); returns the reply's result."""
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
        reply = json.loads(data)
        assert reply["ok"], reply
        return reply["result"]

    def connect(self, **kw):
        kw.setdefault("timeout_ms", 10000)
        return kvclient.Connection(self.sock, **kw)

    def alive(self):
        """Running, or killed on purpose (kill)."""
        return self.killed or self.proc.poll() is None

    def kill(self):
        """Kills kvd (a restart test); the fixture does not count it as a death."""
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kvd():
    """One daemon for the tests that only need isolation by model id (the fast default)."""
    d = Daemon()
    yield d
    alive = d.alive()
    log = d.read_log()
    d.stop()
    assert alive, "kvd died during the session:\n" + log[-4000:]


@pytest.fixture
def kvd_factory():
    """start(**options) -> a Daemon of its own for the test (killed at its end)."""
    started = []

    def start(**options):
        d = Daemon(**options)
        started.append(d)
        return d
    yield start
    dead = [d for d in started if not d.alive()]
    logs = [d.read_log() for d in dead]
    for d in started:
        d.stop()
    assert not dead, "kvd died during the test:\n" + logs[0][-4000:]


@pytest.fixture
def conn(kvd):
    c = kvd.connect(client_name="pytest")
    yield c
    c.close()


_ids = itertools.count()


@pytest.fixture
def model_id(request):
    """A model id no other test uses (so pools on the shared daemon start empty)."""
    return "m-%s-%d-%d" % (request.node.name[:40], os.getpid(), next(_ids))


def run_python(code, *args, timeout=60):
    """Runs code in a fresh python3 (same library and package) with args as sys.argv[1:];
    returns its stdout (bytes); fails the test with its stderr when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PYROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    p = subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], env=env,
                       capture_output=True, timeout=timeout, preexec_fn=_die_with_parent)
    assert p.returncode == 0, "child failed (rc %d):\n%s\n%s" % (
        p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))
    return p.stdout


def wait_until(pred, timeout=5.0, step=0.01):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)
