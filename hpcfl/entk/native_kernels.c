/* The fused eNTK path's CPU kernel (hpcfl/entk/native.py builds and loads it; see its docstring).
 *
 * For one sample b, a layer's per-sample weight gradient is an (O, K) matrix
 *     G_b[o, k] = sum_l D_b[o, l] * U_b[l, k]
 * (a Linear: L = 1, D = delta, U = the input; a Linear on a sequence: l runs over positions; a
 * Conv2d: D = delta over the L output positions, U = the unfolded input, k = (c, ky, kx)). Only a
 * fixed subset of its entries is wanted, stored row by row: out[b, starts[o] + t] is the t-th kept
 * entry of row o in increasing k, and bit (k % 16) of masks[o * V + k / 16] says whether k is kept
 * (V = ceil(K / 16)).
 *
 * The kernel forms G_b in registers, a block of 4 rows x 64 columns at a time (16 AVX-512
 * accumulators), and compresses each accumulator's kept lanes straight into the output with
 * vcompressps: G_b is never written to memory, and no index is gathered. Without AVX-512 the file
 * compiles to hpcfl_native_abi() returning 0, and Python keeps to its torch path.
 *
 * Sums run over l = 0..L-1 in order, one fused multiply-add per term.
 */
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>

int hpcfl_native_abi(void) { return 1; }

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

/* Append acc's kept lanes (mask km) at *p and advance it. */
#define STORE(acc, km)                                                                        \
    do {                                                                                      \
        int n_ = __builtin_popcount((unsigned)(km));                                          \
        _mm512_mask_storeu_ps(p, lanes(n_), _mm512_maskz_compress_ps((km), (acc)));           \
        p += n_;                                                                              \
    } while (0)

#define ROW_STORE(i)                                                                          \
    if ((i) < nrows) {                                                                        \
        float* p = cur[(i)];                                                                  \
        const uint16_t* m = masks + (o0 + (i)) * V + v0;                                      \
        STORE(a##i##0, v0 + 0 < V ? m[0] : 0);                                                \
        STORE(a##i##1, v0 + 1 < V ? m[1] : 0);                                                \
        STORE(a##i##2, v0 + 2 < V ? m[2] : 0);                                                \
        STORE(a##i##3, v0 + 3 < V ? m[3] : 0);                                                \
        cur[(i)] = p;                                                                         \
    }

#define FMA4(i)                                                                               \
    a##i##0 = _mm512_fmadd_ps(d##i, u0, a##i##0);                                             \
    a##i##1 = _mm512_fmadd_ps(d##i, u1, a##i##1);                                             \
    a##i##2 = _mm512_fmadd_ps(d##i, u2, a##i##2);                                             \
    a##i##3 = _mm512_fmadd_ps(d##i, u3, a##i##3);

/* Rows o0..o0+nrows-1 (nrows <= 4) by columns k0..k0+63 of G_b; cur[i]: where row o0+i's next
 * kept entry goes. Named accumulators (not an array) keep all 16 in registers. */
static inline __attribute__((always_inline)) void block(const float* d, int64_t dso, int64_t dsl,
                                                        const float* u, int64_t usl, int64_t o0,
                                                        int64_t nrows, int64_t k0, int64_t K, int64_t L,
                                                        const uint16_t* masks, int64_t V, float** cur) {
    const __mmask16 m0 = lanes(K - k0), m1 = lanes(K - k0 - 16), m2 = lanes(K - k0 - 32),
                    m3 = lanes(K - k0 - 48);
    const float* r0 = d + o0 * dso;
    const float* r1 = d + (o0 + (nrows > 1 ? 1 : 0)) * dso;
    const float* r2 = d + (o0 + (nrows > 2 ? 2 : 0)) * dso;
    const float* r3 = d + (o0 + (nrows > 3 ? 3 : 0)) * dso;
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m512 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    __m512 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const float* ul = u + k0;
    for (int64_t l = 0; l < L; l++, ul += usl) {
        const __m512 u0 = _mm512_maskz_loadu_ps(m0, ul), u1 = _mm512_maskz_loadu_ps(m1, ul + 16);
        const __m512 u2 = _mm512_maskz_loadu_ps(m2, ul + 32), u3 = _mm512_maskz_loadu_ps(m3, ul + 48);
        const __m512 d0 = _mm512_set1_ps(r0[l * dsl]), d1 = _mm512_set1_ps(r1[l * dsl]);
        const __m512 d2 = _mm512_set1_ps(r2[l * dsl]), d3 = _mm512_set1_ps(r3[l * dsl]);
        FMA4(0) FMA4(1) FMA4(2) FMA4(3)
    }
    const int64_t v0 = k0 / 16;
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3)
}

/* One sample, L >= 1: blocks of 4 rows, each swept over K; rows with nothing kept are skipped. */
static void product_one(const float* d, int64_t dso, int64_t dsl, const float* u, int64_t usl, int64_t O,
                        int64_t L, int64_t K, const uint16_t* masks, const int64_t* starts, float* out) {
    const int64_t V = (K + 15) / 16;
    for (int64_t o0 = 0; o0 < O; o0 += 4) {
        const int64_t nrows = O - o0 < 4 ? O - o0 : 4;
        if (starts[o0 + nrows] == starts[o0]) continue;
        float* cur[4];
        for (int64_t i = 0; i < nrows; i++) cur[i] = out + starts[o0 + i];
        for (int64_t k0 = 0; k0 < K; k0 += 64) block(d, dso, dsl, u, usl, o0, nrows, k0, K, L, masks, V, cur);
    }
}

/* One sample, L = 1 (an outer product): each kept row is the scaled input, compressed. */
static void outer_one(const float* d, int64_t dso, const float* u, int64_t O, int64_t K,
                      const uint16_t* masks, const int64_t* starts, float* out) {
    const int64_t V = (K + 15) / 16;
    for (int64_t o = 0; o < O; o++) {
        if (starts[o + 1] == starts[o]) continue;
        const __m512 dv = _mm512_set1_ps(d[o * dso]);
        const uint16_t* m = masks + o * V;
        float* p = out + starts[o];
        for (int64_t v = 0; v < V; v++) {
            const __mmask16 km = m[v];
            if (!km) continue;
            STORE(_mm512_mul_ps(dv, _mm512_maskz_loadu_ps(km, u + 16 * v)), km);
        }
    }
}

/* Samples 0..nb-1: D_b[o, l] = d[b*dsb + o*dso + l*dsl], U_b[l, k] = u[b*usb + l*usl + k]. */
void hpcfl_masked_product(const float* d, int64_t dsb, int64_t dso, int64_t dsl, const float* u, int64_t usb,
                          int64_t usl, int64_t O, int64_t L, int64_t K, const uint16_t* masks,
                          const int64_t* starts, float* out, int64_t ld, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        if (L == 1)
            outer_one(d + b * dsb, dso, u + b * usb, O, K, masks, starts, out + b * ld);
        else
            product_one(d + b * dsb, dso, dsl, u + b * usb, usl, O, L, K, masks, starts, out + b * ld);
    }
}

/* A Conv2d (groups 1): x_b (C, H, W) at strides xs*, unfolded into scratch (L x K, k = (c, ky, kx),
 * zero outside the input), then the product with delta_b (O, L). scratch holds L*K floats. */
void hpcfl_conv_masked_product(const float* x, int64_t xsb, int64_t xsc, int64_t xsh, int64_t xsw, int64_t C,
                               int64_t H, int64_t W, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                               int64_t pw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo, const float* d,
                               int64_t dsb, int64_t dso, int64_t dsl, int64_t O, const uint16_t* masks,
                               const int64_t* starts, float* out, int64_t ld, int64_t nb, float* scratch) {
    const int64_t taps = kh * kw, K = C * taps, L = Ho * Wo;
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * xsb;
        for (int64_t oy = 0; oy < Ho; oy++) {
            for (int64_t ox = 0; ox < Wo; ox++) {
                float* row = scratch + (oy * Wo + ox) * K;
                for (int64_t ky = 0; ky < kh; ky++) {
                    const int64_t iy = oy * sh - ph + ky * dh;
                    for (int64_t kx = 0; kx < kw; kx++) {
                        const int64_t ix = ox * sw - pw + kx * dw;
                        float* dst = row + ky * kw + kx;
                        if (iy < 0 || iy >= H || ix < 0 || ix >= W) {
                            for (int64_t c = 0; c < C; c++) dst[c * taps] = 0.0f;
                        } else {
                            const float* src = xb + iy * xsh + ix * xsw;
                            for (int64_t c = 0; c < C; c++) dst[c * taps] = src[c * xsc];
                        }
                    }
                }
            }
        }
        product_one(d + b * dsb, dso, dsl, scratch, K, O, L, K, masks, starts, out + b * ld);
    }
}
#else
int hpcfl_native_abi(void) { return 0; }
#endif
