// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file distribution_plan.hpp
/// Where every layer's K-FAC work runs: layers × world size × options → which ranks capture
/// statistics and keep running factors, which compute each factor's second-order data,
/// which hold that data and precondition, and who broadcasts what to whom. A pure function:
/// the preconditioner builds its communication from it, `kfac_schedule_study` costs it, a
/// checkpoint knows from it which rank holds what, and none of them re-derives the rules.
///
/// KAISA (SC'20): every rank keeps every running factor (averaged by allreduce); the
/// second-order data of a layer lives on one column of the kaisa_grid (its gradient workers),
/// computed by the assigned A and G workers of that column and broadcast within it when the
/// column has several ranks; each gradient worker preconditions and, when a row has several
/// ranks, broadcasts the result along its row.
/// DP-KFAC: one owner per layer keeps its factors, computes its second-order data and
/// preconditions, then broadcasts the preconditioned gradient to every rank.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kfac/assignment/greedy.hpp"
#include "kfac/assignment/kaisa_grid.hpp"
#include "kfac/config.hpp"
#include "kfac/options.hpp"

namespace kfac::assignment {

/// One rank's part in one layer's work.
struct rank_role {
    bool holds_factors = true;        ///< captures statistics and keeps the running factors
    bool computes_a = true;           ///< computes the A factor's second-order data
    bool computes_g = true;           ///< computes the G factor's second-order data
    bool grad_worker = true;          ///< holds the second-order data and preconditions
    bool share_second_order = false;  ///< takes part in broadcasting it within the column
    ///@{
    /// The A and G workers' ranks within the column group.
    int a_root = 0, g_root = 0;
    ///@}
    bool share_gradient = false;      ///< takes part in broadcasting the preconditioned gradient
    int grad_root = 0;                ///< the broadcasting rank within the gradient group

    /// Gets some of its second-order data from another rank of its column (a sharing gradient
    /// worker that does not compute both factors itself): it waits for those broadcasts.
    [[nodiscard]] bool receives_second_order() const noexcept {
        return share_second_order && !(computes_a && computes_g);
    }
};

/// Where one layer's work runs, over all ranks (ascending rank lists).
struct layer_placement {
    ///@{
    /// Ranks computing the A and G second-order data.
    int a_worker = 0, g_worker = 0;
    ///@}
    std::vector<int> factor_holders;  ///< ranks capturing statistics and keeping the running factors
    std::vector<int> grad_workers;    ///< ranks holding the second-order data and preconditioning
};

/// The whole placement; `role(layer, rank)` is one rank's view of it.
struct distribution_plan {
    distribution strategy = distribution::kaisa;  ///< KAISA or DP-KFAC
    int world = 1;                                ///< the world size planned for
    int columns = 1;               ///< KAISA: gradient-worker groups (1 under DP-KFAC)
    int grad_workers_per_layer = 1;  ///< KAISA: ranks per column, g = max(1, W·f) (1 under DP-KFAC)
    std::string name = "comm_opt";  ///< comm_opt, hybrid_opt, mem_opt or dp_kfac
    std::vector<layer_placement> layers;  ///< per layer, in registration order

    /// Whether the strategy is KAISA (else DP-KFAC).
    [[nodiscard]] bool kaisa() const noexcept { return strategy == distribution::kaisa; }
    /// Second-order data is broadcast within a layer's column (KAISA, columns of > 1 rank).
    [[nodiscard]] bool broadcast_second_order() const noexcept { return kaisa() && grad_workers_per_layer > 1; }
    /// Preconditioned gradients are broadcast (KAISA rows of > 1 rank; DP-KFAC with > 1 rank).
    [[nodiscard]] bool broadcast_gradients() const noexcept {
        return kaisa() ? grad_workers_per_layer < world : world > 1;
    }
    /// The colour of `rank`'s column group and of its gradient group (for CommPolicy::split).
    [[nodiscard]] int column_of(int rank) const noexcept { return kaisa() ? rank % columns : rank; }
    /// `rank`'s row of the grid: the colour of its gradient group and its rank within its column
    /// group (0 under DP-KFAC).
    [[nodiscard]] int row_of(int rank) const noexcept { return kaisa() ? rank / columns : 0; }

    /// What `rank` does for layer `layer` (an index into `layers`).
    /// @throws std::out_of_range for a layer index out of range.
    [[nodiscard]] rank_role role(std::size_t layer, int rank) const {
        const auto& l = layers.at(layer);
        rank_role r;
        r.computes_a = l.a_worker == rank;
        r.computes_g = l.g_worker == rank;
        if (!kaisa()) {
            const bool owner = l.a_worker == rank;
            r.holds_factors = r.computes_a = r.computes_g = r.grad_worker = owner;
            r.share_gradient = broadcast_gradients();
            r.grad_root = l.a_worker;  // the gradient group is the whole world
            return r;
        }
        r.holds_factors = true;
        r.grad_worker = column_of(rank) == column_of(l.g_worker);
        r.share_second_order = broadcast_second_order() && r.grad_worker;
        r.a_root = row_of(l.a_worker);
        r.g_root = row_of(l.g_worker);
        r.share_gradient = broadcast_gradients();
        r.grad_root = column_of(l.g_worker);  // a row holds one rank of each column, in order
        return r;
    }
};

/// Plans the distribution of layers with factor dimensions `dims` (A, G; bias included).
/// @throws kfac::error for a gradient-worker fraction that does not fit the world size, or
///         for colocate_factors = false under MEM_OPT.
template <class AssignmentStrategy>
distribution_plan plan_distribution(const std::vector<std::pair<std::int64_t, std::int64_t>>& dims, int world,
                                    distribution strategy, double grad_worker_fraction, bool colocate_factors) {
    distribution_plan plan;
    plan.strategy = strategy;
    plan.world = world;
    std::vector<factor_workers> workers;
    if (strategy == distribution::dp_kfac) {
        std::vector<std::vector<int>> singletons;
        for (int r = 0; r < world; ++r) singletons.push_back({r});
        workers = AssignmentStrategy::assign(dims, singletons, world, true);
        plan.name = "dp_kfac";
    } else {
        const kaisa_grid grid(world, grad_worker_fraction);
        if (!colocate_factors && grid.grad_workers() == 1 && world > 1)
            throw error("options.colocate_factors = false with MEM_OPT (grad_worker_fraction = " +
                        std::to_string(grad_worker_fraction) + "): MEM_OPT keeps a layer's data on one rank; "
                        "set colocate_factors = true");
        plan.columns = grid.columns();
        plan.grad_workers_per_layer = grid.grad_workers();
        plan.name = grid.strategy_name();
        workers = AssignmentStrategy::assign(dims, grid.columns_list(), world, colocate_factors);
    }
    plan.layers.resize(dims.size());
    for (std::size_t i = 0; i < dims.size(); ++i) {
        auto& l = plan.layers[i];
        l.a_worker = workers[i].a;
        l.g_worker = workers[i].g;
        for (int r = 0; r < world; ++r) {
            const rank_role role = plan.role(i, r);
            if (role.holds_factors) l.factor_holders.push_back(r);
            if (role.grad_worker) l.grad_workers.push_back(r);
        }
    }
    return plan;
}

}  // namespace kfac::assignment
