// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cpu_statistics.hpp
/// The CPU backend's factor statistics (kfac::backend::cpu_eigen derives from it): a batch's
/// A and G statistics of Linear layers and convolutions (golden/README.md §4; im2col or the
/// shift structure of stride-1 patches), an Embedding's token frequencies, and the reduced rows
/// of weight sharing `reduce`; with the SYRK fast path when KFAC_HAS_LAPACK is 1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "kfac/backend/blas_kernels.hpp"
#include "kfac/backend/detail/blas_lapack.hpp"
#include "kfac/backend/detail/shifted_patch_gram.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac::backend::detail {

/// Scratch the CPU backend keeps per layer between calls, so steady-state steps do not allocate.
template <class Scalar>
struct cpu_workspace {
    std::vector<Scalar> patches;
    std::vector<Scalar> reduced;       ///< one row per example (weight sharing `reduce`)
    std::vector<std::int64_t> counts;  ///< occurrences of each token id (Embedding)
    std::vector<Scalar> products;      ///< x̂ ⊙ dy of one example (normalisation layers)
    detail::shifted_gram_scratch<Scalar> shifted;  ///< stride-1 conv A statistic
};

/// The statistics members of cpu_eigen<Scalar> (kfac/backend/cpu_eigen.hpp documents them in
/// its backend policy).
template <class Scalar>
struct cpu_statistics {
    using index = std::int64_t;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using row_major_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                                     0, Eigen::OuterStride<>>;
    using writable_row_major_map = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    /// A buffer of one row per example (weight sharing `reduce`).
    using example_rows = writable_row_major_map;
    using workspace = cpu_workspace<Scalar>;

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

protected:
    /// The first BLAS use of the process gathers blas_kernels(), which says its warning then.
    static void check_blas_kernels() { static_cast<void>(blas_kernels()); }

    template <class Block>
    static void scale_lower(Block& C, Scalar beta) {
        if (beta == Scalar(0)) C.setZero();
        else if (beta != Scalar(1)) C.template triangularView<Eigen::Lower>() *= beta;
    }
};

}  // namespace kfac::backend::detail
