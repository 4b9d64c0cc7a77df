/* The host link's server side: one pthread per link that runs a decode step's MoE layers as the
 * coordinator publishes them, with no Python (and no GIL) between them (included by moe_gemv.c;
 * the Python side is cpu_expert_server/hostlink.py, the protocol expertmesh/transport/link.py).
 *
 * The coordinator's request area and our answer area sit in its shared-memory segment. Per MoE
 * layer i of step s the thread spins until the request flag reads s * STEP_SPAN + i + 1 (or the
 * step is cancelled, or the wait times out: ERR_TIMEOUT into the status, the step ends), copies
 * the routing into private buffers (what is checked is what the kernel reads, whatever the
 * other side writes meanwhile), runs the layer's kernel into the answer's rows (an id outside
 * [-1, S): ERR_BAD_SLOT and zeros), writes the status and then the answer flag with release
 * order. Between steps the thread sleeps on a condition variable: no core spins while idle.
 *
 * A plan is HL_ROW int64 words per layer, built in Python once per (bucket, placement
 * generation): [kernel, S, counts [S + 1] int64 or 0, the kernel's argument block ...] with
 * the pointers to the areas, the private routing buffers, the weights and any scratch filled in.
 *
 * Shapes: R rows of the areas, Tb bucket, H hidden, K top-k, S slots of a layer.
 */
#include <pthread.h>
#include <time.h>

#define HL_STEP_SPAN 1024
#define HL_ERR_TIMEOUT 1
#define HL_ERR_BAD_SLOT 2
#define HL_ERR_KERNEL 4 /* the kernel refused the call (a plan built for other shapes): zeros */
#define HL_ROW 32
#define HL_HEAD 3
enum { HL_ZERO = 0, HL_QA = 1, HL_AMX = 2, HL_DECODE = 3 };

typedef struct {
    volatile int64_t *req_flag;
    const int32_t *req_ids; /* [R, K] */
    const float *req_w;     /* [R, K] */
    volatile int64_t *ans_flag, *ans_status;
    uint8_t *ans_out; /* [R, H] */
    int rows, hidden, top_k, esize;
    int64_t *ids; /* [R, K] private copy, widened */
    float *w;     /* [R, K] private copy */
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the step handed over (under mu) */
    const int64_t *plan;
    int layers, bucket, state; /* state: 0 idle, 1 handed over, 2 running */
    int64_t step, timeout_ns;
    int quit;
    int64_t abort; /* atomic: a step whose waits end now */
    /* the last finished step (under mu) */
    int64_t done_step, done_errors, done_layers, done_kernel_ns, done_wait_ns;
} HostLink;

static int64_t hl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* 1 when the request flag reads `want`; 0 when the step was cancelled or timeout_ns passed */
static int hl_wait_flag(HostLink *h, int64_t want, int64_t step, int64_t timeout_ns) {
    if (__atomic_load_n(h->req_flag, __ATOMIC_ACQUIRE) == want) return 1;
    const int64_t t0 = hl_now();
    for (;;) {
        for (int j = 0; j < 64; j++) {
            if (__atomic_load_n(h->req_flag, __ATOMIC_ACQUIRE) == want) return 1;
            _mm_pause();
        }
        if (__atomic_load_n(&h->abort, __ATOMIC_RELAXED) == step) return 0;
        if (hl_now() - t0 >= timeout_ns) return 0;
    }
}

/* moe_decode's path of backend._decode: integer dots when the format has them, else the general
 * kernel on fp32 activations (bf16 in: widened exactly; out rounded as torch rounds) */
static int hl_decode(const int64_t *d) {
    const int t_ = (int)d[4], h_ = (int)d[11], xbf16 = (int)d[1], obf16 = (int)d[20];
    const int wdtype = (int)d[14];
    if ((wdtype == 1 || wdtype == 2) && d[23]) {
        const int rc = moe_decode_q((const void *)d[0], xbf16, (const int64_t *)d[2], (const float *)d[3], t_, (int)d[5],
                                    (int)d[6], (const uint8_t *)d[7], (long)d[8], (const uint8_t *)d[9], (long)d[10], h_,
                                    (int)d[12], wdtype, (int)d[15], (int)d[16], (void *)d[19], obf16, (int)d[21],
                                    (int)d[22]);
        if (rc != -2) return rc;
    }
    const float *x = (const float *)d[0];
    if (xbf16) {
        row_to_f32((const uint8_t *)d[0], 0, t_ * h_, 1, (float *)d[24]);
        x = (const float *)d[24];
    }
    float *out32 = obf16 ? (float *)d[18] : (float *)d[19];
    const int rc = moe_decode(x, (const int64_t *)d[2], (const float *)d[3], t_, (int)d[5], (int)d[6],
                              (const uint8_t *)d[7], (long)d[8], (const uint8_t *)d[9], (long)d[10], h_, (int)d[12],
                              (int)d[13], wdtype, (int)d[15], (int)d[16], (float *)d[17], out32, (int)d[21], (int)d[22],
                              (int)d[23]);
    if (rc == 0 && obf16)
        for (size_t j = 0; j < (size_t)t_ * h_; j++) ((uint16_t *)d[19])[j] = to_bf16(out32[j]);
    return rc;
}

/* one step: returns its ERR_* bits; *answered = layers answered */
static int64_t hl_run(HostLink *h, const int64_t *plan, int layers, int bucket, int64_t step, int64_t timeout_ns,
                      int64_t *answered, int64_t *kernel_ns, int64_t *wait_ns) {
    int64_t err = 0;
    const int n = bucket * h->top_k;
    const size_t out_bytes = (size_t)bucket * h->hidden * h->esize;
    *answered = *kernel_ns = *wait_ns = 0;
    for (int i = 0; i < layers; i++) {
        const int64_t want = step * HL_STEP_SPAN + i + 1;
        const int64_t tw = hl_now();
        if (!hl_wait_flag(h, want, step, timeout_ns)) {
            err |= HL_ERR_TIMEOUT;
            __atomic_store_n(h->ans_status, err, __ATOMIC_RELEASE);
            break;
        }
        const int64_t tk = hl_now();
        *wait_ns += tk - tw;
        const int64_t *row = plan + (size_t)i * HL_ROW;
        const int64_t s_ = row[1];
        int bad = 0;
        for (int p = 0; p < n; p++) {
            const int32_t id = h->req_ids[p];
            bad |= id < -1 || id >= s_;
            h->ids[p] = id;
            h->w[p] = h->req_w[p];
        }
        int rc = 0;
        if (bad) {
            err |= HL_ERR_BAD_SLOT;
        } else if (row[0] == HL_QA) {
            rc = moe_decode_qa(row + HL_HEAD);
        } else if (row[0] == HL_AMX) {
            rc = moe_amx_a(row + HL_HEAD);
        } else if (row[0] == HL_DECODE) {
            rc = hl_decode(row + HL_HEAD);
        }
        if (rc) err |= HL_ERR_KERNEL;
        if (bad || rc || row[0] == HL_ZERO) memset(h->ans_out, 0, out_bytes);
        if (!bad && row[2]) {
            int64_t *counts = (int64_t *)row[2];
            for (int p = 0; p < n; p++) counts[h->ids[p] + 1]++;
        }
        *kernel_ns += hl_now() - tk;
        *h->ans_status = err;
        __atomic_store_n(h->ans_flag, want, __ATOMIC_RELEASE);
        *answered = i + 1;
    }
    return err;
}

static void *hl_main(void *arg) {
    HostLink *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->quit && h->state != 1) pthread_cond_wait(&h->cv, &h->mu);
        if (h->quit) break;
        h->state = 2;
        const int64_t *plan = h->plan;
        const int layers = h->layers, bucket = h->bucket;
        const int64_t step = h->step, timeout_ns = h->timeout_ns;
        pthread_mutex_unlock(&h->mu);
        int64_t answered, kns, wns;
        const int64_t err = hl_run(h, plan, layers, bucket, step, timeout_ns, &answered, &kns, &wns);
        pthread_mutex_lock(&h->mu);
        h->done_step = step, h->done_errors = err, h->done_layers = answered;
        h->done_kernel_ns = kns, h->done_wait_ns = wns;
        h->state = 0;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* a[0] request area, a[1] answer area, a[2] R, a[3] H, a[4] K, a[5] bytes per element,
 * a[6] ids buffer [R, K] int64, a[7] weights buffer [R, K] fp32 (the caller's, kept until
 * hl_close). NULL when the thread cannot start. */
void *hl_open(const int64_t *a) {
    HostLink *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    uint8_t *req = (uint8_t *)a[0], *ans = (uint8_t *)a[1];
    const size_t r = (size_t)a[2], hd = (size_t)a[3], k = (size_t)a[4], es = (size_t)a[5];
    /* link_layout.py's RequestViews / AnswerViews */
    const size_t x_bytes = (r * hd * es + 255) / 256 * 256, ids_bytes = (r * k * 4 + 255) / 256 * 256;
    h->req_flag = (volatile int64_t *)req;
    h->req_ids = (const int32_t *)(req + 256 + x_bytes);
    h->req_w = (const float *)(req + 256 + x_bytes + ids_bytes);
    h->ans_flag = (volatile int64_t *)ans;
    h->ans_status = (volatile int64_t *)(ans + 64);
    h->ans_out = ans + 256;
    h->rows = (int)r, h->hidden = (int)hd, h->top_k = (int)k, h->esize = (int)es;
    h->ids = (int64_t *)a[6], h->w = (float *)a[7];
    h->abort = -1, h->done_step = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (pthread_create(&h->th, NULL, hl_main, h)) {
        pthread_mutex_destroy(&h->mu);
        pthread_cond_destroy(&h->cv);
        free(h);
        return NULL;
    }
    return h;
}

/* hands step `step` over (plan: layers rows of HL_ROW words, kept by the caller until the step
 * is done); -1 when the last step still runs */
int hl_start(void *p, const int64_t *plan, int layers, int bucket, int64_t step, int64_t timeout_ns) {
    HostLink *h = p;
    pthread_mutex_lock(&h->mu);
    if (h->state != 0) {
        pthread_mutex_unlock(&h->mu);
        return -1;
    }
    h->plan = plan, h->layers = layers, h->bucket = bucket, h->step = step, h->timeout_ns = timeout_ns;
    h->state = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return 0;
}

/* ends step `step`'s waits now (any thread); its later layers are not answered */
void hl_cancel(void *p, int64_t step) { __atomic_store_n(&((HostLink *)p)->abort, step, __ATOMIC_RELAXED); }

/* waits up to timeout_ms for the thread to be idle; then out = (step, errors, layers answered,
 * kernel ns, wait ns) of the last finished step. Returns 1 when idle, 0 on timeout. */
int hl_wait(void *p, int64_t timeout_ms, int64_t *out) {
    HostLink *h = p;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    pthread_mutex_lock(&h->mu);
    while (h->state != 0)
        if (pthread_cond_timedwait(&h->cv, &h->mu, &until)) break;
    const int idle = h->state == 0;
    out[0] = h->done_step, out[1] = h->done_errors, out[2] = h->done_layers;
    out[3] = h->done_kernel_ns, out[4] = h->done_wait_ns;
    pthread_mutex_unlock(&h->mu);
    return idle;
}

/* ends the step in flight (cancelled), joins the thread, frees the link */
void hl_close(void *p) {
    HostLink *h = p;
    pthread_mutex_lock(&h->mu);
    h->quit = 1;
    __atomic_store_n(&h->abort, h->step, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->th, NULL);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}
