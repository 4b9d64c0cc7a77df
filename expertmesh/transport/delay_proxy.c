/* The loopback delay proxy's data path in C (expertmesh/transport/delay_proxy.py holds the
 * semantics, the loopback checks, the CLI and the Python fallback).
 *
 * One accept thread, and per connection and direction one thread that does both halves: it
 * reads whatever the source has (non-blocking), stamps the chunk with the time the kernel
 * received its bytes, keeps it in a ring until due, and sends it then. One thread per
 * direction means no hand-over and no wake-up between reading and sending; the receive stamp
 * (SO_TIMESTAMPNS, converted to CLOCK_MONOTONIC) means the time this thread took to wake up
 * counts inside the delay instead of on top of it.
 *
 * Waiting: within spin_ns of the next chunk's due time the thread busy-polls (non-blocking recv,
 * clock, yielding the core between polls); otherwise it sleeps in ppoll on the source (and the destination when a send would
 * block) until spin_ns before the next due time. After the last byte moved it busy-polls the
 * source for spin_ns less the shortest delay before it sleeps: thanks to the receive stamp a
 * wake-up that takes less than the delay costs nothing, so with a delay of 100 us it sleeps at
 * once and spins only before sending. Its timer slack is set to 1 ns, so that a sleep does not
 * overshoot by the default 50 us.
 *
 * Order: due = max(previous due, stamp + delay + jitter) keeps every chunk behind the one before
 * it, so jitter only ever delays. End of stream passes on as a half-close when due; a failed
 * send closes the connection both ways. No allocation per chunk: the ring is allocated with
 * the connection, and a full ring stops reading (TCP pushes back on the sender).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING_BYTES (1 << 20) /* per direction: 10 GB/s in flight at 100 us */
#define RING_CHUNKS 4096
#define MAX_READ (256 << 10)
#define NEVER INT64_MAX
#define CONNECT_TIMEOUT_S 10
#define MAX_TARGETS 8
#define LATE_NS 20000 /* a chunk sent this long after it was due counts as late */

/* dproxy_stats() slots */
enum {
    ST_CHUNKS,     /* chunks sent (ends of stream not counted) */
    ST_BYTES,      /* bytes sent */
    ST_LATE_SUM,   /* ns: each chunk's first send after its due time, summed */
    ST_LATE_MAX,   /* ns: the largest of those */
    ST_LATE,       /* chunks sent LATE_NS or more after due */
    ST_LAG_SUM,    /* ns: each read's time from the kernel's receive stamp, summed */
    ST_LAG_MAX,    /* ns: the largest of those */
    ST_STAMPED,    /* reads that carried the kernel's receive stamp */
    ST_READS,      /* reads that returned bytes */
    ST_N
};

typedef struct {
    int64_t due; /* CLOCK_MONOTONIC ns */
    uint64_t off; /* byte counter of its first byte */
    uint32_t len; /* 0: end of stream */
    uint32_t sent;
    uint32_t counted; /* its lateness is in the stats */
} chunk_t;

struct proxy;
struct conn;

typedef struct {
    struct conn *conn;
    int src, dst;
    uint64_t rng;
    int64_t last_due;
    uint64_t byte_head, byte_tail; /* counters; index = counter % RING_BYTES */
    uint32_t chunk_head, chunk_tail;
    chunk_t *chunks;
    unsigned char *buf;
} direction_t;

typedef struct conn {
    struct proxy *proxy;
    int a, b; /* the accepted client, the connection to the target */
    int live; /* direction threads still running; the last one closes the sockets */
    int started[2];
    pthread_t th[2];
    struct conn *next;
    direction_t dir[2];
} conn_t;

typedef struct proxy {
    int listen_fd, stop_fd;
    struct sockaddr_storage to[MAX_TARGETS]; /* tried in order, as a resolver's answers */
    socklen_t to_len[MAX_TARGETS];
    int targets;
    int64_t delay, jitter, spin;
    int64_t read_spin; /* spin - the shortest delay: a wake-up later than the delay is absorbed */
    uint64_t seed;
    int stop; /* atomic */
    int64_t connections; /* accepted so far */
    int64_t stats[ST_N]; /* atomics */
    int threads;         /* direction threads alive */
    conn_t *conns; /* live */
    conn_t *done; /* ended, their threads not joined yet */
    pthread_mutex_t mu;
    pthread_cond_t gone;
    pthread_t acceptor;
} proxy_t;

static int64_t mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* CLOCK_MONOTONIC time at which the kernel received the bytes of the last recvmsg: its
 * CLOCK_REALTIME stamp moved by the two clocks' present offset (``now`` where there is none) */
static int64_t arrival_ns(struct msghdr *m, int64_t now, int *stamped) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec ts, rt;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            clock_gettime(CLOCK_REALTIME, &rt);
            int64_t age = ((int64_t)rt.tv_sec - ts.tv_sec) * 1000000000LL + (rt.tv_nsec - ts.tv_nsec);
            /* NOTE: a stamp from the future (the wall clock stepped) or older than a second
             * (stepped the other way) is not trusted */
            *stamped = age >= 0 && age < 1000000000LL;
            return *stamped ? now - age : now;
        }
    }
    return now;
}

static void stat_add(proxy_t *p, int slot, int64_t v) { __atomic_fetch_add(&p->stats[slot], v, __ATOMIC_RELAXED); }

static void stat_max(proxy_t *p, int slot, int64_t v) {
    int64_t old = __atomic_load_n(&p->stats[slot], __ATOMIC_RELAXED);
    while (v > old && !__atomic_compare_exchange_n(&p->stats[slot], &old, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static int ring_has_room(direction_t *d) {
    return d->chunk_tail - d->chunk_head < RING_CHUNKS && d->byte_tail - d->byte_head < RING_BYTES;
}

static void push(direction_t *d, int64_t stamp, uint32_t len) {
    proxy_t *p = d->conn->proxy;
    int64_t delay = p->delay;
    if (p->jitter > 0) /* uniform in [-jitter, +jitter] */
        delay += (int64_t)(splitmix(&d->rng) % (uint64_t)(2 * p->jitter + 1)) - p->jitter;
    int64_t due = stamp + (delay > 0 ? delay : 0);
    if (due < d->last_due)
        due = d->last_due; /* NOTE: never before the previous chunk: TCP's order */
    d->last_due = due;
    chunk_t *c = &d->chunks[d->chunk_tail % RING_CHUNKS];
    c->due = due, c->off = d->byte_tail, c->len = len, c->sent = 0, c->counted = 0;
    d->chunk_tail++;
    d->byte_tail += len;
}

/* 1: read something (or the end), 0: nothing to read now */
static int read_some(direction_t *d, int *eof) {
    uint64_t used = d->byte_tail - d->byte_head;
    size_t at = d->byte_tail % RING_BYTES;
    size_t room = RING_BYTES - used;
    if (room > RING_BYTES - at)
        room = RING_BYTES - at; /* a chunk never wraps: its bytes go out in one send */
    if (room > MAX_READ)
        room = MAX_READ;
    struct iovec iov = {d->buf + at, room};
    union {
        char buf[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr align;
    } ctl;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t n = recvmsg(d->src, &m, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    int64_t now = mono_ns();
    if (n <= 0) { /* the end, or a reset: passed on as the end when due */
        push(d, now, 0);
        *eof = 1;
        return 1;
    }
    int stamped = 0;
    int64_t arrived = arrival_ns(&m, now, &stamped);
    proxy_t *p = d->conn->proxy;
    stat_add(p, ST_READS, 1);
    stat_add(p, ST_STAMPED, stamped);
    stat_add(p, ST_LAG_SUM, now - arrived);
    stat_max(p, ST_LAG_MAX, now - arrived);
    push(d, arrived, (uint32_t)n);
    return 1;
}

enum { SEND_IDLE, SEND_MOVED, SEND_BLOCKED, SEND_END, SEND_FAILED };

/* sends every chunk that is due */
static int send_due(direction_t *d, int64_t now) {
    int moved = 0;
    while (d->chunk_head != d->chunk_tail) {
        chunk_t *c = &d->chunks[d->chunk_head % RING_CHUNKS];
        if (c->due > now)
            break;
        if (c->len == 0) {
            shutdown(d->dst, SHUT_WR);
            return SEND_END;
        }
        if (c->sent == 0 && !c->counted) {
            proxy_t *p = d->conn->proxy;
            int64_t late = now - c->due;
            stat_add(p, ST_CHUNKS, 1);
            stat_add(p, ST_LATE_SUM, late);
            stat_max(p, ST_LATE_MAX, late);
            stat_add(p, ST_LATE, late >= LATE_NS);
            c->counted = 1;
        }
        ssize_t n = send(d->dst, d->buf + (c->off % RING_BYTES) + c->sent, c->len - c->sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return SEND_BLOCKED;
            return SEND_FAILED;
        }
        moved = 1;
        c->sent += (uint32_t)n;
        stat_add(d->conn->proxy, ST_BYTES, n);
        if (c->sent == c->len) {
            d->chunk_head++;
            d->byte_head += c->len;
        }
    }
    return moved ? SEND_MOVED : SEND_IDLE;
}

static void conn_shutdown(conn_t *c) {
    shutdown(c->a, SHUT_RDWR);
    shutdown(c->b, SHUT_RDWR);
}

static void run_direction(direction_t *d) {
    proxy_t *p = d->conn->proxy;
    int eof = 0;
    int64_t active = mono_ns(); /* when a byte last moved */
    for (;;) {
        if (__atomic_load_n(&p->stop, __ATOMIC_RELAXED))
            return;
        int moved = 0;
        if (!eof && ring_has_room(d))
            moved = read_some(d, &eof);
        int64_t now = mono_ns();
        int s = send_due(d, now);
        if (s == SEND_END)
            return;
        if (s == SEND_FAILED) {
            conn_shutdown(d->conn); /* the other direction sees its end at once */
            return;
        }
        if (moved || s == SEND_MOVED) {
            active = now;
            continue;
        }
        int64_t due = (s != SEND_BLOCKED && d->chunk_head != d->chunk_tail)
                          ? d->chunks[d->chunk_head % RING_CHUNKS].due
                          : NEVER;
        if (due - now <= p->spin || now - active < p->read_spin) {
            /* NOTE: busy-poll (a sleep and wake-up would cost more than the wait), yielding the
             * core between polls: on a host with few cores the endpoints may need it meanwhile */
            sched_yield();
            continue;
        }
        struct pollfd fds[3] = {{p->stop_fd, POLLIN, 0}};
        nfds_t nfds = 1;
        if (!eof && ring_has_room(d))
            fds[nfds++] = (struct pollfd){d->src, POLLIN, 0};
        if (s == SEND_BLOCKED)
            fds[nfds++] = (struct pollfd){d->dst, POLLOUT, 0};
        struct timespec ts, *tsp = NULL;
        if (due != NEVER) {
            int64_t wait = due - p->spin - now;
            ts.tv_sec = wait / 1000000000LL, ts.tv_nsec = wait % 1000000000LL;
            tsp = &ts;
        }
        ppoll(fds, nfds, tsp, NULL);
        active = mono_ns() - p->read_spin; /* woken: poll once more, then sleep again if idle */
    }
}

static void conn_free(conn_t *c) {
    for (int i = 0; i < 2; i++) {
        free(c->dir[i].buf);
        free(c->dir[i].chunks);
    }
    free(c);
}

/* A direction thread's end; the connection's last one closes its sockets and leaves it on the
 * done list, whose threads reap() joins */
static void conn_release(conn_t *c) {
    proxy_t *p = c->proxy;
    pthread_mutex_lock(&p->mu);
    int last = --c->live == 0;
    if (last) {
        for (conn_t **q = &p->conns; *q; q = &(*q)->next)
            if (*q == c) {
                *q = c->next;
                break;
            }
        conn_shutdown(c);
        close(c->a);
        close(c->b);
        c->next = p->done, p->done = c;
    }
    p->threads--;
    pthread_cond_broadcast(&p->gone);
    pthread_mutex_unlock(&p->mu);
}

/* Joins the threads of the connections that have ended and frees them. */
static void reap(proxy_t *p) {
    pthread_mutex_lock(&p->mu);
    conn_t *c = p->done;
    p->done = NULL;
    pthread_mutex_unlock(&p->mu);
    while (c) {
        conn_t *next = c->next;
        for (int i = 0; i < 2; i++)
            if (c->started[i])
                pthread_join(c->th[i], NULL);
        conn_free(c);
        c = next;
    }
}

static void *direction_main(void *arg) {
    direction_t *d = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    pthread_setname_np(pthread_self(), "dproxy-conn");
    run_direction(d);
    conn_release(d->conn);
    return NULL;
}

/* A connection to the first target address that takes one, or -1. */
static int connect_target(proxy_t *p) {
    /* NOTE: a target whose backlog is full would hold the accept thread (and a stop) in connect
     * for minutes; on Linux the send timeout bounds a connect */
    struct timeval limit = {CONNECT_TIMEOUT_S, 0}, none = {0, 0};
    for (int i = 0; i < p->targets; i++) {
        int b = socket(p->to[i].ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (b < 0)
            continue;
        setsockopt(b, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
        if (connect(b, (struct sockaddr *)&p->to[i], p->to_len[i]) == 0) {
            setsockopt(b, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
            return b;
        }
        close(b);
    }
    return -1;
}

static void start_conn(proxy_t *p, int a) {
    int b = connect_target(p);
    if (b < 0) {
        close(a);
        return;
    }
    int one = 1;
    for (int i = 0; i < 2; i++) {
        int fd = i ? b : a;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    }
    conn_t *c = calloc(1, sizeof *c);
    int ok = c != NULL;
    for (int i = 0; ok && i < 2; i++) {
        direction_t *d = &c->dir[i];
        d->conn = c, d->src = i ? b : a, d->dst = i ? a : b;
        d->rng = p->seed ^ ((uint64_t)p->connections << 1 | (uint64_t)i);
        d->buf = malloc(RING_BYTES);
        d->chunks = malloc(sizeof(chunk_t) * RING_CHUNKS);
        ok = d->buf && d->chunks;
    }
    if (!ok) {
        if (c)
            conn_free(c);
        close(a), close(b);
        return;
    }
    c->proxy = p, c->a = a, c->b = b;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_mutex_lock(&p->mu);
    c->next = p->conns, p->conns = c;
    p->connections++;
    for (int i = 0; i < 2; i++) {
        c->live++, p->threads++;
        c->started[i] = pthread_create(&c->th[i], &attr, direction_main, &c->dir[i]) == 0;
        if (!c->started[i]) {
            c->live--, p->threads--;
            conn_shutdown(c); /* the other direction (if started) ends and closes */
        }
    }
    int orphan = c->live == 0;
    if (orphan)
        p->conns = c->next;
    pthread_mutex_unlock(&p->mu);
    pthread_attr_destroy(&attr);
    if (orphan) {
        close(a), close(b);
        conn_free(c);
    }
}

static void *accept_main(void *arg) {
    proxy_t *p = arg;
    pthread_setname_np(pthread_self(), "dproxy-accept");
    while (!__atomic_load_n(&p->stop, __ATOMIC_RELAXED)) {
        struct pollfd fds[2] = {{p->stop_fd, POLLIN, 0}, {p->listen_fd, POLLIN, 0}};
        if (poll(fds, 2, -1) < 0 && errno != EINTR)
            return NULL;
        if (__atomic_load_n(&p->stop, __ATOMIC_RELAXED))
            return NULL;
        reap(p);
        int a = accept4(p->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (a >= 0)
            start_conn(p, a);
        else if (errno == EBADF || errno == EINVAL)
            return NULL; /* the listening socket is gone */
    }
    return NULL;
}

/* Forwards connections accepted on listen_fd (which stays the caller's) to port at the first of
 * ``hosts`` (comma-separated IP addresses, up to MAX_TARGETS) that takes the connection.
 * Returns NULL with errno set where it cannot start. */
void *dproxy_start(int listen_fd, const char *hosts, int port, int64_t delay_ns, int64_t jitter_ns,
                   int64_t spin_ns, uint64_t seed) {
    if (delay_ns < 0 || jitter_ns < 0 || spin_ns < 0 || port <= 0 || port > 65535) {
        errno = EINVAL;
        return NULL;
    }
    proxy_t *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", hosts);
    char *save = NULL;
    for (char *h = strtok_r(buf, ",", &save); h && p->targets < MAX_TARGETS; h = strtok_r(NULL, ",", &save)) {
        struct sockaddr_in *v4 = (struct sockaddr_in *)&p->to[p->targets];
        struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&p->to[p->targets];
        if (inet_pton(AF_INET, h, &v4->sin_addr) == 1) {
            v4->sin_family = AF_INET, v4->sin_port = htons((uint16_t)port);
            p->to_len[p->targets++] = sizeof *v4;
        } else if (inet_pton(AF_INET6, h, &v6->sin6_addr) == 1) {
            v6->sin6_family = AF_INET6, v6->sin6_port = htons((uint16_t)port);
            p->to_len[p->targets++] = sizeof *v6;
        } else {
            p->targets = 0;
            break;
        }
    }
    if (p->targets == 0) {
        free(p);
        errno = EINVAL;
        return NULL;
    }
    p->listen_fd = listen_fd;
    p->delay = delay_ns, p->jitter = jitter_ns, p->spin = spin_ns, p->seed = seed;
    p->read_spin = spin_ns - (delay_ns > jitter_ns ? delay_ns - jitter_ns : 0);
    p->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    /* NOTE: non-blocking, so that a connection reset between poll and accept never blocks */
    int fl = fcntl(listen_fd, F_GETFL);
    if (p->stop_fd < 0 || fl < 0 || fcntl(listen_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        int e = errno;
        if (p->stop_fd >= 0)
            close(p->stop_fd);
        free(p);
        errno = e;
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->gone, NULL);
    sigset_t all, old;
    sigfillset(&all); /* its threads leave signals to the caller's threads */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&p->acceptor, NULL, accept_main, p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        close(p->stop_fd);
        free(p);
        errno = rc;
        return NULL;
    }
    return p;
}

int64_t dproxy_connections(void *h) {
    proxy_t *p = h;
    pthread_mutex_lock(&p->mu);
    int64_t n = p->connections;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* The counters (ST_*) into out[ST_N]. */
void dproxy_stats(void *h, int64_t *out) {
    proxy_t *p = h;
    for (int i = 0; i < ST_N; i++)
        out[i] = __atomic_load_n(&p->stats[i], __ATOMIC_RELAXED);
}

/* Stops accepting, closes every connection, waits for every thread, writes the final counters
 * and the connections accepted into final[ST_N + 1] (unless NULL), frees the proxy. */
void dproxy_stop(void *h, int64_t *final) {
    proxy_t *p = h;
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELAXED);
    uint64_t one = 1;
    (void)!write(p->stop_fd, &one, sizeof one);
    pthread_join(p->acceptor, NULL);
    pthread_mutex_lock(&p->mu);
    for (conn_t *c = p->conns; c; c = c->next)
        conn_shutdown(c);
    while (p->threads > 0)
        pthread_cond_wait(&p->gone, &p->mu);
    pthread_mutex_unlock(&p->mu);
    reap(p);
    if (final) {
        dproxy_stats(p, final);
        final[ST_N] = p->connections;
    }
    close(p->stop_fd);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->gone);
    free(p);
}
