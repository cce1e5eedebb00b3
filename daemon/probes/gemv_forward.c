/* ringlet: cblas_sgemm that hands matrix-vector products to cblas_sgemv.
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
 * the real sgemm unchanged. Built without libc (-nostdlib): it calls only the two
 * pointers it is given. Argument order and enum values: the CBLAS interface (cblas.h).
 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Bind the library's own sgemm and sgemv; gemv == 0 forwards nothing. */
void ringlet_gemv_forward_bind(sgemm_fn gemm, sgemv_fn gemv) {
    real_sgemm = gemm;
    real_sgemv = gemv;
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
