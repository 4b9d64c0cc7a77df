/* The TCP relay: carries a host link (the request/answer areas of expertmesh/transport/link.py,
 * in host memory) over one TCP connection, with a pthread at each end and no Python per layer.
 *
 * Coordinator end: per launched step, per MoE layer i, it spins until the local request area's
 * flag shows step*STEP_SPAN+i+1, sends one request frame straight from the area, reads the
 * answer frame straight into the local answer area's out rows, writes the status word, then
 * publishes the answer flag (release). A micro-batched step (run_step) sends each frame as its
 * flag comes and takes the answers as they arrive, each micro-batch in its own rows of the areas.
 * Server end: the mirror, driven by the frames: it reads a request frame into the local
 * request area (payload first, flag last), spins until the local answer area's flag shows the
 * same value, and sends the answer frame straight from the area.
 *
 * Frames (little-endian, both ends on one architecture family):
 *   request: u32 REQ_MAGIC, u32 rows, i64 flag, then x [rows, H] (H*isz bytes a row),
 *            ids [rows, K] int32, w [rows, K] float32
 *   answer:  u32 ANS_MAGIC, u32 rows, i64 flag, i64 status, then out [rows, H]
 * An answer always carries its out rows, also with an error status (then they mean nothing):
 * fixed-size frames keep the receive to one call.
 *
 * Failures: a frame that does not parse, a connection that ends or errs mid-frame, or a peer
 * silent for longer than the timeout inside an exchange closes the connection (counted); the
 * coordinator end then answers the step's remaining layers with an error status as their
 * request flags come, so its graph runs through and the host sees the bits after the step. A
 * request flag that does not come in time (the graph is gone) or the abort word set to the step
 * ends the step without answering further. No allocation after relay_new.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define STEP_SPAN 1024 /* link.py STEP_SPAN */
#define ERR_TIMEOUT 1  /* link.py ERR_TIMEOUT */
#define ERR_WIRE 8     /* link_layout.py ERR_WIRE: the relay's connection failed or carried a bad frame */
#define REQ_MAGIC 0x31514d45u /* "EMQ1" */
#define ANS_MAGIC 0x31414d45u /* "EMA1" */
#define SLICE_MS 20 /* a blocked send/recv wakes this often to look at stop/abort/deadline */
#define MAX_STEP (1LL << 52) /* step * STEP_SPAN + index stays an int64 */

enum { ROLE_COORDINATOR = 0, ROLE_SERVER = 1 };
enum { IO_OK = 0, IO_EOF, IO_WIRE, IO_TIMEOUT, IO_ABORT };
/* relay_stats() slots */
enum {
    ST_STEPS,       /* steps run to the end (coordinator) */
    ST_LAYERS,      /* layers answered with the peer's answer */
    ST_CONNECTS,    /* connections attached */
    ST_CLOSED,      /* connections the peer closed between frames */
    ST_DROPPED,     /* connections closed on an error */
    ST_MALFORMED,   /* frames that did not parse (or ended early) */
    ST_TIMEOUTS,    /* waits that gave up */
    ST_ABORTED,     /* waits ended by the abort word */
    ST_LAST_STEP,   /* the last step run (coordinator) */
    ST_LAST_BITS,   /* its ERR_* bits (the relay's, ORed with the server's statuses) */
    ST_N
};

typedef struct {
    uint32_t magic, rows;
    int64_t flag;
} req_hdr;
typedef struct {
    uint32_t magic, rows;
    int64_t flag, status;
} ans_hdr;

typedef struct relay {
    int role;
    int64_t *req_flag, *ans_flag, *ans_status;
    uint8_t *req_x, *req_ids, *req_w, *ans_out;
    int64_t R, H, K, isz;
    int64_t timeout_ns, spin_ns;
    int64_t abort; /* a step number: its waits (and earlier steps') end at once */
    int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fd; /* -1: none; the thread's once attached */
    int pending, busy;
    int64_t p_step, p_rows, p_layers, p_micro, last_launched;
    int64_t stats[ST_N];
    pthread_t th;
} relay;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void count(relay *r, int slot) { __atomic_fetch_add(&r->stats[slot], 1, __ATOMIC_RELAXED); }

static int stopped(relay *r) { return __atomic_load_n(&r->stop, __ATOMIC_RELAXED); }

/* Steps only grow on a link, so aborting one ends every earlier one too (one queued behind). */
static int aborted(relay *r, int64_t step) {
    return step >= 0 && step <= __atomic_load_n(&r->abort, __ATOMIC_RELAXED);
}

/* Spins until *flag == want (IO_OK), the step is aborted or the relay stops (IO_ABORT), or the
 * timeout passes (IO_TIMEOUT). Pause-spins for spin_ns, then yields the core between polls (a
 * loaded host keeps its other threads going; a fresh flag is still seen within a yield). */
static int wait_flag(relay *r, const int64_t *flag, int64_t want, int64_t step) {
    int64_t t0 = now_ns(), t = t0;
    for (uint32_t k = 0;; k++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == want) return IO_OK;
        if (aborted(r, step) || stopped(r)) return IO_ABORT;
        if ((k & 63) == 0 || t - t0 >= r->spin_ns) t = now_ns(); /* a yield may take a time slice */
        if (t - t0 > r->timeout_ns) return IO_TIMEOUT;
        if (t - t0 < r->spin_ns)
            cpu_relax();
        else
            sched_yield();
    }
}

/* Sends or receives all of iov (changed in place). Polls without blocking for spin_ns (yielding
 * the core between polls), then blocks in SLICE_MS slices. ``idle``: receiving the first byte
 * of a frame has no deadline (a server waits for the next step as long as it takes); the
 * deadline starts at that byte. */
static int xfer(relay *r, int fd, struct iovec *iov, int n, int send, int idle, int64_t step) {
    int64_t t0 = now_ns(), got = 0;
    int64_t deadline = idle ? INT64_MAX : t0 + r->timeout_ns;
    struct msghdr m;
    memset(&m, 0, sizeof m);
    while (n > 0 && iov->iov_len == 0) iov++, n--;
    while (n > 0) {
        int64_t t = now_ns();
        int flags = MSG_NOSIGNAL | (t - t0 < r->spin_ns ? MSG_DONTWAIT : 0);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)n;
        ssize_t k = send ? sendmsg(fd, &m, flags) : recvmsg(fd, &m, flags);
        if (k > 0) {
            if (got == 0 && idle) deadline = now_ns() + r->timeout_ns;
            got += k;
            while (k > 0) {
                size_t take = (size_t)k < iov->iov_len ? (size_t)k : iov->iov_len;
                iov->iov_base = (uint8_t *)iov->iov_base + take;
                iov->iov_len -= take;
                k -= (ssize_t)take;
                while (n > 0 && iov->iov_len == 0) iov++, n--;
            }
            continue;
        }
        if (k == 0 && !send) return got == 0 ? IO_EOF : IO_WIRE;
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return IO_WIRE;
        if (stopped(r) || aborted(r, step)) return IO_ABORT;
        if (now_ns() > deadline) return IO_TIMEOUT;
        if (flags & MSG_DONTWAIT) sched_yield(); /* polling: a loaded host runs the peer meanwhile */
    }
    return IO_OK;
}

static void set_fd_options(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {0, SLICE_MS * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK); /* Python sockets with a timeout are non-blocking */
}

/* Closes the thread's connection (an error: counted). */
static void drop(relay *r, int *fd) {
    pthread_mutex_lock(&r->mu);
    shutdown(*fd, SHUT_RDWR);
    close(*fd);
    r->fd = *fd = -1;
    pthread_mutex_unlock(&r->mu);
    count(r, ST_DROPPED);
}

static void publish(relay *r, int64_t flag, int64_t status) {
    __atomic_store_n(r->ans_status, status, __ATOMIC_RELAXED);
    __atomic_store_n(r->ans_flag, flag, __ATOMIC_RELEASE);
}

static int io_bits(relay *r, int rc) {
    if (rc == IO_TIMEOUT) count(r, ST_TIMEOUTS);
    if (rc == IO_ABORT) count(r, ST_ABORTED);
    if (rc == IO_WIRE) count(r, ST_MALFORMED);
    return rc == IO_TIMEOUT || rc == IO_ABORT ? ERR_TIMEOUT : ERR_WIRE;
}

/* ------------------------------------------------------------------ coordinator end */

/* One step's exchange state at the coordinator end (run_step). */
typedef struct {
    int64_t step, rows, micro;
    int64_t sent, got; /* frames sent; answers published */
    int64_t bits, served;
    int fd;
} exch;

/* Reads the answer to frame ``got`` into its micro-batch's rows and publishes it (a micro-batched
 * step's status word carries the step's bits so far: a later publish never hides an error). A
 * failure mid-exchange closes the connection and answers every frame out with the bits. */
static int take_answer(relay *r, exch *e) {
    int64_t want = e->step * STEP_SPAN + e->got + 1;
    size_t nx = (size_t)(e->rows * r->H * r->isz), at = (size_t)(e->got % e->micro) * (size_t)e->rows;
    ans_hdr a;
    struct iovec in[2] = {{&a, sizeof a}, {r->ans_out + at * r->H * r->isz, nx}};
    int rc = xfer(r, e->fd, in, 2, 0, 0, e->step);
    if (rc == IO_OK && (a.magic != ANS_MAGIC || a.rows != (uint32_t)e->rows || a.flag != want)) rc = IO_WIRE;
    if (rc != IO_OK) { /* mid-exchange: the byte stream is out of step, close it */
        e->bits |= io_bits(r, rc);
        drop(r, &e->fd);
        publish(r, e->step * STEP_SPAN + e->sent, e->bits | e->served);
        e->got = e->sent;
        return rc;
    }
    e->served |= a.status;
    count(r, ST_LAYERS);
    publish(r, want, e->micro > 1 ? e->served : a.status);
    e->got++;
    return IO_OK;
}

/* Whether the connection has bytes to read (or has ended: the read then says so). */
static int readable(int fd) {
    char c;
    ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return k >= 0;
}

/* A micro-batched step's wait for the request flag to show ``want`` or a later value of the
 * step (the next request may be published before this thread looked: its rows are elsewhere),
 * taking the answers to the frames out as they arrive meanwhile: the graph may need any of them
 * before it publishes this request (a dense layer between two MoE layers waits for every
 * micro-batch's answer before the next MoE layer's first request). */
static int wait_req_serving(relay *r, exch *e, int64_t want) {
    int64_t t0 = now_ns(), t = t0;
    for (uint32_t k = 0;; k++) {
        if (__atomic_load_n(r->req_flag, __ATOMIC_ACQUIRE) >= want) return IO_OK;
        if (aborted(r, e->step) || stopped(r)) return IO_ABORT;
        if (e->got < e->sent && e->fd >= 0 && readable(e->fd)) {
            int rc = take_answer(r, e);
            if (rc == IO_ABORT) return rc;
            t0 = t = now_ns(); /* an answer came: the step is alive */
            continue;
        }
        if ((k & 63) == 0 || t - t0 >= r->spin_ns) t = now_ns(); /* a yield may take a time slice */
        if (t - t0 > r->timeout_ns) {
            if (e->got == e->sent || e->fd < 0) return IO_TIMEOUT; /* no flag: the graph is gone */
            /* frames out and no answer in time: the peer is silent, and the graph may be waiting
             * for one of them: they are answered with the bits, the connection closed (as a
             * silent answer of a plain step is) and the graph's requests still to come too */
            e->bits |= io_bits(r, IO_TIMEOUT);
            drop(r, &e->fd);
            publish(r, e->step * STEP_SPAN + e->sent, e->bits | e->served);
            e->got = e->sent;
            t0 = t = now_ns();
            continue;
        }
        if (t - t0 < r->spin_ns)
            cpu_relax();
        else
            sched_yield();
    }
}

/* A step of ``layers`` frames at ``rows`` rows. micro = 1: one frame at a time (wait for the
 * request flag, send, read the answer, publish). micro > 1: frame k is micro-batch k % micro's
 * request, in rows (k % micro) * rows of the areas; frames go out as their flags come and the
 * answers are taken as they arrive (wait_req_serving), so that one micro-batch's answer is on the
 * wire while the graph computes another's attention; the graph's waits then take a flag at or
 * past their own (two answers may be published before a wait looks). */
static int64_t run_step(relay *r, int64_t step, int64_t rows, int64_t layers, int64_t micro) {
    exch e = {step, rows, micro, 0, 0, 0, 0, __atomic_load_n(&r->fd, __ATOMIC_ACQUIRE)};
    size_t nx = (size_t)(rows * r->H * r->isz), nk = (size_t)(rows * r->K * 4);
    for (int64_t k = 0; k < layers; k++) {
        int64_t want = step * STEP_SPAN + k + 1;
        int rc = micro > 1 ? wait_req_serving(r, &e, want) : wait_flag(r, r->req_flag, want, step);
        if (rc != IO_OK) { /* the graph is gone or the step was cancelled: nobody waits for us */
            e.bits |= io_bits(r, rc);
            return e.bits | e.served;
        }
        if (e.bits || e.fd < 0) { /* an earlier layer failed: keep the graph running, with the bits */
            e.bits |= e.fd < 0 ? ERR_WIRE : 0;
            publish(r, want, e.bits | e.served);
            e.sent = e.got = k + 1;
            continue;
        }
        size_t at = (size_t)(k % micro) * (size_t)rows;
        req_hdr q = {REQ_MAGIC, (uint32_t)rows, want};
        struct iovec out[4] = {{&q, sizeof q},
                               {r->req_x + at * r->H * r->isz, nx},
                               {r->req_ids + at * r->K * 4, nk},
                               {r->req_w + at * r->K * 4, nk}};
        rc = xfer(r, e.fd, out, 4, 1, 0, step);
        if (rc != IO_OK) {
            e.bits |= io_bits(r, rc);
            drop(r, &e.fd);
            if (rc == IO_ABORT) return e.bits | e.served;
            publish(r, want, e.bits | e.served);
            e.sent = e.got = k + 1;
            continue;
        }
        e.sent = k + 1;
        if (micro == 1 && take_answer(r, &e) == IO_ABORT) return e.bits | e.served;
    }
    while (e.got < e.sent) /* the answers still out */
        if (take_answer(r, &e) == IO_ABORT) break;
    return e.bits | e.served;
}

static void coordinator_loop(relay *r) {
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->pending && !r->stop) pthread_cond_wait(&r->cv, &r->mu);
        if (r->stop) break;
        int64_t step = r->p_step, rows = r->p_rows, layers = r->p_layers, micro = r->p_micro;
        r->pending = 0;
        r->busy = 1;
        pthread_mutex_unlock(&r->mu);
        int64_t bits = run_step(r, step, rows, layers, micro);
        pthread_mutex_lock(&r->mu);
        r->busy = 0;
        r->stats[ST_LAST_STEP] = step;
        r->stats[ST_LAST_BITS] = bits;
        r->stats[ST_STEPS]++;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------------ server end */

/* Serves one connection until it ends: IO_EOF (closed between frames) or an error. */
static int serve(relay *r, int fd) {
    int64_t last = 0, dead_step = -1;
    for (;;) {
        req_hdr q;
        struct iovec h = {&q, sizeof q};
        int rc = xfer(r, fd, &h, 1, 0, 1, -1);
        if (rc != IO_OK) return rc;
        if (q.magic != REQ_MAGIC || q.rows < 1 || q.rows > (uint64_t)r->R || q.flag <= last ||
            q.flag > MAX_STEP * STEP_SPAN)
            return IO_WIRE; /* garbage, or a flag not after the last one (a replayed frame) */
        int64_t rows = q.rows, step = (q.flag - 1) / STEP_SPAN;
        size_t nx = (size_t)(rows * r->H * r->isz), nk = (size_t)(rows * r->K * 4);
        struct iovec in[3] = {{r->req_x, nx}, {r->req_ids, nk}, {r->req_w, nk}};
        rc = xfer(r, fd, in, 3, 0, 0, step);
        if (rc == IO_EOF) rc = IO_WIRE; /* ended inside the frame */
        if (rc != IO_OK) return rc;
        last = q.flag;
        int64_t status;
        if (step == dead_step || aborted(r, step)) {
            status = ERR_TIMEOUT; /* the step is over here: answer at once, in step with the peer */
        } else {
            __atomic_store_n(r->req_flag, q.flag, __ATOMIC_RELEASE);
            rc = wait_flag(r, r->ans_flag, q.flag, step);
            if (rc == IO_OK) {
                status = __atomic_load_n(r->ans_status, __ATOMIC_ACQUIRE);
                count(r, ST_LAYERS);
            } else {
                io_bits(r, rc);
                if (stopped(r)) return IO_ABORT;
                dead_step = step; /* one timeout per step, not one per layer */
                status = ERR_TIMEOUT;
            }
        }
        ans_hdr a = {ANS_MAGIC, (uint32_t)rows, q.flag, status};
        struct iovec out[2] = {{&a, sizeof a}, {r->ans_out, nx}};
        rc = xfer(r, fd, out, 2, 1, 0, -1);
        if (rc != IO_OK) return rc == IO_EOF ? IO_WIRE : rc;
    }
}

static void server_loop(relay *r) {
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (r->fd < 0 && !r->stop) pthread_cond_wait(&r->cv, &r->mu);
        int fd = r->fd;
        pthread_mutex_unlock(&r->mu);
        if (stopped(r)) break;
        int rc = serve(r, fd);
        if (rc == IO_EOF) {
            pthread_mutex_lock(&r->mu);
            shutdown(fd, SHUT_RDWR);
            close(fd);
            r->fd = -1;
            pthread_mutex_unlock(&r->mu);
            count(r, ST_CLOSED);
        } else {
            if (rc == IO_WIRE) count(r, ST_MALFORMED);
            if (rc == IO_TIMEOUT) count(r, ST_TIMEOUTS);
            drop(r, &fd);
        }
    }
}

static void *thread_main(void *arg) {
    relay *r = arg;
    if (r->role == ROLE_COORDINATOR)
        coordinator_loop(r);
    else
        server_loop(r);
    return NULL;
}

/* ------------------------------------------------------------------ API */

/* ptrs: req flag, x, ids, w, ans flag, status, out (the views of link.py's areas);
 * dims: R, H, K, itemsize; returns NULL on a bad argument or when no thread starts. */
relay *relay_new(int role, void **ptrs, const int64_t *dims, int64_t timeout_ns, int64_t spin_ns) {
    if ((role != ROLE_COORDINATOR && role != ROLE_SERVER) || timeout_ns <= 0 || spin_ns < 0) return NULL;
    for (int i = 0; i < 4; i++)
        if (dims[i] <= 0 || dims[i] > (1 << 24)) return NULL;
    for (int i = 0; i < 7; i++)
        if (!ptrs[i]) return NULL;
    relay *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->role = role;
    r->req_flag = ptrs[0], r->req_x = ptrs[1], r->req_ids = ptrs[2], r->req_w = ptrs[3];
    r->ans_flag = ptrs[4], r->ans_status = ptrs[5], r->ans_out = ptrs[6];
    r->R = dims[0], r->H = dims[1], r->K = dims[2], r->isz = dims[3];
    r->timeout_ns = timeout_ns, r->spin_ns = spin_ns;
    r->fd = -1, r->abort = -1, r->last_launched = -1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (pthread_create(&r->th, NULL, thread_main, r) != 0) {
        free(r);
        return NULL;
    }
    return r;
}

/* Hands a connected socket to the relay (it closes it): 0, or -EBUSY while it has one. */
int relay_attach(relay *r, int fd) {
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    if (r->fd >= 0 || r->busy || r->pending) {
        rc = -EBUSY;
    } else {
        set_fd_options(fd);
        __atomic_store_n(&r->fd, fd, __ATOMIC_RELEASE);
        r->stats[ST_CONNECTS]++;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int relay_connected(relay *r) {
    pthread_mutex_lock(&r->mu);
    int c = r->fd >= 0;
    pthread_mutex_unlock(&r->mu);
    return c;
}

/* Between steps nothing may be readable on the coordinator's connection: a peer that closed
 * it (EOF) or sent bytes nobody asked for is dropped now, before a step is launched over it.
 * Called with the lock held and the thread idle. */
static int still_open(relay *r) {
    char c;
    ssize_t k = recv(r->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 1;
    shutdown(r->fd, SHUT_RDWR);
    close(r->fd);
    r->fd = -1;
    count(r, k == 0 ? ST_CLOSED : ST_DROPPED);
    return 0;
}

/* Coordinator end: launches ``layers`` frames of ``step`` at ``rows`` rows, ``micro`` micro-batches
 * of ``rows`` each (run_step; layers a multiple of micro). 0, or -ENOTCONN (no connection), -EBUSY
 * (a step still queued), -EINVAL (a bad argument or a step number not after the last one: flags
 * never repeat). One step may be queued behind the running one: the graph's last wait passes a
 * moment before the thread sees its step end. */
int relay_step(relay *r, int64_t step, int64_t rows, int64_t layers, int64_t micro) {
    if (r->role != ROLE_COORDINATOR || rows < 1 || micro < 1 || rows * micro > r->R || layers < 1 ||
        layers >= STEP_SPAN || layers % micro != 0 || step < 0 || step >= MAX_STEP)
        return -EINVAL;
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    if (step <= r->last_launched)
        rc = -EINVAL;
    else if (r->fd >= 0 && !r->busy && !r->pending && !still_open(r))
        rc = -ENOTCONN;
    else if (r->fd < 0)
        rc = -ENOTCONN;
    else if (r->pending)
        rc = -EBUSY;
    else {
        r->p_step = step, r->p_rows = rows, r->p_layers = layers, r->p_micro = micro, r->pending = 1;
        r->last_launched = step;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Coordinator end: waits up to timeout_ns for no step to be running or queued; 0 or -ETIMEDOUT. */
int relay_wait_idle(relay *r, int64_t timeout_ns) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t t = ts.tv_nsec + timeout_ns;
    ts.tv_sec += t / 1000000000LL;
    ts.tv_nsec = t % 1000000000LL;
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    while ((r->busy || r->pending) && rc == 0) rc = pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    int idle = !r->busy && !r->pending;
    pthread_mutex_unlock(&r->mu);
    return idle ? 0 : -ETIMEDOUT;
}

/* Ends every wait of ``step`` and of the steps before it at once (from any thread). */
void relay_abort(relay *r, int64_t step) {
    int64_t old = __atomic_load_n(&r->abort, __ATOMIC_RELAXED);
    while (old < step &&
           !__atomic_compare_exchange_n(&r->abort, &old, step, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

void relay_stats(relay *r, int64_t *out) {
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < ST_N; i++) out[i] = __atomic_load_n(&r->stats[i], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&r->mu);
}

/* Stops the thread (a blocked send/recv is woken by the shutdown), closes the connection. */
void relay_free(relay *r) {
    pthread_mutex_lock(&r->mu);
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELAXED);
    if (r->fd >= 0) shutdown(r->fd, SHUT_RDWR);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->th, NULL);
    if (r->fd >= 0) close(r->fd);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}
