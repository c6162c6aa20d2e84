// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file config.hpp
/// Feature macros (each overridable with -D before the first include), the library's
/// exception type and its version.

#include <memory>
#include <stdexcept>
#include <string>

/// 1 when LAPACKE and CBLAS (OpenBLAS) may be called; CMake's kfac::kfac target sets it when
/// KFAC_ENABLE_LAPACK is on and a BLAS was found (KFAC_BLAS, cmake/kfacFindBLAS.cmake). With 0
/// the core needs only Eigen.
#ifndef KFAC_HAS_LAPACK
#define KFAC_HAS_LAPACK 0
#endif

/// What the BLAS library puts before every symbol name: empty for Debian's OpenBLAS,
/// `scipy_` for the PyPI wheel scipy-openblas32 (scipy_cblas_sgemm, scipy_LAPACKE_ssyevd_work,
/// scipy_openblas_set_num_threads), whose headers declare the prefixed names. CMake sets it
/// with KFAC_HAS_LAPACK; kfac/backend/detail/blas_lapack.hpp pastes it onto each call.
#ifndef KFAC_BLAS_SYMBOL_PREFIX
#define KFAC_BLAS_SYMBOL_PREFIX
#endif

/// Largest factor dimension for which Eigen's own eigensolver is used even when LAPACK is
/// available: below it, LAPACK's call overhead outweighs divide and conquer
/// (reference/perf-anchors.md §9: parity near n = 128).
#ifndef KFAC_EIGEN_SOLVER_MAX_DIM
#define KFAC_EIGEN_SOLVER_MAX_DIM 128
#endif

/// Rows of the im2col buffer built at a time for a conv layer's A statistic. A chunk of
/// this many rows stays in L2 for typical widths (C_in·k_h·k_w ≤ 576), so the rank-k update
/// reads it from cache instead of streaming a batch-sized patch matrix through memory.
#ifndef KFAC_IM2COL_CHUNK_ROWS
#define KFAC_IM2COL_CHUNK_ROWS 512
#endif

#define KFAC_VERSION_MAJOR 0  ///< the library's version, major.minor.patch: major
#define KFAC_VERSION_MINOR 1  ///< minor version
#define KFAC_VERSION_PATCH 0  ///< patch version

namespace kfac {

/// The one exception type the library throws. Messages name the layer, the shapes involved
/// and what to change.
class error : public std::runtime_error {
public:
    /// An error of no one layer; what() is `what` after "kfac: ".
    explicit error(const std::string& what) : std::runtime_error("kfac: " + what) {}
    /// An error about one registered layer (or block), which the message names too.
    error(const std::string& what, const std::string& layer)
        : std::runtime_error("kfac: " + what), layer_(std::make_shared<const std::string>(layer)) {}

    /// The name of the layer the error is about; empty when it is about no one layer.
    [[nodiscard]] const std::string& layer() const noexcept { return layer_ ? *layer_ : no_layer(); }
    /// The message without its "kfac: " prefix.
    [[nodiscard]] std::string message() const { return std::string(what()).substr(6); }

private:
    static const std::string& no_layer() noexcept {
        static const std::string none;
        return none;
    }
    std::shared_ptr<const std::string> layer_;  // shared: copying an exception does not throw
};

}  // namespace kfac
