// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file statistic_scale.hpp
/// options.statistics = statistic_scale::per_example: how much one application's reference
/// statistic (what the backends compute, golden/README.md §4) is multiplied by to become the
/// per-example Fisher's factor.
///
/// The host's loss is L = (1/N) Σ_n ℓ_n over the N examples of the batch (dimension 0 of the
/// layer's views), so the output gradient it back-propagates at a row of example n is
/// g = Ds/N, Ds = ∂ℓ_n/∂s being the example's own. With S the rows each example holds (the
/// positions its weights are shared over; 1 for a Linear layer on [N, features]), the factors
/// of Martens & Grosse (2015) and, over positions, of Grosse & Martens (2016, KFC) are
///   A = (1/N) Σ_n Σ_s a aᵀ = S · M_A,    G = (1/(N·S)) Σ_n Σ_s Ds Dsᵀ = N² · M_G,
/// M the means over the N·S rows of the outer products, which the reference computes for
/// Linear and Embedding layers. A convolution's reference divides its patches and its output
/// gradients by S before the mean, so it computes M_A/S² and M_G/S², and its scales are S³
/// and N²·S². With weight sharing `reduce` an example is one row (its positions reduced; K-FAC
/// -reduce, Eschenhagen et al. 2023): A = M_A, G = N²·M_G. A normalisation layer's unit-wise
/// blocks are means over rows of t tᵀ with t linear in g: S·N², like G times the A side's S.

#include <cstdint>
#include <vector>

#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac::detail {

/// The factors one application's A and G statistics are multiplied by (1, 1: the reference).
struct statistic_scales {
    double a = 1.0;
    double g = 1.0;
};

/// The per-example scales of one application of a layer (its group block for a grouped
/// convolution), from the views as the statistics read them (statistic_view()).
template <class T>
[[nodiscard]] statistic_scales per_example_scales(const layer_description& d, const tensor_view<const T>& a,
                                                  const tensor_view<const T>& g, conv_patch_mode patches) {
    const auto examples = static_cast<double>(examples_in(d, a));
    const double n2 = examples * examples;
    if (examples == 0.0) return {};
    if (is_normalization(d.kind)) {  // one statistic, A's, quadratic in g
        const auto rows_per_example = static_cast<double>(statistic_rows(d, a)) / examples;
        return {rows_per_example * n2, 1.0};
    }
    if (d.sharing == weight_sharing::reduce) return {1.0, n2};
    if (d.kind == layer_kind::linear || d.kind == layer_kind::embedding) {
        const auto rows_per_example = static_cast<double>(statistic_rows(d, a)) / examples;
        return {rows_per_example, n2};
    }
    // A convolution ([N, C, H, W] as the backends read it): the reference divides by the
    // positions of its patch grid (A) and of its output gradient (G), equal but for dilated
    // layers under conv_patch_mode::reference.
    const patch_grid grid = make_patch_grid(d.conv, a.extent(2), a.extent(3), patches);
    const auto s_a = static_cast<double>(grid.positions());
    const auto s_g = static_cast<double>(g.extent(2) * g.extent(3));
    return {s_a * s_a * s_a, n2 * s_g * s_g};
}

/// What EKFAC's scaling statistic (kfac/compute/ekfac.hpp) is multiplied by to become the
/// per-example Fisher's diagonal in the eigenbasis: N². The statistic is the mean over the N
/// examples of each example's gradient squared, and an example's gradient is formed from the
/// host's output gradients g = Ds/N (above), 1/N of its own, whatever the layer's kind and weight
/// sharing (its positions are summed inside the gradient, not averaged as the factors' rows are).
template <class T>
[[nodiscard]] double per_example_scaling_scale(const layer_description& d, const tensor_view<const T>& a) {
    const auto examples = static_cast<double>(examples_in(d, a));
    return examples * examples;
}

/// Divides the statistics quadratic in the output gradients by s², s the loss scale the host
/// multiplied its loss by: G's (a normalisation layer's one statistic, A's). For the power of
/// two a dynamic scaler uses, s² and 1/s² are exact, and so is the division (but for results
/// below the normal range), the same as kfac-pytorch's division of each output gradient by s.
inline void without_loss_scale(std::vector<statistic_scales>& scales, std::size_t applications,
                               const layer_description& d, double s) {
    if (scales.empty()) scales.assign(applications, statistic_scales{});
    const double inverse_square = 1.0 / (s * s);
    for (auto& scale : scales) (is_normalization(d.kind) ? scale.a : scale.g) *= inverse_square;
}

}  // namespace kfac::detail
