/* Stand-ins for the two graphs of a host link, in C, so that a benchmark measures the relay
 * and the wire, not Python: probe_graph plays the coordinator's step graph (writes a layer's
 * request flag, spins on the answer flag, one layer after the other) and times each layer;
 * probe_echo plays the server's compute (answers every new request flag with out = x).
 * Built into the relay's library; only benchmarks/bench_relay.py calls them.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STEP_SPAN 1024

struct relay;
int relay_step(struct relay *r, int64_t step, int64_t rows, int64_t layers);

static int64_t probe_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* ptrs: req flag, x, ans flag, out. Runs ``steps`` steps from ``step0`` of ``layers`` layers of
 * ``rows`` rows over the coordinator relay ``r`` (NULL: the compute shares these areas);
 * ns[s * layers + i] = layer i's round trip from its request flag to its answer flag. Returns
 * 0, the negative relay_step code, 1 when an answer did not come within timeout_ns, or 2 when
 * an answer's first or last byte is not what the layer sent (the echo answers out = x). */
int probe_graph(struct relay *r, void **ptrs, int64_t step0, int64_t steps, int64_t layers, int64_t rows,
                int64_t row_bytes, int64_t timeout_ns, int64_t spin_ns, int64_t *ns) {
    int64_t *req_flag = ptrs[0], *ans_flag = ptrs[2];
    uint8_t *x = ptrs[1], *out = ptrs[3];
    for (int64_t s = 0; s < steps; s++) {
        int64_t step = step0 + s;
        int rc = r ? relay_step(r, step, rows, layers) : 0; /* no relay: the areas are shared */
        if (rc) return rc;
        for (int64_t i = 0; i < layers; i++) {
            int64_t want = step * STEP_SPAN + i + 1;
            memset(x, (int)(want & 0x7f), (size_t)(rows * row_bytes)); /* the layer's hidden states */
            int64_t t0 = probe_now();
            __atomic_store_n(req_flag, want, __ATOMIC_RELEASE);
            while (__atomic_load_n(ans_flag, __ATOMIC_ACQUIRE) != want) {
                int64_t t = probe_now() - t0;
                if (t > timeout_ns) return 1;
                if (t > spin_ns) sched_yield(); /* as the relay's own waits: a loaded host goes on */
            }
            ns[s * layers + i] = probe_now() - t0;
            size_t last = (size_t)(rows * row_bytes) - 1;
            if (out[0] != (uint8_t)(want & 0x7f) || out[last] != (uint8_t)(want & 0x7f)) return 2;
        }
    }
    return 0;
}

typedef struct {
    int64_t *req_flag, *ans_flag, *ans_status;
    uint8_t *x, *out;
    int64_t bytes, spin_ns, stop;
    pthread_t th;
} probe_echo_t;

static void *echo_main(void *arg) {
    probe_echo_t *e = arg;
    int64_t last = __atomic_load_n(e->req_flag, __ATOMIC_ACQUIRE);
    int64_t since = probe_now();
    uint32_t k = 0;
    while (!__atomic_load_n(&e->stop, __ATOMIC_RELAXED)) {
        int64_t f = __atomic_load_n(e->req_flag, __ATOMIC_ACQUIRE);
        if (f == last) {
            if ((++k & 63) == 0 && probe_now() - since > e->spin_ns) sched_yield();
            continue;
        }
        since = probe_now();
        memcpy(e->out, e->x, (size_t)e->bytes);
        __atomic_store_n(e->ans_status, 0, __ATOMIC_RELAXED);
        __atomic_store_n(e->ans_flag, f, __ATOMIC_RELEASE);
        last = f;
    }
    return NULL;
}

/* ptrs: req flag, x, ans flag, status, out; copies ``bytes`` of x per answer (the benchmark's
 * rows: the area holds no row count). Both stand-ins pause-spin for spin_ns, then yield. */
probe_echo_t *probe_echo_start(void **ptrs, int64_t bytes, int64_t spin_ns) {
    probe_echo_t *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->req_flag = ptrs[0], e->x = ptrs[1], e->ans_flag = ptrs[2], e->ans_status = ptrs[3], e->out = ptrs[4];
    e->bytes = bytes, e->spin_ns = spin_ns;
    if (pthread_create(&e->th, NULL, echo_main, e)) {
        free(e);
        return NULL;
    }
    return e;
}

void probe_echo_stop(probe_echo_t *e) {
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    pthread_join(e->th, NULL);
    free(e);
}
