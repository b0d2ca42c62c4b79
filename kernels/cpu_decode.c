/* Quantized weights times a few rows of activations on the CPU, the weights decoded in registers (the decode
 * step's matmuls and the head): kernels/cpu_decode.py builds this file with the machine's C compiler and calls it.
 *
 * Both take x [M, K] float32 row-major and write y [M, N] float32 row-major, y = x @ W.T, with every product and
 * sum in float32 (a fused multiply-add per weight; the group's sum scaled once), so y equals the float64 product
 * of x and the dequantized weight up to float32 rounding. The output rows are split among the OpenMP threads
 * (torch's own runtime: the library is loaded after torch, and both name libgomp.so.1). K is a multiple of 32 and
 * of group; group a multiple of 32.
 *
 * int4: packed [N, K / 2] uint8, nibbles paired within each block of 32 columns (Q4_1's layout: byte j of a block
 *       holds column j in its low nibble and column j + 16 in its high one); scales, mins [N, K / group] float32;
 *       W[n, k] = code * scale + min, so y = sum over groups of scale * (codes . x) + min * sum(x over the group).
 * int8: q [N, K] int8; scales [N, K / group] float32; W[n, k] = q * scale (Q8_0 at group 32). */

#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_TILE 4 /* rows of x that share one decode of the weight */

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define INT4_TILE 2 /* rows of x per pass over an int4 row block (its accumulators fill the registers) */

static inline __attribute__((always_inline)) void int4_tile(const float *x, int mt, int K, const uint8_t *blk, int B,
                                                            const uint16_t *sz, size_t sz_stride, int group,
                                                            const float *xsum, int groups, float *out) {
    /* out[m, r] = W[r] . x[m] for the B rows r of one row block: blk [K, B / 2] bytes, sz its rows' (scale, zero)
     * bfloat16 pairs of group 0 (group g at sz + g * sz_stride); W = (code - 8) * scale + zero, so a group adds
     * scale * (codes . x) + (zero - 8 * scale) * sum(x over the group); xsum [mt, groups] */
#ifdef __AVX512F__
    if (B == 64) {
        __m512 total[INT4_TILE][4];
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 4; j++) total[m][j] = _mm512_setzero_ps();
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int g = 0; g < groups; g++) {
            __m512 acc[INT4_TILE][4];
            for (int m = 0; m < mt; m++)
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
            for (int k = g * group; k < (g + 1) * group; k++) {
                if ((k & 1) == 0) _mm_prefetch((const char *)(blk + (size_t)(k + 64) * 32), _MM_HINT_T0);
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + (size_t)k * 32));
                __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                __m512 w[4] = {
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))),
                };
                for (int m = 0; m < mt; m++) {
                    __m512 xk = _mm512_set1_ps(x[(size_t)m * K + k]);
                    for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(w[j], xk, acc[m][j]);
                }
            }
            const uint32_t *pairs = (const uint32_t *)(sz + (size_t)g * sz_stride);
            for (int j = 0; j < 4; j++) {
                __m512i pair = _mm512_loadu_si512((const void *)(pairs + 16 * j));
                __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
                __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
                __m512 shift = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), s, z);
                for (int m = 0; m < mt; m++) {
                    total[m][j] = _mm512_fmadd_ps(s, acc[m][j], total[m][j]);
                    total[m][j] = _mm512_fmadd_ps(shift, _mm512_set1_ps(xsum[m * groups + g]), total[m][j]);
                }
            }
        }
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + m * 64 + 16 * j, total[m][j]);
        return;
    }
#endif
    for (int r = 0; r < B; r++) {
        int d = r % (B / 2), shift = r < B / 2 ? 0 : 4;
        for (int m = 0; m < mt; m++) {
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                float acc = 0.0f;
                for (int k = g * group; k < (g + 1) * group; k++)
                    acc += (float)((blk[(size_t)k * (B / 2) + d] >> shift) & 0x0F) * x[(size_t)m * K + k];
                float s = bf16_to_float(sz[(size_t)g * sz_stride + 2 * r]);
                float z = bf16_to_float(sz[(size_t)g * sz_stride + 2 * r + 1]);
                total += s * acc + (z - 8.0f * s) * xsum[m * groups + g];
            }
            out[m * B + r] = total;
        }
    }
}

static inline __attribute__((always_inline)) void int8_tile(const float *x, int mt, int K, const int8_t *row,
                                                            const float *scale, int group, int groups, float *out) {
#ifdef __AVX512F__
    __m512 total[MAX_TILE];
    for (int m = 0; m < mt; m++) total[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 acc[MAX_TILE];
        for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
        for (int b = g * group; b < (g + 1) * group; b += 32) {
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + b));
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
            for (int m = 0; m < mt; m++) {
                acc[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (size_t)m * K + b), acc[m]);
                acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + (size_t)m * K + b + 16), acc[m]);
            }
        }
        __m512 s = _mm512_set1_ps(scale[g]);
        for (int m = 0; m < mt; m++) total[m] = _mm512_fmadd_ps(s, acc[m], total[m]);
    }
    for (int m = 0; m < mt; m++) out[m] = _mm512_reduce_add_ps(total[m]);
#else
    float total[MAX_TILE] = {0};
    for (int g = 0; g < groups; g++) {
        float acc[MAX_TILE] = {0};
        for (int k = g * group; k < (g + 1) * group; k++)
            for (int m = 0; m < mt; m++) acc[m] += (float)row[k] * x[(size_t)m * K + k];
        for (int m = 0; m < mt; m++) total[m] += scale[g] * acc[m];
    }
    for (int m = 0; m < mt; m++) out[m] = total[m];
#endif
}

/* Each tile width its own inlined copy, so that the accumulators stay in registers. */
#define TILE_CASES(CALL) \
    switch (mt) {        \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    default: CALL(4); break; \
    }

void int4_gemv(const float *x, int M, int K, const uint8_t *packed, const uint16_t *scales_and_zeros, int N, int B,
               int group, float *xsum, float *y) {
    /* packed: torch's CPU int4 layout [N / B, K, B / 2] (byte (b, k, d) = code of row b * B + d at column k in its
     * low nibble, of row b * B + B / 2 + d in its high one); scales_and_zeros [K / group, N, 2] bfloat16;
     * xsum: scratch [M, K / group] float32, filled here */
    int groups = K / group;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int k = g * group; k < (g + 1) * group; k++) s += x[(size_t)m * K + k];
            xsum[m * groups + g] = s;
        }
#pragma omp parallel for schedule(static)
    for (int b = 0; b < N / B; b++) {
        const uint8_t *blk = packed + (size_t)b * K * (B / 2);
        const uint16_t *sz = scales_and_zeros + (size_t)b * B * 2;
        float out[INT4_TILE * 64];
        for (int m0 = 0; m0 < M; m0 += INT4_TILE) {
            int mt = M - m0 < INT4_TILE ? M - m0 : INT4_TILE;
            if (mt == 1)
                int4_tile(x + (size_t)m0 * K, 1, K, blk, B, sz, (size_t)N * 2, group, xsum + m0 * groups, groups, out);
            else
                int4_tile(x + (size_t)m0 * K, 2, K, blk, B, sz, (size_t)N * 2, group, xsum + m0 * groups, groups, out);
            for (int m = 0; m < mt; m++)
                for (int r = 0; r < B; r++) y[(size_t)(m0 + m) * N + (size_t)b * B + r] = out[m * B + r];
        }
    }
}

void int8_gemv(const float *x, int M, int K, const int8_t *q, const float *scales, int N, int group, float *y) {
    int groups = K / group;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *row = q + (size_t)n * K;
        const float *scale = scales + (size_t)n * groups;
        for (int m0 = 0; m0 < M; m0 += MAX_TILE) {
            int mt = M - m0 < MAX_TILE ? M - m0 : MAX_TILE;
            float out[MAX_TILE];
#define INT8_CALL(T) int8_tile(x + (size_t)m0 * K, T, K, row, scale, group, groups, out)
            TILE_CASES(INT8_CALL)
            for (int m = 0; m < mt; m++) y[(size_t)(m0 + m) * N + n] = out[m];
        }
    }
}

/* Decode attention over a paged float32 cache, one query per sequence (paged_attention's decode rows, as
 * kernels.gathered_attention computes them): q [B, H, D] contiguous, out [B, H, D]; k_cache, v_cache [blocks,
 * block_size, KVH, D] with strides (in floats) block_stride, slot_stride, head_stride and D contiguous; block_tables [B, max_blocks]
 * int32, seq_lens [B] int32. Query head h reads KV head h / (H / KVH) over keys max(0, L - window) .. L - 1 (all
 * of them where window <= 0), scores scale * q . k, soft-capped where softcap > 0 (softcap * tanh(s / softcap));
 * softmax in one pass with a running maximum; a sequence of length 0 gives zeros. D <= 512. */
#include <math.h>

void decode_attention(const float *q, const float *k_cache, const float *v_cache, long block_stride, long slot_stride,
                      long head_stride,
                      const int32_t *block_tables, const int32_t *seq_lens, int B, int H, int KVH, int D,
                      int block_size, int max_blocks, float scale, int window, float softcap, float *out) {
    int group = H / KVH;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H, kvh = h / group;
        const float *qv = q + (size_t)bh * D;
        float *o = out + (size_t)bh * D;
        float acc[512];
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        int len = seq_lens[b], first = window > 0 && len > window ? len - window : 0;
        float running_max = -INFINITY, denom = 0.0f;
        for (int t = first; t < len; t++) {
            long block = block_tables[(size_t)b * max_blocks + t / block_size];
            long at = block * block_stride + (long)(t % block_size) * slot_stride + (long)kvh * head_stride;
            const float *kv = k_cache + at, *vv = v_cache + at;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qv[d] * kv[d];
            s *= scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (s > running_max) { /* rescale what was summed to the new maximum */
                float shrink = expf(running_max - s);
                denom *= shrink;
                for (int d = 0; d < D; d++) acc[d] *= shrink;
                running_max = s;
            }
            float p = expf(s - running_max);
            denom += p;
            for (int d = 0; d < D; d++) acc[d] += p * vv[d];
        }
        for (int d = 0; d < D; d++) o[d] = len > first ? acc[d] / denom : 0.0f;
    }
}

/* In place, rows of float32 [T, hidden] contiguous: residual += x (when add), then x = weight * (residual *
 * 1 / sqrt(mean(residual^2) + eps)), the sum of squares in float32 (HF's LlamaRMSNorm at float32). */
void add_rms_norm(float *x, float *residual, const float *weight, int T, int hidden, float eps, int add) {
    for (int t = 0; t < T; t++) {
        float *xr = x + (size_t)t * hidden, *rr = residual + (size_t)t * hidden;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int i = 0; i < hidden; i++) {
            float v = add ? rr[i] + xr[i] : rr[i];
            rr[i] = v;
            sq += v * v;
        }
        float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
        for (int i = 0; i < hidden; i++) xr[i] = weight[i] * (rr[i] * inv);
    }
}

/* In place: the query and key heads qk [T, HK, D] (row stride qk_row, heads D apart) rotated as
 * kernels.reference.apply_rotary_ does, x * cos + partner(x) * sin_signed with each product rounded and then the
 * sum (the file is built with -ffp-contract=off), partner(d) = (d + R / 2) % R below the rotary width R, d itself
 * above it; cos, sin_signed [T, D] rows. Then the rotated keys (heads HK - KVH ..) and v [T, KVH, D] (row stride
 * v_row) go to their slots of k_cache, v_cache [blocks, block_size, KVH, D] (strides block_stride, slot_stride,
 * head_stride); a
 * negative slot writes nothing. D <= 512. */
void rotary_write_kv(float *qk, long qk_row, const float *v, long v_row, const float *cos, const float *sin_signed,
                     float *k_cache, float *v_cache, long block_stride, long slot_stride, long head_stride,
                     const int64_t *slots, int T, int HK,
                     int KVH, int D, int R, int block_size) {
    int half = R / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * D, *s = sin_signed + (size_t)t * D;
        for (int h = 0; h < HK; h++) {
            float *x = qk + (size_t)t * qk_row + (size_t)h * D, old[512];
            memcpy(old, x, sizeof(float) * D);
            for (int d = 0; d < D; d++) {
                int partner = d < R ? (d + half) % R : d;
                float kept = old[d] * c[d], turned = old[partner] * s[d];
                x[d] = kept + turned;
            }
        }
        if (slots[t] < 0) continue;
        long at = (slots[t] / block_size) * block_stride + (slots[t] % block_size) * slot_stride;
        for (int h = 0; h < KVH; h++) {
            memcpy(k_cache + at + h * head_stride, qk + (size_t)t * qk_row + (size_t)(HK - KVH + h) * D,
                   sizeof(float) * D);
            memcpy(v_cache + at + h * head_stride, v + (size_t)t * v_row + (size_t)h * D, sizeof(float) * D);
        }
    }
}

/* 1 where the matrix-vector products run on AVX-512 (this build's target has it), 0 where they run the portable
 * loops, which are correct but slower than torch's own kernels. */
int vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
