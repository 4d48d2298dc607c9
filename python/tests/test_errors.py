"""KvdError: one subclass per kv_err code, raised by every failing call with kvd's message."""

import os
import subprocess
import sys

import pytest

import kvclient
from kvclient import errors

from conftest import PYROOT


def test_one_class_per_code_with_the_library_names():
    seen = set()
    for code in range(1, 23):
        cls = errors.error_class(code)
        assert cls is not kvclient.KvdError and issubclass(cls, kvclient.KvdError)
        assert cls.code == code and cls not in seen
        seen.add(cls)
        e = cls()
        assert e.code == code
        assert e.name == kvclient._lib.lib.kvc_err_name(code).decode()
        assert e.message == kvclient._lib.lib.kvc_strerror(code).decode()
    assert errors.error_class(999) is kvclient.KvdError
    assert errors.error_class(3) is kvclient.KvdNoSpace
    assert errors.error_class(8) is kvclient.KvdQuotaExceeded
    assert errors.error_class(6) is kvclient.KvdPermission
    assert errors.error_class(5) is kvclient.KvdStale
    assert errors.error_class(12) is kvclient.KvdEpoch
    assert errors.error_class(14) is kvclient.KvdClosed
    assert errors.error_class(9) is kvclient.KvdProtocol
    assert errors.error_class(1) is kvclient.KvdInvalid
    assert errors.error_class(4) is kvclient.KvdNotFound
    # Python's own families where they fit
    assert issubclass(kvclient.KvdInvalid, ValueError)
    assert issubclass(kvclient.KvdSystem, OSError)
    assert issubclass(kvclient.KvdTimeout, TimeoutError)
    assert issubclass(kvclient.KvdClosed, ConnectionError)
    assert issubclass(kvclient.KvdDetached, kvclient.KvdState)


def test_connect_failure_names_the_socket(kvd):
    path = os.path.join(os.path.dirname(kvd.sock), "absent.sock")
    with pytest.raises(kvclient.KvdSystem) as ei:
        kvclient.Connection(path)
    assert ei.value.code == 13 and path in str(ei.value) and "No such file" in str(ei.value)
    with pytest.raises(kvclient.KvdProtocol) as ei:
        kvclient.Connection(kvd.admin_sock)
    assert "admin socket" in ei.value.message


def test_daemon_refusals_carry_kvds_message(kvd, model_id):
    a, b = kvd.connect(client_name="a"), kvd.connect(client_name="b")
    try:
        pa = a.attach(model_id, layers=1, kv_heads=1, head_dim=8, tokens_per_block=4)
        pb = b.attach(model_id, layers=1, kv_heads=1, head_dim=8, tokens_per_block=4)
        blk = pa.allocate(1)
        h = pa.hash_tokens([1, 2, 3, 4])
        with pytest.raises(kvclient.KvdPermission) as ei:
            pb.commit(blk, h)  # another session's lease
        assert "not held by this session" in str(ei.value) and ei.value.call == "commit"
        bid, gen = blk[0]
        with pytest.raises(kvclient.KvdStale) as ei:
            pa.release(kvclient.Blocks.of([(bid, gen + 5)]))
        assert "stale" in ei.value.message
        with pytest.raises(kvclient.KvdNotFound) as ei:
            pa.release(kvclient.Blocks.of([(10 ** 6, 0)]))
        assert "does not exist" in ei.value.message
        with pytest.raises(kvclient.KvdState):
            pa.pin(blk, 1000)  # not committed
        with pytest.raises(kvclient.KvdTooBig) as ei:
            pa.allocate(100000)
        assert "100000" in ei.value.message
        with pytest.raises(kvclient.KvdInvalid) as ei:
            a.attach(model_id + "x", layers=0, kv_heads=1, head_dim=8)
        assert "num_layers" in ei.value.message
        with pytest.raises(kvclient.KvdInvalid):
            pa.hash_tokens([1, 2, 3, 4], extra=b"x" * 300)
        with pytest.raises(kvclient.KvdTooBig):
            pa.sequence(4).prefill(list(range(10)))
        # the message of the KvdError is the daemon's, not the fixed description
        assert ei.value.description != ei.value.message
        pa.release(blk)
    finally:
        a.close()
        b.close()


def test_no_space_from_a_small_pool(kvd_factory, model_id):
    d = kvd_factory(pool_memory="1M", segment_bytes="64K")
    with d.connect() as c:
        p = c.attach(model_id, layers=4, kv_heads=4, head_dim=64, tokens_per_block=16)
        held = []
        with pytest.raises(kvclient.KvdNoSpace) as ei:
            for _ in range(1000):
                held.append(p.allocate(4))
        assert ei.value.code == 3 and ei.value.name == "ENOSPC"
        assert held  # some fit before


def test_detached_and_closed_objects_raise(kvd, model_id):
    c = kvd.connect()
    p = c.attach(model_id, layers=1, kv_heads=1, head_dim=8)
    s = p.sequence(64)
    p.detach()
    for f in (lambda: p.allocate(1), lambda: p.lookup(kvclient.Hashes(0)), lambda: p.segments,
              lambda: s.prefill([1, 2]), lambda: len(s), lambda: p.block_view(0, 0, 0)):
        with pytest.raises(kvclient.KvdDetached):
            f()
    c.close()
    with pytest.raises(kvclient.KvdDetached):
        c.ping()
    with pytest.raises(kvclient.KvdDetached):
        c.attach(model_id, layers=1, kv_heads=1, head_dim=8)


def test_library_lookup_error_names_what_was_tried(tmp_path):
    env = dict(os.environ, KVCLIENT_LIBRARY=str(tmp_path / "nope.so"),
               PYTHONPATH=PYROOT)
    p = subprocess.run([sys.executable, "-c", "import kvclient"], env=env, capture_output=True)
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "ImportError" in err and "nope.so" in err and "KVCLIENT_LIBRARY" in err
    # a library that is not libkvclient is refused too
    env["KVCLIENT_LIBRARY"] = "libc.so.6"
    p = subprocess.run([sys.executable, "-c", "import kvclient"], env=env, capture_output=True)
    assert p.returncode != 0 and b"not libkvclient" in p.stderr
