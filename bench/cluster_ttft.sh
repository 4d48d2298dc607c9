#!/usr/bin/env bash
# bench/cluster_ttft.sh BIN_ROOT — cross-node TTFT (issue 17): two kvd daemons ("nodes" A and B,
# each with its own socket, T1 and the same redis-server as remote tier) and the example engine
# (kve_run). A's engine computes a 4096-token prompt (its blocks go down to T1 and on to Redis);
# B's engine then runs a prompt sharing the first 4088 tokens: its prefill Fetches them from
# Redis instead of recomputing. Prints markdown for bench/RESULTS.md's cluster section.
set -euo pipefail
BIN=${1:?bin root}
RUN=$BIN/examples/engine/kve_run
DIR=$(mktemp -d /tmp/kvttft.XXXXXX)
PORT=$((21000 + $$ % 20000))
redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$DIR" >/dev/null &
RS=$!
pids=("$RS")
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
kv() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" | awk 'NR == 1'; }
REPS=${CLUSTER_TTFT_REPS:-3}
rows=()
for r in $(seq "$REPS"); do
    # Fresh nodes and an empty Redis each round: A computes, B has nothing but Redis.
    redis-cli -p "$PORT" flushall >/dev/null
    node=()
    for n in a b; do
        rm -f "$DIR/$n.sock"
        "$BIN/daemon/kvd" --socket="$DIR/$n.sock" --admin-socket="$DIR/$n.admin" \
            --log-level=warn --backend=host --pool-memory=1G --segment-bytes=64M \
            --tier1-memory=1G --tier-write=write-through --remote-redis=127.0.0.1:"$PORT" \
            >"$DIR/$n.log" 2>&1 &
        node+=($!)
        pids+=($!)
    done
    for n in a b; do
        for _ in $(seq 100); do [ -S "$DIR/$n.sock" ] && break; sleep 0.05; done
    done
    a=$("$RUN" --socket "$DIR/a.sock" --model bench --prompt-len 4096 --prompt-seed 1 \
        --max-new 1 --budget 4096)
    # A's 255 full blocks of the prompt are in Redis once DBSIZE has counted them.
    for _ in $(seq 400); do
        [ "$(redis-cli -p "$PORT" dbsize)" -ge 255 ] && break
        sleep 0.05
    done
    b=$("$RUN" --socket "$DIR/b.sock" --model bench --prompt-len 4096 --prompt-seed 1 \
        --max-new 1 --budget 4096)
    rows+=("$(echo "$a" | kv ttft_ms) $(echo "$b" | kv ttft_ms) $(echo "$b" | kv cached)")
    kill "${node[@]}" 2>/dev/null
    wait "${node[@]}" 2>/dev/null || true
done
echo "### Cross-node TTFT: a 4096-token prefix node A computed, node B fetched from Redis"
echo
echo "Model \`bench\` of the example engine; two kvd daemons (each with T1 and the same"
echo "redis-server on loopback as remote tier, write-through), one engine process on each. A's"
echo "request computes the prompt; B's (the same prompt) finds nothing in its own tiers and"
echo "Fetches the prefix from Redis. $REPS rounds, each with fresh daemons and an empty Redis"
echo "(prefill budget 4096 tokens: one prefill pass, one Fetch)."
echo
echo "| round | TTFT ms, A computes | TTFT ms, B from Redis | B's cached tokens | A / B |"
echo "|---:|---:|---:|---:|---:|"
i=0
for row in "${rows[@]}"; do
    i=$((i + 1))
    set -- $row
    awk -v i="$i" -v a="$1" -v b="$2" -v c="$3" 'BEGIN { printf "| %d | %.1f | %.1f | %d | %.1fx |\n", i, a, b, c, a / b }'
done
echo
printf '%s\n' "${rows[@]}" | awk '{ r = $1 / $2; if (NR == 1 || r < w) w = r } END { printf "Worst round: %.1fx lower TTFT from Redis than recomputing (same machine, same run).\n\n", w }'
