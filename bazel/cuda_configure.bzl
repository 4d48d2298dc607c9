"""Repository rule that finds the CUDA toolkit on the build machine.

It writes @local_cuda//:defs.bzl with
  NVCC            the nvcc to compile .cu files with ("" when there is none),
  CUDA_AVAILABLE  True when the kernels can also be linked: nvcc and the static runtime
                  libcudart_static.a were both found,
  CUDA_STATUS     one line saying what was found, or why the build goes without CUDA,
and @local_cuda//:BUILD with the static runtime as :cudart_static.

Toolkits are laid out differently (lib64 -> lib, targets/<arch>/lib, Debian's multiarch folder),
so the runtime is looked for first where nvcc itself says its libraries are (the LIBRARIES line of
`nvcc -dryrun`), then in the usual folders of nvcc's own toolkit, and a one-kernel probe is
compiled and linked against it the way the build will. When nvcc exists but no static runtime
does, or the probe does not link, the build still compiles every .cu file (so the kernels are
checked by nvcc) but links the C fallbacks, and says so: the runtime never fails the build.
KVD_NOCUDA=1 (bazel --config=nocuda) turns CUDA off even where the toolkit exists. Everything runs
offline: it only looks at the local disk.
"""

_STD_ROOTS = ["/usr/local/cuda", "/usr/lib/cuda", "/opt/cuda"]

_LIB_SUBDIRS = [
    "lib64",
    "lib",
    "targets/x86_64-linux/lib",
    "targets/sbsa-linux/lib",
    "targets/aarch64-linux/lib",
]

_DISTRO_LIBDIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"]

def _find_nvcc(rctx):
    nvcc = rctx.which("nvcc")
    if nvcc != None:
        return nvcc
    for root in [rctx.os.environ.get("CUDA_HOME", ""), rctx.os.environ.get("CUDA_PATH", "")] + _STD_ROOTS:
        if root and rctx.path(root + "/bin/nvcc").exists:
            return rctx.path(root + "/bin/nvcc")
    return None

def _nvcc_libdirs(rctx, nvcc):
    """The -L folders of nvcc's own LIBRARIES line, stubs left out."""
    rctx.file("probe.cu", "")
    res = rctx.execute([str(nvcc), "-dryrun", "-c", "probe.cu", "-o", "probe.o"], timeout = 60)
    rctx.execute(["rm", "-f", "probe.cu"])
    dirs = []
    for line in (res.stdout + "\n" + res.stderr).splitlines():
        if "LIBRARIES=" not in line:
            continue
        for word in line.split(" "):
            word = word.strip().strip("\"")
            if word.startswith("-L") and not word.rstrip("/").endswith("/stubs"):
                dirs.append(word[2:])
    return dirs

def _find_cudart(rctx, nvcc):
    """The static runtime of nvcc's own toolkit (never another toolkit's: versions must match)."""
    candidates = _nvcc_libdirs(rctx, nvcc)
    for root in [str(nvcc.dirname.dirname), str(nvcc.realpath.dirname.dirname)]:
        candidates += [root + "/" + sub for sub in _LIB_SUBDIRS]
        if root == "/usr" or root.startswith("/usr/lib/"):
            candidates += _DISTRO_LIBDIRS  # a distribution's toolkit (Debian: nvidia-cuda-toolkit)
    looked = []
    for d in candidates:
        d = d.rstrip("/")
        if d in looked:
            continue
        looked.append(d)
        lib = rctx.path(d + "/libcudart_static.a")
        if lib.exists:
            return lib.realpath, looked
    return None, looked

def _link_check(rctx, nvcc, cudart):
    """Compiles a one-kernel program with nvcc and links it with the C compiler against cudart,
    as the build will. Returns "" when that works (or no C compiler is there to try), else why."""
    cc = rctx.os.environ.get("CC", "") or rctx.which("gcc") or rctx.which("cc")
    if not cc:
        return ""
    rctx.file("link_probe.cu", "__global__ void kvd_link_probe(int *p) { if (p) *p = 1; }\n" +
                               "int main(void) { kvd_link_probe<<<1, 1>>>(0); " +
                               "return cudaDeviceSynchronize() == cudaSuccess ? 0 : 1; }\n")
    res = rctx.execute([str(nvcc), "-c", "link_probe.cu", "-o", "link_probe.o",
                        "-gencode=arch=compute_80,code=sm_80"], timeout = 120)
    if res.return_code == 0:
        res = rctx.execute([str(cc), "link_probe.o", str(cudart), "-ldl", "-lpthread", "-lrt",
                            "-lstdc++", "-o", "link_probe"], timeout = 120)
    rctx.execute(["rm", "-f", "link_probe.cu", "link_probe.o", "link_probe"])
    if res.return_code == 0:
        return ""
    lines = (res.stderr + res.stdout).strip().splitlines()
    return " | ".join(lines[-3:]) if lines else "exit %d" % res.return_code

def _write(rctx, nvcc, available, status, build):
    rctx.file("defs.bzl", "NVCC = %r\nCUDA_AVAILABLE = %s\nCUDA_STATUS = %r\n" % (
        nvcc,
        "True" if available else "False",
        status,
    ))
    rctx.file("STATUS", status + "\n")
    rctx.file("BUILD", "package(default_visibility = [\"//visibility:public\"])\n" +
                       "exports_files([\"STATUS\"])\n" + build)

def _cuda_configure_impl(rctx):
    if rctx.os.environ.get("KVD_NOCUDA", "") == "1":
        _write(rctx, "", False, "cuda: off (KVD_NOCUDA=1 / --config=nocuda)",
               "cc_library(name = \"cudart_static\")\n")
        return
    nvcc = _find_nvcc(rctx)
    if nvcc == None:
        _write(rctx, "", False, "cuda: no nvcc on PATH or in " + ", ".join(_STD_ROOTS) +
                                "; building the CPU fallbacks only",
               "cc_library(name = \"cudart_static\")\n")
        return
    cudart, looked = _find_cudart(rctx, nvcc)
    if cudart == None:
        status = ("cuda: nvcc %s compiles the kernels, but no libcudart_static.a was found " +
                  "(looked in %s); linking the CPU fallbacks") % (nvcc.realpath, ", ".join(looked))
        print(status)
        _write(rctx, str(nvcc.realpath), False, status, "cc_library(name = \"cudart_static\")\n")
        return

    why = _link_check(rctx, nvcc, cudart)
    if why:
        status = ("cuda: nvcc %s compiles the kernels, but a probe kernel does not link against " +
                  "%s (%s); linking the CPU fallbacks") % (nvcc.realpath, cudart, why)
        print(status)
        _write(rctx, str(nvcc.realpath), False, status, "cc_library(name = \"cudart_static\")\n")
        return

    # The static runtime loads libcuda.so.1 itself at run time, so binaries still start without
    # a driver; our code asks it (or its own dlopen of the driver) whether a GPU is usable.
    rctx.symlink(cudart, "libcudart_static.a")
    _write(rctx, str(nvcc.realpath), True, "cuda: nvcc %s, static runtime %s" % (nvcc.realpath, cudart), """
cc_library(
    name = "cudart_static",
    srcs = ["libcudart_static.a"],
    linkopts = ["-ldl", "-lpthread", "-lrt"],
)
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["KVD_NOCUDA", "PATH", "CUDA_HOME", "CUDA_PATH", "CC"],
    local = True,
)
