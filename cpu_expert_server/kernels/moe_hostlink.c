/* The kernel thread and the host links it serves (included by moe_gemv.c; the Python side is
 * cpu_expert_server/kernels/__init__.py's KernelThread and cpu_expert_server/hostlink.py, the
 * protocol expertmesh/transport/link.py).
 *
 * Why one thread: libgomp gives every thread that starts a parallel region a team of its own, and
 * once the teams' threads together outnumber the CPUs, every worker spins only briefly before it
 * sleeps, so each region of each call waits on wake-ups (a bf16 decode layer took ~1.4x as long
 * from a second thread as from the first). A backend therefore starts every kernel from one
 * thread: Python's calls are handed to it (kt_call) and the host links' layers run on it, so the
 * process has one team.
 *
 * A host link: the coordinator's request area and our answer area sit in its shared-memory
 * segment. Per MoE layer i of step s the thread waits until the request flag reads
 * s * STEP_SPAN + i + 1 (or the step is cancelled, or the wait times out: ERR_TIMEOUT into the
 * status, the step ends), copies the routing into private buffers (what is checked is what the
 * kernel reads, whatever the other side writes meanwhile), runs the layer's kernel into the
 * answer's rows (an id outside [-1, S): ERR_BAD_SLOT and zeros), writes the status and then the
 * answer flag with release order. Several links' steps interleave layer by layer: the thread
 * polls each running link's next flag in turn, and a call posted from Python runs between two
 * layers. With nothing to do the thread spins a little (spin_ns) and then sleeps on a condition
 * variable: no core spins while idle.
 *
 * A plan is HL_ROW int64 words per layer, built in Python once per (bucket, placement
 * generation): [kernel, S, counts [S + 1] int64 or 0, the kernel's argument block ...] with
 * the pointers to the areas, the private routing buffers, the weights and any scratch filled in.
 *
 * Shapes: R rows of the areas, Tb bucket, H hidden, K top-k, S slots of a layer.
 */
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#define HL_STEP_SPAN 1024
#define HL_ERR_TIMEOUT 1
#define HL_ERR_BAD_SLOT 2
#define HL_ERR_KERNEL 4 /* the kernel refused the call (a plan built for other shapes): zeros */
#define HL_ROW 32
#define HL_HEAD 3
#define KT_LINKS 64
/* kernels by number: a plan row's head and kt_call's kind */
enum { HL_ZERO = 0, HL_QA = 1, HL_AMX = 2, HL_DECODE = 3, KT_DEQUANT = 4 };

typedef struct KThread KThread;

typedef struct {
    KThread *kt;
    volatile int64_t *req_flag;
    const int32_t *req_ids; /* [R, K] */
    const float *req_w;     /* [R, K] */
    volatile int64_t *ans_flag, *ans_status;
    uint8_t *ans_out; /* [R, H] */
    int rows, hidden, top_k, esize;
    int64_t *ids; /* [R, K] private copy, widened */
    float *w;     /* [R, K] private copy */
    /* the step handed over (under kt->mu) */
    const int64_t *plan;
    int layers, bucket, state; /* state: 0 idle, 1 handed over, 2 running */
    int64_t step, timeout_ns;
    int64_t abort; /* atomic: a step whose waits end now */
    /* the running step (the kernel thread's own) */
    int layer;
    int64_t err, kernel_ns, wait_ns, wait_from;
    unsigned polls;
    /* the last finished step (under kt->mu) */
    int64_t done_step, done_errors, done_layers, done_kernel_ns, done_wait_ns;
} HostLink;

struct KThread {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* to the thread: a step handed over, a call posted, quit */
    pthread_cond_t done; /* from it: a step ended, a call answered */
    HostLink *links[KT_LINKS];
    int nlinks, quit;
    int64_t posted; /* bumped (under mu, read atomically) at every hand-over and quit */
    /* one call at a time: state 0 free, 1 posted, 2 running, 3 answered */
    int call_kind, call_state, call_rc;
    const int64_t *call_args;
    int64_t spin_ns; /* how long the idle thread spins before it sleeps */
    int yield;       /* no core to spare beside the team: spinners yield, and callers spin too */
    pid_t pid;       /* the thread exists in this process only (a fork's child has none) */
};

static int64_t hl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* backend._decode's call as an argument block (int64 [25]): integer dots when the format has
 * them, else the general kernel on fp32 activations (bf16 in: widened exactly into the scratch
 * d[24]; out rounded as torch rounds, through the scratch d[18]) */
int moe_decode_a(const int64_t *d) {
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

/* dequant_rows's arguments as int64 [9] */
int dequant_rows_a(const int64_t *a) {
    dequant_rows((const uint8_t *)a[0], (long)a[1], (int)a[2], (int)a[3], (int)a[4], (int)a[5], (float *)a[6],
                 (int)a[7], (int)a[8]);
    return 0;
}

static int kt_run(int kind, const int64_t *a) {
    switch (kind) {
    case HL_QA: return moe_decode_qa(a);
    case HL_AMX: return moe_amx_a(a);
    case HL_DECODE: return moe_decode_a(a);
    case KT_DEQUANT: return dequant_rows_a(a);
    default: return -3;
    }
}

/* the layer this link waits for, when its flag is up: the kernel into the answer, then the flag */
static void hl_layer(HostLink *h) {
    const int64_t want = h->step * HL_STEP_SPAN + h->layer + 1;
    const int64_t tk = hl_now();
    h->wait_ns += tk - h->wait_from;
    const int64_t *row = h->plan + (size_t)h->layer * HL_ROW;
    const int64_t s_ = row[1];
    const int n = h->bucket * h->top_k;
    int bad = 0;
    for (int p = 0; p < n; p++) {
        const int32_t id = h->req_ids[p];
        bad |= id < -1 || id >= s_;
        h->ids[p] = id;
        h->w[p] = h->req_w[p];
    }
    int rc = 0;
    if (bad)
        h->err |= HL_ERR_BAD_SLOT;
    else if (row[0] != HL_ZERO)
        rc = kt_run((int)row[0], row + HL_HEAD);
    if (rc) h->err |= HL_ERR_KERNEL;
    if (bad || rc || row[0] == HL_ZERO) memset(h->ans_out, 0, (size_t)h->bucket * h->hidden * h->esize);
    if (!bad && row[2]) {
        int64_t *counts = (int64_t *)row[2];
        for (int p = 0; p < n; p++) counts[h->ids[p] + 1]++;
    }
    const int64_t end = hl_now();
    h->kernel_ns += end - tk;
    *h->ans_status = h->err;
    __atomic_store_n(h->ans_flag, want, __ATOMIC_RELEASE);
    h->layer++;
    h->wait_from = end;
}

/* one look at a running step: 1 a layer ran, 2 the step ended (every layer answered, or its
 * wait was cancelled or timed out), 0 nothing yet */
static int hl_poll(HostLink *h) {
    if (h->layer >= h->layers) return 2; /* a step of no layers */
    if (__atomic_load_n(h->req_flag, __ATOMIC_ACQUIRE) == h->step * HL_STEP_SPAN + h->layer + 1) {
        hl_layer(h);
        return h->layer == h->layers ? 2 : 1;
    }
    if (++h->polls % 64) return 0;
    if (__atomic_load_n(&h->abort, __ATOMIC_RELAXED) == h->step || hl_now() - h->wait_from >= h->timeout_ns) {
        h->err |= HL_ERR_TIMEOUT;
        __atomic_store_n(h->ans_status, h->err, __ATOMIC_RELEASE);
        return 2;
    }
    return 0;
}

static void *kt_main(void *arg) {
    KThread *k = arg;
    HostLink *run[KT_LINKS];
    int ended[KT_LINKS];
    pthread_mutex_lock(&k->mu);
    for (;;) {
        int n = 0;
        for (int j = 0; j < k->nlinks; j++) {
            HostLink *h = k->links[j];
            if (h->state == 1) {
                h->state = 2, h->layer = 0, h->err = h->kernel_ns = h->wait_ns = 0, h->polls = 0;
                h->wait_from = hl_now();
            }
            if (h->state == 2) run[n++] = h;
        }
        if (k->call_state == 1) { /* between two layers of any running step */
            const int kind = k->call_kind;
            const int64_t *a = k->call_args;
            k->call_state = 2;
            pthread_mutex_unlock(&k->mu);
            const int rc = kt_run(kind, a);
            pthread_mutex_lock(&k->mu);
            k->call_rc = rc;
            __atomic_store_n(&k->call_state, 3, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&k->done);
            continue;
        }
        const int64_t seen = k->posted;
        if (n == 0) {
            if (k->quit) break;
            /* idle: spin a little for the next hand-over, then sleep */
            pthread_mutex_unlock(&k->mu);
            const int64_t t0 = hl_now();
            int woke = 0;
            while (!woke && hl_now() - t0 < k->spin_ns) {
                for (int j = 0; j < 64 && !woke; j++) {
                    woke = __atomic_load_n(&k->posted, __ATOMIC_ACQUIRE) != seen;
                    _mm_pause();
                }
                if (k->yield) sched_yield();
            }
            pthread_mutex_lock(&k->mu);
            while (k->posted == seen) pthread_cond_wait(&k->cv, &k->mu);
            continue;
        }
        pthread_mutex_unlock(&k->mu);
        /* the running steps' layers as their flags come up, until one ends or something is posted */
        int any = 0;
        for (int j = 0; j < n; j++) ended[j] = 0;
        while (!any && __atomic_load_n(&k->posted, __ATOMIC_ACQUIRE) == seen) {
            int ran = 0;
            for (int j = 0; j < n; j++) {
                if (ended[j]) continue;
                const int r = hl_poll(run[j]);
                ran |= r;
                if (r == 2) ended[j] = any = 1;
            }
            if (!ran) _mm_pause();
        }
        pthread_mutex_lock(&k->mu);
        for (int j = 0; j < n; j++) {
            if (!ended[j]) continue;
            HostLink *h = run[j];
            h->done_step = h->step, h->done_errors = h->err, h->done_layers = h->layer;
            h->done_kernel_ns = h->kernel_ns, h->done_wait_ns = h->wait_ns;
            h->state = 0;
        }
        if (any) pthread_cond_broadcast(&k->done);
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

static void kt_post(KThread *k) { /* under mu */
    __atomic_store_n(&k->posted, k->posted + 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&k->cv);
}

/* a kernel thread that spins spin_ns before it sleeps; with `yield` (the team takes every core)
 * it yields the CPU as it spins and its callers spin as long for their answer (where a wake-up
 * costs more than a yield), else callers sleep at once (their spin would take a core, or a
 * hyperthread's sibling, from the team while the kernel runs). NULL when it cannot start. */
void *kt_open(int64_t spin_ns, int yield) {
    KThread *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    k->spin_ns = spin_ns, k->yield = yield;
    k->pid = getpid();
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, NULL);
    pthread_cond_init(&k->done, NULL);
    if (pthread_create(&k->th, NULL, kt_main, k)) {
        pthread_mutex_destroy(&k->mu);
        pthread_cond_destroy(&k->cv);
        pthread_cond_destroy(&k->done);
        free(k);
        return NULL;
    }
    return k;
}

/* runs kernel `kind` (HL_QA, HL_AMX, HL_DECODE, KT_DEQUANT) on argument block `a` on the kernel
 * thread and returns its code; callers from several threads take turns */
int kt_call(void *p, int kind, const int64_t *a) {
    KThread *k = p;
    pthread_mutex_lock(&k->mu);
    while (k->call_state != 0) pthread_cond_wait(&k->done, &k->mu);
    k->call_kind = kind, k->call_args = a, k->call_state = 1;
    kt_post(k);
    pthread_mutex_unlock(&k->mu);
    if (k->yield) { /* no core to spare: a yielding spin beats a wake-up there */
        const int64_t t0 = hl_now();
        while (__atomic_load_n(&k->call_state, __ATOMIC_ACQUIRE) != 3 && hl_now() - t0 < k->spin_ns) {
            for (int j = 0; j < 64; j++) _mm_pause();
            sched_yield();
        }
    }
    pthread_mutex_lock(&k->mu);
    while (k->call_state != 3) pthread_cond_wait(&k->done, &k->mu);
    const int rc = k->call_rc;
    k->call_state = 0;
    pthread_cond_broadcast(&k->done); /* the next caller */
    pthread_mutex_unlock(&k->mu);
    return rc;
}

/* ends the thread (0); -1 while links are open on it. In a fork's child (no thread) it only
 * answers 0. */
int kt_close(void *p) {
    KThread *k = p;
    if (getpid() != k->pid) return 0;
    pthread_mutex_lock(&k->mu);
    if (k->nlinks) {
        pthread_mutex_unlock(&k->mu);
        return -1;
    }
    k->quit = 1;
    kt_post(k);
    pthread_mutex_unlock(&k->mu);
    pthread_join(k->th, NULL);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    pthread_cond_destroy(&k->done);
    free(k);
    return 0;
}

/* a[0] request area, a[1] answer area, a[2] R, a[3] H, a[4] K, a[5] bytes per element,
 * a[6] ids buffer [R, K] int64, a[7] weights buffer [R, K] fp32 (the caller's, kept until
 * hl_close), a[8] the kernel thread that runs its steps. NULL when the thread has
 * KT_LINKS links already. */
void *hl_open(const int64_t *a) {
    KThread *k = (KThread *)a[8];
    HostLink *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    uint8_t *req = (uint8_t *)a[0], *ans = (uint8_t *)a[1];
    const size_t r = (size_t)a[2], hd = (size_t)a[3], kk = (size_t)a[4], es = (size_t)a[5];
    /* link_layout.py's RequestViews / AnswerViews */
    const size_t x_bytes = (r * hd * es + 255) / 256 * 256, ids_bytes = (r * kk * 4 + 255) / 256 * 256;
    h->kt = k;
    h->req_flag = (volatile int64_t *)req;
    h->req_ids = (const int32_t *)(req + 256 + x_bytes);
    h->req_w = (const float *)(req + 256 + x_bytes + ids_bytes);
    h->ans_flag = (volatile int64_t *)ans;
    h->ans_status = (volatile int64_t *)(ans + 64);
    h->ans_out = ans + 256;
    h->rows = (int)r, h->hidden = (int)hd, h->top_k = (int)kk, h->esize = (int)es;
    h->ids = (int64_t *)a[6], h->w = (float *)a[7];
    h->abort = -1, h->done_step = -1;
    pthread_mutex_lock(&k->mu);
    const int ok = k->nlinks < KT_LINKS;
    if (ok) k->links[k->nlinks++] = h;
    pthread_mutex_unlock(&k->mu);
    if (!ok) {
        free(h);
        return NULL;
    }
    return h;
}

/* hands step `step` over (plan: layers rows of HL_ROW words, kept by the caller until the step
 * is done); -1 when the last step still runs */
int hl_start(void *p, const int64_t *plan, int layers, int bucket, int64_t step, int64_t timeout_ns) {
    HostLink *h = p;
    KThread *k = h->kt;
    pthread_mutex_lock(&k->mu);
    if (h->state != 0) {
        pthread_mutex_unlock(&k->mu);
        return -1;
    }
    h->plan = plan, h->layers = layers, h->bucket = bucket, h->step = step, h->timeout_ns = timeout_ns;
    h->state = 1;
    kt_post(k);
    pthread_mutex_unlock(&k->mu);
    return 0;
}

/* ends step `step`'s waits now (any thread); its later layers are not answered */
void hl_cancel(void *p, int64_t step) { __atomic_store_n(&((HostLink *)p)->abort, step, __ATOMIC_RELAXED); }

/* waits up to timeout_ms for the link to be idle; then out = (step, errors, layers answered,
 * kernel ns, wait ns) of the last finished step. Returns 1 when idle, 0 on timeout. */
int hl_wait(void *p, int64_t timeout_ms, int64_t *out) {
    HostLink *h = p;
    KThread *k = h->kt;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    pthread_mutex_lock(&k->mu);
    while (h->state != 0)
        if (pthread_cond_timedwait(&k->done, &k->mu, &until)) break;
    const int idle = h->state == 0;
    out[0] = h->done_step, out[1] = h->done_errors, out[2] = h->done_layers;
    out[3] = h->done_kernel_ns, out[4] = h->done_wait_ns;
    pthread_mutex_unlock(&k->mu);
    return idle;
}

/* ends the step in flight (cancelled), takes the link off its thread, frees it */
void hl_close(void *p) {
    HostLink *h = p;
    KThread *k = h->kt;
    pthread_mutex_lock(&k->mu);
    __atomic_store_n(&h->abort, h->step, __ATOMIC_RELAXED);
    while (h->state != 0) pthread_cond_wait(&k->done, &k->mu);
    for (int j = 0; j < k->nlinks; j++)
        if (k->links[j] == h) {
            k->links[j] = k->links[--k->nlinks];
            break;
        }
    pthread_mutex_unlock(&k->mu);
    free(h);
}
