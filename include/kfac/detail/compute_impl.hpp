// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file compute_impl.hpp
/// The engine behind a ComputeMethod tag, specialised per method (and, where it must be,
/// per backend). The primary template only explains what is missing.

namespace kfac::detail {

template <class...>
inline constexpr bool dependent_false = false;

template <class Method, class Backend>
struct compute_impl {
    static_assert(dependent_false<Method, Backend>,
                  "kfac: no detail::compute_impl<ComputeMethod, Backend> for this ComputeMethod. "
                  "Use kfac::compute::eigendecomposition or kfac::compute::inverse (include "
                  "kfac/compute/eigendecomposition.hpp or kfac/compute/inverse.hpp), or "
                  "specialise kfac::detail::compute_impl for your method.");
};

}  // namespace kfac::detail
