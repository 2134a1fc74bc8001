/* Per-layer activation peaks inside llama.cpp, for qladder's step guard.
 *
 * A ggml_backend_sched eval callback: asked about every graph node, it wants only the residual
 * stream after each decoder layer ("l_out-<il>", F32 rows of n_embd on the CPU backend), and
 * records per layer
 *   peaks[il]       max |x| over every position of the batch (headroom to the dtype's limit)
 *   rest_peaks[il]  the same without the sequence's first position, whose "massive activation"
 *                   (an attention sink, ~24,900 in SmolLM2) is normal; elsewhere an outlier is not.
 * A NaN is recorded as NaN. Written in C because a Python callback costs ~1 us per graph node
 * (~10% of a decode step).
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct ggml_tensor;
extern const char *ggml_get_name(const struct ggml_tensor *t);
extern int64_t ggml_nelements(const struct ggml_tensor *t);
extern size_t ggml_nbytes(const struct ggml_tensor *t);
extern void *ggml_get_data(const struct ggml_tensor *t);

typedef struct {
    int32_t enabled;       /* 0: decline every node (no graph splits) */
    int32_t n_layer;
    int64_t observed;      /* tensors observed since the last reset */
    float *peaks;          /* [n_layer], reset by the caller before each decode */
    float *rest_peaks;     /* [n_layer] */
    int32_t n_embd;
    int32_t batch_tokens;  /* tokens in the batch being decoded */
    int32_t pos0_in_batch; /* whether the batch starts at position 0 */
    int32_t _pad;
} qladder_monitor;

/* The reductions below run in GCC/Clang vector lanes (4 floats, 4 independent accumulators): a
 * single running max or sum is one serial dependency chain, ~4 cycles an element, and a
 * 49,152-logit row then costs ~60 us, 0.3% of a decode step; lanes bring it near a plain copy. */
typedef float qf4 __attribute__((vector_size(16)));
typedef int32_t qi4 __attribute__((vector_size(16)));
#define ACC 4
#define STEP (4 * ACC)

static inline qf4 load4(const float *x) {
    qf4 v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline qf4 vmax(qf4 a, qf4 b) { /* a > b ? a : b, lane-wise */
    qi4 m = a > b;
    return (qf4)(((qi4)a & m) | ((qi4)b & ~m));
}

static inline qf4 vmin(qf4 a, qf4 b) { /* a < b ? a : b, lane-wise */
    qi4 m = a < b;
    return (qf4)(((qi4)a & m) | ((qi4)b & ~m));
}

static inline float hmax(const qf4 *v, int k, float peak) {
    for (int a = 0; a < k; a++) {
        for (int w = 0; w < 4; w++) {
            peak = v[a][w] > peak ? v[a][w] : peak;
        }
    }
    return peak;
}

static inline float hmin(const qf4 *v, int k, float low) {
    for (int a = 0; a < k; a++) {
        for (int w = 0; w < 4; w++) {
            low = v[a][w] < low ? v[a][w] : low;
        }
    }
    return low;
}

static float absmax(const float *x, int64_t n, float peak) {
    const qi4 abs_mask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    qf4 lane[ACC];
    qi4 nan_seen = {0, 0, 0, 0};
    for (int a = 0; a < ACC; a++) {
        lane[a] = (qf4){peak, peak, peak, peak};
    }
    int64_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        for (int a = 0; a < ACC; a++) {
            qf4 v = (qf4)((qi4)load4(x + i + 4 * a) & abs_mask);
            nan_seen |= v != v;
            lane[a] = vmax(v, lane[a]);
        }
    }
    for (int w = 0; w < 4; w++) {
        if (nan_seen[w]) {
            return NAN;
        }
    }
    peak = hmax(lane, ACC, peak);
    for (; i < n; i++) {
        float v = fabsf(x[i]);
        if (isnan(v)) {
            return v;
        }
        peak = v > peak ? v : peak;
    }
    return peak;
}

static void merge(float *slot, float v) {
    if (!isnan(*slot) && (isnan(v) || v > *slot)) {
        *slot = v;
    }
}

bool qladder_act_monitor(struct ggml_tensor *t, bool ask, void *user_data) {
    qladder_monitor *m = (qladder_monitor *)user_data;
    bool wanted = m->enabled && strncmp(ggml_get_name(t), "l_out-", 6) == 0;
    if (ask || !wanted) {
        return ask ? wanted : true;
    }
    int il = atoi(ggml_get_name(t) + 6);
    int64_t n = ggml_nelements(t);
    const float *x = (const float *)ggml_get_data(t);
    if (il < 0 || il >= m->n_layer || x == NULL || m->n_embd <= 0 ||
        ggml_nbytes(t) != (size_t)n * sizeof(float) || n % m->n_embd != 0) {
        return true;
    }
    int64_t rows = n / m->n_embd;
    /* Row 0 is position 0 only when the batch starts there and no rows were dropped (the last
       layer keeps only the rows whose logits are wanted). */
    int64_t skip = (m->pos0_in_batch && rows == m->batch_tokens) ? m->n_embd : 0;
    float first = absmax(x, skip, 0.0f);
    float rest = absmax(x + skip, n - skip, 0.0f);
    merge(&m->rest_peaks[il], rest);
    merge(&m->peaks[il], first);
    merge(&m->peaks[il], rest);
    m->observed++;
    return true;
}

/* The step guard's row statistics, fused into the copy of llama.cpp's logits row: one pass
 * instead of a copy plus three reductions. out = {sum, max, min}; NaN/Inf propagate into the sum
 * (and NaN into max/min), as torch's reductions do.
 *
 * The hot pass sums in float lanes, flushed to a double every block. Any NaN (or +Inf with -Inf)
 * makes that sum NaN, and a finite row whose float sums overflow makes it infinite: both rare
 * rows are summed again serially in double, with the NaN recorded in max and min.
 */
#define BLOCK 1024

static void copy_stats_serial(const float *x, int64_t n, double *out) {
    double sum = 0.0;
    float hi = -INFINITY, lo = INFINITY;
    int nan_seen = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        sum += v;
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
        nan_seen |= isnan(v);
    }
    out[0] = sum;
    out[1] = nan_seen ? NAN : hi;
    out[2] = nan_seen ? NAN : lo;
}

void qladder_copy_stats(const float *src, float *dst, int64_t n, double *out) {
    memcpy(dst, src, (size_t)n * sizeof(float));
    qf4 hi[ACC], lo[ACC];
    for (int a = 0; a < ACC; a++) {
        hi[a] = (qf4){-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        lo[a] = (qf4){INFINITY, INFINITY, INFINITY, INFINITY};
    }
    double total = 0.0;
    int64_t i = 0;
    while (i + STEP <= n) {
        qf4 sum[ACC] = {{0}};
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        for (; i + STEP <= end; i += STEP) {
            for (int a = 0; a < ACC; a++) {
                qf4 v = load4(dst + i + 4 * a);
                sum[a] += v;
                hi[a] = vmax(v, hi[a]);
                lo[a] = vmin(v, lo[a]);
            }
        }
        for (int a = 0; a < ACC; a++) {
            for (int w = 0; w < 4; w++) {
                total += sum[a][w];
            }
        }
    }
    float top = hmax(hi, ACC, -INFINITY);
    float bottom = hmin(lo, ACC, INFINITY);
    for (; i < n; i++) {
        float v = dst[i];
        total += v;
        top = v > top ? v : top;
        bottom = v < bottom ? v : bottom;
    }
    if (!isfinite(total)) {
        copy_stats_serial(dst, n, out);
        return;
    }
    out[0] = total;
    out[1] = top;
    out[2] = bottom;
}

/* ---- Batched sequences: one llama_decode carrying tokens of several sequences (slots) ----------
 *
 * The same residual-stream peaks, kept per slot: the guard of one sequence sees its own peaks,
 * never another's. The caller describes each batch before decoding it: the slot of every batch
 * token, whether it is its sequence's position 0, and the slot of every output row (llama.cpp's
 * last layer keeps only the rows whose logits are wanted, in batch order). A batch must fit one
 * ubatch (n_tokens <= n_ubatch, unified KV: llama.cpp then keeps the batch's token order).
 *
 * Per-slot fault injection through the real kernels: a slot may carry a gain fault, a value added
 * to one channel of one layer's output for that slot's rows only (llama.cpp's control vectors act
 * on every sequence of a context). And an injected hang: a decode with `stall_ms` set waits inside
 * the callback until `abort_flag` is raised or the time has passed; `qladder_abort` is the
 * context's abort callback (polled by the CPU backend between graph nodes), so a watchdog that
 * raises the flag ends a hung decode, which then returns 2 (aborted).
 */
#include <time.h>

typedef struct {
    int32_t enabled;        /* record peaks this decode (the callback still runs for faults/stalls) */
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_slots;
    int32_t n_tokens;       /* tokens in the batch being decoded */
    int32_t n_outputs;      /* of which rows with logits */
    int32_t *tok_slot;      /* [n_batch] */
    int32_t *tok_pos0;      /* [n_batch] */
    int32_t *out_slot;      /* [n_batch] */
    float *peaks;           /* [n_slots * n_layer] */
    float *rest_peaks;      /* [n_slots * n_layer] */
    int32_t *gain_layer;    /* [n_slots], -1: none */
    int32_t *gain_channel;  /* [n_slots] */
    float *gain_add;        /* [n_slots] */
    int32_t any_gain;       /* whether some slot in this batch has a gain fault */
    volatile int32_t abort_flag;
    volatile int32_t stall_ms;  /* > 0: the next decode hangs (an injected fault), cleared when it ends */
    int32_t _pad;
} qladder_batch_monitor;

bool qladder_abort(void *data) {
    return ((volatile qladder_batch_monitor *)data)->abort_flag != 0;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void hang(qladder_batch_monitor *m) {
    double until = now_ms() + m->stall_ms;
    struct timespec nap = {0, 1000000}; /* 1 ms */
    while (!m->abort_flag && now_ms() < until) {
        nanosleep(&nap, NULL);
    }
    m->stall_ms = 0;
}

static void add_gains(qladder_batch_monitor *m, float *x, int64_t rows, int il, const int32_t *row_slot) {
    for (int64_t r = 0; r < rows; r++) {
        int s = row_slot[r];
        if (s >= 0 && s < m->n_slots && m->gain_layer[s] == il) {
            x[r * m->n_embd + m->gain_channel[s]] += m->gain_add[s];
        }
    }
}

bool qladder_batch_monitor_cb(struct ggml_tensor *t, bool ask, void *user_data) {
    qladder_batch_monitor *m = (qladder_batch_monitor *)user_data;
    const char *name = ggml_get_name(t);
    bool is_out = strncmp(name, "l_out-", 6) == 0;
    if (ask) {
        if (m->stall_ms > 0 && is_out) {
            hang(m);
        }
        return is_out && (m->enabled || m->any_gain);
    }
    if (!is_out) {
        return true;
    }
    int il = atoi(name + 6);
    int64_t n = ggml_nelements(t);
    float *x = (float *)ggml_get_data(t);
    if (il < 0 || il >= m->n_layer || x == NULL || m->n_embd <= 0 ||
        ggml_nbytes(t) != (size_t)n * sizeof(float) || n % m->n_embd != 0) {
        return true;
    }
    int64_t rows = n / m->n_embd;
    const int32_t *row_slot;
    const int32_t *row_pos0 = NULL;
    if (rows == m->n_tokens) {
        row_slot = m->tok_slot;
        row_pos0 = m->tok_pos0;
    } else if (rows == m->n_outputs) {
        row_slot = m->out_slot;  /* the last layer: output rows only, never position 0 of a longer prompt */
    } else {
        return true;
    }
    if (m->any_gain) {
        add_gains(m, x, rows, il, row_slot);
    }
    if (!m->enabled) {
        return true;  /* never false: the scheduler would skip the rest of the split, silently */
    }
    for (int64_t r = 0; r < rows; r++) {
        int s = row_slot[r];
        if (s < 0 || s >= m->n_slots) {
            continue;
        }
        float v = absmax(x + r * m->n_embd, m->n_embd, 0.0f);
        merge(&m->peaks[s * m->n_layer + il], v);
        if (row_pos0 == NULL || !row_pos0[r]) {
            merge(&m->rest_peaks[s * m->n_layer + il], v);
        }
    }
    return true;
}

/* Index of the first maximum of a row (NaN counts as the maximum, as torch's argmax does): the
 * greedy token. The maximum is reduced in vector lanes, then its first index is found by a scan
 * that stops there (a serial compare-and-branch pass cost ~47 us on 49,152 logits; this ~10 us). */
int64_t qladder_argmax(const float *x, int64_t n) {
    qf4 hi[ACC];
    qi4 nan_seen = {0, 0, 0, 0};
    for (int a = 0; a < ACC; a++) {
        hi[a] = (qf4){-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    }
    int64_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        for (int a = 0; a < ACC; a++) {
            qf4 v = load4(x + i + 4 * a);
            nan_seen |= v != v;
            hi[a] = vmax(v, hi[a]);
        }
    }
    float top = hmax(hi, ACC, -INFINITY);
    int nan_any = 0;
    for (int w = 0; w < 4; w++) {
        nan_any |= nan_seen[w] != 0;
    }
    for (; i < n; i++) {
        nan_any |= isnan(x[i]);
        top = x[i] > top ? x[i] : top;
    }
    for (int64_t j = 0; j < n; j++) {
        if (nan_any ? isnan(x[j]) : x[j] == top) {
            return j;
        }
    }
    return 0;
}
