// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file ekfac_scaling_shapes.hpp
/// What the two backends' kernels of EKFAC's scaling statistic share (its definition is in
/// cpu_ekfac_scaling.hpp; the CUDA backend's in device_ekfac_scaling.cuh): which layers the
/// statistic is defined for, the shapes of its operands, and which of the two product orders
/// costs less.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kfac/config.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::detail {

/// Whether forming each example's gradient first and rotating it into the bases (R·A_dim·G_dim
/// multiply-adds, then A_dim²·G_dim + A_dim·G_dim²) costs less than projecting its R rows into
/// both bases first (R·(A_dim² + G_dim²), then R·A_dim·G_dim): for R above
/// A_dim·G_dim·(A_dim + G_dim) / (A_dim² + G_dim²). A 3 × 3 Conv2d(64 → 64) on 16 × 16 outputs
/// (A_dim 577, G_dim 64, R 256) takes a third of the other order's; on 7 × 7 (R 49), 1.4× more.
inline bool example_gradient_first(std::int64_t positions, std::int64_t a_dim, std::int64_t g_dim) {
    const auto r = static_cast<double>(positions), a = static_cast<double>(a_dim), g = static_cast<double>(g_dim);
    return r * (a * a + g * g) > a * g * (a + g);
}

/// Throws unless `d` is a dense Kronecker pair of one group and the bases (q_a, q_g: rows ×
/// columns) and, when it is read (`reads_sum`), the sum have its sizes.
inline void check_ekfac_operands(const layer_description& d, std::int64_t q_a_rows, std::int64_t q_a_cols,
                                 std::int64_t q_g_rows, std::int64_t q_g_cols, std::int64_t sum_rows,
                                 std::int64_t sum_cols, bool reads_sum) {
    using index = std::int64_t;
    const bool dense_pair = d.kind == layer_kind::linear || (is_convolution(d.kind) && d.conv.groups == 1);
    if (!dense_pair)
        throw error(std::string("EKFAC's scaling is defined for a dense Kronecker pair (Linear, or one group of a "
                                "convolution); layer kind '") +
                    kind_name(d.kind) + "'" +
                    (is_convolution(d.kind) ? " with " + std::to_string(d.conv.groups) +
                                                  " groups has one per group: pass each group's block "
                                                  "(layer_description::group_block()) and its channels"
                                            : " has none: use another compute method for it"));
    const index a_dim = d.a_dim(), g_dim = d.g_dim();
    if (q_a_rows != a_dim || q_a_cols != a_dim || q_g_rows != g_dim || q_g_cols != g_dim ||
        (reads_sum && (sum_rows != a_dim || sum_cols != g_dim)))
        throw error("EKFAC's scaling of a layer with A_dim " + std::to_string(a_dim) + " and G_dim " +
                    std::to_string(g_dim) + " got Q_A " + std::to_string(q_a_rows) + "x" + std::to_string(q_a_cols) +
                    ", Q_G " + std::to_string(q_g_rows) + "x" + std::to_string(q_g_cols) + " and a sum " +
                    std::to_string(sum_rows) + "x" + std::to_string(sum_cols) +
                    ": pass the layer's current eigenbases and an A_dim x G_dim sum");
}

/// Throws unless there is one activation view and one output-gradient view per application, at
/// least one.
inline void check_ekfac_application_count(std::size_t activations, std::size_t output_gradients) {
    if (activations == 0 || activations != output_gradients)
        throw error("EKFAC's scaling of several applications got " + std::to_string(activations) +
                    " activations and " + std::to_string(output_gradients) +
                    " output gradients: pass one of each per application, at least one");
}

/// The examples every application's activations `a` hold (an example's gradient sums its
/// applications, which need the same examples); throws when they differ.
template <class T>
std::int64_t common_examples(const layer_description& d, const std::vector<tensor_view<const T>>& a) {
    const std::int64_t n = kfac::detail::examples_in(d, a[0]);
    for (std::size_t k = 1; k < a.size(); ++k)
        if (kfac::detail::examples_in(d, a[k]) != n)
            throw error("EKFAC's scaling: application " + std::to_string(k) + " holds " +
                        std::to_string(kfac::detail::examples_in(d, a[k])) + " examples, application 0 " +
                        std::to_string(n) + "; an example's gradient sums its applications, which need the same examples");
    return n;
}

}  // namespace kfac::backend::detail
