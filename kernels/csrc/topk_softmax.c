/* Router selection on CPU: kernels/gating.py `select_experts_ref` in one call per layer (decode: ~10 PyTorch ops
   a layer fewer).  Per row of logits [T, E] (fp32, row stride sx): sanitize (NaN -> -inf, +inf -> FLT_MAX, a row
   with no finite entry -> all zeros), softmax, top-k of (scores + bias) with exact ties to the lowest expert id
   (a strict > scan in ascending id), weights = scores of the chosen ids, divided by their sum (at least FLT_MIN)
   when renormalizing.  The bias steers the selection only (DeepSeek-V3's auxiliary-loss-free balancing,
   arXiv 2412.19437, section 2.1.2).  Scores may differ from torch.softmax's by an ulp (expf against SLEEF). */
#include <float.h>
#include <math.h>

#define MAX_EXPERTS 1024

typedef struct {
    const float *x; long sx, T, E, K, renorm; const float *bias; float *w; long *ids;
} moeray_topk_softmax_args;

/* Returns 0, or -1 when E > MAX_EXPERTS or K is outside [1, E] (the caller takes the PyTorch path). */
long moeray_topk_softmax(const moeray_topk_softmax_args *a) {
    const long E = a->E, K = a->K;
    if (E > MAX_EXPERTS || K < 1 || K > E) return -1;
    float p[MAX_EXPERTS], key[MAX_EXPERTS];
    for (long t = 0; t < a->T; t++) {
        const float *x = a->x + t * a->sx;
        float m = -INFINITY;
        for (long e = 0; e < E; e++) {
            float v = x[e];
            if (isnan(v)) v = -INFINITY;
            else if (v == INFINITY) v = FLT_MAX;
            p[e] = v;
            if (v > m) m = v;
        }
        if (m == -INFINITY) {  /* no finite entry: uniform scores */
            for (long e = 0; e < E; e++) p[e] = 0.0f;
            m = 0.0f;
        }
        float s = 0.0f;
        for (long e = 0; e < E; e++) {
            p[e] = expf(p[e] - m);
            s += p[e];
        }
        for (long e = 0; e < E; e++) {
            p[e] /= s;
            key[e] = a->bias ? p[e] + a->bias[e] : p[e];
        }
        float *w = a->w + t * K;
        long *ids = a->ids + t * K;
        float sum = 0.0f;
        for (long k = 0; k < K; k++) {
            long best = -1;
            for (long e = 0; e < E; e++)
                if (key[e] != -INFINITY && (best < 0 || key[e] > key[best])) best = e;
            if (best < 0)  /* cannot happen with finite keys; keep ids in range */
                best = k;
            ids[k] = best;
            w[k] = p[best];
            sum += p[best];
            key[best] = -INFINITY;  /* taken */
        }
        if (a->renorm) {
            const float d = sum > FLT_MIN ? sum : FLT_MIN;
            for (long k = 0; k < K; k++) w[k] /= d;
        }
    }
    return 0;
}
