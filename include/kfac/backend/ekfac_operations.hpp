// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file ekfac_operations.hpp
/// What compute::ekfac (kfac/compute/ekfac.hpp) needs of a backend beyond the backend contract
/// (kfac/backend/cpu_eigen.hpp): a backend that runs EKFAC specializes
/// `ekfac_operations<Backend>` with `supported = true` and these static members, over its
/// matrix, vector and scalar types:
/// ```
///   struct rows_copy;      // a kept copy of a captured view's elements
///   struct scratch;        // the estimate's buffers, reused between steps
///   // A copy of v's elements in `into`, and a view of the copy (the backend's memory).
///   static tensor_view<const scalar> keep(const tensor_view<const scalar>& v, rows_copy& into);
///   // s_t ← beta·s_t + Ŝᵀ from every application's views in the bases q_a, q_g (sized by the
///   // call when beta is 0), as kfac/backend/detail/cpu_ekfac_scaling.hpp defines it.
///   static void accumulate(matrix& s_t, const layer_description&, const std::vector<view>& a,
///                          const std::vector<view>& g, const matrix& q_a, const matrix& q_g,
///                          scalar beta, scratch&);
///   static void outer_product(const vector& a, const vector& g, matrix& out);    // a gᵀ
///   static void divide_by_damped(matrix& v_t, const matrix& s_t, scalar damping); // V ⊘ (S + γ)
///   static void scale(matrix& m, scalar s);                 // m ← s·m
///   static void divide(matrix& m, scalar s);                // m ← m / s
///   static void add_scaled(matrix& sum, scalar s, const matrix& m);   // sum ← sum + s·m
///   static void blend(matrix& s_t, const matrix& e, scalar xi);       // S ← ξS + (1 − ξ)E
/// ```
/// The CPU backend's (and that of any backend derived from it) are in
/// kfac/backend/detail/cpu_ekfac_scaling.hpp, the CUDA backend's in
/// kfac/backend/detail/cuda_ekfac_scaling.cuh.

namespace kfac::backend {

/// A backend's operations for compute::ekfac; this primary template: none.
template <class Backend>
struct ekfac_operations {
    static constexpr bool supported = false;  ///< no compute::ekfac on this backend
};

}  // namespace kfac::backend
