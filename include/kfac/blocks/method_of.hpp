// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file method_of.hpp
/// Which compute method a block works under: each block keeps its second-order code for every
/// method (kfac/blocks/block.hpp), chosen by the compute_impl's tag.

#include <type_traits>

#include "kfac/compute/eigendecomposition.hpp"
#include "kfac/compute/inverse.hpp"
#include "kfac/detail/compute_impl.hpp"

namespace kfac::blocks {

/// True under compute::eigendecomposition, false under compute::inverse; any other method is
/// refused, by name, where a block is instantiated for it.
template <class Method>
inline constexpr bool under_eigendecomposition = [] {
    using tag = typename Method::tag;
    static_assert(std::is_same_v<tag, compute::eigendecomposition> || std::is_same_v<tag, compute::inverse>,
                  "kfac: the block kinds (kfac/blocks/) know compute::eigendecomposition and compute::inverse; "
                  "a new compute method needs its second-order code in each block kind");
    return std::is_same_v<tag, compute::eigendecomposition>;
}();

}  // namespace kfac::blocks
