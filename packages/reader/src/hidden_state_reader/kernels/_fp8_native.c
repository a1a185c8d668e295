/*
 * fp8 (e4m3fn) dequantization on the CPU by per-row lookup tables, with the GIL released.
 *
 * A row of `hidden` codes shares one float32 scale, so it takes at most 256 values: the
 * kernel computes those 256 results once per scale (table[k] = values[k] * scale rounded
 * to the output dtype, where values[k] is torch's own float32 conversion of code k) and
 * then only looks codes up. The result is bit for bit torch's reference
 * `(fp8.float() * scales).to(dtype)`: the same float32 products, rounded the same way
 * (round to nearest even, as c10::BFloat16, c10::Half and the F16C instructions do). A
 * NaN stays a NaN; its payload bits may differ from torch's (bfloat16: 0x7fc0 here).
 *
 * Why tables: an arithmetic kernel (code -> float bits, multiply, round) needs about 20
 * vector operations per 16 elements and measured 5 GB/s of bf16 on an AVX-512 core; a
 * scalar table lookup is one load and one store per element (7.7 GB/s there) and any
 * compiler makes it for any CPU. Where AVX-512 VBMI exists (Ice Lake, Zen 4 and later),
 * `vpermi2b` looks up 64 codes at a time in a 128-entry byte table held in two
 * registers, so a 256-entry table of 16-bit results is eight registers and a few
 * permutes per 64 codes: memory speed (15 GB/s there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { OUT_BF16 = 0, OUT_F32 = 1, OUT_F16 = 2 };

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define HAVE_X86_PATHS 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define HAVE_X86_PATHS 0
#endif

/* Set once at import. */
static int cpu_has_vbmi = 0;      /* the vector lookup */
static int cpu_has_avx512bw = 0;  /* table building, 16 at a time */
static int cpu_has_avx2_f16c = 0; /* table building, 8 at a time */

static inline uint16_t bf16_bits(float value) {
    uint32_t u;
    memcpy(&u, &value, sizeof u);
    if (isnan(value))
        return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float32 -> float16 bits, round to nearest even (overflow -> inf, subnormals exact), in
 * float arithmetic: the FP16 library's fp16_ieee_from_fp32_value, which c10::Half uses.
 * The two float multiplications round the mantissa to 10 bits in the hardware's own
 * round-to-nearest-even (this file is compiled without fast-math or contraction). A NaN
 * stays a NaN (its payload is not kept: the tests compare NaN-ness only). */
static inline uint16_t f16_bits(float value) {
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    uint32_t w, bias, bits;
    memcpy(&w, &value, sizeof w);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    /* Two assignments: each rounds to float even where the FPU computes wider (x87). */
    const float big = fabsf(value) * to_inf;
    float base = big * to_zero, bias_value;
    bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u;
    memcpy(&bias_value, &bias, sizeof bias_value);
    base = bias_value + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

/* The 256 16-bit results of one scale, one at a time (any CPU). */
static void table16(const float *values, float scale, int kind, uint16_t *bits) {
    for (int k = 0; k < 256; k++) {
        const float product = values[k] * scale;
        bits[k] = kind == OUT_F16 ? f16_bits(product) : bf16_bits(product);
    }
}

#if HAVE_X86_PATHS
/* The same, 8 or 16 products at a time: float16 rounded by vcvtps2ph (round to nearest
 * even, like f16_bits), bfloat16 by bf16_bits' integer rounding. One entry at a time, the
 * table cost as much as the lookups for rows of 512 codes (the tiny model's hidden size),
 * and float16's software rounding halved the scalar path's speed at any size. */
__attribute__((target("avx2,f16c"))) static void table16_avx2(const float *values, float scale,
                                                               int kind, uint16_t *bits) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i nan_bits = _mm256_set1_epi32(0x7fc0);
    for (int k = 0; k < 256; k += 8) {
        const __m256 product = _mm256_mul_ps(_mm256_loadu_ps(values + k), s);
        __m128i words;
        if (kind == OUT_F16) {
            words = _mm256_cvtps_ph(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        } else {
            const __m256i u = _mm256_castps_si256(product);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), odd), 16);
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(product, product, _CMP_UNORD_Q));
            rounded = _mm256_blendv_epi8(rounded, nan_bits, nan);
            /* Each 32-bit lane holds at most 0xffff: packing cannot saturate. Within each
               128-bit half, then the halves' low quadwords together. */
            const __m256i packed = _mm256_packus_epi32(rounded, rounded);
            words = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
        }
        _mm_storeu_si128((__m128i *)(bits + k), words);
    }
}

__attribute__((target("avx512f,avx512bw"))) static void table16_avx512(
    const float *values, float scale, int kind, uint16_t *bits) {
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i nan_bits = _mm512_set1_epi32(0x7fc0);
    for (int k = 0; k < 256; k += 16) {
        const __m512 product = _mm512_mul_ps(_mm512_loadu_ps(values + k), s);
        __m256i words;
        if (kind == OUT_F16) {
            words = _mm512_cvtps_ph(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        } else {
            const __m512i u = _mm512_castps_si512(product);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), odd), 16);
            const __mmask16 nan = _mm512_cmp_ps_mask(product, product, _CMP_UNORD_Q);
            rounded = _mm512_mask_mov_epi32(rounded, nan, nan_bits);
            words = _mm512_cvtepi32_epi16(rounded);
        }
        _mm256_storeu_si256((__m256i *)(bits + k), words);
    }
}
#endif

/* What a call may use, at most (the CPU may have less; tests force each level):
 * 0 portable C, 1 AVX2 + F16C tables, 2 AVX-512 tables, 3 AVX-512 tables + VBMI lookup. */
enum { LEVEL_PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, LEVEL_VBMI = 3 };

static int level_available(int level) {
    switch (level) {
    case LEVEL_VBMI:
        return cpu_has_vbmi;
    case LEVEL_AVX512:
        return cpu_has_avx512bw;
    case LEVEL_AVX2:
        return cpu_has_avx2_f16c;
    default:
        return level == LEVEL_PORTABLE;
    }
}

static int best_level(void) {
    int level = LEVEL_VBMI;
    while (level > LEVEL_PORTABLE && !level_available(level))
        level--;
    return level;
}

/* The table by the fastest builder allowed (all give the same bits). */
static void build_table16(const float *values, float scale, int kind, int level, uint16_t *bits) {
#if HAVE_X86_PATHS
    if (level >= LEVEL_AVX512) {
        table16_avx512(values, scale, kind, bits);
        return;
    }
    if (level >= LEVEL_AVX2) {
        table16_avx2(values, scale, kind, bits);
        return;
    }
#endif
    table16(values, scale, kind, bits);
}

static void lookup16_scalar(const uint8_t *restrict codes, const uint16_t *table,
                            uint16_t *restrict out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = table[codes[i]];
}

#if HAVE_X86_PATHS
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void lookup16_vbmi(
    const uint8_t *restrict codes, const uint16_t *table, uint16_t *restrict out, Py_ssize_t n) {
    /* The table as low and high byte planes, 32 words at a time. */
    uint8_t lo[256], hi[256];
    for (int k = 0; k < 256; k += 32) {
        const __m512i w = _mm512_loadu_si512(table + k);
        _mm256_storeu_si256((__m256i *)(lo + k), _mm512_cvtepi16_epi8(w));
        _mm256_storeu_si256((__m256i *)(hi + k), _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
    }
    /* vpermi2b uses an index's low 7 bits: codes below 128 come from planes [0, 128), the
       others (the sign bit set) from [128, 256); the sign bit picks between the two. */
    const __m512i lo0 = _mm512_loadu_si512(lo), lo1 = _mm512_loadu_si512(lo + 64);
    const __m512i lo2 = _mm512_loadu_si512(lo + 128), lo3 = _mm512_loadu_si512(lo + 192);
    const __m512i hi0 = _mm512_loadu_si512(hi), hi1 = _mm512_loadu_si512(hi + 64);
    const __m512i hi2 = _mm512_loadu_si512(hi + 128), hi3 = _mm512_loadu_si512(hi + 192);
    /* Interleave the byte planes into little-endian 16-bit words: output word j takes
       low byte j (index j) and high byte j (index 64 + j). */
    uint8_t first[64], second[64];
    for (int j = 0; j < 32; j++) {
        first[2 * j] = (uint8_t)j;
        first[2 * j + 1] = (uint8_t)(64 + j);
        second[2 * j] = (uint8_t)(32 + j);
        second[2 * j + 1] = (uint8_t)(96 + j);
    }
    const __m512i words0 = _mm512_loadu_si512(first), words1 = _mm512_loadu_si512(second);
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i v = _mm512_loadu_si512(codes + i);
        __mmask64 negative = _mm512_movepi8_mask(v);
        __m512i l = _mm512_mask_blend_epi8(negative, _mm512_permutex2var_epi8(lo0, v, lo1),
                                           _mm512_permutex2var_epi8(lo2, v, lo3));
        __m512i h = _mm512_mask_blend_epi8(negative, _mm512_permutex2var_epi8(hi0, v, hi1),
                                           _mm512_permutex2var_epi8(hi2, v, hi3));
        /* Plain stores: non-temporal ones measured no faster once the consumer reads
           the result (it then misses the caches). */
        _mm512_storeu_si512(out + i, _mm512_permutex2var_epi8(l, words0, h));
        _mm512_storeu_si512(out + i + 32, _mm512_permutex2var_epi8(l, words1, h));
    }
    if (i < n)
        lookup16_scalar(codes + i, table, out + i, n - i);
}
#endif

/* 16-bit results (bfloat16 or float16: only the table differs). */
static void rows16(const uint8_t *codes, const float *scales, const float *values, uint16_t *out,
                   Py_ssize_t rows, Py_ssize_t hidden, Py_ssize_t rows_per_scale, int kind,
                   int level) {
    uint16_t table[256];
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (r % rows_per_scale == 0)
            build_table16(values, scales[r / rows_per_scale], kind, level, table);
#if HAVE_X86_PATHS
        if (level >= LEVEL_VBMI) {
            lookup16_vbmi(codes + r * hidden, table, out + r * hidden, hidden);
            continue;
        }
#endif
        lookup16_scalar(codes + r * hidden, table, out + r * hidden, hidden);
    }
}

static void rows_f32(const uint8_t *codes, const float *scales, const float *values, float *out,
                     Py_ssize_t rows, Py_ssize_t hidden, Py_ssize_t rows_per_scale) {
    float table[256];
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (r % rows_per_scale == 0) {
            const float scale = scales[r / rows_per_scale];
            for (int k = 0; k < 256; k++)
                table[k] = values[k] * scale;
        }
        const uint8_t *c = codes + r * hidden;
        float *o = out + r * hidden;
        for (Py_ssize_t i = 0; i < hidden; i++)
            o[i] = table[c[i]];
    }
}

static const char *check(const Py_buffer *codes, const Py_buffer *scales, const Py_buffer *values,
                         const Py_buffer *out, Py_ssize_t hidden, Py_ssize_t rows_per_scale,
                         int kind) {
    Py_ssize_t width = kind == OUT_F32 ? 4 : 2;
    if ((kind != OUT_BF16 && kind != OUT_F32 && kind != OUT_F16) || hidden <= 0 ||
        rows_per_scale <= 0)
        return "kind must be 0, 1 or 2, hidden and rows_per_scale positive";
    Py_ssize_t rows = codes->len / hidden;
    if (codes->len != rows * hidden || out->len != codes->len * width)
        return "codes must be rows x hidden bytes and out as many elements of the kind's width";
    /* Rows rounded up to whole scale groups, without overflowing for any rows_per_scale. */
    const Py_ssize_t groups = rows / rows_per_scale + (rows % rows_per_scale != 0);
    if (scales->len / (Py_ssize_t)sizeof(float) != groups ||
        scales->len % (Py_ssize_t)sizeof(float))
        return "scales must hold one float32 per rows_per_scale rows";
    if (values->len != (Py_ssize_t)sizeof(float) * 256)
        return "values must hold the 256 codes' float32 values";
    if (((uintptr_t)scales->buf | (uintptr_t)values->buf) % sizeof(float) ||
        (uintptr_t)out->buf % width)
        return "scales, values and out must be aligned to their element size";
    return NULL;
}

static PyObject *dequantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer codes, scales, values, out;
    Py_ssize_t hidden, rows_per_scale;
    int kind, level;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnii", &codes, &scales, &values, &out, &hidden,
                          &rows_per_scale, &kind, &level))
        return NULL;
    /* The level asked for, or the highest below it that this CPU has (a VM may hide
       F16C from a CPU that has AVX-512). */
    if (level < 0 || level > LEVEL_VBMI)
        level = LEVEL_VBMI;
    while (level > LEVEL_PORTABLE && !level_available(level))
        level--;
    PyObject *result = NULL;
    const char *problem = check(&codes, &scales, &values, &out, hidden, rows_per_scale, kind);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
    } else {
        Py_ssize_t rows = codes.len / hidden;
        Py_BEGIN_ALLOW_THREADS
        if (kind == OUT_F32)
            rows_f32(codes.buf, scales.buf, values.buf, out.buf, rows, hidden, rows_per_scale);
        else
            rows16(codes.buf, scales.buf, values.buf, out.buf, rows, hidden, rows_per_scale,
                   kind, level);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(codes, scales, values, out, hidden, rows_per_scale, kind, level)\n\n"
     "Fill out (kind 0: bfloat16 bits, 1: float32, 2: float16 bits) with values[code] *\n"
     "scale per element, rounded to the kind's type, row r of `hidden` codes using\n"
     "scales[r // rows_per_scale]. level: the most this call may use (0 portable C, 1 AVX2\n"
     "+ F16C tables, 2 AVX-512 tables, 3 and the AVX-512 VBMI lookup; -1 or above BEST:\n"
     "BEST, what this CPU has)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fp8_native",
    "fp8 e4m3fn dequantization by per-row lookup tables (see fp8_cpu.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__fp8_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#if HAVE_X86_PATHS
    __builtin_cpu_init();
    cpu_has_avx512bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    cpu_has_vbmi = cpu_has_avx512bw && __builtin_cpu_supports("avx512vbmi");
    /* F16C is CPUID leaf 1, ECX bit 29 (not every compiler's __builtin_cpu_supports knows
       it); "avx2" also says the OS saves the AVX registers. */
    unsigned int eax, ebx, ecx, edx;
    cpu_has_avx2_f16c = __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
                        (ecx & (1u << 29));
#endif
    int available = 0; /* bit n: level n runs on this CPU */
    for (int level = LEVEL_PORTABLE; level <= LEVEL_VBMI; level++)
        available |= level_available(level) << level;
    if (PyModule_AddStringConstant(m, "VECTOR", cpu_has_vbmi ? "avx512vbmi" : "") < 0 ||
        PyModule_AddIntConstant(m, "BEST", best_level()) < 0 ||
        PyModule_AddIntConstant(m, "AVAILABLE", available) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
