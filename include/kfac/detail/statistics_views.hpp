// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file statistics_views.hpp
/// How the preconditioner hands one application's views to a backend's statistics: in the
/// shapes the backends read (a Conv1d's [N, C, L] as the Conv2d's [N, C, 1, L]), and how many
/// rows the application's statistic averages over (the weight of its rank's contribution).

#include <cstdint>

#include "kfac/detail/layer_checks.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

/// The view with a dimension of extent 1 inserted before dimension `axis`.
template <class T>
[[nodiscard]] tensor_view<T> with_unit_axis(tensor_view<T> v, int axis) {
    if (v.rank == max_view_rank) throw tensor_view<T>::rank_error(static_cast<std::size_t>(v.rank) + 1);
    for (int i = v.rank; i > axis; --i)
        v.extents[static_cast<std::size_t>(i)] = v.extents[static_cast<std::size_t>(i - 1)];
    v.extents[static_cast<std::size_t>(axis)] = 1;
    ++v.rank;
    return v;
}

/// An activations or output-gradients view as the backends read it: Linear [..., features],
/// convolutions [N, C, H, W].
template <class T>
[[nodiscard]] tensor_view<T> statistic_view(const layer_description& d, tensor_view<T> v) {
    return d.kind == layer_kind::conv1d && !v.empty() ? with_unit_axis(v, 2) : v;
}

/// Examples in one application's view: dimension 0 of a convolution's views and of a
/// Linear layer's [N, positions..., features] views; a rank-1 Linear view is one example.
template <class T>
[[nodiscard]] std::int64_t examples_in(const layer_description& d, const tensor_view<T>& v) {
    return d.kind == layer_kind::linear && v.rank < 2 ? 1 : v.extent(0);
}

/// Rows of one application's statistic: the examples of a convolution or of a Linear
/// layer under weight sharing `reduce`, every leading row of a Linear layer under `expand`,
/// every token of an Embedding.
template <class T>
[[nodiscard]] std::int64_t statistic_rows(const layer_description& d, const tensor_view<T>& activations) {
    if (d.kind == layer_kind::embedding) return activations.size();
    if (d.kind == layer_kind::linear && d.sharing == weight_sharing::expand) return leading_rows(activations);
    return examples_in(d, activations);
}

}  // namespace kfac::detail
