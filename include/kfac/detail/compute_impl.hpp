// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file compute_impl.hpp
/// The engine behind a ComputeMethod tag, specialised per method (and, where it must be,
/// per backend). The primary template only explains what is missing.

namespace kfac::detail {

template <class...>
inline constexpr bool dependent_false = false;

/// One side of a layer's Kronecker factorisation: A (activations) or G (output gradients).
enum class factor_side { a, g };

/// How a factor's second-order data came about, for eigenbasis_counts(): its eigenvectors
/// computed now, kept from the previous computation, or none (a method without eigenvectors).
enum class basis_use { none, decomposed, reused };

template <class Method, class Backend>
struct compute_impl {
    static_assert(dependent_false<Method, Backend>,
                  "kfac: no detail::compute_impl<ComputeMethod, Backend> for this ComputeMethod. "
                  "Use kfac::compute::eigendecomposition or kfac::compute::inverse (include "
                  "kfac/compute/eigendecomposition.hpp or kfac/compute/inverse.hpp), or "
                  "specialise kfac::detail::compute_impl for your method.");
};

}  // namespace kfac::detail
