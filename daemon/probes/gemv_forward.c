/* ringlet: cblas_sgemm that hands matrix-vector products to cblas_sgemv, and products
 * of a few rows to a kernel that reads the weight once.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm, a decode step's
 * (1 x K) @ (K x N) products too. OpenBLAS 0.3.21 (Debian 12's) packs the whole weight
 * matrix for such a call and reaches ~9 GB/s here; its sgemv streams the same matrix at
 * ~20 GB/s (2 threads, 576 x 1536 float32; bench/README.md). OpenBLAS itself forwards
 * these calls from 0.3.28 on some architectures (OpenBLAS PR #4814).
 *
 * This library exports only cblas_sgemm. ringlet loads it into the global symbol scope
 * before the BLAS it checked, so libmlx.so binds cblas_sgemm here, and binds the real
 * sgemm and sgemv with ringlet_gemv_forward_bind(). Calls with M == 1 or N == 1 (and
 * K > 0: a K == 0 gemm still scales C by beta, which an sgemv with no columns would
 * skip) go to sgemv; every other call, and every call while no sgemv is bound, goes to
 * the real sgemm unchanged. Built with OpenMP where the compiler has it, else without
 * libc (-nostdlib): then it calls only the two pointers it is given. Argument order and
 * enum values: the CBLAS interface (cblas.h).
 *
 * Products of 2 to FEW_ROWS rows (a speculative step's k + 1 positions, a decode group's
 * requests) against a weight: OpenBLAS packs the whole weight for them too, so a forward
 * of 7 positions cost 2.3-2.6 single-position ones here. few_rows() streams each weight
 * row once and takes its dot product with every input row (GCC vector extensions,
 * compiled for this CPU, on the BLAS's thread count): 2 to 8 rows then cost 1.1-1.8
 * single-row forwards (bench/README.md). It takes A untransposed (an input row is
 * contiguous) and op(B) either way: B^T (an mlx Linear, x @ W.T: a weight row is
 * contiguous) or B with at most FEW_COLS columns (attention's scores @ V); other shapes
 * go to sgemm.
 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

/* the most rows few_rows() takes; the most columns of an untransposed B it takes */
enum { FEW_ROWS = 8, FEW_COLS = 512 };

/* the widest vector the CPU it is built for has: AVX-512 16 floats, else 8 (AVX2, or
 * two SSE/NEON registers) */
#ifdef __AVX512F__
enum { W = 16 };
#else
enum { W = 8 };
#endif
typedef float v8 __attribute__((vector_size(W * 4)));
/* the lanes a shuffle of hsum() leaves as they are, past the first n (only on 16 lanes) */
#ifdef __AVX512F__
#define SHUF_REST(n) SHUF_REST_##n
#define SHUF_REST_2 , 2, 3
#define SHUF_REST_4 , 4, 5, 6, 7
#define SHUF_REST_8 , 8, 9, 10, 11, 12, 13, 14, 15
#else
#define SHUF_REST(n) SHUF_REST8_##n
#define SHUF_REST8_2 , 2, 3
#define SHUF_REST8_4 , 4, 5, 6, 7
#define SHUF_REST8_8
#endif
typedef float v8u __attribute__((vector_size(W * 4), aligned(4))); /* an unaligned load */
#define LOAD(p) (*(const v8u *)(p))

/* the sum of a vector's lanes: halves added log2(W) times (a scalar loop over the lanes
 * cost more than the products themselves) */
static inline float hsum(v8 v) {
#ifdef __AVX512F__
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3 SHUF_REST(8));
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1 SHUF_REST(4) SHUF_REST(8));
    v += __builtin_shufflevector(v, v, 1, 0 SHUF_REST(2) SHUF_REST(4) SHUF_REST(8));
    return v[0];
}

static inline void put(float *o, float alpha, float t, float beta) {
    /* beta == 0: C is not read (it may hold anything, NaN included), as BLAS specifies */
    *o = beta == 0.0f ? alpha * t : alpha * t + beta * *o;
}

/* threads for few_rows(): the BLAS's own count (ringlet_few_rows_threads); the weight's
 * rows are split among them (OpenMP, where the library was built with it: otherwise
 * the pragma is ignored and one thread does all). A single-row product runs on the
 * BLAS's threads, so a few-row one on one thread would cost twice as much as it here. */
static int few_threads = 1;

void ringlet_few_rows_threads(int n) { few_threads = n < 1 ? 1 : n; }

/* whether a product is big enough to share: a weight of at least 64k floats (256 kB;
 * a smaller one is read faster than threads wake) */
static inline int parallel(int n, int k) { return few_threads > 1 && (long)n * k >= 65536; }

/* c (M x n) = alpha a (M x k) b^T + beta c, b stored n x k: each row of b read once */
#define DOTS(M)                                                                                          \
    static void dots##M(int n, int k, float alpha, const float *a, long lda, const float *b, long ldb,   \
                        float beta, float *c, long ldc) {                                                \
        _Pragma("omp parallel for num_threads(few_threads) schedule(static) if (parallel(n, k))")      \
        for (int j = 0; j < n; j++) {                                                                    \
            const float *w = b + j * ldb;                                                                \
            v8 s[M];                                                                                     \
            for (int i = 0; i < M; i++) s[i] = (v8){0};                                                  \
            int p = 0;                                                                                   \
            for (; p + W <= k; p += W) {                                                                       \
                v8 x = LOAD(w + p);                                                                      \
                for (int i = 0; i < M; i++) s[i] += LOAD(a + i * lda + p) * x;                           \
            }                                                                                            \
            for (int i = 0; i < M; i++) {                                                                \
                float t = hsum(s[i]);                                                                    \
                for (int q = p; q < k; q++) t += a[i * lda + q] * w[q];                                  \
                put(c + i * ldc + j, alpha, t, beta);                                                    \
            }                                                                                            \
        }                                                                                                \
    }
DOTS(2) DOTS(3) DOTS(4) DOTS(5) DOTS(6) DOTS(7) DOTS(8)

/* c (m x n) = alpha a (m x k) b + beta c, b stored k x n with n <= FEW_COLS: rows of b
 * added into an accumulator per row of c, kept on the stack (m * n floats, <= 16 kB) */
static void axpys(int m, int n, int k, float alpha, const float *a, long lda, const float *b, long ldb, float beta,
                  float *c, long ldc) {
    float acc[FEW_ROWS * FEW_COLS];
    for (int i = 0; i < m * n; i++) acc[i] = 0.0f;
    for (int p = 0; p < k; p++) {
        const float *w = b + p * ldb;
        for (int i = 0; i < m; i++) {
            float x = a[i * lda + p];
            float *r = acc + i * n;
            for (int j = 0; j < n; j++) r[j] += x * w[j];
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) put(c + i * ldc + j, alpha, acc[i * n + j], beta);
}

/* whether few_rows() takes this row-major product */
static int takes_few_rows(int trans_a, int trans_b, int m, int n) {
    return m >= 2 && m <= FEW_ROWS && n > 0 && trans_a == NO_TRANS && (trans_b != NO_TRANS || n <= FEW_COLS);
}

/* products few_rows() computed (read by tests through the loader; not atomic: a count,
 * not a clock) */
unsigned long ringlet_few_rows_calls;

static void few_rows(int trans_b, int m, int n, int k, float alpha, const float *a, long lda, const float *b, long ldb,
                     float beta, float *c, long ldc) {
    ringlet_few_rows_calls++;
    if (trans_b == NO_TRANS) {
        axpys(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    switch (m) {
    case 2: dots2(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    case 3: dots3(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    case 4: dots4(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    case 5: dots5(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    case 6: dots6(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    case 7: dots7(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    default: dots8(n, k, alpha, a, lda, b, ldb, beta, c, ldc); break;
    }
}

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int few_rows_on;

/* Bind the library's own sgemm and sgemv; gemv == 0 forwards nothing; few != 0 sends
 * products of a few rows to few_rows(). */
void ringlet_gemv_forward_bind(sgemm_fn gemm, sgemv_fn gemv, int few) {
    real_sgemm = gemm;
    real_sgemv = gemv;
    few_rows_on = few;
}

static void row_major(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                      const float *b, int ldb, float beta, float *c, int ldc) {
    int ta = trans_a != NO_TRANS, tb = trans_b != NO_TRANS;
    if (m == 1 && n > 0) {
        /* c (1 x n) = alpha a op(B) + beta c: sgemv on B, x = the row a (stride lda if A is transposed) */
        real_sgemv(ROW_MAJOR, tb ? NO_TRANS : TRANS, tb ? n : k, tb ? k : n, alpha, b, ldb, a, ta ? lda : 1,
                   beta, c, 1);
    } else if (n == 1 && m > 0) {
        /* c (m x 1, stride ldc) = alpha op(A) b + beta c: sgemv on A, x = the column b */
        real_sgemv(ROW_MAJOR, ta ? TRANS : NO_TRANS, ta ? k : m, ta ? m : k, alpha, a, lda, b, tb ? 1 : ldb,
                   beta, c, ldc);
    } else if (few_rows_on && takes_few_rows(trans_a, trans_b, m, n)) {
        few_rows(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    } else {
        real_sgemm(ROW_MAJOR, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (!real_sgemv || k <= 0 || (order != ROW_MAJOR && order != COL_MAJOR)) {
        real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    } else if (order == COL_MAJOR) {
        /* column-major C (m x n) is row-major C^T (n x m) = op(B)^T op(A)^T */
        row_major(trans_b, trans_a, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    } else {
        row_major(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}
