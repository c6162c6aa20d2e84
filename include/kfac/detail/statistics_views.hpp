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

/// Examples in one application's view: dimension 0 of a convolution's or a BatchNorm's views
/// and of a Linear layer's or a LayerNorm's [N, positions..., features] views; a rank-1 view of
/// features is one example.
template <class T>
[[nodiscard]] std::int64_t examples_in(const layer_description& d, const tensor_view<T>& v) {
    return features_last(d.kind) && v.rank < 2 ? 1 : v.extent(0);
}

/// How a normalisation layer's views (x̂ and dy, of one shape) hold its C channels: element
/// (example n, position p, channel c) at n·P·C + p·C + c with the channels last (LayerNorm's
/// [N, positions..., C]) or at n·C·P + c·P + p (BatchNorm's [N, C, spatial...]). A row of
/// the curvature blocks is one position of one example (sum_positions false, weight sharing
/// expand) or one example, its positions summed (weight sharing reduce).
struct norm_layout {
    std::int64_t examples = 0, positions = 0, channels = 0;
    bool channels_last = true;
    bool sum_positions = false;
    [[nodiscard]] std::int64_t rows() const noexcept { return sum_positions ? examples : examples * positions; }
};

/// The layout of a checked normalisation layer view.
template <class T>
[[nodiscard]] norm_layout norm_layout_of(const layer_description& d, const tensor_view<T>& v) {
    norm_layout l;
    l.channels = d.out;
    l.channels_last = features_last(d.kind);
    l.sum_positions = d.sharing == weight_sharing::reduce;
    l.examples = examples_in(d, v);
    l.positions = l.examples * l.channels == 0 ? 0 : v.size() / (l.examples * l.channels);
    return l;
}

/// Rows of one application's statistic: the examples of a convolution or of a Linear
/// layer under weight sharing `reduce`, every leading row of a Linear layer under `expand`,
/// every token of an Embedding, the rows of a normalisation layer's layout.
template <class T>
[[nodiscard]] std::int64_t statistic_rows(const layer_description& d, const tensor_view<T>& activations) {
    if (d.kind == layer_kind::embedding) return activations.size();
    if (is_normalization(d.kind)) return norm_layout_of(d, activations).rows();
    if (d.kind == layer_kind::linear && d.sharing == weight_sharing::expand) return leading_rows(activations);
    return examples_in(d, activations);
}

}  // namespace kfac::detail
