// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cpu_eigen.hpp
/// The CPU backend: Eigen matrices, with CBLAS/LAPACKE (OpenBLAS) fast paths when
/// KFAC_HAS_LAPACK is 1. The header-only fallback uses Eigen alone. The LAPACK-level calls
/// (Cholesky inverse, syevd) also fall back to Eigen at run time while OpenBLAS runs generic
/// kernels, which crash in them (kfac/backend/blas_kernels.hpp).
///
/// **Backend policy.** A backend is a type that provides, all static unless noted:
/// ```
///   using scalar_type;                    // float or double
///   using matrix;  using vector;          // dense storage of factors and second-order data
///   struct serial_blas_scope;             // RAII: library calls single-threaded while alive
///   static matrix identity(index n);
///   // Factor statistics: sum(lower) = beta·sum + alpha·X̃ᵀX̃ of one batch (golden §4),
///   // reading the layer's views in place; `ws` is scratch the backend may keep.
///   static void accumulate_a_statistic(matrix& sum, const layer_description&,
///                                      tensor_view<const scalar_type> input,
///                                      conv_patch_mode, scalar_type beta, workspace& ws);
///   static void accumulate_g_statistic(matrix& sum, const layer_description&,
///                                      tensor_view<const scalar_type> grad_output,
///                                      scalar_type beta, workspace& ws);
///   // F ← decay·F + weight·sym(sum), where only sum's lower triangle is meaningful.
///   static void running_average(matrix& F, matrix& sum, scalar_type decay, scalar_type weight);
///   static void scale_symmetric(matrix& M, scalar_type s);   // mirror lower, then M ← s·M
///   static bool symmetric_eigen(const matrix& M, matrix& Q, vector& lambda);  // ascending
///   static bool damped_inverse(const matrix& M, scalar_type damping, matrix& inverse);
///   // C = op(A)·op(B); trans_a / trans_b select the transpose.
///   static void multiply(const matrix& A, bool trans_a, const matrix& B, bool trans_b, matrix& C);
///   static matrix zeros(index rows, index cols);
///   static bool all_finite(const matrix&);
///   static bool lower_all_finite(const matrix&);
///   // Gradient transfer between the host's views and backend storage. The backend holds
///   // Γᵀ = [∇W | ∇b]ᵀ (A_dim × G_dim), which is the host's row-major Γ without a transpose.
///   static void load_gradient(matrix& gamma_t, tensor_view<const scalar_type> w,
///                             tensor_view<const scalar_type> b);
///   static void store_gradient(const matrix& P_t, scalar_type scale,
///                              tensor_view<scalar_type> w, tensor_view<scalar_type> b);
///   static double frobenius_dot(const matrix& X, const matrix& Y);  // Σ X∘Y, in double
///   // Element-wise pieces of the compute methods (kfac/compute/*.hpp):
///   static vector ones(index n);
///   static matrix scaled_identity(index n, scalar_type diagonal);
///   static void clamp_nonnegative(vector& v);                      // v ← max(v, 0)
///   static void add_constant(vector& v, scalar_type s);            // v ← v + s
///   // D(i, j) = 1 / (a_i·g_j + damping), and V(i, j) /= (a_i·g_j + damping)
///   static void inverse_eigen_product(const vector& a, const vector& g, scalar_type damping, matrix& D);
///   static void divide_by_eigen_product(matrix& V, const vector& a, const vector& g, scalar_type damping);
///   static void multiply_elementwise(matrix& V, const matrix& D);  // V ← V ∘ D
///   // Where the data lives. Device backends (device_memory = true) also provide
///   // pinned_buffer, download() and upload() for staging collectives through host memory
///   // (kfac/detail/host_staging.hpp).
///   static constexpr bool device_memory;
///   using host_matrix;                           // column-major Eigen matrix on the host
///   static host_matrix to_host(const matrix&);   // column-major host copy (or the matrix)
///   static matrix from_host(const host_matrix&); // checkpoints: data back into storage
/// ```
/// Returning false from symmetric_eigen / damped_inverse means "no usable result"; the
/// preconditioner then keeps the previous second-order data.
/// Optional: the members of kfac/backend/diagonal_factors.hpp (Embedding layers), with which
/// running_average, scale_symmetric and lower_all_finite also take a diagonal factor's
/// n × 1 column, and accumulate_a_statistic writes one; and those of
/// kfac/backend/unit_wise_factors.hpp (LayerNorm, BatchNorm), and the one of
/// kfac/backend/eigenbasis_reuse.hpp (options.eigenbasis_reuse_tolerance).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/LU>

#include "kfac/backend/blas_kernels.hpp"
#include "kfac/backend/detail/blas_lapack.hpp"
#include "kfac/backend/detail/cpu_statistics.hpp"
#include "kfac/backend/detail/cpu_unit_wise.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac::backend {

/// CPU backend over Eigen (and OpenBLAS/LAPACKE when KFAC_HAS_LAPACK; LAPACK's solvers only
/// while blas_kernels() says the kernels are not generic).
/// @tparam Scalar float or double: the precision of factors, decompositions and gradients.
/// Its factor statistics are detail::cpu_statistics' (kfac/backend/detail/cpu_statistics.hpp),
/// its normalisation layers' unit-wise blocks detail::cpu_unit_wise's (cpu_unit_wise.hpp).
template <class Scalar = float>
struct cpu_eigen : detail::cpu_statistics<Scalar>, detail::cpu_unit_wise<Scalar> {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::backend::cpu_eigen<Scalar>: Scalar must be float or double");

    using scalar_type = Scalar;     ///< the compute type: float or double
    using index = std::int64_t;     ///< rows, columns and element counts
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;  ///< column-major, dense
    using vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;               ///< a column, dense
    /// A host's row-major view (data, rows, columns, row stride) read as a matrix, in place.
    using row_major_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                     0, Eigen::OuterStride<>>;
    /// A host's contiguous row-major buffer written as a matrix, in place.
    using writable_row_major_map = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    /// A buffer of one row per example (weight sharing `reduce`).
    using example_rows = writable_row_major_map;

    /// While alive, BLAS calls run single-threaded (the caller runs several at once).
    struct serial_blas_scope {
#if KFAC_HAS_LAPACK
        // BLAS's thread count is the process's: scopes of several preconditioners stepping
        // in several threads at once nest in any order, so the first to open saves the count
        // and the last to close restores it (each scope restoring what it found would leave
        // 1 behind when they interleave).
        serial_blas_scope() {
            check_blas_kernels();
            detail::serial_blas_enter();
        }
        ~serial_blas_scope() { detail::serial_blas_leave(); }
#endif
        serial_blas_scope(const serial_blas_scope&) = delete;
        serial_blas_scope& operator=(const serial_blas_scope&) = delete;
#if !KFAC_HAS_LAPACK
        // Eigen's kernels are single-threaded already. User-provided members keep the guard
        // non-trivial, so declaring one is not an "unused variable" either way.
        serial_blas_scope() {}   // NOLINT(modernize-use-equals-default)
        ~serial_blas_scope() {}  // NOLINT(modernize-use-equals-default)
#endif
    };

    /// Scratch kept per layer between calls, so steady-state steps do not allocate.
    using workspace = detail::cpu_workspace<Scalar>;


    /// Factors, second-order data and gradients live in host memory.
    static constexpr bool device_memory = false;

    static matrix identity(index n) { return matrix::Identity(n, n); }             ///< the n × n identity
    static matrix zeros(index rows, index cols) { return matrix::Zero(rows, cols); }  ///< a rows × cols zero matrix
    static vector ones(index n) { return vector::Ones(n); }                        ///< n ones
    /// The n × n matrix with `diagonal` on its diagonal, 0 elsewhere.
    static matrix scaled_identity(index n, Scalar diagonal) {
        matrix m = matrix::Zero(n, n);
        m.diagonal().setConstant(diagonal);
        return m;
    }
    /// The matrix itself: it is already in host memory.
    using host_matrix = matrix;
    static const matrix& to_host(const matrix& m) { return m; }  ///< `m` itself
    static matrix from_host(host_matrix h) { return h; }         ///< `h` itself

    static void clamp_nonnegative(vector& v) { v = v.cwiseMax(Scalar(0)); }  ///< v ← max(v, 0)
    static void add_constant(vector& v, Scalar s) { v.array() += s; }        ///< v ← v + s
    /// d(i, j) = 1 / (a_i·g_j + damping).
    static void inverse_eigen_product(const vector& a, const vector& g, Scalar damping, matrix& d) {
        d = ((a * g.transpose()).array() + damping).inverse().matrix();
    }
    /// v(i, j) ← v(i, j) / (a_i·g_j + damping).
    static void divide_by_eigen_product(matrix& v, const vector& a, const vector& g, Scalar damping) {
        v.array() /= ((a * g.transpose()).array() + damping);
    }
    static void multiply_elementwise(matrix& v, const matrix& d) { v.array() *= d.array(); }  ///< v ← v ∘ d

    /// F ← decay·F + weight·sum, after mirroring sum's lower triangle into its upper one.
    static void running_average(matrix& F, matrix& sum, Scalar decay, Scalar weight) {
        mirror_lower(sum);
        F = decay * F + weight * sum;
    }

    /// M ← s·M after mirroring its lower triangle into the upper one.
    static void scale_symmetric(matrix& M, Scalar s) {
        mirror_lower(M);
        M *= s;
    }

    /// Only the output is checked: a non-finite input cannot give a finite decomposition.
    /// syevd above KFAC_EIGEN_SOLVER_MAX_DIM when LAPACK's solvers are usable, else Eigen's.
    static bool symmetric_eigen(const matrix& M, matrix& Q, vector& lambda) {
        const bool solved = M.rows() > KFAC_EIGEN_SOLVER_MAX_DIM && lapack_solvers_usable()
                                ? lapack_symmetric_eigen(M, Q, lambda)
                                : eigen_symmetric_eigen(M, Q, lambda);
        return solved && all_finite(Q) && lambda.allFinite();
    }

    /// inverse = (M + damping·I)⁻¹ by Cholesky (LAPACK's potrf + potri when usable, else
    /// Eigen's LLT), falling back to LU when rounding leaves the matrix not quite SPD.
    static bool damped_inverse(const matrix& M, Scalar damping, matrix& inverse);  // below the class

    /// The decompositions in double (kfac/backend/fp64_decompositions.hpp): M widened exactly,
    /// the result rounded once to Scalar.
    static bool symmetric_eigen_fp64(const matrix& M, matrix& Q, vector& lambda) {
        using wide = cpu_eigen<double>;
        typename wide::matrix q;
        typename wide::vector l;
        if (!wide::symmetric_eigen(M.template cast<double>(), q, l)) return false;
        Q = q.template cast<Scalar>();
        lambda = l.template cast<Scalar>();
        return all_finite(Q) && lambda.allFinite();
    }
    /// damped_inverse() in double: M widened exactly, the inverse rounded once to Scalar.
    static bool damped_inverse_fp64(const matrix& M, double damping, matrix& inverse) {
        using wide = cpu_eigen<double>;
        typename wide::matrix i;
        if (!wide::damped_inverse(M.template cast<double>(), damping, i)) return false;
        inverse = i.template cast<Scalar>();
        return all_finite(inverse);
    }

    /// C = op(A)·op(B), op the transpose where trans_a or trans_b says so (sgemm/dgemm with
    /// LAPACK, else Eigen's product).
    static void multiply(const matrix& A, bool trans_a, const matrix& B, bool trans_b, matrix& C) {
        const index m = trans_a ? A.cols() : A.rows();
        const index k = trans_a ? A.rows() : A.cols();
        const index n = trans_b ? B.rows() : B.cols();
        C.resize(m, n);
#if KFAC_HAS_LAPACK
        check_blas_kernels();
        detail::gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                     static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), Scalar(1),
                     A.data(), static_cast<int>(A.rows()), B.data(), static_cast<int>(B.rows()),
                     Scalar(0), C.data(), static_cast<int>(C.rows()));
#else
        (void)k;
        if (trans_a && trans_b) C.noalias() = A.transpose() * B.transpose();
        else if (trans_a) C.noalias() = A.transpose() * B;
        else if (trans_b) C.noalias() = A * B.transpose();
        else C.noalias() = A * B;
#endif
    }

    static bool all_finite(const matrix& M) { return M.allFinite(); }  ///< no NaN, no ±Inf
    /// Finiteness of the lower triangle only (the part a statistic sum defines).
    static bool lower_all_finite(const matrix& M) {
        for (index j = 0; j < M.cols(); ++j)
            if (!M.col(j).tail(M.rows() - j).allFinite()) return false;
        return true;
    }

    /// gamma ← Γᵀ (A_dim × G_dim): column j is weight row j followed by bias j. Γᵀ in
    /// column-major order is Γ in the host's row-major order, so this is a streaming copy.
    static void load_gradient(matrix& gamma, tensor_view<const Scalar> w, tensor_view<const Scalar> b) {
        const index rows = w.extent(0);
        const index cols = w.size() / rows;
        const index a_dim = cols + (b.empty() ? 0 : 1);
        gamma.resize(a_dim, rows);
        if (b.empty()) {
            std::copy(w.data, w.data + w.size(), gamma.data());
            return;
        }
        for (index j = 0; j < rows; ++j) {
            Scalar* dst = gamma.data() + j * a_dim;
            std::copy(w.data + j * cols, w.data + (j + 1) * cols, dst);
            dst[cols] = b.data[j];
        }
    }

    /// The inverse of load_gradient, scaled: weight and bias ← scale·Pᵀ's columns.
    static void store_gradient(const matrix& pt, Scalar scale, tensor_view<Scalar> w, tensor_view<Scalar> b) {
        const index rows = w.extent(0);
        const index cols = w.size() / rows;
        const index a_dim = pt.rows();
        for (index j = 0; j < rows; ++j) {
            const Scalar* src = pt.data() + j * a_dim;
            Scalar* dst = w.data + j * cols;
            for (index i = 0; i < cols; ++i) dst[i] = scale * src[i];
            if (!b.empty()) b.data[j] = scale * src[cols];
        }
    }

    /// Copies the strict lower triangle into the upper one (Eigen's transposed copy measured
    /// faster here than a hand-tiled loop, bench/README.md).
    /// A one-column matrix (a diagonal factor's storage, or a 1 × 1 one) has nothing to mirror.
    static void mirror_lower(matrix& M) {
        if (M.cols() == 1) return;
        M.template triangularView<Eigen::StrictlyUpper>() = M.transpose();
    }

    // Eigenbasis reuse (kfac/backend/eigenbasis_reuse.hpp): F Q by GEMM (2n³, at the GEMM
    // rate), then the quotients and both norms in one O(n²) pass, in double so that a
    // residual near the tolerance is not decided by float rounding of n² terms.
    /// λ_i = q_iᵀ F q_i and the relative residual ‖F Q − Q diag(λ)‖_F / ‖F‖_F, which it returns
    /// (NaN for F = 0 or a non-finite input).
    static double rayleigh_quotients(const matrix& F, const matrix& Q, vector& lambda) {
        matrix fq;
        multiply(F, false, Q, false, fq);
        const index n = Q.cols(), rows = Q.rows();
        lambda.resize(n);
        double off_diagonal = 0.0, norm = 0.0;
        for (index j = 0; j < n; ++j) {
            double quotient = 0.0;
            for (index i = 0; i < rows; ++i) quotient += static_cast<double>(Q(i, j)) * static_cast<double>(fq(i, j));
            lambda(j) = static_cast<Scalar>(quotient);
            for (index i = 0; i < rows; ++i) {
                const double r = static_cast<double>(fq(i, j)) - quotient * static_cast<double>(Q(i, j));
                const double f = static_cast<double>(F(i, j));
                off_diagonal += r * r;
                norm += f * f;
            }
        }
        return std::sqrt(off_diagonal) / std::sqrt(norm);  // NaN for F = 0 or non-finite input
    }

    // Diagonal factors and [in, out] weights (kfac/backend/diagonal_factors.hpp).
    /// values ← column.
    static void diagonal_values(const matrix& column, vector& values) { values = column.col(0); }
    /// out(i) = 1 / (column(i) + damping); false when a result is not finite.
    static bool damped_reciprocal(const matrix& column, Scalar damping, matrix& out) {
        out = (column.array() + damping).inverse().matrix();
        return all_finite(out);
    }
    /// m(i, ·) ← column(i)·m(i, ·).
    static void scale_rows(matrix& m, const matrix& column) { m.array().colwise() *= column.col(0).array(); }
    /// gamma ← Γᵀ = the host's [in, out] row-major weight gradient as an in × out matrix.
    static void load_gradient_transposed(matrix& gamma, tensor_view<const Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        gamma = row_major_map(w.data, rows, cols, Eigen::OuterStride<>(cols));
    }
    /// The host's [in, out] weight gradient ← scale·Pᵀ (in × out).
    static void store_gradient_transposed(const matrix& pt, Scalar scale, tensor_view<Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        writable_row_major_map(w.data, rows, cols) = scale * pt;
    }

    /// Σ X∘Y over all entries, accumulated in double.
    static double frobenius_dot(const matrix& X, const matrix& Y) {
        double s = 0.0;
        const Scalar* x = X.data();
        const Scalar* y = Y.data();
        for (index i = 0, n = X.size(); i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(y[i]);
        return s;
    }

private:
    /// The first BLAS use of the process gathers blas_kernels(), which says its warning then.
    static void check_blas_kernels() { static_cast<void>(blas_kernels()); }

    /// LAPACK's solvers run unless OpenBLAS runs generic kernels, which crash inside them
    /// (blas_kernels.hpp); Eigen's own solvers, compiled into the program, take over then.
    static bool lapack_solvers_usable() {
#if KFAC_HAS_LAPACK
        return !blas_kernels().generic;
#else
        return false;
#endif
    }

    /// Q, lambda ← the eigenpairs of M by LAPACK's divide and conquer (?syevd).
    static bool lapack_symmetric_eigen(const matrix& M, matrix& Q, vector& lambda) {
#if KFAC_HAS_LAPACK
        Q = M;
        lambda.resize(M.rows());
        return detail::syevd(static_cast<int>(M.rows()), Q.data(), static_cast<int>(Q.rows()),
                             lambda.data()) == 0;
#else
        static_cast<void>(M), static_cast<void>(Q), static_cast<void>(lambda);
        return false;
#endif
    }

    static bool eigen_symmetric_eigen(const matrix& M, matrix& Q, vector& lambda);  // below the class

    /// m ← m⁻¹ for an SPD m by potrf + potri (half the flops of LU, perf-anchors §5); false
    /// when potrf finds m not positive definite.
    static bool lapack_cholesky_inverse(matrix& m) {
#if KFAC_HAS_LAPACK
        const int n = static_cast<int>(m.rows());
        if (detail::cholesky_inverse_lower(n, m.data(), n) != 0) return false;
        mirror_lower(m);
        return true;
#else
        static_cast<void>(m);
        return false;
#endif
    }

    /// m ← m⁻¹ for an SPD m by Eigen's LLT and a solve against the identity.
    static bool eigen_cholesky_inverse(matrix& m);  // below the class
};

// The members that compile Eigen's solvers (SelfAdjointEigenSolver about 5 s of GCC's time per
// scalar type at -Og, LLT with PartialPivLU about 5 s more) are defined out of the class, so not
// inline: a program that compiles cpu_eigen<Scalar> once (`template struct cpu_eigen<double>;`)
// and declares it elsewhere (`extern template struct cpu_eigen<double>;`) then compiles them
// once. GCC still instantiates an extern template's inline members where it may inline them.

template <class Scalar>
bool cpu_eigen<Scalar>::damped_inverse(const matrix& M, Scalar damping, matrix& inverse) {
    inverse = M;
    inverse.diagonal().array() += damping;
    const bool inverted = lapack_solvers_usable() ? lapack_cholesky_inverse(inverse)
                                                  : eigen_cholesky_inverse(inverse);
    if (inverted) return all_finite(inverse);
    inverse = M;  // potrf may have overwritten part of it
    inverse.diagonal().array() += damping;
    Eigen::PartialPivLU<matrix> lu(inverse);
    inverse = lu.inverse();
    return all_finite(inverse);
}

template <class Scalar>
bool cpu_eigen<Scalar>::eigen_symmetric_eigen(const matrix& M, matrix& Q, vector& lambda) {
    Eigen::SelfAdjointEigenSolver<matrix> solver(M, Eigen::ComputeEigenvectors);
    if (solver.info() != Eigen::Success) return false;
    Q = solver.eigenvectors();
    lambda = solver.eigenvalues();
    return true;
}

template <class Scalar>
bool cpu_eigen<Scalar>::eigen_cholesky_inverse(matrix& m) {
    Eigen::LLT<matrix> llt(m);
    if (llt.info() != Eigen::Success) return false;
    m = llt.solve(matrix::Identity(m.rows(), m.cols()));
    return true;
}

}  // namespace kfac::backend
