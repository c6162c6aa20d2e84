// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file blas_lapack.hpp
/// Thin, overloaded (float/double) wrappers over the few CBLAS, LAPACKE and OpenBLAS routines
/// the CPU backend uses when KFAC_HAS_LAPACK is 1. Column-major throughout. Every call goes
/// through KFAC_BLAS_NAME, so one source serves libraries whose symbols carry a prefix
/// (scipy-openblas32: scipy_cblas_ssyrk) and those whose symbols do not (Debian's OpenBLAS);
/// code outside the library (benchmarks, tests) calls these wrappers rather than the C API.

#include "kfac/config.hpp"

/// The library's name for a CBLAS/LAPACKE/OpenBLAS symbol: KFAC_BLAS_SYMBOL_PREFIX pasted
/// before `name` (two levels, so that the prefix macro is expanded before the paste).
#define KFAC_BLAS_PASTE_EXPANDED(prefix, name) prefix##name
#define KFAC_BLAS_PASTE(prefix, name) KFAC_BLAS_PASTE_EXPANDED(prefix, name)
#define KFAC_BLAS_NAME(name) KFAC_BLAS_PASTE(KFAC_BLAS_SYMBOL_PREFIX, name)
#define KFAC_BLAS_STRINGIFY_EXPANDED(text) #text
#define KFAC_BLAS_STRINGIFY(text) KFAC_BLAS_STRINGIFY_EXPANDED(text)
/// KFAC_BLAS_SYMBOL_PREFIX as a string literal: "" or "scipy_".
#define KFAC_BLAS_SYMBOL_PREFIX_STRING KFAC_BLAS_STRINGIFY(KFAC_BLAS_SYMBOL_PREFIX)

#if KFAC_HAS_LAPACK

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include <cblas.h>
#include <lapacke.h>

#if defined(__unix__) || defined(__APPLE__)
#if __has_include(<dlfcn.h>)
#include <dlfcn.h>
#define KFAC_BLAS_HAS_DLADDR 1
#endif
#endif

namespace kfac::backend::detail {

using blas_int = int;

inline void syrk(CBLAS_TRANSPOSE trans, blas_int n, blas_int k, float alpha, const float* a,
                 blas_int lda, float beta, float* c, blas_int ldc) {
    KFAC_BLAS_NAME(cblas_ssyrk)(CblasColMajor, CblasLower, trans, n, k, alpha, a, lda, beta, c, ldc);
}
inline void syrk(CBLAS_TRANSPOSE trans, blas_int n, blas_int k, double alpha, const double* a,
                 blas_int lda, double beta, double* c, blas_int ldc) {
    KFAC_BLAS_NAME(cblas_dsyrk)(CblasColMajor, CblasLower, trans, n, k, alpha, a, lda, beta, c, ldc);
}

inline void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blas_int m, blas_int n, blas_int k,
                 float alpha, const float* a, blas_int lda, const float* b, blas_int ldb,
                 float beta, float* c, blas_int ldc) {
    KFAC_BLAS_NAME(cblas_sgemm)(CblasColMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blas_int m, blas_int n, blas_int k,
                 double alpha, const double* a, blas_int lda, const double* b, blas_int ldb,
                 double beta, double* c, blas_int ldc) {
    KFAC_BLAS_NAME(cblas_dgemm)(CblasColMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/// One call of ?syevd_work ('V', lower), the caller owning the workspace; lwork = -1 (and
/// liwork = -1) asks for the sizes instead.
inline int syevd_work(blas_int n, float* a, blas_int lda, float* w, float* work, blas_int lwork,
                      blas_int* iwork, blas_int liwork) {
    return KFAC_BLAS_NAME(LAPACKE_ssyevd_work)(LAPACK_COL_MAJOR, 'V', 'L', n, a, lda, w, work, lwork,
                                               iwork, liwork);
}
inline int syevd_work(blas_int n, double* a, blas_int lda, double* w, double* work, blas_int lwork,
                      blas_int* iwork, blas_int liwork) {
    return KFAC_BLAS_NAME(LAPACKE_dsyevd_work)(LAPACK_COL_MAJOR, 'V', 'L', n, a, lda, w, work, lwork,
                                               iwork, liwork);
}

/// Divide-and-conquer symmetric eigensolver (values ascending, vectors overwrite `a`).
/// Workspace sizes are the documented minima or the query, whichever is larger: the float
/// query under-reports for n ≥ 2895 (reference/perf-anchors.md §9), which would fail.
template <class T>
int syevd(blas_int n, T* a, blas_int lda, T* w) {
    T work_query = 0;
    blas_int iwork_query = 0;
    int info = syevd_work(n, a, lda, w, &work_query, -1, &iwork_query, -1);
    if (info != 0) return info;
    const std::int64_t nn = n;
    const auto lwork = static_cast<blas_int>(
        std::max<std::int64_t>(static_cast<std::int64_t>(work_query) + 1, 1 + 6 * nn + 2 * nn * nn));
    const auto liwork = std::max<blas_int>(iwork_query, static_cast<blas_int>(3 + 5 * nn));
    // Default-initialised, not zero-filled: syevd writes its workspace before reading it, and
    // filling 2n² values is a measurable share of the call for large n.
    const std::unique_ptr<T[]> work(new T[static_cast<std::size_t>(lwork)]);
    const std::unique_ptr<blas_int[]> iwork(new blas_int[static_cast<std::size_t>(liwork)]);
    return syevd_work(n, a, lda, w, work.get(), lwork, iwork.get(), liwork);
}

/// Cholesky factorisation of an SPD matrix's lower triangle, in place (?potrf_work).
inline int potrf_lower(blas_int n, float* a, blas_int lda) {
    return KFAC_BLAS_NAME(LAPACKE_spotrf_work)(LAPACK_COL_MAJOR, 'L', n, a, lda);
}
inline int potrf_lower(blas_int n, double* a, blas_int lda) {
    return KFAC_BLAS_NAME(LAPACKE_dpotrf_work)(LAPACK_COL_MAJOR, 'L', n, a, lda);
}

/// The inverse's lower triangle from potrf_lower's factor, in place (?potri_work).
inline int potri_lower(blas_int n, float* a, blas_int lda) {
    return KFAC_BLAS_NAME(LAPACKE_spotri_work)(LAPACK_COL_MAJOR, 'L', n, a, lda);
}
inline int potri_lower(blas_int n, double* a, blas_int lda) {
    return KFAC_BLAS_NAME(LAPACKE_dpotri_work)(LAPACK_COL_MAJOR, 'L', n, a, lda);
}

/// Cholesky factorisation and inverse of an SPD matrix, lower triangle (potrf + potri).
template <class T>
int cholesky_inverse_lower(blas_int n, T* a, blas_int lda) {
    const int info = potrf_lower(n, a, lda);
    return info == 0 ? potri_lower(n, a, lda) : info;
}

// ---- OpenBLAS's own API ---------------------------------------------------------------------

inline int blas_thread_count() { return KFAC_BLAS_NAME(openblas_get_num_threads)(); }
inline void set_blas_thread_count(int threads) { KFAC_BLAS_NAME(openblas_set_num_threads)(threads); }

/// Scopes of single-threaded BLAS open in this process, and the count the first one found.
struct serial_blas_state {
    std::mutex mutex;
    int open = 0;
    int saved = 1;
};
inline serial_blas_state& serial_blas() {
    static serial_blas_state state;
    return state;
}
/// Opens a scope of single-threaded BLAS: the first saves the thread count and sets 1.
inline void serial_blas_enter() {
    serial_blas_state& s = serial_blas();
    const std::lock_guard<std::mutex> lock(s.mutex);
    if (s.open++ == 0) {
        s.saved = blas_thread_count();
        set_blas_thread_count(1);
    }
}
/// Closes one: the last restores the count the first found.
inline void serial_blas_leave() {
    serial_blas_state& s = serial_blas();
    const std::lock_guard<std::mutex> lock(s.mutex);
    if (--s.open == 0) set_blas_thread_count(s.saved);
}

/// The kernel set OpenBLAS chose (or was told to use through OPENBLAS_CORETYPE) for this
/// process: "Haswell", "Zen", "SkylakeX", "Prescott", ... (upper case in builds without
/// DYNAMIC_ARCH).
inline std::string blas_core_name() {
    const char* name = KFAC_BLAS_NAME(openblas_get_corename)();
    return name ? std::string(name) : std::string();
}

/// OpenBLAS's build line: version, DYNAMIC_ARCH, the kernel set, MAX_THREADS.
inline std::string blas_config() {
    const char* config = KFAC_BLAS_NAME(openblas_get_config)();
    std::string text = config ? std::string(config) : std::string();
    // scipy-openblas32 pads it with spaces.
    const auto first = text.find_first_not_of(' ');
    const auto last = text.find_last_not_of(' ');
    return first == std::string::npos ? std::string() : text.substr(first, last - first + 1);
}

/// The file the process loaded OpenBLAS from, or "" where that cannot be asked (no dladdr).
inline std::string blas_library_path() {
#ifdef KFAC_BLAS_HAS_DLADDR
    Dl_info where{};
    // Converting a function pointer to void* is conditionally supported; POSIX requires it.
    if (dladdr(reinterpret_cast<const void*>(&KFAC_BLAS_NAME(openblas_get_config)), &where) != 0 &&
        where.dli_fname != nullptr)
        return where.dli_fname;
#endif
    return {};
}

}  // namespace kfac::backend::detail

#endif  // KFAC_HAS_LAPACK
