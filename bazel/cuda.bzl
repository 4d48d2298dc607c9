"""cuda_library: compiles .cu files with nvcc into objects that C targets link.

Fatbin for sm_80 and sm_90 plus PTX for compute_90, so newer GPUs JIT the PTX. When the build
machine has no nvcc (or --config=nocuda), the CUDA objects are left out and `fallback_srcs`
(plain C that reports "built without CUDA") are compiled instead, so every binary still links
and chooses the host path at run time. When nvcc exists but the static runtime does not
(bazel/cuda_configure.bzl), the .cu files are still compiled, as data of the fallback library,
so that nvcc checks the kernels wherever it can.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "NVCC")

_GENCODE = " ".join([
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
])

def _nvcc_objects(name, srcs, hdrs):
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        native.genrule(
            name = obj.replace(".o", "_nvcc"),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = ("%s -O3 -std=c++17 %s -Xcompiler=-fPIC -I. -I$(GENDIR) " % (NVCC, _GENCODE)) +
                  "-c $(location %s) -o $@" % src,
            message = "nvcc " + src,
        )
        objs.append(obj)
    return objs

def cuda_library(name, srcs, hdrs = [], fallback_srcs = [], deps = [], copts = [], **kw):
    if not CUDA_AVAILABLE:
        native.cc_library(
            name = name,
            srcs = fallback_srcs,
            hdrs = hdrs,
            deps = deps,
            copts = copts,
            data = _nvcc_objects(name, srcs, hdrs) if NVCC else [],
            **kw
        )
        return
    objs = _nvcc_objects(name, srcs, hdrs)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart_static"],
        copts = copts,
        defines = ["KV_HAVE_CUDA=1"],
        **kw
    )
