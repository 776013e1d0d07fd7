/* The expert predictor's decode-step bookkeeping (actors/prefetch/predictors.py formulas): Markov counts,
   Markov / hybrid distributions, the lookahead gate, and one MoE layer's whole step. */
#include "common.h"

/* The distinct valid (0 <= id < E) ids of a row of K, in first-seen order; returns how many (K <= 64). */
static long id_set(const long *row, long K, long E, long *out) {
    long n = 0;
    for (long k = 0; k < K; k++) {
        const long e = row[k];
        int dup = e < 0 || e >= E;
        for (long i = 0; i < n && !dup; i++) dup = out[i] == e;
        if (!dup) out[n++] = e;
    }
    return n;
}

/* Markov counts of one layer (actors/prefetch/predictors.py: TransitionCounts; float64): for each token t
   with expert set B_t (ids [T, K], -1 padded): freq[b] += 1, inter[a, b] += 1 for a in the token's set at the
   previous MoE layer (pl [T, Kp], or 0), intra[a, b] += 1 for a in its predecessor's set here (pt [T, Kt], or 0). */
static void markov_observe(double *freq, double *inter, double *intra, long E, long T, const long *ids, long K,
                           const long *pl, long Kp, const long *pt, long Kt) {
    long cur[64], src[64];
    for (long t = 0; t < T; t++) {
        const long nc = id_set(ids + t * K, K, E, cur);
        if (!nc) continue;
        for (long i = 0; i < nc; i++) freq[cur[i]] += 1.0;
        for (int which = 0; which < 2; which++) {
            const long *rows = which ? pt : pl, Ks = which ? Kt : Kp;
            double *m = which ? intra : inter;
            if (!rows) continue;
            const long ns = id_set(rows + t * Ks, Ks, E, src);
            for (long j = 0; j < ns; j++)
                for (long i = 0; i < nc; i++) m[src[j] * E + cur[i]] += 1.0;
        }
    }
}

/* Per token the softmax over E of the log-linear Markov score (MarkovPredictor / HybridPredictor):
       s(b) = log P(b) + w0 sum_{a in A_t} (log P_inter(b | a) - log P(b)) + w1 sum_{a in B_t} (log P_intra(b | a)
              - log P(b)) + w2 look[t, b]
   with additive smoothing alpha on every count row; A_t from pl [T, Kp] (or 0), B_t from pt [T, Kt] (or 0),
   look [T, E] log-probabilities (or 0).  out [T, E] float32. */
static void markov_probs(const double *freq, const double *inter, const double *intra, long E, double alpha,
                         double w0, double w1, double w2, long T, const long *pl, long Kp, const long *pt, long Kt,
                         const float *look, float *out) {
    double logf[E], sc[E];
    long src[64];
    double fs = 0.0;
    for (long b = 0; b < E; b++) fs += freq[b];
    for (long b = 0; b < E; b++) logf[b] = log((freq[b] + alpha) / (fs + E * alpha));
    for (long t = 0; t < T; t++) {
        for (long b = 0; b < E; b++) sc[b] = logf[b];
        for (int which = 0; which < 2; which++) {
            const long *rows = which ? pt : pl, Ks = which ? Kt : Kp;
            const double *m = which ? intra : inter, w = which ? w1 : w0;
            if (!rows) continue;
            const long ns = id_set(rows + t * Ks, Ks, E, src);
            for (long j = 0; j < ns; j++) {
                const double *ra = m + src[j] * E;
                double rs = 0.0;
                for (long b = 0; b < E; b++) rs += ra[b];
                const double tot = rs + E * alpha;
                for (long b = 0; b < E; b++) sc[b] += w * (log((ra[b] + alpha) / tot) - logf[b]);
            }
        }
        if (look) for (long b = 0; b < E; b++) sc[b] += w2 * (double)look[t * E + b];
        double mx = sc[0], z = 0.0;
        for (long b = 1; b < E; b++) mx = sc[b] > mx ? sc[b] : mx;
        for (long b = 0; b < E; b++) { sc[b] = exp(sc[b] - mx); z += sc[b]; }
        for (long b = 0; b < E; b++) out[t * E + b] = (float)(sc[b] / z);
    }
}

/* The lookahead predictor's log softmax(gate (rmsnorm(h) * norm_w)) for T rows of h [T, D] (row stride sh);
   gate [E, D] float32, norm_w [D] or 0.  out [T, E]. */
void moeray_gate_logprobs(const float *h, long sh, long T, long D, const float *norm_w, float eps,
                          const float *gate, long E, float *out, float *scratch) {
    for (long t = 0; t < T; t++) {
        const float *ht = h + t * sh;
        float ss = dotf(ht, ht, D);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (long d = 0; d < D; d++) scratch[d] = norm_w ? (ht[d] * r) * norm_w[d] : ht[d] * r;
        float *o = out + t * E, mx = -INFINITY, z = 0.0f;
        for (long e = 0; e < E; e++) { o[e] = dotf(gate + e * D, scratch, D); mx = o[e] > mx ? o[e] : mx; }
        for (long e = 0; e < E; e++) z += expf(o[e] - mx);
        const float lz = mx + logf(z);
        for (long e = 0; e < E; e++) o[e] -= lz;
    }
}

/* One MoE layer of a decode step's expert-prediction bookkeeping (actors/experts/prediction.py: ExpertRuntime), for
   T tokens, in one call:
   1. score the prediction made for this layer (pred [T, B], or 0) against its routing ids [T, K]:
      stats[0..3] += (sum |pred_t & B_t|, sum |pred_t|, sum |B_t|, T);
   2. router thrash against each token's predecessor's set pt [T, Kt] (or 0): stats[4..5] += (sum of Jaccard
      distances over tokens whose predecessor routed, their count);
   3. learn: this layer's counts (freq, inter, intra; 0: skip) as markov_observe, with pl [T, Kp];
   4. predict the next MoE layer (nfreq != 0): per token the Markov / hybrid distribution of
      markov_probs from the next layer's counts, with this layer's routing as its previous-layer set,
      npt [T, Knt] as the predecessors' sets there, and, when gate != 0, w2 times the lookahead log-probabilities
      of h [T, D] (row stride sh) under the next layer's norm and gate; then the top B experts per token (ties:
      the lower id) into pred_out [T, NB], and per expert the sum (agg) and max (top) of the T probabilities.
   scratch: D + 2 * T * E floats. */
static void prefetch_step(double *stats, const long *ids, long K, long T, const long *pred, long B,
                          const long *pl, long Kp, const long *pt, long Kt,
                          double *freq, double *inter, double *intra, long E,
                          const double *nfreq, const double *ninter, const double *nintra, double alpha,
                          double w0, double w1, double w2, const long *npt, long Knt,
                          const float *h, long sh, long D, const float *norm, float eps, const float *gate,
                          long NB, long *pred_out, float *agg, float *top, float *scratch) {
    long cur[64], oth[64];
    for (long t = 0; t < T; t++) {
        const long nc = id_set(ids + t * K, K, E, cur);
        if (pred) {
            const long np = id_set(pred + t * B, B, E, oth);
            long hit = 0;
            for (long i = 0; i < np; i++) for (long j = 0; j < nc; j++) hit += oth[i] == cur[j];
            stats[0] += hit; stats[1] += np; stats[2] += nc;
        }
        if (pt) {
            const long na = id_set(pt + t * Kt, Kt, E, oth);
            if (na) {
                long in = 0;
                for (long i = 0; i < na; i++) for (long j = 0; j < nc; j++) in += oth[i] == cur[j];
                stats[4] += 1.0 - (double)in / (double)(na + nc - in);
                stats[5] += 1.0;
            }
        }
    }
    if (pred) stats[3] += T;
    if (freq) markov_observe(freq, inter, intra, E, T, ids, K, pl, Kp, pt, Kt);
    if (!nfreq) return;
    float *look = 0, *p = scratch + D + T * E;
    if (gate) {
        look = scratch + D;
        moeray_gate_logprobs(h, sh, T, D, norm, eps, gate, E, look, scratch);
    }
    markov_probs(nfreq, ninter, nintra, E, alpha, w0, w1, look ? w2 : 0.0, T, ids, K, npt, Knt, look, p);
    for (long e = 0; e < E; e++) { agg[e] = 0.0f; top[e] = 0.0f; }
    for (long t = 0; t < T; t++) {
        const float *pr = p + t * E;
        for (long e = 0; e < E; e++) { agg[e] += pr[e]; top[e] = pr[e] > top[e] ? pr[e] : top[e]; }
        long *po = pred_out + t * NB;
        for (long i = 0; i < NB; i++) {
            long best = -1;
            for (long e = 0; e < E; e++) {
                int used = 0;
                for (long j = 0; j < i && !used; j++) used = po[j] == e;
                if (!used && (best < 0 || pr[e] > pr[best])) best = e;
            }
            po[i] = best;
        }
    }
}

/* Entry points: markov_observe's, markov_probs's and prefetch_step's arguments as one struct each
   (kernels/cpu/_abi.py: MarkovObserveArgs, MarkovProbsArgs, PrefetchStepArgs). */
typedef struct {
    double *freq, *inter, *intra; long E, T; const long *ids; long K; const long *pl; long Kp; const long *pt;
    long Kt;
} moeray_markov_observe_args;

void moeray_markov_observe(const moeray_markov_observe_args *a) {
    markov_observe(a->freq, a->inter, a->intra, a->E, a->T, a->ids, a->K, a->pl, a->Kp, a->pt, a->Kt);
}

typedef struct {
    const double *freq, *inter, *intra; long E; double alpha, w0, w1, w2; long T; const long *pl; long Kp;
    const long *pt; long Kt; const float *look; float *out;
} moeray_markov_probs_args;

void moeray_markov_probs(const moeray_markov_probs_args *a) {
    markov_probs(a->freq, a->inter, a->intra, a->E, a->alpha, a->w0, a->w1, a->w2, a->T, a->pl, a->Kp, a->pt, a->Kt,
                 a->look, a->out);
}

typedef struct {
    double *stats; const long *ids; long K, T; const long *pred; long B;    /* 1-2: score, thrash */
    const long *pl; long Kp; const long *pt; long Kt;
    double *freq, *inter, *intra; long E;                                   /* 3: learn (freq 0: skip) */
    const double *nfreq, *ninter, *nintra; double alpha, w0, w1, w2;        /* 4: predict (nfreq 0: skip) */
    const long *npt; long Knt;
    const float *h; long sh, D; const float *norm; float eps; const float *gate;  /* lookahead (gate 0: none) */
    long NB; long *pred_out; float *agg, *top, *scratch;
} moeray_prefetch_step_args;

void moeray_prefetch_step(const moeray_prefetch_step_args *a) {
    prefetch_step(a->stats, a->ids, a->K, a->T, a->pred, a->B, a->pl, a->Kp, a->pt, a->Kt, a->freq, a->inter,
                  a->intra, a->E, a->nfreq, a->ninter, a->nintra, a->alpha, a->w0, a->w1, a->w2, a->npt, a->Knt,
                  a->h, a->sh, a->D, a->norm, a->eps, a->gate, a->NB, a->pred_out, a->agg, a->top, a->scratch);
}
