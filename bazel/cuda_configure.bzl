"""Repository rule that finds the CUDA toolkit on the build machine.

It writes @local_cuda//:defs.bzl with CUDA_AVAILABLE and NVCC, and @local_cuda//:BUILD with
the static CUDA runtime. Set KVD_NOCUDA=1 (bazel --config=nocuda does) to build without CUDA
even where nvcc exists. Everything runs offline: it only looks at the local filesystem.
"""

_STD_NVCC = "/usr/local/cuda/bin/nvcc"

def _find_nvcc(rctx):
    if rctx.os.environ.get("KVD_NOCUDA", "") == "1":
        return None
    nvcc = rctx.which("nvcc")
    if nvcc == None and rctx.path(_STD_NVCC).exists:
        nvcc = rctx.path(_STD_NVCC)
    return nvcc

def _cuda_configure_impl(rctx):
    nvcc = _find_nvcc(rctx)
    if nvcc == None:
        rctx.file("defs.bzl", "CUDA_AVAILABLE = False\nNVCC = \"\"\n")
        rctx.file("BUILD", "package(default_visibility = [\"//visibility:public\"])\n" +
                           "cc_library(name = \"cudart_static\")\n")
        return

    # <toolkit>/bin/nvcc -> <toolkit>; the static runtime lives in <toolkit>/lib64 (or
    # targets/x86_64-linux/lib), and it loads libcuda.so.1 itself at run time.
    root = nvcc.realpath.dirname.dirname
    libdir = root.get_child("lib64")
    if not libdir.get_child("libcudart_static.a").exists:
        libdir = root.get_child("targets").get_child("x86_64-linux").get_child("lib")
    rctx.symlink(libdir.get_child("libcudart_static.a"), "libcudart_static.a")
    rctx.file("defs.bzl", "CUDA_AVAILABLE = True\nNVCC = \"%s\"\n" % nvcc.realpath)
    rctx.file("BUILD", """package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cudart_static",
    srcs = ["libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
)
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["KVD_NOCUDA", "PATH"],
    local = True,
)
