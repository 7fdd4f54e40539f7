// Unit-scale float8 weights (every scale exactly 1): the product fp8 activations make, shared by
// dtensor_quant/_formats/float8.cpp (the tiles' unit-scale path, values_matmul) and float8_a8.cpp (its whole-linear
// stage, which stores each tile through its epilogue). Included after native_tiles.h.
#pragma once
#include "native_tiles.h"
#ifdef _OPENMP
#include <omp.h>
#endif

// Where x[j] of a chunk of 2 * half codes goes: the lo lanes, then the hi lanes (half: 16 AVX-512, 8 AVX2).
static inline int64_t dq_x_order(int64_t j, int64_t half) { return 8 * ((j % half) / 4) + 4 * (j / half) + j % 4; }

// Unit-scale rows (fp8 activations' products, float8_a8.cpp, multiply the codes' values with scale 1): a code's
// bf16 bits straight from two 128-entry byte tables of its magnitude (vpermi2b), the sign its top bit: 64 codes in
// 7 instructions, where dq_e4m3_raw and the multiply by 2^120 take 22; the same bits (an e4m3 value is exactly a
// normal bf16 value). Needs AVX-512 VBMI (every AMX CPU has it; Cooper Lake's AVX-512 BF16 does not).
static inline bool dq_vbmi() {
    static const bool have = __builtin_cpu_supports("avx512vbmi");
    return have;
}

// A code magnitude's bf16 bits: the high bytes of codes 0..63, 64..127, then the low bytes likewise; and the
// vpermb order of dq_e4m3_unit_bf16 (made once here: built on every call it cost about a fifth of a 2048-code
// row's decode, and the AMX loop decodes a row at a time).
struct DqE4m3Tables {
    alignas(64) uint8_t b[4][64];
    alignas(64) uint8_t idx[64];
    DqE4m3Tables() {
        for (int c = 0; c < 128; ++c) {
            const float v = std::ldexp(c >> 3 ? 8.0f + (c & 7) : float(c & 7), (c >> 3 ? (c >> 3) : 1) - 10);
            uint32_t u;
            std::memcpy(&u, &v, 4);
            b[c / 64][c % 64] = static_cast<uint8_t>(u >> 24);
            b[2 + c / 64][c % 64] = static_cast<uint8_t>(u >> 16);
        }
        for (int L = 0; L < 4; ++L)
            for (int i = 0; i < 8; ++i) {
                idx[16 * L + i] = static_cast<uint8_t>(dq_x_order(8 * L + i, 16));
                idx[16 * L + 8 + i] = static_cast<uint8_t>(32 + dq_x_order(8 * L + i, 16));
            }
    }
};

// dst[p] (p < n, a multiple of 32) = the bf16 bits of code 32 * (p / 32) + perm(p % 32) of codes p[0..n): the
// codes permuted with vpermb so that the byte unpacks leave each chunk of 32 in dq_x_order's order.
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void dq_e4m3_unit_bf16(const uint8_t* p, int64_t n, uint16_t* dst) {
    static const DqE4m3Tables t;
    const __m512i order = _mm512_load_si512(t.idx), sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i h0 = _mm512_load_si512(t.b[0]), h1 = _mm512_load_si512(t.b[1]);
    const __m512i l0 = _mm512_load_si512(t.b[2]), l1 = _mm512_load_si512(t.b[3]);
    for (int64_t k = 0; k < n; k += 64) {
        DQ_PREFETCH_AHEAD(p + k);
        const bool two = k + 64 <= n;
        const __m512i c = _mm512_permutexvar_epi8(
            order, two ? _mm512_loadu_si512(p + k) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p + k));
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(h0, c, h1), c, sign, 0xF8);  // a|b&c
        const __m512i lo = _mm512_permutex2var_epi8(l0, c, l1);
        _mm512_storeu_si512(dst + k, _mm512_unpacklo_epi8(lo, hi));
        if (two) _mm512_storeu_si512(dst + k + 32, _mm512_unpackhi_epi8(lo, hi));
    }
}

// -- Unit scales on AMX (the fp8 activations' product: every scale exactly 1) -------------------------------------
//
// native_tiles.h's level 4 decodes a tile's 32 rows DQ_AMX_KB (512) columns at a time into one of two buffers,
// the next block all during the first group of tokens, and loads each operand tile just before its products. For
// unit scales the decode is the cheap table path (dq_e4m3_unit_bf16: 0.2-0.35 ms for all 4M codes of a
// [2048, 2048] weight), so the time is the tile loop's. Measured alone (no decode, 128 tokens, [2048, 2048]), that
// loop ran at 1.3-4x TDPBF16PS's peak; with every operand in L1 it ran no faster in the slow runs of this shared
// machine, so it is not L2 bandwidth: a tile register is reloaded only after the last product reading it, and
// the load-then-multiply order waited for that. Here:
//  * each operand tile is reloaded as soon as its last reader is issued (f8u_block), the next step's loads
//    overlapping this step's products (alone: 0.52-0.78 ms against 0.66-0.70 in the fast runs);
//  * blocks of F8U_KB (2048) columns: the sums stay in the tile registers over all of K up to 2048 (stored and
//    reloaded, exactly, between blocks only beyond);
//  * the next block -- of this tile or of the thread's next tile -- is decoded a few 64-code pieces after every
//    step (f8u_decode, inlined in f8u_block with its tables in registers), spread evenly over the block's steps;
//  * tokens in chunks of F8U_XV_BYTES of paired activations, at least DQ_MB (128 tokens at 2048 columns, as
//    dq_tiles; 1 MiB chunks, 256 tokens, decoded the weight half as often but ran 1.03-1.08x at 512 tokens).
// In-process A/B against main's tiles ([2048, 2048], unit scales, same outputs asserted): 0.81-0.90x the time at
// 32 tokens, 0.88-1.00x at 128, 0.90-0.95x at 512, by machine state.
// The decode was what the tile unit's work did not hide while it came in bursts: whole rows (32 x 64 codes) after
// every eighth step at 128 tokens, or slices through a call per step that split them by division. Measured in a
// C++ loop alone ([2048, 2048], 128 tokens, real data; the tiles alone 0.63 ms, the decode alone 0.26): whole rows
// 0.98 ms, four inlined pieces after each step 0.82-0.85 (one after each product instead: 0.89-0.91; an L1
// prefetch of the codes: no gain); in a slower run of the machine whole rows 1.15-1.17 ms, 64-code slices through
// a dq_e4m3_unit_bf16 call per step 1.44-1.49, the inlined pieces 0.80-0.82. In-process A/B against the
// whole-row decode (the whole fp8-activation linear, same outputs asserted): 0.81x the time at 32 tokens, 0.88x
// at 128, 0.95x at 512. Tried and not kept before: an L2 prefetch of the codes of the block after next (no gain),
// a decode with the column order folded into the byte interleave (4 shuffles per 64 codes instead of 5: no
// gain), software prefetch of the activations' tiles (slower), 4 x 1 and 1 x 4 blocks of tiles (slower).
// Each sum is still TDPBF16PS's over the same 32-column steps in the same order, from zero, with the same
// operands (rows and activations in Float8Rows' order): the same bits as dq_tiles.
constexpr int64_t F8U_KB = DQ_KC;              // columns per block; two blocks' rows: dq_buffer(0)'s size
constexpr int64_t F8U_XV_BYTES = 512 * 1024;  // paired activations per chunk of tokens (L2-resident)

// The column order of a chunk of 32 (float8.cpp's Float8Rows::perm): the activations are permuted the same way.
struct F8UnitOrder {
    static int64_t perm(int64_t p) { return dq_x_order(p, 16); }
};

static bool f8_unit_scales(const float* scale, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (scale[i] != 1.0f) return false;
    return true;
}

#if DQ_AMX
// dq_e4m3_unit_bf16's tables and permutation, held in registers by the tile loop that decodes with them.
struct F8uTables {
    __m512i order, sign, h0, h1, l0, l1;
};

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline))
static inline F8uTables f8u_tables() {
    static const DqE4m3Tables t;
    return {_mm512_load_si512(t.idx), _mm512_set1_epi8(static_cast<char>(0x80)), _mm512_load_si512(t.b[0]),
            _mm512_load_si512(t.b[1]),  _mm512_load_si512(t.b[2]),               _mm512_load_si512(t.b[3])};
}

// Where the decode of the next block of rows stands: `rows` rows of w codes (stride K) from `codes`, their bf16
// bits to dst (stride ld); row r, column c next. Rows past the weight's last are not in `rows`: their buffer rows
// keep older values, whose sums are unused.
struct F8uCursor {
    const uint8_t* codes = nullptr;
    uint16_t* dst = nullptr;
    int64_t K = 0, ld = 0, w = 0, rows = 0, r = 0, c = 0;

    int64_t pieces() const { return rows * ((w + 63) / 64); }  // 64 codes each, a row's last 32 alone
};

// The cursor's next n pieces (fewer where it reaches its end), each dq_e4m3_unit_bf16's 64 codes (the same bits in
// the same places).
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline))
static inline void f8u_decode(F8uCursor& d, const F8uTables& t, int64_t n) {
    for (; n > 0 && d.r < d.rows; --n) {
        const uint8_t* p = d.codes + d.r * d.K + d.c;
        uint16_t* dst = d.dst + d.r * d.ld + d.c;
        const bool two = d.c + 64 <= d.w;
        const __m512i c = _mm512_permutexvar_epi8(
            t.order, two ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p));
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.h0, c, t.h1), c, t.sign, 0xF8);
        const __m512i lo = _mm512_permutex2var_epi8(t.l0, c, t.l1);
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(lo, hi));
        if (two) _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(lo, hi));
        d.c += 64;
        if (d.c >= d.w) d.c = 0, ++d.r;
    }
}

// All of the cursor's pieces (the first block, before any tile work to hide them under).
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void f8u_decode_all(F8uCursor& d) {
    f8u_decode(d, f8u_tables(), d.pieces());
}

// Ct[32][Mp] (+)= rows . x over columns [k0, k0 + kc) for token groups [g0, g0 + 1 or 2), as dq_amx_block, with the
// operand tiles reloaded early; `per` pieces of the next block's decode (next) after each step's products are
// issued, the decode inlined here with its tables in registers.
template <bool TWO>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vbmi")))
static void f8u_block(const uint16_t* rows, int64_t ld, const uint32_t* xv, int64_t K, int64_t k0, int64_t kc,
                      int64_t g0, float* Ct, int64_t Mp, bool first, F8uCursor& next, int64_t per) {
    float* c0 = Ct + 16 * g0;
    float* c1 = Ct + 16 * Mp + 16 * g0;
    const int64_t cs = Mp * 4, lb = ld * 2;
    const F8uTables t = f8u_tables();
    F8uCursor d = next;  // a local copy: its fields stay in registers across the tile intrinsics
    dq_amx_sums_begin<TWO>(c0, c1, cs, first);
    const uint32_t* x0 = xv + (g0 * (K / 2) + k0 / 2) * 16;
    const uint32_t* x1 = x0 + (K / 2) * 16;
    const uint16_t* r1 = rows + 16 * ld;
    _tile_loadd(4, rows, lb);
    _tile_loadd(6, x0, 64);
    if (TWO) _tile_loadd(7, x1, 64);
    _tile_loadd(5, r1, lb);
    for (int64_t k = 0; k < kc; k += 32) {
        const bool more = k + 32 < kc;
        _tile_dpbf16ps(0, 4, 6);
        if (TWO) _tile_dpbf16ps(1, 4, 7);
        if (more) _tile_loadd(4, rows + k + 32, lb);  // tile 4's last reader issued
        _tile_dpbf16ps(2, 5, 6);
        if (more) _tile_loadd(6, x0 + (k + 32) * 8, 64);
        if (TWO) _tile_dpbf16ps(3, 5, 7);
        if (more) {
            if (TWO) _tile_loadd(7, x1 + (k + 32) * 8, 64);
            _tile_loadd(5, r1 + k + 32, lb);
        }
        f8u_decode(d, t, per);
    }
    dq_amx_sums_end<TWO>(c0, c1, cs);
    next = d;
}

// The sums x @ W^T for M tokens of bf16 x and unit-scale codes [N, K] (K % 32 == 0), on AMX with AVX-512 VBMI: a
// chunk of tokens at a time, prepare(m0, ms, xb) writing tokens [m0, m0 + ms) of x into xb [ms, K] in
// F8UnitOrder's column order; each tile's sums, Ct[32][Mp] (Mp: its chunk's tokens rounded up to 16), handed to
// store(Ct, m0, ms, rows, n0) for tokens [m0, m0 + ms) and weight rows [n0, n0 + rows).
template <class P, class S>
static void f8_unit_amx(const uint8_t* codes, int64_t M, int64_t N, int64_t K, int64_t threads, P&& prepare,
                        S&& store) {
    int64_t mb = F8U_XV_BYTES / (2 * K) / 16 * 16;
    mb = mb < DQ_MB ? DQ_MB : mb;
    mb = M < mb ? M : mb;
    const int64_t kb = K < F8U_KB ? K : F8U_KB, ld = kb + DQ_LDPAD, size = DQ_TR * ld;
    const int64_t tiles = (N + DQ_TR - 1) / DQ_TR, blocks = (K + kb - 1) / kb;
    uint16_t* xb = new uint16_t[mb * K];
    uint32_t* xv = static_cast<uint32_t*>(std::aligned_alloc(64, (mb + 15) / 16 * 16 * K * 2));
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t ms = M - m0 < mb ? M - m0 : mb, G = (ms + 15) / 16, Mp = 16 * G;
        prepare(m0, ms, xb);
        dq_prepare_x_amx(xb, ms, K, xv);
        #pragma omp parallel num_threads(threads) if(threads > 1)
        {
#ifdef _OPENMP
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
            const int64_t nt = 1, id = 0;
#endif
            // this thread's tiles [t0, t1), as schedule(static) would hand them out; block j of its sequence
            // (tile t0 + j / blocks, columns (j % blocks) * kb) lives in buffer j & 1
            const int64_t t0 = tiles * id / nt, t1 = tiles * (id + 1) / nt, jobs = (t1 - t0) * blocks;
            uint16_t* rb = reinterpret_cast<uint16_t*>(dq_buffer(0, DQ_TR * (DQ_KC + DQ_LDPAD)));
            float* C = dq_buffer(2, Mp * DQ_TR);
            DqAmxScope amx;
            auto width = [&](int64_t j) { return K - (j % blocks) * kb < kb ? K - (j % blocks) * kb : kb; };
            // block j's rows to decode, into buffer j & 1
            auto cursor = [&](int64_t j) {
                F8uCursor d;
                if (j >= jobs) return d;
                const int64_t n0 = (t0 + j / blocks) * DQ_TR;
                d.codes = codes + n0 * K + (j % blocks) * kb;
                d.dst = rb + (j & 1) * size;
                d.K = K, d.ld = ld, d.w = width(j), d.rows = N - n0 < DQ_TR ? N - n0 : DQ_TR;
                return d;
            };
            if (jobs) {
                F8uCursor first = cursor(0);
                f8u_decode_all(first);
            }
            for (int64_t j = 0; j < jobs; ++j) {
                const int64_t n0 = (t0 + j / blocks) * DQ_TR, k0 = (j % blocks) * kb, w = width(j);
                const uint16_t* cur = rb + (j & 1) * size;
                // the next block's decode spread evenly over this block's steps, a few pieces after each
                F8uCursor next = cursor(j + 1);
                const int64_t all = (G + 1) / 2 * (w / 32), per = (next.pieces() + all - 1) / all;
                for (int64_t g = 0; g < G; g += 2) {
                    if (g + 1 < G)
                        f8u_block<true>(cur, ld, xv, K, k0, w, g, C, Mp, k0 == 0, next, per);
                    else
                        f8u_block<false>(cur, ld, xv, K, k0, w, g, C, Mp, k0 == 0, next, per);
                }
                if (k0 + w >= K) store(C, m0, ms, N - n0 < DQ_TR ? N - n0 : DQ_TR, n0);
            }
        }
    }
    delete[] xb;
    std::free(xv);
}
#endif  // DQ_AMX
