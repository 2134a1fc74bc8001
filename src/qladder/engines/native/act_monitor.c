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
