/*
 * fp8 (e4m3fn) dequantization on the CPU by per-row lookup tables, with the GIL released.
 *
 * A row of `hidden` codes shares one float32 scale, so it takes at most 256 values: the
 * kernel computes those 256 results once per scale (table[k] = values[k] * scale rounded
 * to the output dtype, where values[k] is torch's own float32 conversion of code k) and
 * then only looks codes up. The result is bit for bit torch's reference
 * `(fp8.float() * scales).to(dtype)`: the same float32 products, rounded the same way
 * (bfloat16: round to nearest even, NaN -> 0x7fc0, as c10::BFloat16 does; float16: round
 * to nearest even, as c10::Half and the F16C instructions do).
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
#define HAVE_VBMI_PATH 1
#include <immintrin.h>
#else
#define HAVE_VBMI_PATH 0
#endif

static int cpu_has_vbmi = 0; /* set once at import */

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
    float base = (fabsf(value) * to_inf) * to_zero, bias_value;
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

/* The 256 results of one scale, as low and high byte planes (the vector path's layout). */
static void table16(const float *values, float scale, int kind, uint8_t *lo, uint8_t *hi) {
    for (int k = 0; k < 256; k++) {
        const float product = values[k] * scale;
        const uint16_t bits = kind == OUT_F16 ? f16_bits(product) : bf16_bits(product);
        lo[k] = (uint8_t)(bits & 0xffu);
        hi[k] = (uint8_t)(bits >> 8);
    }
}

#if HAVE_VBMI_PATH
/* table16 for float16 on the vector path: the same products, rounded 16 at a time by
 * vcvtps2ph (round to nearest even, like f16_bits; every AVX-512 CPU has it). Building
 * the table in software measured half the speed of the bfloat16 path. */
__attribute__((target("avx512f"))) static void table_f16_avx512(const float *values, float scale,
                                                                 uint8_t *lo, uint8_t *hi) {
    const __m512 s = _mm512_set1_ps(scale);
    uint16_t bits[256];
    for (int k = 0; k < 256; k += 16) {
        const __m512 product = _mm512_mul_ps(_mm512_loadu_ps(values + k), s);
        _mm256_storeu_si256((__m256i *)(bits + k),
                            _mm512_cvtps_ph(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (int k = 0; k < 256; k++) {
        lo[k] = (uint8_t)(bits[k] & 0xffu);
        hi[k] = (uint8_t)(bits[k] >> 8);
    }
}
#endif

static void lookup16_scalar(const uint8_t *restrict codes, const uint8_t *lo, const uint8_t *hi,
                            uint16_t *restrict out, Py_ssize_t n) {
    uint16_t table[256];
    for (int k = 0; k < 256; k++)
        table[k] = (uint16_t)(lo[k] | (hi[k] << 8));
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = table[codes[i]];
}

#if HAVE_VBMI_PATH
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void lookup16_vbmi(
    const uint8_t *restrict codes, const uint8_t *lo, const uint8_t *hi, uint16_t *restrict out,
    Py_ssize_t n) {
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
        lookup16_scalar(codes + i, lo, hi, out + i, n - i);
}
#endif

/* 16-bit results (bfloat16 or float16: only the table differs). */
static void rows16(const uint8_t *codes, const float *scales, const float *values, uint16_t *out,
                   Py_ssize_t rows, Py_ssize_t hidden, Py_ssize_t rows_per_scale, int kind,
                   int vector) {
    uint8_t lo[256], hi[256];
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (r % rows_per_scale == 0) {
#if HAVE_VBMI_PATH
            if (vector && kind == OUT_F16) {
                table_f16_avx512(values, scales[r / rows_per_scale], lo, hi);
            } else
#endif
                table16(values, scales[r / rows_per_scale], kind, lo, hi);
        }
#if HAVE_VBMI_PATH
        if (vector) {
            lookup16_vbmi(codes + r * hidden, lo, hi, out + r * hidden, hidden);
            continue;
        }
#endif
        lookup16_scalar(codes + r * hidden, lo, hi, out + r * hidden, hidden);
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
    if (scales->len != (Py_ssize_t)sizeof(float) * ((rows + rows_per_scale - 1) / rows_per_scale))
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
    int kind, vector;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnip", &codes, &scales, &values, &out, &hidden,
                          &rows_per_scale, &kind, &vector))
        return NULL;
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
                   kind, vector && cpu_has_vbmi);
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
     "dequantize(codes, scales, values, out, hidden, rows_per_scale, kind, vector)\n\n"
     "Fill out (kind 0: bfloat16 bits, 1: float32, 2: float16 bits) with values[code] *\n"
     "scale per element, rounded to the kind's type,\n"
     "row r of `hidden` codes using scales[r // rows_per_scale]; vector=False forces the\n"
     "scalar lookup (the vector one is used only where the CPU has AVX-512 VBMI)."},
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
#if HAVE_VBMI_PATH
    __builtin_cpu_init();
    cpu_has_vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
#endif
    if (PyModule_AddStringConstant(m, "VECTOR", cpu_has_vbmi ? "avx512vbmi" : "") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
