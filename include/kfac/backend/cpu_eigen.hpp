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
#include "kfac/backend/detail/shifted_patch_gram.hpp"
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
template <class Scalar = float>
struct cpu_eigen {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::backend::cpu_eigen<Scalar>: Scalar must be float or double");

    using scalar_type = Scalar;
    using index = std::int64_t;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
    using row_major_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                     0, Eigen::OuterStride<>>;
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
    struct workspace {
        std::vector<Scalar> patches;
        std::vector<Scalar> reduced;       ///< one row per example (weight sharing `reduce`)
        std::vector<std::int64_t> counts;  ///< occurrences of each token id (Embedding)
        std::vector<Scalar> products;      ///< x̂ ⊙ dy of one example (normalisation layers)
        detail::shifted_gram_scratch<Scalar> shifted;  ///< stride-1 conv A statistic
    };

    /// Factors, second-order data and gradients live in host memory.
    static constexpr bool device_memory = false;

    static matrix identity(index n) { return matrix::Identity(n, n); }
    static matrix zeros(index rows, index cols) { return matrix::Zero(rows, cols); }
    static vector ones(index n) { return vector::Ones(n); }
    static matrix scaled_identity(index n, Scalar diagonal) {
        matrix m = matrix::Zero(n, n);
        m.diagonal().setConstant(diagonal);
        return m;
    }
    /// The matrix itself: it is already in host memory.
    using host_matrix = matrix;
    static const matrix& to_host(const matrix& m) { return m; }
    static matrix from_host(host_matrix h) { return h; }

    static void clamp_nonnegative(vector& v) { v = v.cwiseMax(Scalar(0)); }
    static void inverse_eigen_product(const vector& a, const vector& g, Scalar damping, matrix& d) {
        d = ((a * g.transpose()).array() + damping).inverse().matrix();
    }
    static void divide_by_eigen_product(matrix& v, const vector& a, const vector& g, Scalar damping) {
        v.array() /= ((a * g.transpose()).array() + damping);
    }
    static void multiply_elementwise(matrix& v, const matrix& d) { v.array() *= d.array(); }

    using block_map = Eigen::Map<matrix, 0, Eigen::OuterStride<>>;

    /// Lower triangle of the leading n × n block of C (leading dimension ldc):
    /// C = beta·C + alpha·XᵀX for a row-major rows × n X (rows are samples).
    static void gram_of_rows(Scalar* C, index ldc, const Scalar* X, index rows, index n,
                             Scalar alpha, Scalar beta) {
#if KFAC_HAS_LAPACK
        check_blas_kernels();
        detail::syrk(CblasNoTrans, static_cast<int>(n), static_cast<int>(rows), alpha, X,
                     static_cast<int>(n), beta, C, static_cast<int>(ldc));
#else
        block_map c(C, n, n, Eigen::OuterStride<>(ldc));
        scale_lower(c, beta);
        Eigen::Map<const matrix> xt(X, n, rows);
        c.template selfadjointView<Eigen::Lower>().rankUpdate(xt, alpha);
#endif
    }

    /// Lower triangle of the leading n × n block of C: C = beta·C + alpha·YYᵀ for a
    /// row-major n × k Y with leading dimension ld.
    static void gram_of_cols(Scalar* C, index ldc, const Scalar* Y, index n, index k, index ld,
                             Scalar alpha, Scalar beta) {
#if KFAC_HAS_LAPACK
        check_blas_kernels();
        detail::syrk(CblasTrans, static_cast<int>(n), static_cast<int>(k), alpha, Y,
                     static_cast<int>(ld), beta, C, static_cast<int>(ldc));
#else
        block_map c(C, n, n, Eigen::OuterStride<>(ldc));
        scale_lower(c, beta);
        row_major_map y(Y, n, k, Eigen::OuterStride<>(ld));
        c.template selfadjointView<Eigen::Lower>().rankUpdate(y, alpha);
#endif
    }

    /// Adds beta·C + alpha·(column sums of X) to the bias row of the lower triangle: the
    /// products of every column with the bias's ones column, and alpha·rows at the corner.
    static void add_bias_row(matrix& C, const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>& sums,
                             index rows, Scalar alpha, Scalar beta) {
        // beta == 0 must not read C: 0 · (uninitialised NaN) would be NaN.
        const index last = C.rows() - 1;
        auto old = [&](index j) { return beta == Scalar(0) ? Scalar(0) : beta * C(last, j); };
        for (index j = 0; j < last; ++j) C(last, j) = old(j) + alpha * sums(j);
        C(last, last) = old(last) + alpha * static_cast<Scalar>(rows);
    }

    /// A statistic of one batch (golden/README.md §4.1, §4.2), added to `sum` as
    /// sum = beta·sum + X̃ᵀX̃ / (N·S³) (S = 1 for linear layers; lower triangle).
    static void accumulate_a_statistic(matrix& sum, const layer_description& d,
                                       tensor_view<const Scalar> a, conv_patch_mode mode,
                                       Scalar beta, workspace& ws) {
        const index cols = d.weight_columns();
        if (d.kind == layer_kind::embedding) {
            add_token_frequencies(sum, a, d.in, beta, ws);
            return;
        }
        if (d.sharing == weight_sharing::reduce) {
            reduce_inputs(d, a, mode, ws);
            add_example_gram(sum, d.bias, ws.reduced.data(), kfac::detail::examples_in(d, a), cols, beta);
            return;
        }
        if (d.kind == layer_kind::linear) {
            const index rows = a.size() / cols;
            const Scalar alpha = Scalar(1) / static_cast<Scalar>(rows);
            gram_of_rows(sum.data(), sum.rows(), a.data, rows, cols, alpha, beta);
            if (d.bias) {
                row_major_map x(a.data, rows, cols, Eigen::OuterStride<>(cols));
                add_bias_row(sum, x.colwise().sum(), rows, alpha, beta);
            }
            return;
        }
        const patch_grid grid = make_patch_grid(d.conv, a.extent(2), a.extent(3), mode);
        if (detail::shifted_patch_gram_pays(d.conv, grid, a.extent(1), a.extent(2), a.extent(3)))
            accumulate_patch_gram_shifted(sum, d, a, grid, beta, ws);
        else
            accumulate_patch_gram_im2col(sum, d, a, grid, beta, ws);
    }

    /// The conv A statistic by im2col: patches extracted a chunk of rows at a time, one SYRK
    /// per chunk. Every geometry; the route for strides above 1 and for few channels.
    static void accumulate_patch_gram_im2col(matrix& sum, const layer_description& d, tensor_view<const Scalar> a,
                                             const patch_grid& grid, Scalar beta, workspace& ws) {
        const index cols = d.weight_columns();
        const index n = a.extent(0), channels = a.extent(1), height = a.extent(2), width = a.extent(3);
        const index spatial = grid.positions();
        const Scalar alpha = patch_gram_scale(n, spatial);
        const index total_rows = n * grid.rows;  // (sample, grid row) pairs
        const index chunk_rows = std::max<index>(
            1, KFAC_IM2COL_CHUNK_ROWS / std::max<index>(1, grid.cols));
        const index ld = chunk_rows * grid.cols;
        ws.patches.resize(static_cast<std::size_t>(cols * ld));
        Eigen::Matrix<Scalar, 1, Eigen::Dynamic> sums =
            Eigen::Matrix<Scalar, 1, Eigen::Dynamic>::Zero(cols);
        for (index first = 0; first < total_rows; first += chunk_rows) {
            const index count = std::min(chunk_rows, total_rows - first);
            const index k = count * grid.cols;
            extract_patches_transposed(a.data, channels, height, width, d.conv, grid, first,
                                       count, ws.patches.data(), ld);
            const Scalar b = first == 0 ? beta : Scalar(1);
            gram_of_cols(sum.data(), sum.rows(), ws.patches.data(), cols, k, ld, alpha, b);
            if (d.bias) {
                row_major_map p(ws.patches.data(), cols, k, Eigen::OuterStride<>(ld));
                sums += p.rowwise().sum().transpose();
            }
        }
        if (d.bias) add_bias_row(sum, sums, n * spatial, alpha, beta);
    }

    /// The conv A statistic of a stride-1 convolution from the shift structure of its patches
    /// (kfac/backend/detail/shifted_patch_gram.hpp): one cross-product per tap offset instead
    /// of im2col. The same sums in another order.
    static void accumulate_patch_gram_shifted(matrix& sum, const layer_description& d, tensor_view<const Scalar> a,
                                              const patch_grid& grid, Scalar beta, workspace& ws) {
        const index n = a.extent(0), spatial = grid.positions();
        const Scalar alpha = patch_gram_scale(n, spatial);
        const auto geometry = detail::make_shifted_gram_geometry(d.conv, grid, a.extent(1), a.extent(2), a.extent(3));
#if KFAC_HAS_LAPACK
        check_blas_kernels();
#endif
        detail::accumulate_shifted_patch_gram(sum.data(), sum.rows(), a.data, n, geometry, alpha, beta, ws.shifted);
        if (d.bias) {
            Eigen::Matrix<Scalar, 1, Eigen::Dynamic> sums =
                Eigen::Matrix<Scalar, 1, Eigen::Dynamic>::Zero(d.weight_columns());
            detail::add_patch_element_sums(sums, a.data, n, geometry);
            add_bias_row(sum, sums, n * spatial, alpha, beta);
        }
    }

    /// Σ (x̃/S)(x̃/S)ᵀ / (N·S) = X̃ᵀX̃ / (N·S³): the reference's scaling of a conv A statistic.
    static Scalar patch_gram_scale(index n, index spatial) {
        const auto s = static_cast<Scalar>(spatial);
        return Scalar(1) / (static_cast<Scalar>(n) * s * s * s);
    }

    /// G statistic of one batch: sum = beta·sum + YᵀY / (N·S³) (golden §4.1, §4.2 step 5).
    static void accumulate_g_statistic(matrix& sum, const layer_description& d,
                                       tensor_view<const Scalar> g, Scalar beta, workspace& ws) {
        const index out = d.out;
        if (d.sharing == weight_sharing::reduce) {
            reduce_gradients(d, g, ws);
            add_example_gram(sum, false, ws.reduced.data(), kfac::detail::examples_in(d, g), out, beta);
            return;
        }
        if (d.kind == layer_kind::linear || d.kind == layer_kind::embedding) {
            const index rows = g.size() / out;
            gram_of_rows(sum.data(), sum.rows(), g.data, rows, out,
                         Scalar(1) / static_cast<Scalar>(rows), beta);
            return;
        }
        const index n = g.extent(0), spatial = g.extent(2) * g.extent(3);
        const Scalar s = static_cast<Scalar>(spatial);
        const Scalar alpha = Scalar(1) / (static_cast<Scalar>(n) * s * s * s);
        // Sample i's gradient is a C_out × S row-major block: its rows are the channels.
        for (index i = 0; i < n; ++i)
            gram_of_cols(sum.data(), sum.rows(), g.data + i * out * spatial, out, spatial,
                         spatial, alpha, i == 0 ? beta : Scalar(1));
    }

    /// The diagonal A statistic of an Embedding (an n × 1 column): sum = beta·sum + c / R, c(v)
    /// the occurrences of token v among the R ids (the mean of the one-hot rows' outer products,
    /// which has no off-diagonal term). Counted in integers, so each entry is rounded once.
    static void add_token_frequencies(matrix& sum, tensor_view<const Scalar> ids, index tokens, Scalar beta,
                                      workspace& ws) {
        ws.counts.assign(static_cast<std::size_t>(tokens), 0);
        const index rows = ids.size();
        for (index i = 0; i < rows; ++i) ++ws.counts[static_cast<std::size_t>(ids.data[i])];
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(rows);
        for (index v = 0; v < tokens; ++v) {
            const Scalar frequency = alpha * static_cast<Scalar>(ws.counts[static_cast<std::size_t>(v)]);
            sum(v, 0) = beta == Scalar(0) ? frequency : beta * sum(v, 0) + frequency;  // β = 0 reads nothing
        }
    }

    /// ws.reduced ← ā_n, the mean over positions of example n's inputs (Linear) or patches
    /// (convolutions, zero padding included), one row of weight_columns() per example.
    static void reduce_inputs(const layer_description& d, tensor_view<const Scalar> a, conv_patch_mode mode,
                              workspace& ws) {
        const index cols = d.weight_columns(), n = kfac::detail::examples_in(d, a);
        ws.reduced.resize(static_cast<std::size_t>(n * cols));
        example_rows out(ws.reduced.data(), n, cols);
        if (d.kind == layer_kind::linear) {
            const index positions = a.size() / cols / n;
            row_major_map x(a.data, n * positions, cols, Eigen::OuterStride<>(cols));
            for (index e = 0; e < n; ++e)
                out.row(e) = x.middleRows(e * positions, positions).colwise().sum() / static_cast<Scalar>(positions);
            return;
        }
        const index channels = a.extent(1), height = a.extent(2), width = a.extent(3);
        const patch_grid grid = make_patch_grid(d.conv, height, width, mode);
        const index positions = grid.positions();
        ws.patches.resize(static_cast<std::size_t>(cols * positions));
        for (index e = 0; e < n; ++e) {
            extract_patches_transposed(a.data, channels, height, width, d.conv, grid, e * grid.rows, grid.rows,
                                       ws.patches.data(), positions);
            row_major_map p(ws.patches.data(), cols, positions, Eigen::OuterStride<>(positions));
            out.row(e) = p.rowwise().sum().transpose() / static_cast<Scalar>(positions);
        }
    }

    /// ws.reduced ← ĝ_n, the sum over positions of example n's output gradients.
    static void reduce_gradients(const layer_description& d, tensor_view<const Scalar> g, workspace& ws) {
        const index out = d.out, n = kfac::detail::examples_in(d, g);
        ws.reduced.resize(static_cast<std::size_t>(n * out));
        example_rows sums(ws.reduced.data(), n, out);
        if (d.kind == layer_kind::linear) {
            const index positions = g.size() / out / n;
            row_major_map y(g.data, n * positions, out, Eigen::OuterStride<>(out));
            for (index e = 0; e < n; ++e) sums.row(e) = y.middleRows(e * positions, positions).colwise().sum();
            return;
        }
        const index positions = g.extent(2) * g.extent(3);
        for (index e = 0; e < n; ++e) {
            row_major_map y(g.data + e * out * positions, out, positions, Eigen::OuterStride<>(positions));
            sums.row(e) = y.rowwise().sum().transpose();
        }
    }

    /// sum = beta·sum + (1/n)·X̃ᵀX̃ for the n × cols row-major X of one row per example, with
    /// the ones column of a bias last (lower triangle).
    static void add_example_gram(matrix& sum, bool bias, const Scalar* x, index n, index cols, Scalar beta) {
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(n);
        gram_of_rows(sum.data(), sum.rows(), x, n, cols, alpha, beta);
        if (bias) {
            row_major_map m(x, n, cols, Eigen::OuterStride<>(cols));
            add_bias_row(sum, m.colwise().sum(), n, alpha, beta);
        }
    }

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
    static bool damped_inverse(const matrix& M, Scalar damping, matrix& inverse) {
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

    static bool all_finite(const matrix& M) { return M.allFinite(); }
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
    static void diagonal_values(const matrix& column, vector& values) { values = column.col(0); }
    static bool damped_reciprocal(const matrix& column, Scalar damping, matrix& out) {
        out = (column.array() + damping).inverse().matrix();
        return all_finite(out);
    }
    static void scale_rows(matrix& m, const matrix& column) { m.array().colwise() *= column.col(0).array(); }
    /// gamma ← Γᵀ = the host's [in, out] row-major weight gradient as an in × out matrix.
    static void load_gradient_transposed(matrix& gamma, tensor_view<const Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        gamma = row_major_map(w.data, rows, cols, Eigen::OuterStride<>(cols));
    }
    static void store_gradient_transposed(const matrix& pt, Scalar scale, tensor_view<Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        writable_row_major_map(w.data, rows, cols) = scale * pt;
    }

    // Unit-wise blocks of normalisation layers (kfac/backend/unit_wise_factors.hpp): C rows,
    // columns F_γγ, F_γβ, F_ββ (F_γγ alone without shift).

    /// sum = beta·sum + (1/R) Σ_rows (t_γ², t_γ t_β, t_β²) per channel, t_γ = Σ x̂ ⊙ dy and
    /// t_β = Σ dy over the row's positions (norm_layout). One example at a time: its C × P
    /// block of x̂ ⊙ dy goes through ws.products.
    static void accumulate_unit_wise_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> x,
                                               tensor_view<const Scalar> dy, Scalar beta, workspace& ws) {
        using channel_sums = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
        using block = Eigen::Array<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
        using channels_last = Eigen::Map<const block>;  // C × P, column p the position's channels
        using channels_first = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
        const auto layout = kfac::detail::norm_layout_of(d, x);
        const index c = layout.channels, p = layout.positions;
        const bool shift = d.bias;
        channel_sums gg = channel_sums::Zero(c), gb = channel_sums::Zero(c), bb = channel_sums::Zero(c);
        ws.products.resize(static_cast<std::size_t>(c * p));
        Eigen::Map<block> u(ws.products.data(), c, p);
        auto fold = [&](const auto& xn, const auto& dyn) {
            u = xn * dyn;  // x̂ ⊙ dy, channels × positions
            if (layout.sum_positions) {
                const channel_sums t_gamma = u.rowwise().sum(), t_beta = dyn.rowwise().sum();
                gg += t_gamma.square();
                if (shift) {
                    gb += t_gamma * t_beta;
                    bb += t_beta.square();
                }
            } else {
                gg += u.square().rowwise().sum();
                if (shift) {
                    gb += (u * dyn).rowwise().sum();
                    bb += dyn.square().rowwise().sum();
                }
            }
        };
        for (index n = 0; n < layout.examples; ++n) {
            const Scalar* xn = x.data + n * c * p;
            const Scalar* dyn = dy.data + n * c * p;
            if (layout.channels_last) fold(channels_last(xn, c, p), channels_last(dyn, c, p));
            else fold(channels_first(xn, c, p), channels_first(dyn, c, p));
        }
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(layout.rows());
        auto add = [&](index column, const channel_sums& s) {  // β = 0 reads nothing of sum
            if (beta == Scalar(0)) sum.col(column) = (alpha * s).matrix();
            else sum.col(column) = beta * sum.col(column) + (alpha * s).matrix();
        };
        add(0, gg);
        if (shift) {
            add(1, gb);
            add(2, bb);
        }
    }

    /// Every block the k × k identity: columns (1, 0, 1) for k = 2, (1) for k = 1.
    static matrix unit_wise_identity(index channels, index k) {
        matrix m = matrix::Zero(channels, k * (k + 1) / 2);
        m.col(0).setOnes();
        if (k == 2) m.col(2).setOnes();
        return m;
    }

    /// (F_c + γI)⁻¹ in closed form: [[F_ββ + γ, −F_γβ], [−F_γβ, F_γγ + γ]] / det, with
    /// det = (F_γγF_ββ − F_γβ²) + γ(F_γγ + F_ββ) + γ². The first term is det F ≥ 0 for the PSD
    /// F_c (a mean of t tᵀ), which rounding may leave slightly negative: clamped at 0, so det
    /// stays ≥ γ(tr F + γ) > 0 and the relative error of each entry is a few roundings.
    static bool unit_wise_damped_inverse(const matrix& blocks, Scalar damping, matrix& out) {
        out.resize(blocks.rows(), blocks.cols());
        if (blocks.cols() == 1) {
            out.col(0) = (blocks.col(0).array() + damping).inverse().matrix();
            return all_finite(out);
        }
        const auto f_gg = blocks.col(0).array(), f_gb = blocks.col(1).array(), f_bb = blocks.col(2).array();
        const auto det = (f_gg * f_bb - f_gb.square()).max(Scalar(0)) + damping * (f_gg + f_bb) + damping * damping;
        out.col(0) = ((f_bb + damping) / det).matrix();
        out.col(1) = (-f_gb / det).matrix();
        out.col(2) = ((f_gg + damping) / det).matrix();
        return all_finite(out);
    }

    static void scale_blocks(matrix& blocks, Scalar s) { blocks *= s; }
    static void average_blocks(matrix& F, const matrix& sum, Scalar decay, Scalar weight) { F = decay * F + weight * sum; }

    /// P_t(:, c) = B_c Γᵀ(:, c): row 0 the scale, row 1 the shift.
    static void unit_wise_multiply(const matrix& blocks, const matrix& gamma_t, matrix& p_t) {
        p_t.resize(gamma_t.rows(), gamma_t.cols());
        const auto b_gg = blocks.col(0).transpose().array();
        if (blocks.cols() == 1) {
            p_t.row(0) = (b_gg * gamma_t.row(0).array()).matrix();
            return;
        }
        const auto b_gb = blocks.col(1).transpose().array(), b_bb = blocks.col(2).transpose().array();
        const auto g_scale = gamma_t.row(0).array(), g_shift = gamma_t.row(1).array();
        p_t.row(0) = (b_gg * g_scale + b_gb * g_shift).matrix();
        p_t.row(1) = (b_gb * g_scale + b_bb * g_shift).matrix();
    }

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

    static bool eigen_symmetric_eigen(const matrix& M, matrix& Q, vector& lambda) {
        Eigen::SelfAdjointEigenSolver<matrix> solver(M, Eigen::ComputeEigenvectors);
        if (solver.info() != Eigen::Success) return false;
        Q = solver.eigenvectors();
        lambda = solver.eigenvalues();
        return true;
    }

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
    static bool eigen_cholesky_inverse(matrix& m) {
        Eigen::LLT<matrix> llt(m);
        if (llt.info() != Eigen::Success) return false;
        m = llt.solve(matrix::Identity(m.rows(), m.cols()));
        return true;
    }

    template <class Block>
    static void scale_lower(Block& C, Scalar beta) {
        if (beta == Scalar(0)) C.setZero();
        else if (beta != Scalar(1)) C.template triangularView<Eigen::Lower>() *= beta;
    }
};

}  // namespace kfac::backend
