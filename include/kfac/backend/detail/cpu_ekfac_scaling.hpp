// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cpu_ekfac_scaling.hpp
/// The scaling statistic of eigenvalue-corrected K-FAC (EKFAC: George, Laurent, Bouthillier,
/// Ballas, Vincent, "Fast Approximate Natural Gradient Descent in a Kronecker-factored
/// Eigenbasis", NeurIPS 2018) on the CPU, for a dense Kronecker block.
///
/// EKFAC keeps K-FAC's eigenbases Q_A and Q_G and replaces the Kronecker product of their
/// eigenvalues by the second moment of the per-example gradients in that basis. With Γ_n the
/// gradient example n contributes to the layer's weights (G_dim × A_dim, the bias column last),
///
///     Ŝᵀ = (1/N) Σ_n (Q_Aᵀ Γ_nᵀ Q_G)∘²        (A_dim × G_dim: the layout of Γᵀ, as the eigen
///                                               method's D = 1/(λ_A λ_Gᵀ + γ) is laid out)
///
/// where ∘² squares elementwise and N is the number of examples. Γ_n = Σ_r g_{n,r} ã_{n,r}ᵀ sums
/// the example's positions r: the rows of a Linear layer's example ([N, positions..., in],
/// weight sharing `expand`) or a convolution's output positions (ã_{n,r} the input patch of
/// position r with the dilation the convolution applies, whatever options.conv_patches says
/// for K-FAC's A, since this is the gradient itself; a 1 appended for the bias). Under weight
/// sharing `reduce` an example is one row already (ĝ_n ā_nᵀ, the reduce definition's
/// per-example gradient). g_{n,r} are the output gradients as the host gives them (with a mean
/// loss, each carries its 1/N, as in K-FAC's G).
///
/// Cost. The rows are projected once, Ã = X̃ Q_A and G̃ = Y Q_G (N·R·(A_dim² + G_dim²) flops for
/// R positions per example); then with one position Ŝᵀ = (Ã∘Ã)ᵀ (G̃∘G̃) / N, one more product of
/// N·A_dim·G_dim; with R > 1 each example's Ã_nᵀ G̃_n (R·A_dim·G_dim) is formed and squared before
/// the sum, N·R·A_dim·G_dim in all and an A_dim × G_dim scratch. Where it costs less
/// (example_gradient_first(): R above A_dim·G_dim·(A_dim + G_dim)/(A_dim² + G_dim²)), each
/// example's Γ̃_nᵀ is formed first from its rows (R·A_dim·G_dim) and rotated once,
/// Q_Aᵀ Γ̃_nᵀ Q_G (A_dim²·G_dim + A_dim·G_dim²), by the BLAS's gemm. Treating every position as an
/// example of its own ((Ã∘Ã)ᵀ(G̃∘G̃) over all rows) would cost one product but drop the
/// cross-position terms of (Σ_r ã g̃)², which a shared weight's gradient has.
///
/// A layer applied several times in one pass (a shared weight: a siamese branch, an unrolled
/// recurrence) has Γ_n = Σ_k Γ_{n,k}, the example's gradients of every application k summed
/// before the square; the overload over applications forms each example's Σ_k Ã_{n,k}ᵀ G̃_{n,k}
/// (each application's positions its own), N·Σ_k R_k·A_dim·G_dim multiply-adds.

#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "kfac/backend/blas_kernels.hpp"
#include "kfac/backend/detail/blas_lapack.hpp"
#include "kfac/backend/detail/cpu_statistics.hpp"
#include "kfac/backend/detail/ekfac_scaling_shapes.hpp"
#include "kfac/config.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::detail {

/// Buffers accumulate_ekfac_scaling() reuses between calls.
template <class Scalar>
struct ekfac_scaling_scratch {
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    matrix projected_a, projected_g;  ///< Ã (rows × A_dim) and G̃ (rows × G_dim), or one example's transposes
    matrix example;                   ///< Ã_nᵀ G̃_n of one example (A_dim × G_dim)
    matrix gradient_t, rotated;       ///< Γ̃_nᵀ of one example (A_dim × G_dim), and Q_Aᵀ Γ̃_nᵀ
    cpu_workspace<Scalar> rows;       ///< patches and reduced rows (cpu_statistics)
};

/// C (m × n, column-major, leading dimension ldc) ← op(A)·op(B) + beta·C for column-major A and
/// B (leading dimensions lda, ldb); beta = 0 does not read C. The BLAS's gemm where the build
/// has one (its kernels for this CPU), else Eigen's product.
template <class Scalar>
void ekfac_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const Scalar* a,
                std::int64_t lda, const Scalar* b, std::int64_t ldb, Scalar beta, Scalar* c, std::int64_t ldc) {
#if KFAC_HAS_LAPACK
    static_cast<void>(blas_kernels());
    detail::gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m),
                 static_cast<int>(n), static_cast<int>(k), Scalar(1), a, static_cast<int>(lda), b, static_cast<int>(ldb),
                 beta, c, static_cast<int>(ldc));
#else
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using const_map = Eigen::Map<const matrix, 0, Eigen::OuterStride<>>;
    const const_map am(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
    const const_map bm(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
    Eigen::Map<matrix, 0, Eigen::OuterStride<>> cm(c, m, n, Eigen::OuterStride<>(ldc));
    if (beta == Scalar(0)) cm.setZero();
    else cm *= beta;
    if (trans_a && trans_b) cm.noalias() += am.transpose() * bm.transpose();
    else if (trans_a) cm.noalias() += am.transpose() * bm;
    else if (trans_b) cm.noalias() += am * bm.transpose();
    else cm.noalias() += am * bm;
#endif
}

/// ws.gradient_t (A_dim × O) ← beta·ws.gradient_t + Γᵀ of R rows x (row-major R × cols) and y
/// (row-major R × O): Σ_r x̃_r y_rᵀ, the bias row Σ_r y_r.
template <class Scalar>
void add_rows_gradient(ekfac_scaling_scratch<Scalar>& ws, const layer_description& d, const Scalar* x, const Scalar* y,
                       std::int64_t rows, Scalar beta) {
    const std::int64_t cols = d.weight_columns(), a_dim = d.a_dim();
    ws.gradient_t.resize(a_dim, d.out);
    // Row-major R × cols is column-major cols × R (leading dimension cols); likewise y.
    ekfac_gemm(false, true, cols, d.out, rows, x, cols, y, d.out, beta, ws.gradient_t.data(), a_dim);
    if (!d.bias) return;
    using rows_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    const auto sums = rows_map(y, rows, d.out).colwise().sum();
    if (beta == Scalar(0)) ws.gradient_t.row(cols) = sums;
    else ws.gradient_t.row(cols) = beta * ws.gradient_t.row(cols) + sums;
}

/// ws.gradient_t ← beta·ws.gradient_t + Γᵀ of one convolution example: its patches (row-major
/// cols × R) and output gradients (row-major O × R): P Yᵀ, the bias row Y's row sums.
template <class Scalar>
void add_patches_gradient(ekfac_scaling_scratch<Scalar>& ws, const layer_description& d, const Scalar* patches,
                          const Scalar* y, std::int64_t positions, Scalar beta) {
    const std::int64_t cols = d.weight_columns(), a_dim = d.a_dim();
    ws.gradient_t.resize(a_dim, d.out);
    // Row-major cols × R is column-major R × cols (leading dimension R); likewise y (R × O).
    ekfac_gemm(true, false, cols, d.out, positions, patches, positions, y, positions, beta, ws.gradient_t.data(), a_dim);
    if (!d.bias) return;
    using rows_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    const auto sums = rows_map(y, d.out, positions).rowwise().sum().transpose();
    if (beta == Scalar(0)) ws.gradient_t.row(cols) = sums;
    else ws.gradient_t.row(cols) = beta * ws.gradient_t.row(cols) + sums;
}

/// s_t += inv_n · (Q_Aᵀ Γ̃ᵀ Q_G)∘² for the example gradient in ws.gradient_t.
template <class Scalar>
void add_rotated_example(Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& s_t,
                         const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_a,
                         const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_g, Scalar inv_n,
                         ekfac_scaling_scratch<Scalar>& ws) {
    const std::int64_t a_dim = q_a.rows(), g_dim = q_g.rows();
    ws.rotated.resize(a_dim, g_dim);
    ws.example.resize(a_dim, g_dim);
    ekfac_gemm(true, false, a_dim, g_dim, a_dim, q_a.data(), a_dim, ws.gradient_t.data(), a_dim, Scalar(0),
               ws.rotated.data(), a_dim);
    ekfac_gemm(false, false, a_dim, g_dim, g_dim, ws.rotated.data(), a_dim, q_g.data(), g_dim, Scalar(0),
               ws.example.data(), a_dim);
    s_t.noalias() += inv_n * ws.example.array().square().matrix();
}

/// Throws unless `d` is a dense Kronecker pair of one group and the bases (and, when it is read,
/// the sum) have its sizes (ekfac_scaling_shapes.hpp).
template <class Scalar>
void check_ekfac_operands(const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& s_t, const layer_description& d,
                          const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_a,
                          const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_g, Scalar beta) {
    check_ekfac_operands(d, q_a.rows(), q_a.cols(), q_g.rows(), q_g.cols(), s_t.rows(), s_t.cols(), beta != Scalar(0));
}

/// s_t ← beta·s_t + Ŝᵀ (the file's definition) from one application's activations `a` and output
/// gradients `g`, as the statistics read them (a convolution's [N, C, H, W] and [N, O, H', W'],
/// a Conv1d's with a unit height), and the current eigenbases q_a (A_dim × A_dim) and q_g
/// (G_dim × G_dim). beta = 0 overwrites s_t without reading it.
/// @throws kfac::error for a layer whose factors are not a dense Kronecker pair of one group
///         (an Embedding, a normalisation layer, a grouped convolution's whole layer), or bases
///         or a sum of the wrong size.
template <class Scalar>
void accumulate_ekfac_scaling(Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& s_t, const layer_description& d,
                              tensor_view<const Scalar> a, tensor_view<const Scalar> g,
                              const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_a,
                              const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_g, Scalar beta,
                              ekfac_scaling_scratch<Scalar>& ws) {
    using index = std::int64_t;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using rows_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    using statistics = cpu_statistics<Scalar>;

    check_ekfac_operands(s_t, d, q_a, q_g, beta);
    const index cols = d.weight_columns(), a_dim = d.a_dim(), g_dim = d.g_dim();
    if (beta == Scalar(0)) s_t = matrix::Zero(a_dim, g_dim);
    else s_t *= beta;

    // Q_A's rows of the weight columns, and its bias row: x̃ᵀQ_A = xᵀ Q_A[:cols] + Q_A[cols] for x̃ = [x; 1].
    const auto weights_a = q_a.topRows(cols);
    auto project_a = [&](const auto& x_rows, matrix& out) {  // rows × cols → rows × A_dim
        out.noalias() = x_rows * weights_a;
        if (d.bias) out.rowwise() += q_a.row(cols);
    };
    const index n = kfac::detail::examples_in(d, a);
    if (n == 0) return;
    const Scalar inv_n = Scalar(1) / static_cast<Scalar>(n);

    // One row per example: Ŝᵀ = (Ã∘Ã)ᵀ (G̃∘G̃) / N.
    auto add_single_rows = [&](const auto& x_rows, const auto& y_rows) {
        project_a(x_rows, ws.projected_a);
        ws.projected_g.noalias() = y_rows * q_g;
        s_t.noalias() += inv_n * (ws.projected_a.array().square().matrix().transpose() *
                                  ws.projected_g.array().square().matrix());
    };

    if (d.sharing == weight_sharing::reduce) {
        statistics::reduce_inputs(d, a, conv_patch_mode::dilated, ws.rows);
        const matrix x = rows_map(ws.rows.reduced.data(), n, cols);
        statistics::reduce_gradients(d, g, ws.rows);
        add_single_rows(x, rows_map(ws.rows.reduced.data(), n, d.out));
        return;
    }
    if (d.kind == layer_kind::linear) {
        const index rows = a.size() / cols, positions = rows / n;
        const rows_map x(a.data, rows, cols), y(g.data, rows, d.out);
        if (positions == 1) {
            add_single_rows(x, y);
            return;
        }
        if (example_gradient_first(positions, a_dim, g_dim)) {
            for (index e = 0; e < n; ++e) {
                add_rows_gradient(ws, d, a.data + e * positions * cols, g.data + e * positions * d.out, positions,
                                  Scalar(0));
                add_rotated_example(s_t, q_a, q_g, inv_n, ws);
            }
            return;
        }
        project_a(x, ws.projected_a);
        ws.projected_g.noalias() = y * q_g;
        for (index e = 0; e < n; ++e) {
            ws.example.noalias() = ws.projected_a.middleRows(e * positions, positions).transpose() *
                                   ws.projected_g.middleRows(e * positions, positions);
            s_t.noalias() += inv_n * ws.example.array().square().matrix();
        }
        return;
    }
    // Convolution: example e's patches P_e (cols × R, R its output positions) and output
    // gradients Y_e (O × R); Ã_eᵀ = Q_A[:cols]ᵀ P_e (+ the bias row), G̃_eᵀ = Q_Gᵀ Y_e.
    const index channels = a.extent(1), height = a.extent(2), width = a.extent(3);
    const patch_grid grid = make_patch_grid(d.conv, height, width, conv_patch_mode::dilated);
    const index positions = grid.positions();
    if (positions != g.extent(2) * g.extent(3))
        throw error("EKFAC's scaling: the convolution's " + std::to_string(positions) +
                    " patch positions differ from its output gradients' " + std::to_string(g.extent(2) * g.extent(3)) +
                    ": pass the activations and output gradients of one application");
    ws.rows.patches.resize(static_cast<std::size_t>(cols * positions));
    const bool gradient_first = example_gradient_first(positions, a_dim, g_dim);
    for (index e = 0; e < n; ++e) {
        extract_patches_transposed(a.data, channels, height, width, d.conv, grid, e * grid.rows, grid.rows,
                                   ws.rows.patches.data(), positions);
        if (gradient_first) {
            add_patches_gradient(ws, d, ws.rows.patches.data(), g.data + e * d.out * positions, positions, Scalar(0));
            add_rotated_example(s_t, q_a, q_g, inv_n, ws);
            continue;
        }
        const rows_map patches(ws.rows.patches.data(), cols, positions);
        const rows_map y(g.data + e * d.out * positions, d.out, positions);
        ws.projected_a.noalias() = weights_a.transpose() * patches;  // A_dim × R
        if (d.bias) ws.projected_a.colwise() += q_a.row(cols).transpose();
        ws.projected_g.noalias() = q_g.transpose() * y;  // G_dim × R
        ws.example.noalias() = ws.projected_a * ws.projected_g.transpose();
        s_t.noalias() += inv_n * ws.example.array().square().matrix();
    }
}

/// s_t ← beta·s_t + Ŝᵀ from several applications of one layer in one pass (`a[k]`, `g[k]` as the
/// one-application overload takes them, every application over the same N examples): each
/// example's gradient sums its gradients of every application before the square. One
/// application is the overload above, to the bit.
/// @throws kfac::error as the overload above, for no application, or for applications over
///         different numbers of examples.
template <class Scalar>
void accumulate_ekfac_scaling(Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& s_t, const layer_description& d,
                              const std::vector<tensor_view<const Scalar>>& a,
                              const std::vector<tensor_view<const Scalar>>& g,
                              const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_a,
                              const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& q_g, Scalar beta,
                              ekfac_scaling_scratch<Scalar>& ws) {
    using index = std::int64_t;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using rows_map = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
    using statistics = cpu_statistics<Scalar>;
    check_ekfac_application_count(a.size(), g.size());
    if (a.size() == 1) return accumulate_ekfac_scaling(s_t, d, a[0], g[0], q_a, q_g, beta, ws);
    check_ekfac_operands(s_t, d, q_a, q_g, beta);
    const index cols = d.weight_columns(), a_dim = d.a_dim(), g_dim = d.g_dim();
    const index n = common_examples(d, a);
    if (beta == Scalar(0)) s_t = matrix::Zero(a_dim, g_dim);
    else s_t *= beta;
    if (n == 0) return;
    const Scalar inv_n = Scalar(1) / static_cast<Scalar>(n);
    const auto weights_a = q_a.topRows(cols);

    // Per application, what example e's contribution reads: reduced rows (weight sharing reduce,
    // one row per example), or the layer's rows of every position.
    using row_matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    std::vector<row_matrix> reduced_x(a.size()), reduced_y(a.size());
    if (d.sharing == weight_sharing::reduce)
        for (std::size_t k = 0; k < a.size(); ++k) {
            statistics::reduce_inputs(d, a[k], conv_patch_mode::dilated, ws.rows);
            reduced_x[k] = rows_map(ws.rows.reduced.data(), n, cols);
            statistics::reduce_gradients(d, g[k], ws.rows);
            reduced_y[k] = rows_map(ws.rows.reduced.data(), n, d.out);
        }
    // ws.example += Ã_{e,k}ᵀ G̃_{e,k} for x_rows (R × cols) and y_rows (R × O) of example e.
    auto add_rows = [&](const auto& x_rows, const auto& y_rows) {
        ws.projected_a.noalias() = x_rows * weights_a;
        if (d.bias) ws.projected_a.rowwise() += q_a.row(cols);
        ws.projected_g.noalias() = y_rows * q_g;
        ws.example.noalias() += ws.projected_a.transpose() * ws.projected_g;
    };
    // A convolution's patch grid per application (its output positions checked once against its
    // output gradients'), and every application's positions per example.
    const bool patches = is_convolution(d.kind) && d.sharing != weight_sharing::reduce;
    std::vector<patch_grid> grids;
    for (std::size_t k = 0; patches && k < a.size(); ++k) {
        grids.push_back(make_patch_grid(d.conv, a[k].extent(2), a[k].extent(3), conv_patch_mode::dilated));
        if (grids.back().positions() != g[k].extent(2) * g[k].extent(3))
            throw error("EKFAC's scaling: application " + std::to_string(k) + "'s " +
                        std::to_string(grids.back().positions()) + " patch positions differ from its output gradients' " +
                        std::to_string(g[k].extent(2) * g[k].extent(3)) +
                        ": pass the activations and output gradients of each application");
    }
    auto positions_of = [&](std::size_t k) -> index {
        if (d.sharing == weight_sharing::reduce) return 1;
        return patches ? grids[k].positions() : a[k].size() / cols / n;
    };
    // Example e's patches of application k into ws.rows.patches (row-major cols × R).
    auto extract_example_patches = [&](std::size_t k, index e) {
        const patch_grid& grid = grids[k];
        ws.rows.patches.resize(static_cast<std::size_t>(cols * grid.positions()));
        extract_patches_transposed(a[k].data, a[k].extent(1), a[k].extent(2), a[k].extent(3), d.conv, grid,
                                   e * grid.rows, grid.rows, ws.rows.patches.data(), grid.positions());
    };
    // The cheaper order sums the applications' Γ_{n,k} and rotates the sum once.
    index positions = 0;
    for (std::size_t k = 0; k < a.size(); ++k) positions += positions_of(k);
    if (example_gradient_first(positions, a_dim, g_dim)) {
        for (index e = 0; e < n; ++e) {
            for (std::size_t k = 0; k < a.size(); ++k) {
                const Scalar beta_k = k == 0 ? Scalar(0) : Scalar(1);
                const index r = positions_of(k);
                if (d.sharing == weight_sharing::reduce) {
                    add_rows_gradient(ws, d, reduced_x[k].data() + e * cols, reduced_y[k].data() + e * d.out, 1, beta_k);
                } else if (!patches) {
                    add_rows_gradient(ws, d, a[k].data + e * r * cols, g[k].data + e * r * d.out, r, beta_k);
                } else {
                    extract_example_patches(k, e);
                    add_patches_gradient(ws, d, ws.rows.patches.data(), g[k].data + e * d.out * r, r, beta_k);
                }
            }
            add_rotated_example(s_t, q_a, q_g, inv_n, ws);
        }
        return;
    }
    for (index e = 0; e < n; ++e) {
        ws.example = matrix::Zero(a_dim, g_dim);
        for (std::size_t k = 0; k < a.size(); ++k) {
            const index r = positions_of(k);
            if (d.sharing == weight_sharing::reduce) {
                add_rows(reduced_x[k].middleRows(e, 1), reduced_y[k].middleRows(e, 1));
            } else if (!patches) {
                add_rows(rows_map(a[k].data + e * r * cols, r, cols), rows_map(g[k].data + e * r * d.out, r, d.out));
            } else {  // a convolution: the example's patches (R × cols) and output gradients (O × R)
                extract_example_patches(k, e);
                add_rows(rows_map(ws.rows.patches.data(), cols, r).transpose(),
                         rows_map(g[k].data + e * d.out * r, d.out, r).transpose());
            }
        }
        s_t.noalias() += inv_n * ws.example.array().square().matrix();
    }
}

}  // namespace kfac::backend::detail

namespace kfac::backend::detail {

/// compute::ekfac's operations on the CPU backend (kfac/backend/ekfac_operations.hpp).
template <class Scalar>
struct cpu_ekfac_operations {
    static constexpr bool supported = true;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
    using rows_copy = std::vector<Scalar>;
    using scratch = ekfac_scaling_scratch<Scalar>;

    static tensor_view<const Scalar> keep(const tensor_view<const Scalar>& v, rows_copy& into) {
        into.assign(v.data, v.data + v.size());
        tensor_view<const Scalar> kept = v;
        kept.data = into.data();
        return kept;
    }
    static void accumulate(matrix& s_t, const layer_description& d, const std::vector<tensor_view<const Scalar>>& a,
                           const std::vector<tensor_view<const Scalar>>& g, const matrix& q_a, const matrix& q_g,
                           Scalar beta, scratch& ws) {
        accumulate_ekfac_scaling(s_t, d, a, g, q_a, q_g, beta, ws);
    }
    static void outer_product(const vector& a, const vector& g, matrix& out) { out = a * g.transpose(); }
    static void divide_by_damped(matrix& v_t, const matrix& s_t, Scalar damping) {
        v_t.array() /= (s_t.array() + damping);
    }
    static void scale(matrix& m, Scalar s) { m *= s; }
    static void divide(matrix& m, Scalar s) { m /= s; }
    static void add_scaled(matrix& sum, Scalar s, const matrix& m) { sum += s * m; }
    static void blend(matrix& s_t, const matrix& e, Scalar xi) { s_t = xi * s_t + (Scalar(1) - xi) * e; }
};

}  // namespace kfac::backend::detail
