// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file placement_costs.hpp
/// What the assignment strategies weigh: one (A side, G side) pair per block a layer becomes,
/// in registration order. The first link of the placement chain
///
///   layer descriptions → placement_costs → plan_distribution<Strategy> → distribution_plan
///
/// which the preconditioner and `kfac_schedule_study` both call, so that both place the same
/// blocks on the same ranks (a grouped convolution of g groups is g blocks in both).

#include <cstdint>
#include <utility>
#include <vector>

#include "kfac/blocks/kinds.hpp"
#include "kfac/layers/layer_description.hpp"

namespace kfac::assignment {

/// (A side, G side) per block, as the strategies cost them.
using block_costs = std::vector<std::pair<std::int64_t, std::int64_t>>;

/// One entry per block: groups() entries for a grouped convolution (each group's block has the
/// same shape), one for any other layer; each as its block kind weighs it (block_layout::
/// placement: a dense factor by its dimension, a diagonal or unit-wise one of n stored entries
/// as the dense ⌈√n⌉ × ⌈√n⌉ that holds as many).
[[nodiscard]] inline block_costs placement_costs(const std::vector<layer_description>& layers) {
    block_costs costs;
    for (const auto& d : layers) {
        const auto cost = blocks::layout_of(d).placement;
        const std::int64_t blocks = d.groups() > 1 ? d.groups() : 1;
        for (std::int64_t j = 0; j < blocks; ++j) costs.push_back(cost);
    }
    return costs;
}

}  // namespace kfac::assignment
