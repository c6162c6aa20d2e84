// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file unit_wise_factors.hpp
/// The optional backend members that normalisation layers need (LayerNorm, BatchNorm: an A
/// factor of kfac::factor_structure::unit_wise, one k × k block per channel stored as a
/// C × k(k+1)/2 matrix, k = 2 with a shift and 1 without). A backend that lacks them refuses
/// such a layer at registration, by name.
///
/// ```
///   // sum = beta·sum + mean over rows of the blocks t tᵀ, t = (Σ x̂ ⊙ dy, Σ dy) per channel
///   // (kfac::detail::norm_layout_of says what a row is); beta = 0 reads nothing of sum.
///   static void accumulate_unit_wise_statistic(matrix& sum, const layer_description&,
///                                              tensor_view<const scalar_type> normalized,
///                                              tensor_view<const scalar_type> grad_output,
///                                              scalar_type beta, workspace& ws);
///   static matrix unit_wise_identity(index channels, index k);   // every block the identity
///   // out = the blocks' damped inverses (F_c + damping·I)⁻¹, same layout; false when a
///   // result is not finite.
///   static bool unit_wise_damped_inverse(const matrix& blocks, scalar_type damping, matrix& out);
///   // P_t(:, c) = B_c Γᵀ(:, c) for the k × C gradient Γᵀ (rows: scale, then shift).
///   static void unit_wise_multiply(const matrix& blocks, const matrix& gamma_t, matrix& p_t);
///   // The blocks are no triangle of a symmetric matrix, whatever their shape (C × 3 is
///   // square for C = 3): scaled and averaged entry by entry, never mirrored.
///   static void scale_blocks(matrix& blocks, scalar_type s);                       // B ← s·B
///   static void average_blocks(matrix& F, const matrix& sum, scalar_type decay, scalar_type weight);
/// ```

#include <concepts>
#include <cstdint>

#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

template <class B>
concept backend_with_unit_wise_factors =
    requires(typename B::matrix& m, const typename B::matrix& c, typename B::scalar_type s,
             const layer_description& d, tensor_view<const typename B::scalar_type> v, typename B::workspace& ws,
             std::int64_t n) {
        B::accumulate_unit_wise_statistic(m, d, v, v, s, ws);
        { B::unit_wise_identity(n, n) } -> std::same_as<typename B::matrix>;
        { B::unit_wise_damped_inverse(c, s, m) } -> std::same_as<bool>;
        B::unit_wise_multiply(c, c, m);
        B::scale_blocks(m, s);
        B::average_blocks(m, c, s, s);
    };

}  // namespace kfac::detail
