// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file diagonal_factors.hpp
/// The optional backend members that layers with a diagonal A factor need (an Embedding's:
/// kfac::factor_structure::diagonal, stored as an n × 1 column), and the transposed weight
/// layout those layers have ([in, out] rather than [out, in]). A backend that lacks them
/// refuses such a layer at registration, by name.
///
/// ```
///   static void diagonal_values(const matrix& column, vector& values);      // values ← column
///   // out(i) = 1 / (column(i) + damping); false when a result is not finite.
///   static bool damped_reciprocal(const matrix& column, scalar_type damping, matrix& out);
///   static void scale_rows(matrix& M, const matrix& column);                // M(i, ·) *= column(i)
///   // Γᵀ of an [in, out] weight gradient: in × out, the transpose of the host's row-major view.
///   static void load_gradient_transposed(matrix& gamma_t, tensor_view<const scalar_type> w);
///   static void store_gradient_transposed(const matrix& P_t, scalar_type scale, tensor_view<scalar_type> w);
/// ```

#include <concepts>

#include "kfac/layers/tensor_view.hpp"

namespace kfac::detail {

template <class B>
concept backend_with_diagonal_factors =
    requires(typename B::matrix& m, const typename B::matrix& c, typename B::vector& v, typename B::scalar_type s,
             tensor_view<const typename B::scalar_type> r, tensor_view<typename B::scalar_type> w) {
        B::diagonal_values(c, v);
        { B::damped_reciprocal(c, s, m) } -> std::same_as<bool>;
        B::scale_rows(m, c);
        B::load_gradient_transposed(m, r);
        B::store_gradient_transposed(c, s, w);
    };

}  // namespace kfac::detail
