# examples/engine/lengths.awk — writes a kve_run workload (format in workload.h) whose prompt and
# output lengths are drawn from log-normal distributions with given means, to measure KV memory
# waste on request-length mixes shaped like public traces (bench.sh: ShareGPT-like, Alpaca-like).
# No dataset is read: only the lengths are modelled; prompt tokens are uniform random ids.
#
#   awk -v n=64 -v mean_in=161.31 -v mean_out=337.99 -v sigma=0.9 -v cap=2048 -v seed=1 \
#       -v vocab=256 -v gap_ms=0 -f lengths.awk > FILE
#
# Each length is drawn as exp(N(mu, sigma^2)) with mu = ln(mean) - sigma^2/2 (a log-normal whose
# mean is `mean`: long-tailed like chat traces); then all n draws are scaled by mean / sample mean
# so that a small sample still has the requested mean, rounded and clamped to [1, cap]. The
# header comment gives the realised means (bench.sh reports those).
function lognormal(mean,    u1, u2, z, mu, x) {
    u1 = rand(); u2 = rand()
    if (u1 < 1e-12) u1 = 1e-12
    z = sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2)
    mu = log(mean) - sigma * sigma / 2
    return exp(mu + sigma * z)
}
function clamp(x) {
    x = int(x + 0.5)
    return x < 1 ? 1 : (x > cap ? cap : x)
}
BEGIN {
    if (n == "" || mean_in == "" || mean_out == "") {
        print "lengths.awk: n, mean_in and mean_out are needed" > "/dev/stderr"
        exit 2
    }
    if (sigma == "") sigma = 0.9
    if (cap == "") cap = 2048
    if (seed == "") seed = 1
    if (vocab == "") vocab = 256
    if (gap_ms == "") gap_ms = 0
    srand(seed)
    t = 0; raw_in = 0; raw_out = 0; sum_in = 0; sum_out = 0
    for (r = 0; r < n; r++) {
        pin[r] = lognormal(mean_in); raw_in += pin[r]
        pout[r] = lognormal(mean_out); raw_out += pout[r]
    }
    for (r = 0; r < n; r++) {
        pin[r] = clamp(pin[r] * mean_in * n / raw_in); sum_in += pin[r]
        pout[r] = clamp(pout[r] * mean_out * n / raw_out); sum_out += pout[r]
    }
    printf "# lengths n=%d mean_in=%.2f mean_out=%.2f sigma=%.2f cap=%d seed=%d " \
           "realised_in=%.2f realised_out=%.2f\n", n, mean_in, mean_out, sigma, cap, seed,
           sum_in / n, sum_out / n
    for (r = 0; r < n; r++) {
        line = sprintf("%d %.1f %d %d", r, t, pout[r], pin[r])
        for (i = 0; i < pin[r]; i++) line = line " " int(rand() * vocab)
        print line
        t += gap_ms * rand() * 2
    }
}
