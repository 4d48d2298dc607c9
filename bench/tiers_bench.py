"""bench/tiers_bench.py KVD — lower-tier copy bandwidth against its baselines, same run, same bytes.

For each of RUNS runs, one kvd (-c opt) per tier:
  T1: tier1-memory on, write-through: N blocks committed are copied T0 -> T1 by the copy threads;
      `evict all` drops them from T0; one Fetch copies them T1 -> T0.
  T2: tier1-memory 0, tier2-path in a directory of this machine's /tmp: T0 -> T2 writes, then a
      Fetch reads them back (O_DIRECT where the file system takes it).
Bandwidth of a tier = bytes moved / copy-thread time (the daemon's copy_bytes_* / copy_ns_*
counters: per-copy bandwidth, every job timed on its own thread). Baselines, measured in the
same run on the same sizes: memcpy (numpy copyto between two warm buffers; for the cold round's
copies down, from a second mapping of a memfd that has not touched it into buffers never
touched, the faults a cold round's copy takes), and pwrite/pread of the same slot-sized,
4096-aligned buffers to a file in the same directory with the same O_DIRECT flag (for the cold
writes, from such a second mapping). Prints
markdown (bench/run.sh records it in bench/RESULTS.md); the target (>= 0.9x) is met only when
the worst run meets it. The copy table runs under the system's shmem THP mode and again under
`advise` (docs/ARCHITECTURE.md, "Huge pages"; set for that table, as root, and put back). Then: hit rates on a trace whose working set is 4x T0, TTFT from T1 / T2
in the example engine, and the Lookup path's cost with tiers on (rpc_bench's timed pairs, and
the instructions per Lookup counted by callgrind where valgrind is installed).
"""

import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "pyclient"))
os.environ.setdefault("KVDWIRE_PROTO_DIR", os.path.join(HERE, "..", "proto"))

import numpy as np  # noqa: E402

import kvdwire as kw  # noqa: E402
from kvdwire import pb  # noqa: E402

RUNS = int(os.environ.get("TIERS_RUNS", "5"))
# 192 blocks (384 MiB) a round: a warm T1 round of 48 (96 MiB) took about 6 ms, so one
# descheduling of a copy thread on a shared 2-vCPU VM moved its ratio by a third (warm demotion
# 0.81-1.10x memcpy over 4 daemons of 48 blocks, 1.26-1.31x over 4 of 192, same hour, shmem THP
# advise).
NBLOCKS = 192
# 32 layers x 8 kv heads x 128 dims x 16 tokens fp16, block-major: 2 MiB blocks, one run each.
LAYOUT = kw.Layout(32, 8, 128, 16, pb.FP16, pb.BLOCK_MAJOR)
BB = LAYOUT.block_bytes


class Kvd:
    def __init__(self, binary, tmp, **opts):
        tmp = tempfile.mkdtemp(prefix="d", dir=tmp)  # a fresh socket path per daemon
        self.dir = tmp
        self.sock = os.path.join(tmp, "kvd.sock")
        self.admin_sock = os.path.join(tmp, "admin.sock")
        base = {"backend": "host", "socket": self.sock, "admin_socket": self.admin_sock,
                "pool_memory": "256M", "segment_bytes": "32M", "log_level": "warn",
                "tier_write": "write-through", "fetch_min_tokens": "1"}
        base.update(opts)
        args = [binary] + ["--%s=%s" % (k.replace("_", "-"), v) for k, v in base.items()]
        self.log = open(os.path.join(tmp, "kvd.log"), "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not (os.path.exists(self.sock) and os.path.exists(self.admin_sock)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvd did not start: " + open(self.log.name).read())
            time.sleep(0.01)

    def admin(self, cmd):
        import json
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.admin_sock)
        s.sendall(cmd.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            data += s.recv(1 << 20)
        s.close()
        r = json.loads(data)
        assert r["ok"], r
        return r["result"]

    def tiers(self):
        return self.admin("stats")["tiers"]

    def settle(self):
        deadline = time.monotonic() + 60
        while self.tiers()["jobs_inflight"] != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("copies did not finish")
            time.sleep(0.005)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def round_trip(d, tier, base):
    """Commits NBLOCKS blocks of tokens from `base` (copied down, write-through), evicts them
    from T0, fetches them back (up), checks every byte; returns the tier's counters after."""
    c = kw.Conn(d.sock)
    c.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool = c.attach("bench-tiers", LAYOUT)
    # The previous round's blocks leave T0, so this round writes into T0 blocks the daemon has
    # touched before (a running daemon's steady state; a new segment's pages fault in once on
    # the daemon's side too, which the cold round shows).
    d.admin("evict all")
    r = c.allocate(pool.pool_id, NBLOCKS)
    pool.follow(r)
    blocks = kw.reply_blocks(r)
    toks = list(range(base, base + NBLOCKS * LAYOUT.tokens_per_block))
    hashes = kw.hash_chain(pool.hash_seed, toks, LAYOUT.tokens_per_block, b"", pool.hash_algo)
    rng = np.random.default_rng(base + 1)
    pats = []
    for (bid, _), _h in zip(blocks, hashes):
        p = rng.integers(0, 1 << 16, BB // 2, dtype=np.uint16).tobytes()
        pool.write_block(bid, p)
        pats.append(p)
    entries, parent = [], kw.NO_PARENT
    for b, h in zip(blocks, hashes):
        entries.append((b, h, parent))
        parent = b[0]
    canon = c.commit(pool.pool_id, entries)
    c.release(pool.pool_id, canon)
    d.settle()
    d.admin("evict all")
    fr = c.fetch(pool.pool_id, hashes)
    pool.follow(fr)
    got = kw.reply_blocks(fr)
    assert fr.status == pb.FETCH_DONE and len(got) == NBLOCKS and fr.promoted == NBLOCKS, fr
    for (bid, _), p in zip(got, pats):
        assert pool.read_block(bid) == p
    c.release(pool.pool_id, got)
    st = d.tiers()
    c.close()
    return st


def rates(before, after, tier):
    """(down per-copy, down throughput, up per-copy, up throughput) in GB/s between two
    counter snapshots: per-copy = bytes / copy-thread time; throughput = bytes / wall time
    while such copies were in flight (the copy threads together)."""
    def d(k):
        return after[k] - before.get(k, 0)
    t = "t%d" % tier
    out = []
    for way in ("down", "up"):
        b = d("copy_bytes_%s_%s" % (way, t))
        out.append(b / d("copy_ns_%s_%s" % (way, t)))
        out.append(b / d("copy_busy_ns_%s_%s" % (way, t)))
    return out


def huge_arrays(n):
    """n arrays of BB bytes in one anonymous mapping that asks for transparent huge pages
    (granted where the kernel's THP mode for anonymous memory is madvise or always)."""
    m = mmap.mmap(-1, n * BB + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    whole = np.frombuffer(m, dtype=np.uint8)
    skip = (-whole.ctypes.data) % (2 << 20)  # the first 2 MiB boundary
    return [whole[skip + i * BB:skip + (i + 1) * BB] for i in range(n)]


class SecondMapping:
    """n pieces of `piece` bytes (default BB) in a memfd, written through one shared mapping, and
    `views` of them through a second mapping that has touched nothing yet: what kvd's copy thread
    meets when it first reads a T0 block a client wrote (its own mapping of the segment faults
    each page in on first access). Both mappings ask for huge pages, as kvd's and libkvclient's
    do."""

    def __init__(self, n, piece=BB):
        size = n * piece
        self.fd = os.memfd_create("kvd-tiers-bench")
        os.ftruncate(self.fd, size)
        self.a = mmap.mmap(self.fd, size)
        self.b = mmap.mmap(self.fd, size)
        for m in (self.a, self.b):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):
                pass
        words = np.frombuffer(self.a, dtype=np.uint64)
        words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        del words
        self.whole = np.frombuffer(self.b, dtype=np.uint8)
        self.views = [self.whole[i * piece:(i + 1) * piece] for i in range(n)]

    def close(self):
        self.views = None
        self.whole = None
        self.a.close()
        self.b.close()
        os.close(self.fd)


def memcpy_gbps(kind):
    """One thread's memcpy (numpy copyto) GB/s. kind "blocks": NBLOCKS distinct blocks into
    NBLOCKS distinct buffers touched before (the bytes a round moves, as a warm T1 copy writes
    them: the baseline); "fresh": into a freshly allocated buffer each (its pages fault in);
    "cold": from a mapping of shared memory that has not touched it yet into buffers that have
    never been touched (SecondMapping; the work of a cold round's T0 -> T1 copy, which reads a
    new segment through the daemon's mapping for the first time into new T1 buffers: the cold
    rows' baseline); "cached": one block into one buffer NBLOCKS times (both stay in the caches:
    an upper reference, not the same bytes)."""
    rng = np.random.default_rng(7)
    nsrc = 1 if kind == "cached" else NBLOCKS
    if kind == "cold":
        src = SecondMapping(NBLOCKS)
        try:
            dst = huge_arrays(NBLOCKS)  # never touched: each page faults in, as a new T1 buffer's
            ns = 0
            for i in range(NBLOCKS):
                t0 = time.perf_counter_ns()
                np.copyto(dst[i], src.views[i])
                ns += time.perf_counter_ns() - t0
        finally:
            src.close()
        return NBLOCKS * BB / ns
    # In 2 MiB-aligned mappings that ask for huge pages, as kvd's T1 buffers and (where shmem
    # THP allows) its T0 blocks do: the baseline gets the page size kvd gets at best.
    src = huge_arrays(nsrc)
    dst = huge_arrays(nsrc)
    for a in src:
        a[:] = rng.integers(0, 256, BB, dtype=np.uint8)
    for a, b in zip(dst, src):
        np.copyto(a, b)  # touched before, as a recycled T1 buffer
    ns = 0
    for i in range(NBLOCKS):
        k = i % nsrc
        if kind == "fresh":
            dst[k] = np.empty(BB, dtype=np.uint8)  # malloc'd fresh: its pages fault in
        t0 = time.perf_counter_ns()
        np.copyto(dst[k], src[k])
        ns += time.perf_counter_ns() - t0
    return NBLOCKS * BB / ns


def raw_disk_gbps(directory, slot):
    """The raw disk loop: one synchronous pwrite a slot, NBLOCKS slots of a fresh file, then one
    pread a slot, O_DIRECT when taken; from and into NBLOCKS distinct slot-sized buffers (the
    bytes a round moves, each where kvd's T0 holds its block), then again from and into one
    buffer (cache-resident: a reference, as dd runs). The buffers are shared anonymous memory
    (shmem, as T0 segments are) that asks for huge pages as kvd's mappings do, so both sides get
    the same page size. Returns (write GB/s, read GB/s, one-buffer write, one-buffer read,
    O_DIRECT taken)."""
    path = os.path.join(directory, "raw.bin")
    flags = os.O_RDWR | os.O_CREAT
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags | direct, 0o600)
    except OSError:
        fd, direct = os.open(path, flags, 0o600), 0
    m = mmap.mmap(-1, NBLOCKS * slot)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    words = np.frombuffer(m, dtype=np.uint64)
    words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # distinct
    bufs = [memoryview(m)[i * slot:(i + 1) * slot] for i in range(NBLOCKS)]
    out = []
    for same in (False, True):
        wns = rns = 0
        for i in range(NBLOCKS):
            t0 = time.perf_counter_ns()
            os.pwritev(fd, [bufs[0 if same else i]], 4096 + i * slot)
            wns += time.perf_counter_ns() - t0
        for i in range(NBLOCKS):
            t0 = time.perf_counter_ns()
            os.preadv(fd, [bufs[0 if same else i]], 4096 + i * slot)
            rns += time.perf_counter_ns() - t0
        out += [NBLOCKS * BB / wns, NBLOCKS * BB / rns]
    os.close(fd)
    os.unlink(path)
    for v in bufs:
        v.release()
    del words
    m.close()
    return out[0], out[1], out[2], out[3], bool(direct)


def raw_write_cold_gbps(directory, slot):
    """The raw write loop of raw_disk_gbps (one synchronous pwrite of a whole slot each, NBLOCKS
    slots of a fresh file) from slots that the writing mapping has not touched yet
    (SecondMapping: each O_DIRECT pwrite faults its pages in first), the work of a cold round's
    T0 -> T2 writes, which read a new segment through the daemon's mapping for the first time:
    the cold write row's baseline. Same file flags; GB/s of the blocks' bytes, as
    raw_disk_gbps counts. Measured once a run, just before the T2 daemon starts."""
    path = os.path.join(directory, "raw-cold.bin")
    flags = os.O_RDWR | os.O_CREAT
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    src = SecondMapping(NBLOCKS, slot)
    try:
        ns = 0
        for i in range(NBLOCKS):
            v = memoryview(src.b)[i * slot:(i + 1) * slot]
            t0 = time.perf_counter_ns()
            os.pwritev(fd, [v], 4096 + i * slot)
            ns += time.perf_counter_ns() - t0
            v.release()
    finally:
        os.close(fd)
        os.unlink(path)
        src.close()
    return NBLOCKS * BB / ns


THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def thp_mode():
    """The kernel's shmem THP mode (the bracketed word), or None where it cannot be read."""
    try:
        line = open(THP).read()
    except OSError:
        return None
    a, b = line.find("["), line.find("]")
    return line[a + 1:b] if 0 <= a < b else None


def set_thp(mode):
    """Sets the shmem THP mode; False where this process may not (not root, read-only sysfs)."""
    try:
        with open(THP, "w") as f:
            f.write(mode)
    except OSError:
        return False
    return thp_mode() == mode


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop("signal %d" % signum)


def copies():
    """The copy table under this system's shmem THP mode and (TIERS_SHMEM_THP, default `advise`;
    empty: not) under the mode docs/ARCHITECTURE.md ("Huge pages") recommends. The modes take
    turns within each run (the order alternating from run to run), the bench setting the other
    mode for its part of a run (root only) and putting the system's back after it, on an error
    and on SIGTERM / SIGHUP too; where it cannot set it, that table is skipped and said so."""
    import signal
    system = thp_mode()
    modes = [system]
    want = os.environ.get("TIERS_SHMEM_THP", "advise")
    skipped = None
    if want and system is not None and want != system:
        if os.geteuid() == 0 and os.access(THP, os.W_OK):
            modes.append(want)
        else:
            skipped = want
    rows = {m: new_rows() for m in modes}
    old = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    direct = False
    try:
        for run in range(RUNS):
            for m in (modes if run % 2 == 0 else modes[::-1]):
                try:
                    if m != system and not set_thp(m):
                        raise RuntimeError("could not set %s to %s" % (THP, m))
                    direct = one_run(sys.argv[1], rows[m])
                finally:
                    if thp_mode() != system and not set_thp(system):
                        print("tiers_bench: could not put %s back to %s: set it by hand"
                              % (THP, system), file=sys.stderr)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    for m in modes:
        print("#### Copy bandwidth, shmem THP `%s` (%s)" % (
            m, "this system's setting" if m == system else
            "set by the bench for its part of each run, then put back to `%s`" % system))
        print()
        print_table(rows[m], direct, len(modes))
        print()
    if skipped:
        print("The table under shmem THP `%s` was skipped: this process cannot set %s (not root?)."
              % (skipped, THP))
        print()


def new_rows():
    rows = {}
    for k in ("t1_cold", "t1_warm", "t2_cold", "t2_warm"):
        for m in ("down_copy", "down_tput", "up_copy", "up_tput"):
            rows["%s_%s" % (k, m)] = []
    for k in ("memcpy", "memcpy_fresh", "memcpy_cold", "memcpy_cached", "raw_w", "raw_r",
              "raw_w_cold", "raw_r_cold", "raw_w_warm", "raw_r_warm", "raw_w_one", "raw_r_one",
              "raw_w_fresh"):
        rows[k] = []
    return rows


def one_run(binary, rows):
    """One run: a T1 daemon's two rounds, the memcpy baselines, a T2 daemon's two rounds between
    raw disk loops; appends to rows. Returns whether O_DIRECT was taken."""
    tmp = tempfile.mkdtemp(prefix="kvdtb.", dir="/tmp")
    try:
        # T1 holds exactly one round: the second round's copies recycle the first's buffers.
        d = Kvd(binary, tmp, tier1_memory=str(NBLOCKS * BB + (1 << 20)),
                pool_memory=str(3 * NBLOCKS * BB))
        try:
            s1 = round_trip(d, 1, 0)
            s2 = round_trip(d, 1, 10 ** 7)
        finally:
            d.stop()
        for phase, (a, b) in (("cold", ({}, s1)), ("warm", (s1, s2))):
            v = rates(a, b, 1)
            for m, x in zip(("down_copy", "down_tput", "up_copy", "up_tput"), v):
                rows["t1_%s_%s" % (phase, m)].append(x)
        rows["memcpy"].append(memcpy_gbps("blocks"))
        rows["memcpy_fresh"].append(memcpy_gbps("fresh"))
        rows["memcpy_cold"].append(memcpy_gbps("cold"))
        rows["memcpy_cached"].append(memcpy_gbps("cached"))
        t2 = os.path.join(tmp, "t2")
        slot = (64 + BB + 4095) // 4096 * 4096
        # The raw loop runs just before, between and just after the two rounds (this VM's
        # disk rate drifts from minute to minute): each round's baseline is the mean of the
        # loops on either side of it.
        raw = [raw_disk_gbps(tmp, slot)]
        rows["raw_w_fresh"].append(raw_write_cold_gbps(tmp, slot))
        d = Kvd(binary, tmp, tier1_memory="0", tier2_path=t2,
                tier2_bytes=str(3 * NBLOCKS * (BB + 4096)), pool_memory=str(3 * NBLOCKS * BB))
        try:
            s1 = round_trip(d, 2, 0)
            raw.append(raw_disk_gbps(tmp, slot))
            s2 = round_trip(d, 2, 10 ** 7)
            raw.append(raw_disk_gbps(tmp, slot))
        finally:
            d.stop()
        for phase, (a, b), k in (("cold", ({}, s1), 0), ("warm", (s1, s2), 1)):
            v = rates(a, b, 2)
            for m, x in zip(("down_copy", "down_tput", "up_copy", "up_tput"), v):
                rows["t2_%s_%s" % (phase, m)].append(x)
            rows["raw_w_" + phase].append((raw[k][0] + raw[k + 1][0]) / 2)
            rows["raw_r_" + phase].append((raw[k][1] + raw[k + 1][1]) / 2)
        rows["raw_w"].append(sum(x[0] for x in raw) / 3)
        rows["raw_r"].append(sum(x[1] for x in raw) / 3)
        rows["raw_w_one"].append(sum(x[2] for x in raw) / 3)
        rows["raw_r_one"].append(sum(x[3] for x in raw) / 3)
        return raw[0][4]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(rows, direct, nmodes):
    def ratio(a, b):
        return [x / y for x, y in zip(rows[a], rows[b])]

    def fmt(v):
        v = sorted(v)
        return "%.2f (%.2f-%.2f)" % (v[len(v) // 2], v[0], v[-1])

    print("%d runs%s; each moves %d blocks of %d KiB (layout 32x8x128x16 fp16 block-major, raw "
          "format) down (write-through at commit) and back up (one Fetch after `evict all`), "
          "twice per daemon: *cold* is the first round (new T0 segments, T1 buffers and copy-thread "
          "scratch fault in on first touch), *warm* the second (T1 holds one round, so its copies "
          "recycle the first round's buffers, and the round reuses T0 blocks the daemon touched "
          "before: a running daemon's steady state). GB/s as median (min-max). "
          "Throughput = bytes / wall time while copies of that kind were in flight (libuv's 4 "
          "copy threads together, on %d cores); per copy = bytes / each job's own time."
          % (RUNS, " (taking turns with the other table's, run by run)" if nmodes > 1 else "",
             NBLOCKS, BB // 1024, os.cpu_count()))
    print("T2 and its baseline in a directory under /tmp, O_DIRECT %s; the T2 baseline of a "
          "round is the mean of the raw loops run just before and just after it (the loops "
          "write a fresh file, one synchronous pwrite a slot, each slot from a buffer of its own "
          "in shared memory that asks for huge pages as kvd's T0 does, then read it back into "
          "the same buffers)."
          % ("on" if direct else "off (refused)"))
    print()
    print("| copy | phase | kvd throughput | kvd per copy | baseline | baseline GB/s | "
          "ratio (throughput) | target | met (worst run) |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = (("T0 -> T1", "t1", "down", "memcpy", "memcpy of the round's blocks (one thread)"),
             ("T1 -> T0 (Fetch)", "t1", "up", "memcpy", "memcpy of the round's blocks (one thread)"),
             ("T0 -> T2", "t2", "down", "raw_w", "pwrite of the same slots"),
             ("T2 -> T0 (Fetch)", "t2", "up", "raw_r", "pread of the same slots"))
    # A cold round's copies down read T0 through a mapping that has not touched it and write
    # into memory never touched (T1) or pin pages not yet mapped (T2): their baselines do the same
    # (memcpy_gbps("cold"), raw_write_cold_gbps). The warm baseline of those rows is printed
    # below the table.
    cold_base = {("t1", "down"): ("memcpy_cold", "memcpy from a second, untouched mapping into "
                                  "untouched buffers"),
                 ("t2", "down"): ("raw_w_fresh", "pwrite of the same slots from a second, "
                                  "untouched mapping")}
    for name, tier, way, base0, bname in table:
        for phase in ("cold", "warm"):
            k = "%s_%s_%s" % (tier, phase, way)
            base = base0 if tier == "t1" else "%s_%s" % (base0, phase)
            bn = bname
            if phase == "cold" and (tier, way) in cold_base:
                base, bn = cold_base[(tier, way)]
            r = ratio(k + "_tput", base)
            print("| %s | %s | %s | %s | %s | %s | %s | >= 0.9x | %s |" % (
                name, phase, fmt(rows[k + "_tput"]), fmt(rows[k + "_copy"]), bn,
                fmt(rows[base]), fmt(r),
                "yes" if min(r) >= 0.9 else "no (worst %.2f)" % min(r)))
    print()
    print("Baseline: one thread's memcpy (numpy) of %d distinct %d KiB blocks into %d distinct "
          "buffers touched before, all in mappings that ask for huge pages (the bytes a round "
          "moves, where a warm round writes them). The cold copies down have baselines that do "
          "a cold round's work (since 2026-12-07 07:01Z; before, every T1 row had the warm "
          "memcpy): the blocks in a memfd written through one mapping and read through a second "
          "one that has not touched them, as kvd's copy thread first reads a new T0 segment, "
          "into buffers never touched (T1) or pwritten with the file's flags (T2). The cold rows "
          "against the warm baselines instead: T0 -> T1 %s, T0 -> T2 %s. Same run: memcpy into "
          "a freshly malloc'd buffer each (small pages) %s GB/s; one block into one buffer %d "
          "times (cache-resident, not the same bytes; the baseline of runs before 2026-12-02) "
          "%s GB/s."
          % (NBLOCKS, BB // 1024, NBLOCKS, fmt(ratio("t1_cold_down_tput", "memcpy")),
             fmt(ratio("t2_cold_down_tput", "raw_w_cold")), fmt(rows["memcpy_fresh"]), NBLOCKS,
             fmt(rows["memcpy_cached"])))
    print()
    print("The raw loop from and into one buffer instead (cache-resident, as dd runs; a "
          "reference, not the same bytes' places; the baseline of runs before 2026-12-07 05:16Z): "
          "pwrite %s GB/s, pread %s GB/s." % (fmt(rows["raw_w_one"]), fmt(rows["raw_r_one"])))


# ---- hit rate on a trace whose working set is 4x T0 ------------------------------------------

TRACE_LAYOUT = kw.Layout(2, 2, 8, 16, pb.FP16, pb.LAYER_MAJOR)  # 2 KiB blocks
DOCS, DOC_BLOCKS, REQUESTS = 64, 16, 3000  # 1024 distinct blocks


def trace(seed):
    """Requests as document numbers: a skewed popularity (a few hot documents, a long tail),
    each request reading its document's whole prefix (RAG chunks, long system prompts)."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, DOCS + 1) ** 0.6
    return rng.choice(DOCS, size=REQUESTS, p=w / w.sum())


def replay(d, docs):
    """Each request: Fetch its prefix (T0 hits + what comes up from below), compute and commit
    the rest, release. Returns (hit blocks from T0, promoted blocks, requested blocks)."""
    c = kw.Conn(d.sock)
    c.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
    pool = c.attach("bench-trace", TRACE_LAYOUT)
    t = TRACE_LAYOUT.tokens_per_block
    chains = {}
    t0 = up = asked = 0
    for k, doc in enumerate(docs):
        hs = chains.get(doc)
        if hs is None:
            toks = list(range(doc * 100000, doc * 100000 + DOC_BLOCKS * t))
            hs = chains[doc] = kw.hash_chain(pool.hash_seed, toks, t, b"", pool.hash_algo)
        fr = c.fetch(pool.pool_id, hs)
        pool.follow(fr)
        got = kw.reply_blocks(fr)
        if k >= REQUESTS // 5:  # the first fifth warms the cache
            t0 += fr.t0_hits
            up += fr.promoted
            asked += len(hs)
        held = list(got)
        if len(got) < len(hs):
            r = c.allocate(pool.pool_id, len(hs) - len(got))
            pool.follow(r)
            new = kw.reply_blocks(r)
            parent = got[-1][0] if got else kw.NO_PARENT
            entries = []
            for b, h in zip(new, hs[len(got):]):
                entries.append((b, h, parent))
                parent = b[0]
            held += c.commit(pool.pool_id, entries)
        c.release(pool.pool_id, held)
    c.close()
    return t0, up, asked


def hit_rates(binary):
    """T0 only, T0+T1, T0+T1+T2 (T1 too small for the working set), same trace each."""
    rows = []
    cap_t0 = 256  # blocks: a quarter of the working set
    for name, extra in (("T0 only", {}),
                        ("T0 + T1", {"tier1_memory": str(4 * cap_t0 * 2048)}),
                        ("T0 + T1 + T2", {"tier1_memory": str(cap_t0 * 2048),
                                          "tier2_bytes": "64M"})):
        res = []
        for run in range(3):
            tmp = tempfile.mkdtemp(prefix="kvdtr.", dir="/tmp")
            try:
                opts = {"pool_memory": str(cap_t0 * (2048 + 64) + 8192),
                        "segment_bytes": str(64 * 2048), "fetch_min_tokens": "16"}
                opts.update(extra)
                if "tier2_bytes" in opts:
                    opts["tier2_path"] = os.path.join(tmp, "t2")
                d = Kvd(binary, tmp, **opts)
                try:
                    t0, up, asked = replay(d, trace(100 + run))
                    st = d.tiers()
                finally:
                    d.stop()
                res.append((t0 / asked, (t0 + up) / asked, st["dirty_drops"]))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        rows.append((name, res))
    return rows


def ttft(binary):
    """kve_run (examples/engine, model big, 1024-token prompt): TTFT of the prompt computed,
    against the same prompt whose blocks were evicted from T0 and come back from T1 or T2."""
    run_bin = os.path.join(os.path.dirname(os.path.dirname(binary)), "examples", "engine",
                           "kve_run")
    if not os.path.exists(run_bin):
        return None
    out = {"computed": [], "T1": [], "T2": []}
    cached = {}
    for rep in range(3):
        for tier in ("T1", "T2"):
            tmp = tempfile.mkdtemp(prefix="kvdtt.", dir="/tmp")
            try:
                opts = {"pool_memory": "2G", "segment_bytes": "64M", "tier_write": "write-through"}
                if tier == "T1":
                    opts["tier1_memory"] = "2G"
                else:
                    opts.update(tier1_memory="0", tier2_path=os.path.join(tmp, "t2"),
                                tier2_bytes="4G")
                d = Kvd(binary, tmp, **opts)
                try:
                    args = [run_bin, "--socket", d.sock, "--model", "big", "--threads", "2",
                            "--prompt-len", "1024", "--prompt-seed", str(rep + 1), "--max-new",
                            "1", "--budget", "256"]

                    def stats(extra=()):
                        o = subprocess.run(args + list(extra), capture_output=True, text=True,
                                           check=True).stdout
                        line = [x for x in o.splitlines() if x.startswith("STATS")][0]
                        return dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
                    if tier == "T1":
                        out["computed"].append(float(stats(["--no-cache"])["ttft_sum_ms"]))
                    stats()  # computes and commits the prompt's blocks (copied down)
                    d.settle()
                    d.admin("evict all")
                    st = stats()
                    out[tier].append(float(st["ttft_sum_ms"]))
                    cached[tier] = int(st["cached_tokens"])
                finally:
                    d.stop()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out, cached


def print_trace_and_ttft(binary):
    print()
    print("#### Hit rate on a trace whose working set is 4x T0")
    print()
    print("%d documents of %d blocks (2 KiB blocks; 1024 distinct blocks), T0 holds 256; %d "
          "requests of a whole document each, popularity ~ 1/rank^0.6, the first fifth warming "
          "up; T1 of 1024 blocks (T0 + T1), or T1 of 256 blocks and T2 of 64 MiB (T0 + T1 + T2); "
          "write-back (the default); 3 traces (seeds 100-102), median (min-max)."
          % (DOCS, DOC_BLOCKS, REQUESTS))
    print()
    rows = hit_rates(binary)
    base = [r[0] for r in rows[0][1]]

    def fmt(v):
        v = sorted(v)
        return "%.3f (%.3f-%.3f)" % (v[len(v) // 2], v[0], v[-1])
    print("| tiers | hit rate in T0 | hit rate, T0 + fetched | x T0-only | dirty drops |")
    print("|---|---|---|---|---|")
    for name, res in rows:
        total = [r[1] for r in res]
        ratio = [a / b for a, b in zip(total, base)]
        print("| %s | %s | %s | %s | %s |" % (name, fmt([r[0] for r in res]), fmt(total),
                                               fmt(ratio), "/".join(str(r[2]) for r in res)))
    worst = min(a / b for a, b in zip([r[1] for r in rows[1][1]], base))
    print()
    print("Target: at least 2x the T0-only hit rate: %s (worst trace %.2fx with T0 + T1)."
          % ("met" if worst >= 2 else "not met", worst))
    r = ttft(binary)
    if r is None:
        return
    out, cached = r
    print()
    print("#### TTFT of a 1024-token prompt: recomputed vs fetched from T1 / T2 (example engine)")
    print()
    print("kve_run --model big --threads 2, the prompt computed and committed once, then "
          "`evict all` (write-through copies are down), then the same prompt again; 3 prompts.")
    print()
    print("| prompt | cached tokens | TTFT ms, median (min-max) | computed / this |")
    print("|---|---|---|---|")

    def f2(v):
        v = sorted(v)
        return "%.1f (%.1f-%.1f)" % (v[len(v) // 2], v[0], v[-1])
    print("| computed (no cache) | 0 | %s | 1 |" % f2(out["computed"]))
    for tier in ("T1", "T2"):
        rat = [a / b for a, b in zip(out["computed"], out[tier])]
        print("| fetched from %s | %d | %s | %s |" % (tier, cached.get(tier, 0), f2(out[tier]),
                                                    f2(rat)))


def lookup_cost(binary):
    """rpc_bench --only tiers: Lookup-128 + Release with tiers off vs on (nothing demoted)."""
    rpc = os.path.join(os.path.dirname(os.path.dirname(binary)), "bench", "rpc_bench")
    if not os.path.exists(rpc):
        return
    out = subprocess.run([rpc, "--kvd", binary, "--only", "tiers"], capture_output=True,
                         text=True, check=True).stdout
    print()
    print("#### Cost on the Lookup path (bench/rpc_bench --only tiers)")
    print(out.strip())


def callgrind_pairs(binary, tiers, n):
    """Instructions kvd ran (callgrind) for its start, one 128-block Commit and n Lookup-128 +
    Release pairs of one Python client, tiers off or on (T1 and T2, nothing demoted)."""
    tmp = tempfile.mkdtemp(prefix="kvdcg.", dir="/tmp")
    try:
        sock = os.path.join(tmp, "kvd.sock")
        out = os.path.join(tmp, "cg.out")
        args = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out, binary,
                "--socket=" + sock, "--admin-socket=" + os.path.join(tmp, "admin.sock"),
                "--log-level=warn", "--segment-bytes=4M", "--pool-memory=256M"]
        if tiers:
            args += ["--tier1-memory=256M", "--tier2-path=" + os.path.join(tmp, "t2"),
                     "--tier2-bytes=256M"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(sock):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvd under callgrind did not start")
                time.sleep(0.05)
            c = kw.Conn(sock)
            c.hello(features=kw.FEATURE_PACKED | kw.FEATURE_TIERS)
            pool = c.attach("bench-cg", TRACE_LAYOUT)
            r = c.allocate(pool.pool_id, 128)
            pool.follow(r)
            blocks = kw.reply_blocks(r)
            hashes = kw.hash_chain(pool.hash_seed, list(range(128 * 16)), 16, b"",
                                   pool.hash_algo)
            entries, parent = [], kw.NO_PARENT
            for b, h in zip(blocks, hashes):
                entries.append((b, h, parent))
                parent = b[0]
            c.release(pool.pool_id, c.commit(pool.pool_id, entries))
            for _ in range(n):
                got = kw.reply_blocks(c.lookup(pool.pool_id, hashes))
                assert len(got) == 128, len(got)
                c.release(pool.pool_id, got)
            c.close()
        finally:
            proc.terminate()
            proc.wait()
        for line in open(out):
            if line.startswith("summary:"):
                return int(line.split()[1])
        raise RuntimeError("no callgrind summary")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def lookup_instructions(binary, n=500):
    """The Lookup path's cost with tiers on, counted in instructions (callgrind): the timed rows
    above move several percent between fresh daemon pairs on a shared host; instructions do
    not. Per pair = (run with n pairs - run with none) / n, for tiers off and on."""
    if shutil.which("valgrind") is None:
        return
    per = {}
    for tiers in (False, True):
        per[tiers] = (callgrind_pairs(binary, tiers, n) - callgrind_pairs(binary, tiers, 0)) / n
    ratio = per[True] / per[False]
    print()
    print("Instructions kvd runs per Lookup-128 + Release (callgrind; one Python client, %d pairs "
          "after one 128-block Commit, less a run with none; T1 and T2 on, nothing demoted):"
          % n)
    print()
    print("| tiers off | tiers on | on / off | within 3% |")
    print("|---:|---:|---:|---|")
    print("| %.0f | %.0f | %.4f | %s |" % (per[False], per[True], ratio,
                                            "yes" if ratio <= 1.03 else "no"))


if __name__ == "__main__":
    copies()
    if os.environ.get("TIERS_SKIP_TRACE") != "1":
        print_trace_and_ttft(sys.argv[1])
        lookup_cost(sys.argv[1])
        lookup_instructions(sys.argv[1])
