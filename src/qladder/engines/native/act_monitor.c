/* Per-layer activation peaks inside llama.cpp, for qladder's step guard.
 *
 * A ggml_backend_sched eval callback: asked about every graph node, it wants only the residual
 * stream after each decoder layer ("l_out-<il>", F32 on the CPU backend), and records
 * max |x| per layer into a caller-owned float array. A NaN is recorded as NaN. Written in C
 * because a Python callback costs ~1 us per graph node (~10% of a decode step).
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
    int32_t enabled;   /* 0: decline every node (no graph splits) */
    int32_t n_layer;
    int64_t observed;  /* tensors observed since the last reset */
    float *peaks;      /* [n_layer], reset by the caller before each decode */
} qladder_monitor;

bool qladder_act_monitor(struct ggml_tensor *t, bool ask, void *user_data) {
    qladder_monitor *m = (qladder_monitor *)user_data;
    const char *name = ggml_get_name(t);
    bool wanted = m->enabled && strncmp(name, "l_out-", 6) == 0;
    if (ask) {
        return wanted;
    }
    if (!wanted) {
        return true;
    }
    int il = atoi(name + 6);
    int64_t n = ggml_nelements(t);
    const float *x = (const float *)ggml_get_data(t);
    if (il < 0 || il >= m->n_layer || x == NULL || ggml_nbytes(t) != (size_t)n * sizeof(float)) {
        return true;
    }
    float peak = m->peaks[il];
    for (int64_t i = 0; i < n; i++) {
        float v = fabsf(x[i]);
        if (v > peak || isnan(v)) {
            peak = v;
            if (isnan(v)) {
                break;
            }
        }
    }
    if (!isnan(m->peaks[il])) {
        m->peaks[il] = peak;
    }
    m->observed++;
    return true;
}
