// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file device_ekfac_scaling.cuh
/// EKFAC's scaling statistic on the CUDA backend (its definition, and the CPU's kernel, are in
/// cpu_ekfac_scaling.hpp):
///
///     s_t ← beta·s_t + (1/N) Σ_n (Q_Aᵀ Γ_nᵀ Q_G)∘²,   Γ_nᵀ = Σ_k Σ_r x̃_{n,k,r} y_{n,k,r}ᵀ,
///
/// over chunks of examples, each example's gradient in the eigenbases made by strided-batched
/// GEMMs and the squares summed over the chunk by one kernel. The GEMMs are the Library's
/// (cuBLAS in cuda_ekfac_scaling.cuh; a host emulation with the same arguments in the CPU
/// tests), the element-wise work Thrust kernels under the Library's execution policy; so the
/// whole index arithmetic runs, and is checked against the CPU backend, on machines without a
/// GPU (tests/cuda/device_ekfac_scaling_cpu_test.cpp).
///
/// Per chunk of c examples and application k, the rows are two column-major operands: X (the
/// A_dim features of every row: a Linear layer's [x; 1], a convolution's patches with the
/// dilation it applies, reduce's ā_n) and Y (the G_dim output gradients, reduce's ĝ_n), each
/// either features × rows (Linear's own layout) or rows × features (patches, and a
/// convolution's gradients channels-last). Then, with R positions per example:
/// - one row per example and one application: Ã = Q_Aᵀ X and G̃ = Q_Gᵀ Y, squared, and
///   s_t += (1/N)·Ã∘² (G̃∘²)ᵀ, three GEMMs and no per-example matrix;
/// - rows projected first (example_gradient_first() false): Ã_k = Q_Aᵀ X_k, G̃_k = Q_Gᵀ Y_k, then
///   E_n = Σ_k Ã_{k,n} G̃_{k,n}ᵀ by one batched GEMM per application;
/// - gradients first: Γ_nᵀ = Σ_k X_{k,n} Y_{k,n}ᵀ by one batched GEMM per application, then
///   Q_Aᵀ [Γ_1ᵀ … Γ_cᵀ] (one GEMM) and each times Q_G (one batched GEMM, Q_G's stride 0);
/// then s_t += (1/N) Σ_n E_n∘². Chunks hold at most KFAC_CUDA_PATCH_CHUNK_ELEMENTS elements of
/// scratch (one example at least); the per-example matrices are A_dim × G_dim each.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/backend/detail/ekfac_scaling_shapes.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

/// Most elements of the scratch one chunk of EKFAC's per-example work holds (as the patches of
/// the factor statistics, 2²⁶: 256 MiB in float).
#ifndef KFAC_CUDA_EKFAC_CHUNK_ELEMENTS
#define KFAC_CUDA_EKFAC_CHUNK_ELEMENTS (std::int64_t{1} << 26)
#endif

namespace kfac::backend::kernels {

/// out(f, r) = x[r][f] for a C-order [rows, cols] input, as a column-major matrix with leading
/// dimension ld ≥ cols (room for a bias's ones row).
template <class Policy, class T>
void rows_as_columns(Policy&& policy, const T* x, index rows, index cols, T* out, index ld) {
    for_each_index(policy, rows * cols, [=] KFAC_HOST_DEVICE(index t) {
        const index f = t % cols, r = t / cols;
        out[f + r * ld] = x[t];
    });
}

/// m ← m∘m.
template <class Policy, class T>
void square(Policy&& policy, T* m, index count) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { m[t] = m[t] * m[t]; });
}

/// s(i) += alpha·Σ_b e(i + b·count)² for i < count: the squares of `batch` matrices stored one
/// after another, summed in order b = 0, 1, … by one thread per entry.
template <class Policy, class T>
void add_squares_over_batch(Policy&& policy, const T* e, index count, index batch, T alpha, T* s) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index i) {
        T sum = T(0);
        for (index b = 0; b < batch; ++b) {
            const T v = e[i + b * count];
            sum += v * v;
        }
        s[i] += alpha * sum;
    });
}

/// out(i, j) = a_i·g_j (m × n): K-FAC's scaling λ_A λ_Gᵀ, EKFAC's until it is estimated.
template <class Policy, class T>
void outer_product(Policy&& policy, const T* a, index m, const T* g, index n, T* out) {
    for_each_index(policy, m * n, [=] KFAC_HOST_DEVICE(index t) { out[t] = a[t % m] * g[t / m]; });
}

/// v(t) ← v(t) / (s(t) + damping): the gradient in the eigenbases over EKFAC's damped scaling.
template <class Policy, class T>
void divide_by_damped_scaling(Policy&& policy, T* v, const T* s, index count, T damping) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { v[t] = v[t] / (s[t] + damping); });
}

/// m(t) ← m(t) / d.
template <class Policy, class T>
void divide(Policy&& policy, T* m, index count, T d) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { m[t] = m[t] / d; });
}

}  // namespace kfac::backend::kernels

namespace kfac::backend::device_ekfac {

using index = std::int64_t;

/// Scratch kept between estimates; Buffer has reserve(count) and data().
template <class Buffer>
struct scratch {
    Buffer x, y;                      ///< one application's rows of a chunk, when laid out anew
    Buffer projected_x, projected_y;  ///< Q_Aᵀ X and Q_Gᵀ Y of a chunk
    Buffer examples, rotated;         ///< the chunk's per-example A_dim × G_dim matrices
};

/// A column-major operand of rows: feature f of row r at f + r·ld (features_by_rows) or at
/// r + f·ld (rows × features).
template <class T>
struct rows_operand {
    const T* data = nullptr;
    index ld = 0;
    bool features_by_rows = true;
};

/// s_t (A_dim × G_dim, column-major, device memory) ← beta·s_t + Ŝᵀ from each application's
/// activations a[k] and output gradients g[k] (device memory, as the statistics read them) in
/// the bases q_a (A_dim × A_dim, its rows and columns given) and q_g (G_dim × G_dim). Library provides policy(), gemm() and
/// gemm_strided_batched() (cuBLAS's arguments, transposes as bools, in index).
/// @throws kfac::error as the CPU's accumulate_ekfac_scaling does.
template <class Library, class T, class Buffer>
void accumulate_scaling(T* s_t, index sum_rows, index sum_cols, const layer_description& d,
                        const std::vector<tensor_view<const T>>& a, const std::vector<tensor_view<const T>>& g,
                        const T* q_a, index q_a_rows, index q_a_cols, const T* q_g, index q_g_rows, index q_g_cols,
                        T beta, scratch<Buffer>& ws) {
    detail::check_ekfac_application_count(a.size(), g.size());
    detail::check_ekfac_operands(d, q_a_rows, q_a_cols, q_g_rows, q_g_cols, sum_rows, sum_cols, beta != T(0));
    const index cols = d.weight_columns(), a_dim = d.a_dim(), g_dim = d.g_dim(), out = d.out;
    const index n = detail::common_examples(d, a);
    auto policy = Library::policy();
    if (beta == T(0)) kernels::fill(policy, s_t, a_dim * g_dim, T(0));
    else kernels::scale(policy, s_t, a_dim * g_dim, beta);
    if (n == 0) return;

    // Each application's positions per example, and a convolution's patch grid (its positions
    // checked against its output gradients').
    const bool reduce = d.sharing == weight_sharing::reduce;
    const bool patches = is_convolution(d.kind) && !reduce;
    std::vector<patch_grid> grids;
    std::vector<index> positions;
    for (std::size_t k = 0; k < a.size(); ++k) {
        if (is_convolution(d.kind))
            grids.push_back(make_patch_grid(d.conv, a[k].extent(2), a[k].extent(3), conv_patch_mode::dilated));
        if (patches && grids.back().positions() != g[k].extent(2) * g[k].extent(3))
            throw error("EKFAC's scaling: application " + std::to_string(k) + "'s " +
                        std::to_string(grids.back().positions()) + " patch positions differ from its output gradients' " +
                        std::to_string(g[k].extent(2) * g[k].extent(3)) +
                        ": pass the activations and output gradients of each application");
        positions.push_back(reduce ? 1 : patches ? grids.back().positions() : a[k].size() / cols / n);
    }
    index total_positions = 0, most_positions = 0;
    for (const index r : positions) {
        total_positions += r;
        most_positions = std::max(most_positions, r);
    }
    const bool single_rows = a.size() == 1 && positions[0] == 1;
    const bool gradient_first = !single_rows && detail::example_gradient_first(total_positions, a_dim, g_dim);

    // Examples per chunk: the scratch of one example (its rows laid out and projected, and its
    // two A_dim × G_dim matrices) within the cap.
    const index per_example = 2 * (a_dim + g_dim) * most_positions + (single_rows ? 0 : 2 * a_dim * g_dim);
    const index chunk = std::clamp<index>(KFAC_CUDA_EKFAC_CHUNK_ELEMENTS / std::max<index>(1, per_example), 1, n);
    ws.x.reserve(static_cast<std::size_t>(a_dim * most_positions * chunk));
    ws.y.reserve(static_cast<std::size_t>(g_dim * most_positions * chunk));
    if (!gradient_first) {
        ws.projected_x.reserve(static_cast<std::size_t>(a_dim * most_positions * chunk));
        ws.projected_y.reserve(static_cast<std::size_t>(g_dim * most_positions * chunk));
    }
    if (!single_rows) {
        ws.examples.reserve(static_cast<std::size_t>(a_dim * g_dim * chunk));
        if (gradient_first) ws.rotated.reserve(static_cast<std::size_t>(a_dim * g_dim * chunk));
    }
    const T inv_n = T(1) / static_cast<T>(n);

    // Application k's rows of examples [first, first + c) as X and Y operands.
    auto x_rows = [&](std::size_t k, index first, index c) -> rows_operand<T> {
        const tensor_view<const T>& v = a[k];
        if (reduce) {
            if (d.kind == layer_kind::linear)
                kernels::mean_rows_per_example(policy, v.data + first * (v.size() / n), c, v.size() / n / cols, cols,
                                               ws.x.data(), a_dim);
            else
                kernels::mean_patch_per_example(policy, v.data + first * (v.size() / n), c, v.extent(1), v.extent(2),
                                                v.extent(3), d.conv, grids[k], ws.x.data(), a_dim);
            if (d.bias) kernels::fill_row(policy, ws.x.data(), a_dim, cols, c, T(1));
            return {ws.x.data(), a_dim, true};
        }
        if (patches) {
            const patch_grid& grid = grids[k];
            kernels::extract_patches(policy, v.data, v.extent(1), v.extent(2), v.extent(3), d.conv, grid,
                                     first * grid.rows, c * grid.rows, d.bias, ws.x.data(), c * positions[k]);
            return {ws.x.data(), c * positions[k], false};
        }
        const T* x = v.data + first * positions[k] * cols;
        if (!d.bias) return {x, cols, true};
        kernels::rows_as_columns(policy, x, c * positions[k], cols, ws.x.data(), a_dim);
        kernels::fill_row(policy, ws.x.data(), a_dim, cols, c * positions[k], T(1));
        return {ws.x.data(), a_dim, true};
    };
    auto y_rows = [&](std::size_t k, index first, index c) -> rows_operand<T> {
        const tensor_view<const T>& v = g[k];
        const T* y = v.data + first * (v.size() / n);
        if (reduce) {
            if (d.kind == layer_kind::linear)
                kernels::sum_rows_per_example(policy, y, c, v.size() / n / out, out, ws.y.data());
            else
                kernels::sum_positions_per_example(policy, y, c, out, v.size() / (n * out), ws.y.data());
            return {ws.y.data(), out, true};
        }
        if (patches) {
            kernels::channels_last(policy, y, c, out, positions[k], ws.y.data());
            return {ws.y.data(), c * positions[k], false};
        }
        return {y, out, true};
    };
    // into (dim × rows) ← Qᵀ·(the operand as features × rows).
    auto project = [&](const T* q, index dim, const rows_operand<T>& m, index rows, T* into) {
        Library::gemm(true, !m.features_by_rows, dim, rows, dim, T(1), q, dim, m.data, m.ld, T(0), into, dim);
    };

    for (index first = 0; first < n; first += chunk) {
        const index c = std::min(chunk, n - first);
        if (single_rows) {
            project(q_a, a_dim, x_rows(0, first, c), c, ws.projected_x.data());
            project(q_g, g_dim, y_rows(0, first, c), c, ws.projected_y.data());
            kernels::square(policy, ws.projected_x.data(), a_dim * c);
            kernels::square(policy, ws.projected_y.data(), g_dim * c);
            Library::gemm(false, true, a_dim, g_dim, c, inv_n, ws.projected_x.data(), a_dim, ws.projected_y.data(), g_dim,
                          T(1), s_t, a_dim);
            continue;
        }
        for (std::size_t k = 0; k < a.size(); ++k) {
            const index r = positions[k];
            const T beta_k = k == 0 ? T(0) : T(1);
            const rows_operand<T> x = x_rows(k, first, c), y = y_rows(k, first, c);
            if (gradient_first) {  // Γ_nᵀ (+)= X_n Y_nᵀ
                Library::gemm_strided_batched(!x.features_by_rows, y.features_by_rows, a_dim, g_dim, r, T(1), x.data,
                                              x.ld, x.features_by_rows ? r * x.ld : r, y.data, y.ld,
                                              y.features_by_rows ? r * y.ld : r, beta_k, ws.examples.data(), a_dim,
                                              a_dim * g_dim, c);
                continue;
            }
            project(q_a, a_dim, x, c * r, ws.projected_x.data());
            project(q_g, g_dim, y, c * r, ws.projected_y.data());
            Library::gemm_strided_batched(false, true, a_dim, g_dim, r, T(1), ws.projected_x.data(), a_dim, a_dim * r,
                                          ws.projected_y.data(), g_dim, g_dim * r, beta_k, ws.examples.data(), a_dim,
                                          a_dim * g_dim, c);
        }
        if (gradient_first) {  // E_n = Q_Aᵀ Γ_nᵀ Q_G
            Library::gemm(true, false, a_dim, g_dim * c, a_dim, T(1), q_a, a_dim, ws.examples.data(), a_dim, T(0),
                          ws.rotated.data(), a_dim);
            Library::gemm_strided_batched(false, false, a_dim, g_dim, g_dim, T(1), ws.rotated.data(), a_dim,
                                          a_dim * g_dim, q_g, g_dim, 0, T(0), ws.examples.data(), a_dim, a_dim * g_dim, c);
        }
        kernels::add_squares_over_batch(policy, ws.examples.data(), a_dim * g_dim, c, inv_n, s_t);
    }
}

}  // namespace kfac::backend::device_ekfac
