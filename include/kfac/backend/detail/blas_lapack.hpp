// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file blas_lapack.hpp
/// Thin, overloaded (float/double) wrappers over the few CBLAS and LAPACKE routines the CPU
/// backend uses when KFAC_HAS_LAPACK is 1. Column-major throughout.

#include "kfac/config.hpp"

#if KFAC_HAS_LAPACK

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <cblas.h>
#include <lapacke.h>

namespace kfac::backend::detail {

using blas_int = int;

inline void syrk(CBLAS_TRANSPOSE trans, blas_int n, blas_int k, float alpha, const float* a,
                 blas_int lda, float beta, float* c, blas_int ldc) {
    cblas_ssyrk(CblasColMajor, CblasLower, trans, n, k, alpha, a, lda, beta, c, ldc);
}
inline void syrk(CBLAS_TRANSPOSE trans, blas_int n, blas_int k, double alpha, const double* a,
                 blas_int lda, double beta, double* c, blas_int ldc) {
    cblas_dsyrk(CblasColMajor, CblasLower, trans, n, k, alpha, a, lda, beta, c, ldc);
}

inline void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blas_int m, blas_int n, blas_int k,
                 float alpha, const float* a, blas_int lda, const float* b, blas_int ldb,
                 float beta, float* c, blas_int ldc) {
    cblas_sgemm(CblasColMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blas_int m, blas_int n, blas_int k,
                 double alpha, const double* a, blas_int lda, const double* b, blas_int ldb,
                 double beta, double* c, blas_int ldc) {
    cblas_dgemm(CblasColMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/// Divide-and-conquer symmetric eigensolver (values ascending, vectors overwrite `a`).
/// Workspace sizes are the documented minima or the query, whichever is larger: the float
/// query under-reports for n ≥ 2895 (reference/perf-anchors.md §9), which would fail.
template <class T>
int syevd(blas_int n, T* a, blas_int lda, T* w) {
    T work_query = 0;
    blas_int iwork_query = 0;
    auto call = [&](T* work, blas_int lwork, blas_int* iwork, blas_int liwork) {
        if constexpr (std::is_same_v<T, float>)
            return LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'L', n, a, lda, w, work, lwork,
                                       iwork, liwork);
        else
            return LAPACKE_dsyevd_work(LAPACK_COL_MAJOR, 'V', 'L', n, a, lda, w, work, lwork,
                                       iwork, liwork);
    };
    int info = call(&work_query, -1, &iwork_query, -1);
    if (info != 0) return info;
    const std::int64_t nn = n;
    const auto lwork = static_cast<blas_int>(
        std::max<std::int64_t>(static_cast<std::int64_t>(work_query) + 1, 1 + 6 * nn + 2 * nn * nn));
    const auto liwork = std::max<blas_int>(iwork_query, static_cast<blas_int>(3 + 5 * nn));
    // Default-initialised, not zero-filled: syevd writes its workspace before reading it, and
    // filling 2n² values is a measurable share of the call for large n.
    const std::unique_ptr<T[]> work(new T[static_cast<std::size_t>(lwork)]);
    const std::unique_ptr<blas_int[]> iwork(new blas_int[static_cast<std::size_t>(liwork)]);
    return call(work.get(), lwork, iwork.get(), liwork);
}

/// Cholesky factorisation and inverse of an SPD matrix, lower triangle (potrf + potri).
template <class T>
int cholesky_inverse_lower(blas_int n, T* a, blas_int lda) {
    int info = 0;
    if constexpr (std::is_same_v<T, float>) {
        info = LAPACKE_spotrf_work(LAPACK_COL_MAJOR, 'L', n, a, lda);
        if (info == 0) info = LAPACKE_spotri_work(LAPACK_COL_MAJOR, 'L', n, a, lda);
    } else {
        info = LAPACKE_dpotrf_work(LAPACK_COL_MAJOR, 'L', n, a, lda);
        if (info == 0) info = LAPACKE_dpotri_work(LAPACK_COL_MAJOR, 'L', n, a, lda);
    }
    return info;
}

}  // namespace kfac::backend::detail

#endif  // KFAC_HAS_LAPACK
