// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_library_calls.cuh
/// The cuBLAS and cuSOLVER calls the CUDA backend makes, overloaded on float and double, each
/// checked: a failure throws kfac::error naming the typed call (cublasSsyrk, cusolverDnDsyevd,
/// ...) and its status.

#include <type_traits>

#include <cublas_v2.h>
#include <cusolverDn.h>

#include "kfac/backend/detail/cuda_support.cuh"

namespace kfac::backend::cuda_detail {

#define KFAC_CUDA_TYPED_CALL(T, s_call, d_call, ...)                                    \
    do {                                                                                  \
        if constexpr (std::is_same_v<T, float>) check(s_call(__VA_ARGS__), #s_call);      \
        else check(d_call(__VA_ARGS__), #d_call);                                         \
    } while (0)

/// Lower triangle of C = alpha·op(A)·op(A)ᵀ + beta·C.
template <class T>
void syrk(cublasOperation_t op, int n, int k, T alpha, const T* a, int lda, T beta, T* c, int ldc) {
    cublasHandle_t h = library_handles::of_this_thread().blas();
    KFAC_CUDA_TYPED_CALL(T, cublasSsyrk, cublasDsyrk, h, CUBLAS_FILL_MODE_LOWER, op, n, k, &alpha, a, lda, &beta, c, ldc);
}

template <class T>
void gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc) {
    cublasHandle_t h = library_handles::of_this_thread().blas();
    KFAC_CUDA_TYPED_CALL(T, cublasSgemm, cublasDgemm, h, op_a, op_b, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
}

/// `batch` products C_b = alpha·op(A_b)·op(B_b) + beta·C_b, A_b at a + b·stride_a (likewise B, C;
/// a stride of 0 reuses one matrix).
template <class T>
void gemm_strided_batched(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, T alpha, const T* a,
                          int lda, long long stride_a, const T* b, int ldb, long long stride_b, T beta, T* c, int ldc,
                          long long stride_c, int batch) {
    cublasHandle_t h = library_handles::of_this_thread().blas();
    KFAC_CUDA_TYPED_CALL(T, cublasSgemmStridedBatched, cublasDgemmStridedBatched, h, op_a, op_b, m, n, k, &alpha, a, lda,
                         stride_a, b, ldb, stride_b, &beta, c, ldc, stride_c, batch);
}

/// 1: factor statistics through GEMM, which computes both triangles (twice SYRK's flops) but
/// runs cuBLAS's tuned split-k kernels. Measured on an H100 (bench_cuda, 2026-11-23): the
/// factor-update step of ResNet-32 at batch 128 took 334 ms with cublasSsyrk and 40 ms with
/// cublasSgemm (inverse method; 56 → 35 ms in double), ResNet-50 at batch 32 517 → 236 ms:
/// SYRK over k ≈ 10⁵ patch rows and n ≤ 577 runs far below the card's speed in float.
#ifndef KFAC_CUDA_GRAM_BY_GEMM
#define KFAC_CUDA_GRAM_BY_GEMM 1
#endif

/// C = alpha·op(A)·op(A)ᵀ + beta·C, of which the lower triangle is used (op = N: A is n × k;
/// op = T: A is k × n): a GEMM that also writes the upper one, or SYRK.
template <class T>
void gram(cublasOperation_t op, int n, int k, T alpha, const T* a, int lda, T beta, T* c, int ldc) {
#if KFAC_CUDA_GRAM_BY_GEMM
    gemm<T>(op, op == CUBLAS_OP_N ? CUBLAS_OP_T : CUBLAS_OP_N, n, n, k, alpha, a, lda, a, lda, beta, c, ldc);
#else
    syrk<T>(op, n, k, alpha, a, lda, beta, c, ldc);
#endif
}

/// Workspace size, in elements, of the eigensolver for an n × n matrix.
template <class T>
int syevd_workspace(int n, T* a, T* w) {
    int lwork = 0;
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSsyevd_bufferSize, cusolverDnDsyevd_bufferSize, h, CUSOLVER_EIG_MODE_VECTOR,
                         CUBLAS_FILL_MODE_LOWER, n, a, n, w, &lwork);
    return lwork;
}

template <class T>
void syevd(int n, T* a, T* w, T* work, int lwork, int* info) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSsyevd, cusolverDnDsyevd, h, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
                         a, n, w, work, lwork, info);
}

template <class T>
int potrf_workspace(int n, T* a) {
    int lwork = 0;
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSpotrf_bufferSize, cusolverDnDpotrf_bufferSize, h, CUBLAS_FILL_MODE_LOWER, n, a,
                         n, &lwork);
    return lwork;
}

template <class T>
void potrf(int n, T* a, T* work, int lwork, int* info) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSpotrf, cusolverDnDpotrf, h, CUBLAS_FILL_MODE_LOWER, n, a, n, work, lwork, info);
}

template <class T>
int potri_workspace(int n, T* a) {
    int lwork = 0;
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSpotri_bufferSize, cusolverDnDpotri_bufferSize, h, CUBLAS_FILL_MODE_LOWER, n, a,
                         n, &lwork);
    return lwork;
}

template <class T>
void potri(int n, T* a, T* work, int lwork, int* info) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSpotri, cusolverDnDpotri, h, CUBLAS_FILL_MODE_LOWER, n, a, n, work, lwork, info);
}

template <class T>
int getrf_workspace(int n, T* a) {
    int lwork = 0;
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSgetrf_bufferSize, cusolverDnDgetrf_bufferSize, h, n, n, a, n, &lwork);
    return lwork;
}

template <class T>
void getrf(int n, T* a, T* work, int* pivots, int* info) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSgetrf, cusolverDnDgetrf, h, n, n, a, n, work, pivots, info);
}

/// Solves A·X = B for n right-hand sides, A from getrf.
template <class T>
void getrs(int n, const T* a, const int* pivots, T* b, int* info) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSgetrs, cusolverDnDgetrs, h, CUBLAS_OP_N, n, n, a, n, pivots, b, n, info);
}

/// Parameters of the batched Jacobi eigensolver (cusolverDn?syevjBatched): eigenvalues sorted
/// ascending, as ?syevd returns them; the default tolerance (machine precision) and sweeps.
class syevj_parameters {
public:
    syevj_parameters() {
        check(cusolverDnCreateSyevjInfo(&info_), "cusolverDnCreateSyevjInfo");
        check(cusolverDnXsyevjSetSortEig(info_, 1), "cusolverDnXsyevjSetSortEig");
    }
    syevj_parameters(const syevj_parameters&) = delete;
    syevj_parameters& operator=(const syevj_parameters&) = delete;
    ~syevj_parameters() { (void)cusolverDnDestroySyevjInfo(info_); }
    [[nodiscard]] syevjInfo_t get() const noexcept { return info_; }

private:
    syevjInfo_t info_ = nullptr;
};

/// Workspace, in elements, of the batched Jacobi eigensolver for `batch` n × n matrices.
template <class T>
int syevj_batched_workspace(int n, T* a, T* w, const syevj_parameters& p, int batch) {
    int lwork = 0;
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSsyevjBatched_bufferSize, cusolverDnDsyevjBatched_bufferSize, h,
                         CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, a, n, w, &lwork, p.get(), batch);
    return lwork;
}

/// `batch` n × n matrices stored one after another in `a` (n ≤ 32): eigenvectors in place,
/// eigenvalues n after n in `w`, each matrix's status in info[b].
template <class T>
void syevj_batched(int n, T* a, T* w, T* work, int lwork, int* info, const syevj_parameters& p, int batch) {
    cusolverDnHandle_t h = library_handles::of_this_thread().solver();
    KFAC_CUDA_TYPED_CALL(T, cusolverDnSsyevjBatched, cusolverDnDsyevjBatched, h, CUSOLVER_EIG_MODE_VECTOR,
                         CUBLAS_FILL_MODE_LOWER, n, a, n, w, work, lwork, info, p.get(), batch);
}

#undef KFAC_CUDA_TYPED_CALL

}  // namespace kfac::backend::cuda_detail
