/* Quantized weights times a few rows of activations on the CPU, the weights decoded in registers (the decode
 * step's matmuls and the head), and the float32 decode step's attention, norms and rotary: kernels/cpu_decode.py
 * builds this file with the machine's C compiler and calls it.
 *
 * The products take x [M, K] float32 row-major and write y [M, N] float32 row-major, y = x @ W.T. The output rows
 * are split among the OpenMP threads (torch's own runtime: the library is loaded after torch, and both name
 * libgomp.so.1). K is a multiple of 32 and of group; group a multiple of 32.
 *
 * int4: torch's CPU int4 layout at row block 64 (int4_gemv); x in 16-bit fixed point per block of 32 columns, the
 *       dot products exact in int32 (int4_quantize_row), scaled and summed in float32.
 * int8: q [N, K] int8; scales [N, K / group] float32; W[n, k] = q * scale (Q8_0 at group 32); every product and sum
 *       in float32 (a fused multiply-add per weight; the group's sum scaled once). */

#include <math.h>
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

/* int4 activations: each row's blocks of 32 columns in 16-bit fixed point, x ~ xs[b] * (256 * hi + lo) with hi, lo
 * int8 (hi = floor((q + 128) / 256), lo = q - 256 * hi, q = rint(x / xs[b]) within +-INT4_XQ_MAX), xs[b] = the
 * block's largest |x| / INT4_XQ_MAX: 2^-16 of the block's largest value at worst, where torch's int4 kernel rounds
 * each activation to bfloat16 (2^-9 of itself). The weight's codes (0..15) times hi and lo are exact integer dot
 * products (AVX512-VNNI's vpdpbusd: unsigned bytes times signed bytes, summed in int32). A block with a
 * non-finite value gets xs = NaN, so its rows' outputs are NaN as the float product's would be. */
#define INT4_XQ_MAX 32639 /* 127 * 256 + 127: hi stays within int8 */

static void int4_quantize_row(const float *x, int K, int8_t *hi, int8_t *lo, float *xs) {
    /* q = rint(x * (1 / scale)) in float32, as int4_activations computes it */
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + (size_t)b * 32;
        float amax = 0.0f;
        int finite = 1;
        for (int k = 0; k < 32; k++) {
            finite &= isfinite(xb[k]) != 0;
            amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
        }
        float scale = finite ? amax / (float)INT4_XQ_MAX : NAN;
        xs[b] = scale;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f; /* 0: a block of zeros, or NaN's row */
#ifdef __AVX512F__
        for (int half = 0; half < 2; half++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * half), _mm512_set1_ps(inv)));
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(INT4_XQ_MAX)), _mm512_set1_epi32(-INT4_XQ_MAX));
            __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
            __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
            _mm_storeu_si128((__m128i *)(hi + (size_t)b * 32 + 16 * half), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i *)(lo + (size_t)b * 32 + 16 * half), _mm512_cvtepi32_epi8(l));
        }
#else
        for (int k = 0; k < 32; k++) {
            int q = (int)lrintf(xb[k] * inv);
            q = q > INT4_XQ_MAX ? INT4_XQ_MAX : (q < -INT4_XQ_MAX ? -INT4_XQ_MAX : q);
            int h = (q + 128) >> 8;
            hi[(size_t)b * 32 + k] = (int8_t)h;
            lo[(size_t)b * 32 + k] = (int8_t)(q - 256 * h);
        }
#endif
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
/* vpermt2b indices: lane j of a 16-row quarter (rows 0-15: [0], rows 16-31: [1]) gathers its row's codes at columns
 * k .. k + 3 from two registers holding columns (k, k + 1) and (k + 2, k + 3), 32 rows each */
#define INT4_LANE(j) (j), 32 + (j), 64 + (j), 96 + (j)
static const uint8_t INT4_GATHER[2][64] = {
    {INT4_LANE(0), INT4_LANE(1), INT4_LANE(2), INT4_LANE(3), INT4_LANE(4), INT4_LANE(5), INT4_LANE(6), INT4_LANE(7),
     INT4_LANE(8), INT4_LANE(9), INT4_LANE(10), INT4_LANE(11), INT4_LANE(12), INT4_LANE(13), INT4_LANE(14),
     INT4_LANE(15)},
    {INT4_LANE(16), INT4_LANE(17), INT4_LANE(18), INT4_LANE(19), INT4_LANE(20), INT4_LANE(21), INT4_LANE(22),
     INT4_LANE(23), INT4_LANE(24), INT4_LANE(25), INT4_LANE(26), INT4_LANE(27), INT4_LANE(28), INT4_LANE(29),
     INT4_LANE(30), INT4_LANE(31)},
};
#endif

static inline __attribute__((always_inline)) void int4_block_row(const int8_t *hi, const int8_t *lo, const float *xs,
                                                                 int K, const uint8_t *blk, const uint16_t *sz,
                                                                 size_t sz_stride, int group, const float *xsum,
                                                                 float *out) {
    /* out[r] = W[r] . x for the 64 rows r of one row block (torch's layout at B = 64): blk [K, 32] bytes, byte d of
     * column k holding row d's code (low nibble) and row d + 32's (high nibble); sz the rows' (scale, zero) bfloat16
     * pairs of group 0 (group g at sz + g * sz_stride); W = (code - 8) * scale + zero, so a group adds scale *
     * (codes . x) + (zero - 8 * scale) * sum(x over the group), xsum [K / group] the exact sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i idx0 = _mm512_loadu_si512(INT4_GATHER[0]), idx1 = _mm512_loadu_si512(INT4_GATHER[1]);
    __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int g = 0; g < K / group; g++) {
        const uint32_t *pairs = (const uint32_t *)(sz + (size_t)g * sz_stride);
        __m512 gacc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int b = g * group; b < (g + 1) * group; b += 32) {
            __m512i ahi[4], alo[4];
            for (int j = 0; j < 4; j++) ahi[j] = alo[j] = _mm512_setzero_si512();
            for (int k = b; k < b + 32; k += 4) {
                _mm_prefetch((const char *)(blk + (size_t)(k + 64) * 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk + (size_t)(k + 66) * 32), _MM_HINT_T0);
                __m512i z0 = _mm512_loadu_si512((const void *)(blk + (size_t)k * 32));
                __m512i z1 = _mm512_loadu_si512((const void *)(blk + (size_t)(k + 2) * 32));
                __m512i l0 = _mm512_and_si512(z0, low4), l1 = _mm512_and_si512(z1, low4);
                __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(z0, 4), low4);
                __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(z1, 4), low4);
                __m512i w[4] = {
                    _mm512_permutex2var_epi8(l0, idx0, l1), _mm512_permutex2var_epi8(l0, idx1, l1),
                    _mm512_permutex2var_epi8(h0, idx0, h1), _mm512_permutex2var_epi8(h0, idx1, h1),
                };
                int32_t xh, xl;
                memcpy(&xh, hi + k, 4);
                memcpy(&xl, lo + k, 4);
                __m512i vh = _mm512_set1_epi32(xh), vl = _mm512_set1_epi32(xl);
                for (int j = 0; j < 4; j++) {
                    ahi[j] = _mm512_dpbusd_epi32(ahi[j], w[j], vh);
                    alo[j] = _mm512_dpbusd_epi32(alo[j], w[j], vl);
                }
            }
            __m512 scale = _mm512_set1_ps(xs[b / 32]);
            for (int j = 0; j < 4; j++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(ahi[j], 8), alo[j]); /* |dot| < 2^24: exact */
                gacc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, gacc[j]);
            }
        }
        __m512 xg = _mm512_set1_ps(xsum[g]);
        for (int j = 0; j < 4; j++) {
            __m512i pair = _mm512_loadu_si512((const void *)(pairs + 16 * j));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
            __m512 shift = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), s, z);
            total[j] = _mm512_fmadd_ps(s, gacc[j], total[j]);
            total[j] = _mm512_fmadd_ps(shift, xg, total[j]);
        }
    }
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + 16 * j, total[j]);
#else
    for (int r = 0; r < 64; r++) {
        int d = r % 32, nibble = r < 32 ? 0 : 4;
        float total = 0.0f;
        for (int g = 0; g < K / group; g++) {
            float s = bf16_to_float(sz[(size_t)g * sz_stride + 2 * r]);
            float z = bf16_to_float(sz[(size_t)g * sz_stride + 2 * r + 1]);
            float gacc = 0.0f;
            for (int b = g * group; b < (g + 1) * group; b += 32) {
                int32_t dot_hi = 0, dot_lo = 0;
                for (int k = b; k < b + 32; k++) {
                    int code = (blk[(size_t)k * 32 + d] >> nibble) & 0x0F;
                    dot_hi += code * hi[k];
                    dot_lo += code * lo[k];
                }
                gacc = fmaf((float)(dot_hi * 256 + dot_lo), xs[b / 32], gacc);
            }
            total = fmaf(s, gacc, total);
            total = fmaf(fmaf(-8.0f, s, z), xsum[g], total);
        }
        out[r] = total;
    }
#endif
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

__attribute__((noinline))
void int4_gemv(const float *x, int M, int K, const uint8_t *packed, const uint16_t *scales_and_zeros, int N,
               int group, void *scratch, float *y) {
    /* packed: torch's CPU int4 layout at row block 64, [N / 64, K, 32] (byte (b, k, d) = code of row b * 64 + d at
     * column k in its low nibble, of row b * 64 + 32 + d in its high one); scales_and_zeros [K / group, N, 2]
     * bfloat16; scratch: M * (2 * K + 4 * (K / 32 + K / group)) bytes, filled here (the rows' int8 parts, block
     * scales and group sums) */
    int groups = K / group;
    int8_t *hi = (int8_t *)scratch, *lo = hi + (size_t)M * K;
    float *xs = (float *)(lo + (size_t)M * K), *xsum = xs + (size_t)M * (K / 32);
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * K;
        int4_quantize_row(row, K, hi + (size_t)m * K, lo + (size_t)m * K, xs + (size_t)m * (K / 32));
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int k = g * group; k < (g + 1) * group; k++) s += row[k];
            xsum[m * groups + g] = s;
        }
    }
#pragma omp parallel for schedule(static)
    for (int b = 0; b < N / 64; b++) {
        const uint8_t *blk = packed + (size_t)b * K * 32;
        const uint16_t *sz = scales_and_zeros + (size_t)b * 64 * 2;
        for (int m = 0; m < M; m++) /* the block (K * 32 bytes) stays in cache for the next rows */
            int4_block_row(hi + (size_t)m * K, lo + (size_t)m * K, xs + (size_t)m * (K / 32), K, blk, sz,
                           (size_t)N * 2, group, xsum + m * groups, y + (size_t)m * N + (size_t)b * 64);
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
 * kernels.gathered_attention computes them): q [B, H, D] (rows q_row floats apart, heads D apart; decode_attention:
 * contiguous), out [B, H, D]; k_cache, v_cache [blocks, block_size, KVH, D] with strides (in floats) block_stride,
 * slot_stride, head_stride and D contiguous; block_tables [B, max_blocks] int32, seq_lens [B] int32. Query head h
 * reads KV head h / (H / KVH) over keys max(0, L - window) .. L - 1 (all of them where window <= 0), scores
 * scale * q . k, soft-capped where softcap > 0 (softcap * tanh(s / softcap)); softmax in one pass with a running
 * maximum; a sequence of length 0 gives zeros. D <= 512. */

static __attribute__((noinline))
void attention_rows(const float *q, long q_row, const float *k_cache, const float *v_cache,
                           long block_stride, long slot_stride, long head_stride, const int32_t *block_tables,
                           const int32_t *seq_lens, int B, int H, int KVH, int D, int block_size, int max_blocks,
                           float scale, int window, float softcap, float *out) {
    int group = H / KVH;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H, kvh = h / group;
        const float *qv = q + (size_t)b * q_row + (size_t)h * D;
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

void decode_attention(const float *q, const float *k_cache, const float *v_cache, long block_stride, long slot_stride,
                      long head_stride, const int32_t *block_tables, const int32_t *seq_lens, int B, int H, int KVH,
                      int D, int block_size, int max_blocks, float scale, int window, float softcap, float *out) {
    attention_rows(q, (long)H * D, k_cache, v_cache, block_stride, slot_stride, head_stride, block_tables, seq_lens,
                   B, H, KVH, D, block_size, max_blocks, scale, window, softcap, out);
}

/* In place, rows of float32 [T, hidden] contiguous: residual += x (when add), then x = weight * (residual *
 * 1 / sqrt(mean(residual^2) + eps)), the sum of squares in float32 (HF's LlamaRMSNorm at float32). */
__attribute__((noinline))
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
__attribute__((noinline))
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

/* The functions the layer below calls are noinline: one compiled body serves it and the model's calls one by one,
 * so that their reductions sum in one order (a compiler may vectorize an inlined copy's otherwise). */

/* One decoder layer's decode step up to its MLP's activation, for M rows of float32, each the one new token of its
 * sequence, every linear in torch's CPU int4 layout without a bias: the calls the model makes one by one
 * (model/llama.py DecoderLayer: add_rms_norm, int4_gemv, rotary_write_kv, decode attention, int4_gemv,
 * add_rms_norm, int4_gemv), in the same order on the same values, so bit for bit the same results. In three
 * parts, between which the caller adds the LoRA of each linear it just computed (an adapter's step), or in one call
 * (decode_layer: no adapter). The layer's weights and shapes (DecodeLayer) and the step's inputs and work buffers
 * (DecodeStep) are built once. */
typedef struct {
    int hidden, heads, kv_heads, head_dim, rotary_dim, intermediate, group;
    float eps, scale, softcap;
    int window;
    const float *attn_norm, *mlp_norm;
    const uint8_t *qkv, *o, *gate_up; /* packed [N / 64, K, 32] */
    const uint16_t *qkv_sz, *o_sz, *gate_up_sz; /* [K / group, N, 2] bfloat16 */
} DecodeLayer;

typedef struct {
    int M, block_size, max_blocks;
    long block_stride, slot_stride, head_stride; /* the caches' strides, in floats */
    const float *cos, *sin_signed;               /* [M, head_dim] */
    const int64_t *slots;                        /* [M] */
    const int32_t *block_tables, *seq_lens;      /* [M, max_blocks], [M] */
    float *qkv, *attn;                           /* [M, (heads + 2 kv_heads) head_dim], [M, heads head_dim] */
    void *scratch;                               /* int4_gemv's, for the widest K */
} DecodeStep;

/* x, residual [M, hidden]: residual += x where add (else residual holds the layer's input), x = its input norm;
 * S->qkv = q|k|v of x. */
void decode_qkv(const DecodeLayer *L, const DecodeStep *S, float *x, float *residual, int add) {
    int nqkv = (L->heads + 2 * L->kv_heads) * L->head_dim;
    add_rms_norm(x, residual, L->attn_norm, S->M, L->hidden, L->eps, add);
    int4_gemv(x, S->M, L->hidden, L->qkv, L->qkv_sz, nqkv, L->group, S->scratch, S->qkv);
}

/* S->qkv's q and k rotated, k and v written to their slots, S->attn = decode attention, o [M, hidden] = its o. */
void decode_attention_o(const DecodeLayer *L, const DecodeStep *S, float *k_cache, float *v_cache, float *o) {
    int M = S->M, D = L->head_dim, H = L->heads, KVH = L->kv_heads, nqkv = (H + 2 * KVH) * D;
    rotary_write_kv(S->qkv, nqkv, S->qkv + (size_t)(H + KVH) * D, nqkv, S->cos, S->sin_signed, k_cache, v_cache,
                    S->block_stride, S->slot_stride, S->head_stride, S->slots, M, H + KVH, KVH, D, L->rotary_dim,
                    S->block_size);
    attention_rows(S->qkv, nqkv, k_cache, v_cache, S->block_stride, S->slot_stride, S->head_stride, S->block_tables,
                   S->seq_lens, M, H, KVH, D, S->block_size, S->max_blocks, L->scale, L->window, L->softcap, S->attn);
    int4_gemv(S->attn, M, H * D, L->o, L->o_sz, L->hidden, L->group, S->scratch, o);
}

/* residual += x, x = its MLP norm, gate_up [M, 2 * intermediate] = gate|up of x. */
void decode_gate_up(const DecodeLayer *L, const DecodeStep *S, float *x, float *residual, float *gate_up) {
    add_rms_norm(x, residual, L->mlp_norm, S->M, L->hidden, L->eps, 1);
    int4_gemv(x, S->M, L->hidden, L->gate_up, L->gate_up_sz, 2 * L->intermediate, L->group, S->scratch, gate_up);
}

void decode_layer(const DecodeLayer *L, const DecodeStep *S, float *x, float *residual, int add, float *k_cache,
                  float *v_cache, float *gate_up) {
    decode_qkv(L, S, x, residual, add);
    decode_attention_o(L, S, k_cache, v_cache, x);
    decode_gate_up(L, S, x, residual, gate_up);
}

/* 1 where the matrix-vector products run on AVX-512 with VNNI and VBMI (this build's target has them), 0 where they
 * run the portable loops, which compute the same but slower than torch's own kernels. */
int vectorized(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    return 1;
#else
    return 0;
#endif
}
