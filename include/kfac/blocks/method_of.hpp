// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file method_of.hpp
/// Which compute method a block works under: each block keeps its second-order code for every
/// method (kfac/blocks/block.hpp), chosen by the compute_impl's tag.

#include <type_traits>

#include "kfac/compute/eigendecomposition.hpp"
#include "kfac/compute/inverse.hpp"
#include "kfac/detail/compute_impl.hpp"

namespace kfac::compute {
struct ekfac;  // kfac/compute/ekfac.hpp
}

namespace kfac::blocks {

/// True under the methods that precondition in the factors' eigenbases (compute::eigendecomposition,
/// and compute::ekfac, which changes only the scaling those bases are divided by), false under
/// compute::inverse; any other method is refused, by name, where a block is instantiated for it.
template <class Method>
inline constexpr bool under_eigendecomposition = [] {
    using tag = typename Method::tag;
    constexpr bool eigenbasis = std::is_same_v<tag, compute::eigendecomposition> || std::is_same_v<tag, compute::ekfac>;
    static_assert(eigenbasis || std::is_same_v<tag, compute::inverse>,
                  "kfac: the block kinds (kfac/blocks/) know compute::eigendecomposition, compute::ekfac and "
                  "compute::inverse; a new compute method needs its second-order code in each block kind");
    return eigenbasis;
}();

}  // namespace kfac::blocks
