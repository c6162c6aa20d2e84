// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file greedy.hpp
/// KAISA's greedy, longest-first placement of second-order work on ranks.
///
/// Layers are taken in descending order of total cost (a stable sort: equal costs keep
/// registration order). Each goes to the least-loaded worker group (first such group in the
/// order given), and within it to the least-loaded rank (first such rank). Without
/// colocation the layer's factors are placed one by one, most expensive first; equal costs
/// place G before A. Deterministic tie-break: groups and ranks in ascending order, where the
/// reference follows Python's set iteration order (see reference/kfac-pytorch-spec.md).

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kfac/config.hpp"

namespace kfac::assignment {

/// Cost of one layer's two factors.
struct layer_work {
    double a = 0.0;  ///< the A factor's cost
    double g = 0.0;  ///< the G factor's cost
};

/// Rank that computes each factor of a layer.
struct factor_workers {
    int a = -1;  ///< rank computing the A factor's second-order data
    int g = -1;  ///< rank computing the G factor's second-order data
};

/// The ranks computing each layer's A and G second-order data, by greedy placement (above).
/// @param work per layer, in registration order.
/// @param groups worker groups (lists of ranks), e.g. the columns of KAISA's grid.
/// @param world_size number of ranks.
/// @param colocate_factors place a layer's A and G work on the same rank.
/// @throws kfac::error if a group is empty or names a rank outside [0, world_size).
[[nodiscard]] inline std::vector<factor_workers> greedy_assignment(
    const std::vector<layer_work>& work, const std::vector<std::vector<int>>& groups,
    int world_size, bool colocate_factors) {
    if (groups.empty()) throw error("greedy_assignment: no worker groups given");
    for (const auto& grp : groups) {
        if (grp.empty()) throw error("greedy_assignment: a worker group is empty");
        for (int r : grp)
            if (r < 0 || r >= world_size)
                throw error("greedy_assignment: rank " + std::to_string(r) +
                            " is outside the world of size " + std::to_string(world_size));
    }
    std::vector<double> load(static_cast<std::size_t>(world_size), 0.0);
    std::vector<std::size_t> order(work.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
        return work[x].a + work[x].g > work[y].a + work[y].g;
    });
    auto least_loaded_rank = [&](const std::vector<int>& grp) {
        return *std::min_element(grp.begin(), grp.end(), [&](int x, int y) {
            return load[static_cast<std::size_t>(x)] < load[static_cast<std::size_t>(y)];
        });
    };
    std::vector<factor_workers> out(work.size());
    for (std::size_t layer : order) {
        std::size_t best = 0;
        double best_load = 0.0;
        for (std::size_t i = 0; i < groups.size(); ++i) {
            double l = 0.0;
            for (int r : groups[i]) l += load[static_cast<std::size_t>(r)];
            if (i == 0 || l < best_load) best = i, best_load = l;
        }
        const auto& grp = groups[best];
        const layer_work& w = work[layer];
        if (colocate_factors) {
            const int r = least_loaded_rank(grp);
            load[static_cast<std::size_t>(r)] += w.a + w.g;
            out[layer] = {r, r};
        } else {
            const bool g_first = w.g >= w.a;  // equal costs: G before A ('G' > 'A')
            for (int pass = 0; pass < 2; ++pass) {
                const bool is_g = (pass == 0) == g_first;
                const int r = least_loaded_rank(grp);
                load[static_cast<std::size_t>(r)] += is_g ? w.g : w.a;
                (is_g ? out[layer].g : out[layer].a) = r;
            }
        }
    }
    return out;
}

}  // namespace kfac::assignment
