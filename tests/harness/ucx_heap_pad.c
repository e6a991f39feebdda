/* Issue #42 on demand: the bytes after the UCX worker address are non-zero.
 *
 *     cc -shared -fPIC -O2 -o ucx_heap_pad.so tests/harness/ucx_heap_pad.c -ldl
 *     srun --mpi=pmi2 -N2 -n3 --export=ALL,LD_PRELOAD=$PWD/ucx_heap_pad.so python ...
 *
 * mpich 5's UCX netmod publishes 4096 bytes from the worker address through PMI (MPID_MAX_BC_SIZE),
 * the address and whatever follows it in the heap. Non-zero bytes hex-encode without run-length
 * compression, so every 511-byte segment becomes a PMI-1 put of about 1077 bytes, longer than the
 * 1024 bytes slurmstepd reads per request: the case a run meets when the heap after the address
 * holds few zero runs (src/distlm/runtime/mpi_init.py). mpich 4 (the address only) and the OFI netmod (no
 * UCX) are not affected. Used by tests/test_mpi_init.py and benchmarks/slurm/pmi_repro.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef int ucs_status_t;

ucs_status_t ucp_worker_get_address(void *worker, void **address_p, size_t *len_p)
{
    static ucs_status_t (*real)(void *, void **, size_t *);
    if (!real) { /* libucp is libmpi's dependency, not in the global scope: RTLD_NEXT misses it */
        void *ucp = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);
        real = (ucs_status_t (*)(void *, void **, size_t *))dlsym(ucp, "ucp_worker_get_address");
    }
    ucs_status_t st = real(worker, address_p, len_p);
    if (st == 0) {
        char *buf = malloc(*len_p + 8192);
        memset(buf, 0xA5, *len_p + 8192);
        memcpy(buf, *address_p, *len_p);
        *address_p = buf; /* ucp_worker_release_address frees it; the original stays allocated */
    }
    return st;
}
