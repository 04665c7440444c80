/* Motor-controller side of docs/protocol.md, in C against libzmq, written from the document.
 *
 * Build:  cc -O2 -Wall -Wextra -o subscriber_c examples/subscriber_c.c -lzmq
 *         (Debian/Ubuntu: apt-get install libzmq3-dev)
 * Run:    ./subscriber_c [endpoint] [count]      default tcp://127.0.0.1:5555, 500 messages
 *
 * Prints one line per action and a summary: messages, sequence gaps, publish-to-receive
 * latency (same host: both sides use CLOCK_MONOTONIC), HOLD count. A stream silent for
 * SILENT_MS counts as HOLD (one line each time it falls silent). Exits 0 after `count`
 * actions or a SHUTDOWN message, 1 on a protocol error.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define HEADER_SIZE 64
#define FLAG_HOLD 0x001u
#define FLAG_SHUTDOWN 0x080u
/* A silent stream means HOLD too (protocol.md section 1): a daemon killed without its SHUTDOWN
 * message, or a cable pulled, sends nothing at all. A few control periods (5 at 50 Hz). */
#define SILENT_MS 100

/* Little-endian field readers: independent of the host's byte order and alignment. */
static uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t rd64(const unsigned char *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }
static float rdf32(const unsigned char *p) {
    uint32_t u = rd32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

struct action_header {
    uint16_t version, kind, index, rows, dim;
    uint32_t flags, session, chunk_id;
    uint64_t seq;
    int64_t publish_mono_ns, publish_wall_ns, obs_mono_ns;
};

static int parse_header(const unsigned char *b, size_t n, struct action_header *h) {
    if (n != HEADER_SIZE || memcmp(b, "PHYA", 4) != 0) return -1;
    h->version = rd16(b + 4);
    if (h->version != 1) return -1;
    h->kind = rd16(b + 6);
    h->flags = rd32(b + 8);
    h->session = rd32(b + 12);
    h->seq = rd64(b + 16);
    h->publish_mono_ns = (int64_t)rd64(b + 24);
    h->publish_wall_ns = (int64_t)rd64(b + 32);
    h->obs_mono_ns = (int64_t)rd64(b + 40);
    h->chunk_id = rd32(b + 48);
    h->index = rd16(b + 52);
    h->rows = rd16(b + 54);
    h->dim = rd16(b + 56);
    return 0;
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Receive one frame into `buf`; returns its size, -1 when ZeroMQ fails (errno EAGAIN: nothing
 * within SILENT_MS), or -2 for a frame larger than `cap`. Sets *more if another frame follows. */
static int recv_frame(void *sock, unsigned char *buf, size_t cap, int *more) {
    int n = zmq_recv(sock, buf, cap, 0);
    if (n < 0) return -1;
    int m = 0;
    size_t ms = sizeof m;
    zmq_getsockopt(sock, ZMQ_RCVMORE, &m, &ms);
    *more = m;
    return n > (int)cap ? -2 : n; /* truncated frames are errors */
}

int main(int argc, char **argv) {
    const char *endpoint = argc > 1 ? argv[1] : "tcp://127.0.0.1:5555";
    long count = argc > 2 ? strtol(argv[2], NULL, 10) : 500;
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_SUB);
    int silent_ms = SILENT_MS;
    if (zmq_setsockopt(sock, ZMQ_RCVTIMEO, &silent_ms, sizeof silent_ms) != 0 || zmq_connect(sock, endpoint) != 0 ||
        zmq_setsockopt(sock, ZMQ_SUBSCRIBE, "action", 6) != 0) {
        fprintf(stderr, "cannot connect to %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        return 1;
    }
    unsigned char topic[256], head[HEADER_SIZE + 1], payload[4 * 1024];
    long received = 0, gaps = 0, holds = 0;
    int have_last = 0;
    uint64_t last_seq = 0;
    uint32_t session = 0;
    double lat_sum_us = 0, lat_max_us = 0;
    int status = 0, silent = 0;
    while (received < count) {
        int more = 0;
        int nt = recv_frame(sock, topic, sizeof topic, &more);
        if (nt == -1 && zmq_errno() == EAGAIN) {
            if (!silent && have_last) {
                printf("no message for %d ms: HOLD (the daemon stopped or the link is down)\n", SILENT_MS);
                fflush(stdout);
                silent = 1;
                holds++; /* one for the silent episode, as the header says */
            }
            /* A real controller holds the motors here until messages come again. */
            continue;
        }
        silent = 0;
        if (nt < 0 || !more) { status = 1; fprintf(stderr, "bad topic frame\n"); break; }
        int nh = recv_frame(sock, head, sizeof head, &more);
        struct action_header h;
        if (nh < 0 || !more || parse_header(head, (size_t)nh, &h) != 0) {
            status = 1; fprintf(stderr, "bad header\n"); break;
        }
        int np = recv_frame(sock, payload, sizeof payload, &more);
        int64_t now = mono_ns();
        if (np < 0 || more || (size_t)np != (size_t)h.rows * h.dim * 4 || h.kind != 1) {
            status = 1; fprintf(stderr, "bad payload\n"); break;
        }
        if (!have_last || h.session != session) {
            session = h.session;
        } else if (h.seq > last_seq + 1) {
            /* Only forward: an unsigned difference of a repeat would subtract from the count. */
            gaps += (long)(h.seq - last_seq - 1);
        }
        have_last = 1;
        last_seq = h.seq;
        received++;
        double lat_us = (double)(now - h.publish_mono_ns) / 1e3;
        lat_sum_us += lat_us;
        if (lat_us > lat_max_us) lat_max_us = lat_us;
        if (h.flags & FLAG_HOLD) holds++;
        printf("seq %llu chunk %u[%u] flags 0x%03x latency %.1f us a0 %.4f\n", (unsigned long long)h.seq,
               h.chunk_id, h.index, h.flags, lat_us, h.dim ? rdf32(payload) : 0.0f);
        /* A real controller sends the payload to the motors unless HOLD is set. */
        if (h.flags & FLAG_SHUTDOWN) break;
    }
    printf("summary: received %ld gaps %ld holds %ld latency mean %.1f us max %.1f us\n", received, gaps, holds,
           received ? lat_sum_us / received : 0.0, lat_max_us);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return status;
}
