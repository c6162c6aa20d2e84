// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eigenbasis_reuse.hpp
/// The optional backend member behind options.eigenbasis_reuse_tolerance: how well an old
/// eigenbasis still diagonalises a factor, measured with one matrix product. A backend that
/// lacks it refuses a tolerance > 0 at construction, by name.
///
/// ```
///   // λ_i = q_iᵀ F q_i (the Rayleigh quotients of F's columns in the basis Q), and the
///   // relative residual ‖F Q − Q diag(λ)‖_F / ‖F‖_F, accumulated in double; NaN when F or
///   // Q is not finite or F is zero (so no tolerance accepts it).
///   static double rayleigh_quotients(const matrix& F, const matrix& Q, vector& lambda);
/// ```
///
/// For an orthogonal Q the residual is ‖Qᵀ F Q − diag(λ)‖_F / ‖F‖_F: the off-diagonal mass
/// of F in that basis, which is what Q diag(λ) Qᵀ leaves out of F.

#include <concepts>

namespace kfac::detail {

template <class B>
concept backend_with_eigenbasis_reuse =
    requires(const typename B::matrix& m, typename B::vector& v) {
        { B::rayleigh_quotients(m, m, v) } -> std::same_as<double>;
    };

}  // namespace kfac::detail
