/* gpu_probe: the first step of the GPU device check (tests/gpu/bundle/run.sh). Loads the driver
 * the way kvd does (common/kv_cuda.c: dlopen libcuda.so.1, every entry point resolved),
 * prints a report of each visible device as markdown, and measures the facts kvd's cuda-vmm
 * path depends on instead of trusting the headers:
 *   - allocation granularity (minimum and recommended) for POSIX-fd shareable memory;
 *   - whether cuMemMap accepts a non-zero offset into an allocation (cuda.h: "currently must be
 *     zero"; kvd never needs one since segments are one allocation per section, but the answer
 *     is recorded);
 *   - a cuMemCreate -> export fd -> import -> map -> write -> read round trip;
 *   - cuIpcGetMemHandle on cuMemAlloc memory (the cuda-ipc backend's export).
 * Exit status: 0 when every device passed, 1 when a probe failed, 2 when no GPU is visible (no
 * driver library, or cuInit/cuDeviceGetCount report no device). run.sh stops at 2 and says so.
 * Usage: gpu_probe [--device N]   (default: every device; the round trip runs on each). */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_cuda.h"

#define ATTR_SMS 16 /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
#define ATTR_CC_MAJOR 75
#define ATTR_CC_MINOR 76
#define ATTR_MEM_CLOCK_KHZ 36 /* CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE */
#define ATTR_BUS_WIDTH 37     /* CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH */
#define ATTR_UVA 41           /* CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING */
#define ATTR_PCI_BUS 33
#define ATTR_PCI_DEVICE 34

static int failures;

static const char *err(const kv_cuda *cu, kv_cu_result r) {
    static char buf[200];
    return kv_cuda_strerror(cu, r, buf, sizeof(buf));
}

static void row(const char *what, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void row(const char *what, const char *fmt, ...) {
    va_list ap;
    printf("| %s | ", what);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" |\n");
}

static void fail(const char *what, const kv_cuda *cu, kv_cu_result r) {
    row(what, "**FAILED**: %s", err(cu, r));
    failures++;
}

static int attr(const kv_cuda *cu, kv_cu_device d, int a) {
    int v = -1;
    if (cu->device_get_attribute(&v, a, d) != KV_CU_SUCCESS) {
        return -1;
    }
    return v;
}

/* cuMemCreate two granules, export and re-import them by fd, map at offset 0 and (separately)
 * at a non-zero offset, and check bytes written through one mapping read back. */
static void probe_vmm(const kv_cuda *cu, const kv_cuda_device *d) {
    kv_cu_alloc_prop prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = KV_CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requested_handle_types = KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = d->ordinal;
    size_t gmin = 0;
    size_t grec = 0;
    kv_cu_result r = cu->mem_get_granularity(&gmin, &prop, KV_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != KV_CU_SUCCESS) {
        fail("granularity", cu, r);
        return;
    }
    if (cu->mem_get_granularity(&grec, &prop, KV_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) !=
        KV_CU_SUCCESS) {
        grec = 0;
    }
    row("granularity (POSIX fd)", "minimum %zu KiB, recommended %zu KiB", gmin >> 10, grec >> 10);

    size_t bytes = 2 * gmin;
    kv_cu_mem_handle h = 0;
    r = cu->mem_create(&h, bytes, &prop, 0);
    if (r != KV_CU_SUCCESS) {
        fail("cuMemCreate (2 granules)", cu, r);
        return;
    }
    int fd = -1;
    r = cu->mem_export(&fd, h, KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != KV_CU_SUCCESS) {
        fail("cuMemExportToShareableHandle (fd)", cu, r);
        cu->mem_release(h);
        return;
    }
    kv_cu_mem_handle imp = 0;
    r = cu->mem_import(&imp, (void *)(intptr_t)fd, KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != KV_CU_SUCCESS) {
        fail("cuMemImportFromShareableHandle (fd)", cu, r);
        close(fd);
        cu->mem_release(h);
        return;
    }
    close(fd);

    kv_cu_access_desc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location = prop.location;
    acc.flags = KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    /* Whole allocation at offset 0 through the original handle; write a pattern. */
    kv_cu_deviceptr va = 0;
    r = cu->mem_address_reserve(&va, bytes, gmin, 0, 0);
    if (r != KV_CU_SUCCESS) {
        fail("cuMemAddressReserve", cu, r);
        goto out;
    }
    r = cu->mem_map(va, bytes, 0, h, 0);
    if (r == KV_CU_SUCCESS) {
        r = cu->mem_set_access(va, bytes, &acc, 1);
    }
    if (r != KV_CU_SUCCESS) {
        fail("cuMemMap offset 0 + cuMemSetAccess", cu, r);
        cu->mem_address_free(va, bytes);
        goto out;
    }
    unsigned char *pat = malloc(bytes);
    unsigned char *back = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) {
        pat[i] = (unsigned char)(i * 131u + 7u);
    }
    r = cu->memcpy_htod(va, pat, bytes);
    if (r == KV_CU_SUCCESS) {
        r = cu->ctx_synchronize();
    }
    if (r != KV_CU_SUCCESS) {
        fail("cuMemcpyHtoD into the mapping", cu, r);
    } else {
        row("cuMemCreate/export/import/map", "ok (%zu KiB, POSIX fd)", bytes >> 10);
    }

    /* The imported handle, mapped alone, reads the same bytes (what a worker sees). */
    kv_cu_deviceptr va2 = 0;
    r = cu->mem_address_reserve(&va2, bytes, gmin, 0, 0);
    if (r == KV_CU_SUCCESS) {
        r = cu->mem_map(va2, bytes, 0, imp, 0);
        if (r == KV_CU_SUCCESS) {
            r = cu->mem_set_access(va2, bytes, &acc, 1);
            if (r == KV_CU_SUCCESS) {
                memset(back, 0, bytes);
                r = cu->memcpy_dtoh(back, va2, bytes);
            }
            if (r != KV_CU_SUCCESS) {
                fail("read through the imported handle", cu, r);
            } else if (memcmp(pat, back, bytes) != 0) {
                row("read through the imported handle", "**FAILED**: bytes differ");
                failures++;
            } else {
                row("read through the imported handle", "ok (bytes equal)");
            }
            cu->mem_unmap(va2, bytes);
        } else {
            fail("cuMemMap of the imported handle", cu, r);
        }
        cu->mem_address_free(va2, bytes);
    }

    /* A non-zero offset: the second granule alone. */
    kv_cu_deviceptr va3 = 0;
    r = cu->mem_address_reserve(&va3, gmin, gmin, 0, 0);
    if (r == KV_CU_SUCCESS) {
        r = cu->mem_map(va3, gmin, gmin, imp, 0);
        if (r != KV_CU_SUCCESS) {
            row("cuMemMap at a non-zero offset", "refused: %s (kvd does not need it)", err(cu, r));
        } else {
            r = cu->mem_set_access(va3, gmin, &acc, 1);
            if (r == KV_CU_SUCCESS) {
                memset(back, 0, gmin);
                r = cu->memcpy_dtoh(back, va3, gmin);
            }
            if (r != KV_CU_SUCCESS) {
                row("cuMemMap at a non-zero offset", "mapped, but access failed: %s", err(cu, r));
            } else {
                row("cuMemMap at a non-zero offset", "%s",
                    memcmp(back, pat + gmin, gmin) == 0
                        ? "accepted; reads the second granule"
                        : "accepted, but reads the wrong bytes (never rely on it)");
            }
            cu->mem_unmap(va3, gmin);
        }
        cu->mem_address_free(va3, gmin);
    }
    free(pat);
    free(back);
    cu->mem_unmap(va, bytes);
    cu->mem_address_free(va, bytes);
out:
    cu->mem_release(imp);
    cu->mem_release(h);
}

static void probe_ipc(const kv_cuda *cu) {
    kv_cu_deviceptr p = 0;
    kv_cu_result r = cu->mem_alloc(&p, 2u << 20);
    if (r != KV_CU_SUCCESS) {
        fail("cuMemAlloc (2 MiB)", cu, r);
        return;
    }
    kv_cu_ipc_mem_handle ih;
    r = cu->ipc_get_mem_handle(&ih, p);
    if (r != KV_CU_SUCCESS) {
        fail("cuIpcGetMemHandle", cu, r);
    } else {
        row("cuIpcGetMemHandle", "ok");
    }
    cu->mem_free(p);
}

int main(int argc, char **argv) {
    int only = -1;
    if (argc == 3 && strcmp(argv[1], "--device") == 0) {
        only = atoi(argv[2]);
    } else if (argc != 1) {
        fprintf(stderr, "usage: gpu_probe [--device N]\n");
        return 1;
    }
    kv_cuda cu;
    char why[512];
    if (kv_cuda_load(NULL, &cu, why, sizeof(why)) != KV_OK) {
        printf("No GPU visible: %s\n", why);
        return 2;
    }
    int n = 0;
    kv_cu_result r = cu.device_get_count(&n);
    if (r != KV_CU_SUCCESS || n == 0) {
        printf("No GPU visible: %s\n",
               r != KV_CU_SUCCESS ? err(&cu, r) : "the driver reports no devices");
        return 2;
    }
    printf("Driver API %d.%d, %d device(s) visible.\n\n", cu.driver_version / 1000,
           (cu.driver_version % 1000) / 10, n);
    for (int i = 0; i < n; i++) {
        if (only >= 0 && i != only) {
            continue;
        }
        kv_cuda_device d;
        if (kv_cuda_device_open(&cu, i, &d, why, sizeof(why)) != KV_OK) {
            printf("Device %d: **FAILED** to open: %s\n\n", i, why);
            failures++;
            continue;
        }
        char uuid[64];
        int clock = attr(&cu, d.dev, ATTR_MEM_CLOCK_KHZ);
        int width = attr(&cu, d.dev, ATTR_BUS_WIDTH);
        printf("### Device %d: %s\n\n| fact | value |\n|---|---|\n", i, d.name);
        row("UUID", "%s", kv_cuda_uuid_str(&d.uuid, uuid, sizeof(uuid)));
        row("compute capability", "%d.%d", attr(&cu, d.dev, ATTR_CC_MAJOR),
            attr(&cu, d.dev, ATTR_CC_MINOR));
        row("SMs", "%d", attr(&cu, d.dev, ATTR_SMS));
        row("PCI bus:device", "%02x:%02x", attr(&cu, d.dev, ATTR_PCI_BUS),
            attr(&cu, d.dev, ATTR_PCI_DEVICE));
        if (clock > 0 && width > 0) {
            /* Double data rate: 2 transfers per clock. HBM3e reports its clock this way too. */
            row("peak memory bandwidth (from clock x bus width)", "%.0f GB/s",
                2.0 * clock * 1e3 * (width / 8.0) / 1e9);
        }
        row("unified addressing", "%s", attr(&cu, d.dev, ATTR_UVA) == 1 ? "yes" : "no");
        row("VMM (cuMemCreate)", "%s", d.vmm ? "supported" : "**not supported**");
        row("POSIX fd handles", "%s", d.posix_fd ? "supported" : "**not supported**");
        if (d.vmm && d.posix_fd) {
            probe_vmm(&cu, &d);
        } else {
            failures++;
        }
        probe_ipc(&cu);
        printf("\n");
        kv_cuda_device_close(&cu, &d);
    }
    kv_cuda_unload(&cu);
    printf("%s\n", failures == 0 ? "Probe: every check passed." : "Probe: some checks FAILED.");
    return failures == 0 ? 0 : 1;
}
