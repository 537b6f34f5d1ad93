/* Fixed-order CPU kernels of the true on-policy mode (loaded by cpu_kernels.py).
 *
 * Every output element is computed by one sequence of IEEE operations that depends only on its
 * own inputs: a dot product is one fmaf chain over k, in order, from 0; a sum over keys runs in
 * 16 lanes fixed by the key's position, then a fixed tree. Vectorization spreads *independent*
 * elements over SIMD lanes and never reorders a chain, and fmaf and the basic operations round
 * the same on every x86-64 CPU (scalar or vector, AVX2 or AVX-512, FMA instruction or libm),
 * so a row's bits do not depend on the batch, on its place in it, on the instruction set or on
 * the compiler's flags. Built with -ffp-contract=off: no multiply and add is fused unless written
 * as fmaf.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* ---- matmul ------------------------------------------------------------------------------------ */

#ifdef __AVX512F__
#define NR 64 /* columns per block: 4 zmm registers a row */
#else
#define NR 32
#endif
#define MR 4 /* rows per block */

/* out[m][n] = sum_k a[m][k] * bt[k][n], for rows m0 .. m0 + mr - 1 and columns n0 .. n0 + nr - 1. */
static void matmul_block(const float *a, const float *bt, float *out, int64_t N, int64_t K, int64_t m0,
                         int64_t n0, int mr, int nr) {
    float acc[MR][NR];
    memset(acc, 0, sizeof(acc));
    if (mr == MR && nr == NR) { /* the same chains as below, with sizes the compiler knows */
        for (int64_t k = 0; k < K; k++) {
            const float *b = bt + k * N + n0;
            for (int i = 0; i < MR; i++) {
                const float x = a[(m0 + i) * K + k];
                for (int j = 0; j < NR; j++) acc[i][j] = fmaf(x, b[j], acc[i][j]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k++) {
            const float *b = bt + k * N + n0;
            for (int i = 0; i < mr; i++) {
                const float x = a[(m0 + i) * K + k];
                for (int j = 0; j < nr; j++) acc[i][j] = fmaf(x, b[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++) memcpy(out + (m0 + i) * N + n0, acc[i], nr * sizeof(float));
}

/* out [M, N] = a [M, K] @ bt [K, N], all row-major and contiguous. */
void rl_matmul(const float *a, const float *bt, float *out, int64_t M, int64_t N, int64_t K) {
    for (int64_t n0 = 0; n0 < N; n0 += NR) {
        const int nr = N - n0 < NR ? (int)(N - n0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            matmul_block(a, bt, out, N, K, m0, n0, mr, nr);
        }
    }
}

/* ---- attention --------------------------------------------------------------------------------- */

/* exp(x) for x <= 0: x clamped at -87 (e^-87 ~ 1.6e-38, the weight of a key that far below the
 * row's largest score), x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree
 * 7 (error below 1e-8 relative), times 2^n by the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float round_shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504f + round_shift) - round_shift;
    float r = fmaf(-n, 0.693145752f, x); /* ln2 in two parts: the first times n is exact */
    r = fmaf(-n, 1.42860677e-06f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

/* ---- silu ------------------------------------------------------------------------------------ */

/* silu(g) = g / (1 + e^-g), each element on its own: e^-g as exp_nonpositive's polynomial on
 * x = -|g|, inverted for g < 0 (so 1 / e^-|g|, x clamped at -87 as there). The result depends on
 * the element alone, not on where it sits in the tensor or how many there are (torch's vectorized
 * exp rounds its scalar tail differently on some CPUs). */
void rl_silu(const float *g, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float e = exp_nonpositive(-fabsf(g[i]));
        const float exp_minus_g = g[i] >= 0.0f ? e : 1.0f / e;
        out[i] = g[i] / (1.0f + exp_minus_g);
    }
}

#define TILE 16 /* consecutive queries of a segment attended together: they share key and value reads */

/* Causal attention, one query at a time in effect: query i (segment s = segments[i], position
 * pos = positions[i]) attends to keys 0 .. pos of segment s, key p in slot key_slots[s][p].
 *   q [N, Hq, D], kv [2, Hkv, R, D] (K then V, R slots), key_slots [S, L], out [N, Hq, D].
 * For query i and head h (kv head h / (Hq / Hkv)): s_p = scale * (fmaf chain over d of q.k_p),
 * m = max_p s_p, w_p = exp_nonpositive(s_p - m), out = (fmaf chain over p of w_p v_p) / sum_p w_p,
 * the sum in LANES lanes by p % LANES, then halved in a fixed tree. Consecutive queries of one
 * segment, and the query heads of one kv head, are tiled only to share key and value reads; no
 * value of one query depends on another.
 * scratch: rl_attend_scratch(N, positions, Hq / Hkv, D) floats. Returns 0, or 1 (nothing
 * computed) when a segment, position or slot to be read is out of range. */
static int64_t score_width(int64_t N, const int64_t *positions) {
    int64_t keys = 0;
    for (int64_t i = 0; i < N; i++) keys = positions[i] + 1 > keys ? positions[i] + 1 : keys;
    return (keys + LANES - 1) / LANES * LANES;
}

int64_t rl_attend_scratch(int64_t N, const int64_t *positions, int64_t group, int64_t D) {
    return TILE * group * (score_width(N, positions) + 1) + D * LANES + 4 * D;
}

int rl_attend(const float *q, const float *kv, const int64_t *key_slots, const int64_t *segments,
              const int64_t *positions, float *out, float *scratch, int64_t N, int64_t Hq, int64_t Hkv, int64_t R,
              int64_t D, int64_t S, int64_t L, float scale) {
    const int64_t group = Hq / Hkv;
    const float *keys = kv, *values = kv + Hkv * R * D;
    for (int64_t i = 0; i < N; i++) {
        if (segments[i] < 0 || segments[i] >= S || positions[i] < 0 || positions[i] >= L) return 1;
        for (int64_t p = 0; p <= positions[i]; p++)
            if (key_slots[segments[i] * L + p] < 0 || key_slots[segments[i] * L + p] >= R) return 1;
    }
    const int64_t width = score_width(N, positions);
    float *scores = scratch, *sums = scores + TILE * group * width, *key_block = sums + TILE * group,
          *acc = key_block + D * LANES;
    for (int64_t i0 = 0; i0 < N;) {
        int64_t t_count = 1;
        while (t_count < TILE && i0 + t_count < N && segments[i0 + t_count] == segments[i0]) t_count++;
        const int64_t *slots = key_slots + segments[i0] * L;
        int64_t last = 0;
        for (int64_t t = 0; t < t_count; t++) last = positions[i0 + t] > last ? positions[i0 + t] : last;
        /* Rows r = (query head in the group) * t_count + t share each key and value row read. */
        const int64_t rows = group * t_count;
#define ROW_Q(r) (q + ((i0 + (r) % t_count) * Hq + g * group + (r) / t_count) * D)
#define ROW_POS(r) (positions[i0 + (r) % t_count])
        for (int64_t g = 0; g < Hkv; g++) {
            /* scores[r][p] for p <= last, 16 keys at a time, their rows laid out d-major */
            for (int64_t p0 = 0; p0 <= last; p0 += LANES) {
                for (int j = 0; j < LANES; j++) {
                    const int64_t p = p0 + j;
                    if (p <= last) {
                        const float *k = keys + (g * R + slots[p]) * D;
                        for (int64_t d = 0; d < D; d++) key_block[d * LANES + j] = k[d];
                    } else {
                        for (int64_t d = 0; d < D; d++) key_block[d * LANES + j] = 0.0f;
                    }
                }
                int64_t r = 0;
                for (; r + 4 <= rows; r += 4) { /* four rows' chains interleaved: the same chains */
                    const float *q0 = ROW_Q(r), *q1 = ROW_Q(r + 1), *q2 = ROW_Q(r + 2), *q3 = ROW_Q(r + 3);
                    float dot[4][LANES] = {{0}};
                    for (int64_t d = 0; d < D; d++) {
                        const float *k = key_block + d * LANES;
                        for (int j = 0; j < LANES; j++) {
                            dot[0][j] = fmaf(q0[d], k[j], dot[0][j]);
                            dot[1][j] = fmaf(q1[d], k[j], dot[1][j]);
                            dot[2][j] = fmaf(q2[d], k[j], dot[2][j]);
                            dot[3][j] = fmaf(q3[d], k[j], dot[3][j]);
                        }
                    }
                    for (int u = 0; u < 4; u++)
                        for (int j = 0; j < LANES; j++) scores[(r + u) * width + p0 + j] = dot[u][j] * scale;
                }
                for (; r < rows; r++) {
                    const float *query = ROW_Q(r);
                    float dot[LANES] = {0};
                    for (int64_t d = 0; d < D; d++)
                        for (int j = 0; j < LANES; j++) dot[j] = fmaf(query[d], key_block[d * LANES + j], dot[j]);
                    for (int j = 0; j < LANES; j++) scores[r * width + p0 + j] = dot[j] * scale;
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t pos = ROW_POS(r);
                float *w = scores + r * width;
                float m = w[0];
                for (int64_t p = 1; p <= pos; p++) m = w[p] > m ? w[p] : m;
                for (int64_t p = 0; p <= pos; p++) w[p] = exp_nonpositive(w[p] - m);
                for (int64_t p = pos + 1; p < width; p++) w[p] = 0.0f; /* adds exact zeros below */
                float lanes[LANES] = {0};
                for (int64_t p0 = 0; p0 < width; p0 += LANES)
                    for (int j = 0; j < LANES; j++) lanes[j] += w[p0 + j];
                for (int half = LANES / 2; half > 0; half /= 2)
                    for (int j = 0; j < half; j++) lanes[j] += lanes[j + half];
                sums[r] = lanes[0];
            }
            for (int64_t r = 0; r < rows; r += 4) { /* four rows share each value row read */
                const int u_count = rows - r < 4 ? (int)(rows - r) : 4;
                int64_t pos[4] = {0}, reach = 0;
                for (int u = 0; u < u_count; u++) {
                    pos[u] = ROW_POS(r + u);
                    reach = pos[u] > reach ? pos[u] : reach;
                }
                memset(acc, 0, sizeof(float) * 4 * D);
                for (int64_t p = 0; p <= reach; p++) {
                    const float *v = values + (g * R + slots[p]) * D;
                    for (int u = 0; u < u_count; u++) {
                        if (p > pos[u]) continue;
                        const float weight = scores[(r + u) * width + p];
                        float *a = acc + u * D;
                        for (int64_t d = 0; d < D; d++) a[d] = fmaf(weight, v[d], a[d]);
                    }
                }
                for (int u = 0; u < u_count; u++) {
                    float *o = out + (ROW_Q(r + u) - q);
                    for (int64_t d = 0; d < D; d++) o[d] = acc[u * D + d] / sums[r + u];
                }
            }
        }
#undef ROW_Q
#undef ROW_POS
        i0 += t_count;
    }
    return 0;
}
