"""proto_c_library: runs Debian's protoc-c on a .proto at build time (generated code is never
committed) and compiles the result against libprotobuf-c."""

def proto_c_library(name, src, deps = [], **kw):
    base = src[:-len(".proto")]
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = [base + ".pb-c.c", base + ".pb-c.h"],
        cmd = "protoc-c --proto_path=$$(dirname $(location %s)) --c_out=$(RULEDIR) $(location %s)" %
              (src, src),
        message = "protoc-c " + src,
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb-c.c"],
        hdrs = [base + ".pb-c.h"],
        # protoc-c's output includes its own header by bare name.
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        deps = deps + ["//bazel:protobuf_c"],
        **kw
    )
