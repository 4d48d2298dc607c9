"""kv_test: a cmocka unit test as a cc_test with a short name; Bazel prints its failures."""

def kv_test(name, srcs, deps = [], tags = [], size = "small", **kw):
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//bazel:cmocka"],
        tags = tags,
        size = size,
        **kw
    )
