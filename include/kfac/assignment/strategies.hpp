// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file strategies.hpp
/// Assignment strategies: how second-order work is placed on ranks.
///
/// **AssignmentStrategy policy.** A strategy is a type with
/// ```
///   static constexpr const char* name;
///   // Ranks computing each layer's factors, given factor dimensions (bias included).
///   static std::vector<factor_workers> assign(const std::vector<std::pair<int64, int64>>& dims,
///                                             const std::vector<std::vector<int>>& groups,
///                                             int world_size, bool colocate_factors);
/// ```
/// In a single process every factor lands on rank 0 whatever the strategy.

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "kfac/assignment/greedy.hpp"

namespace kfac::assignment {

namespace detail {

template <class Cost>
std::vector<factor_workers> greedy_by(Cost cost, const std::vector<std::pair<std::int64_t, std::int64_t>>& dims,
                                      const std::vector<std::vector<int>>& groups, int world_size,
                                      bool colocate) {
    std::vector<layer_work> work;
    work.reserve(dims.size());
    for (auto [a, g] : dims) work.push_back({cost(static_cast<double>(a)), cost(static_cast<double>(g))});
    return greedy_assignment(work, groups, world_size, colocate);
}

}  // namespace detail

/// KAISA COMPUTE: balance the n³ cost of decomposing each factor.
struct compute_balanced {
    /// The strategy's name, part of the configuration the ranks agree on.
    static constexpr const char* name = "compute";
    /// The ranks computing each layer's A and G second-order data, given the factor dimensions
    /// (A, G; bias included) and the worker groups, as greedy_assignment() takes them.
    static std::vector<factor_workers> assign(const std::vector<std::pair<std::int64_t, std::int64_t>>& dims,
                                              const std::vector<std::vector<int>>& groups,
                                              int world_size, bool colocate) {
        return detail::greedy_by([](double n) { return n * n * n; }, dims, groups, world_size, colocate);
    }
};

/// KAISA MEMORY: balance the n² storage of each factor's second-order data.
struct memory_balanced {
    /// The strategy's name, part of the configuration the ranks agree on.
    static constexpr const char* name = "memory";
    /// The ranks computing each layer's A and G second-order data, given the factor dimensions
    /// (A, G; bias included) and the worker groups, as greedy_assignment() takes them.
    static std::vector<factor_workers> assign(const std::vector<std::pair<std::int64_t, std::int64_t>>& dims,
                                              const std::vector<std::vector<int>>& groups,
                                              int world_size, bool colocate) {
        return detail::greedy_by([](double n) { return n * n; }, dims, groups, world_size, colocate);
    }
};

/// Layer i goes to the i-th rank of the flattened group list, cyclically; for studies.
struct round_robin {
    /// The strategy's name, part of the configuration the ranks agree on.
    static constexpr const char* name = "round_robin";
    /// The ranks computing each layer's A and G second-order data, given the factor dimensions
    /// (A, G; bias included) and the worker groups, as greedy_assignment() takes them.
    static std::vector<factor_workers> assign(const std::vector<std::pair<std::int64_t, std::int64_t>>& dims,
                                              const std::vector<std::vector<int>>& groups,
                                              int /*world_size*/, bool colocate) {
        std::vector<int> ranks;
        for (const auto& g : groups) ranks.insert(ranks.end(), g.begin(), g.end());
        if (ranks.empty()) throw error("round_robin: no worker groups given");
        std::vector<factor_workers> out(dims.size());
        std::size_t next = 0;
        for (auto& w : out) {
            w.a = ranks[next++ % ranks.size()];
            w.g = colocate ? w.a : ranks[next++ % ranks.size()];
        }
        return out;
    }
};

}  // namespace kfac::assignment
