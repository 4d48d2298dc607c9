#!/usr/bin/env bash
# bench/run.sh <name>... — runs benchmarks (built beforehand with -c opt; ./dev bench does) and
# records each one's markdown in its own section of bench/RESULTS.md, replacing the previous run.
# Add a benchmark: one case below that prints markdown on stdout. BENCH_BIN_DIR overrides where
# the binaries are (default bazel-bin/bench). With no name, runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN_DIR=${BENCH_BIN_DIR:-bazel-bin/bench}
RESULTS=bench/RESULTS.md
ALL=(core rpc host sched engine python tiers disk compress cluster)

run_one() {
    case "$1" in
        core) "$BIN_DIR/core_bench" --daemon "$BIN_DIR/../daemon/kvd" ;;
        rpc) "$BIN_DIR/rpc_bench" --kvd "$BIN_DIR/../daemon/kvd" ;;
        host) "$BIN_DIR/host_bench" --kvd "$BIN_DIR/../daemon/kvd" ;;
        sched) "$BIN_DIR/sched_bench" --kvd "$BIN_DIR/../daemon/kvd" ;;
        engine) bash examples/engine/bench.sh "$BIN_DIR/.." ;;
        tiers) /usr/bin/python3 bench/tiers_bench.py "$BIN_DIR/../daemon/kvd" ;;
        disk)
            # Twice, separate processes: this machine's raw disk rate changes between them.
            for k in 1 2; do
                printf '### Process %d\n\n' "$k"
                "$BIN_DIR/disk_bench" --rounds "${DISK_ROUNDS:-7}"
                printf '\n'
            done
            # A host pool's case: T0 a memfd that another process wrote just before each write.
            printf '### Process 3: T0 a memfd another process stored into just before each round\n\n'
            "$BIN_DIR/disk_bench" --rounds "${DISK_ROUNDS:-7}" --memfd --fresh
            printf '\n'
            ;;
        cluster)
            # The remote rows: 15 samples a size (their lower quartile is what the target is
            # held to); the events part: 7 runs.
            "$BIN_DIR/cluster_bench" --kvd "$BIN_DIR/../daemon/kvd" --runs "${CLUSTER_RUNS:-7}" \
                --remote-runs "${CLUSTER_REMOTE_RUNS:-15}"
            # The remote rows again with Llama-3-8B-sized blocks (32 layers: 2 MiB; 7 samples:
            # 15 would hold about 15 GB in Redis).
            CLUSTER_NO_EVENTS=1 CLUSTER_NO_LOOKUP=1 CLUSTER_NO_WRITE=1 "$BIN_DIR/cluster_bench" \
                --kvd "$BIN_DIR/../daemon/kvd" \
                --runs "${CLUSTER_RUNS:-7}" --block-layers 32
            bash bench/cluster_ttft.sh "$BIN_DIR/.."
            ;;
        compress)
            # The held-out text by the training script's own rule (no torch needed for it).
            local held
            held=$(mktemp)
            /usr/bin/python3 -c 'import sys; sys.path.insert(0, "examples/engine/train")
import train_model; open(sys.argv[1], "wb").write(train_model.corpus(train_model.CORPUS)[1])' "$held"
            "$BIN_DIR/compress_bench" --kvd "$BIN_DIR/../daemon/kvd" \
                --checkpoint examples/engine/models/lic.bin --text "$held" --runs "${COMPRESS_RUNS:-3}"
            rm -f "$held"
            "$BIN_DIR/ice_bench"
            ;;
        python) /usr/bin/python3 bench/python_bench.py "$BIN_DIR/../daemon/kvd" \
                    "$BIN_DIR/../client/shared/libkvclient.so" "$BIN_DIR/python_c_baseline" ;;
        *)
            echo "bench/run.sh: unknown benchmark '$1' (known: ${ALL[*]})" >&2
            return 2
            ;;
    esac
}

# Replaces the text between "<!-- bench:NAME:begin -->" and "<!-- bench:NAME:end -->" in
# RESULTS.md with the file $2 (appends the section when it is not there yet).
record() {
    local name=$1 body=$2 tmp
    tmp=$(mktemp)
    awk -v name="$name" -v body="$body" '
        BEGIN { b = "<!-- bench:" name ":begin -->"; e = "<!-- bench:" name ":end -->" }
        $0 == b { print; while ((getline line < body) > 0) print line; skip = 1; found = 1; next }
        $0 == e { skip = 0 }
        !skip { print }
        END {
            if (!found) {
                print ""; print b
                while ((getline line < body) > 0) print line
                print e
            }
        }' "$RESULTS" > "$tmp"
    mv "$tmp" "$RESULTS"
}

names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ALL[@]}")
[ -f "$RESULTS" ] || printf '# Benchmark results\n' > "$RESULTS"
for name in "${names[@]}"; do
    out=$(mktemp)
    {
        echo "## $name"
        echo
        echo "Run $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) CPUs," \
             "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')," \
             "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
             "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
        echo
        run_one "$name"
    } | tee "$out"
    record "$name" "$out"
    rm -f "$out"
done
