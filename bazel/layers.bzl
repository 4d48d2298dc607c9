"""The daemon's layers, bottom up (docs/ARCHITECTURE.md). A layer's targets are visible to the
layers above it and to test-only code, never to a layer below: Bazel refuses such a dependency.
tests/layering/check_layers.py checks the same order over includes and linked symbols."""

DAEMON_LAYERS = ["core", "mem", "config", "tenancy", "session", "registry", "tiers", "kvevents", "proto", "net", "ops", "app"]

# Test-only code and test suites outside the daemon that may use any layer.
_TEST_USERS = [
    "//daemon/testing:__pkg__",
    "//tests:__subpackages__",
    "//bench:__pkg__",
]

def above(layer):
    """Visibility of a daemon layer's production targets: every layer above it, the daemon's
    top package (the kvd binary) and the test users."""
    i = DAEMON_LAYERS.index(layer)
    return ["//daemon/%s:__pkg__" % l for l in DAEMON_LAYERS[i + 1:]] + ["//daemon:__pkg__"] + _TEST_USERS
