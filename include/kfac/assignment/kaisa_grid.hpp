// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kaisa_grid.hpp
/// KAISA's grid of ranks. With W ranks and gradient-worker fraction f, g = max(1, W·f)
/// ranks hold each layer's second-order data. The ranks are laid row-major on a
/// g × (W/g) grid: the **columns** are the gradient-worker groups (one column holds and
/// applies a layer's second-order data) and the **rows** the gradient-receiver groups (each
/// row holds one member of every column, which broadcasts the preconditioned gradient).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "kfac/config.hpp"

namespace kfac {

/// Named gradient-worker fractions (kfac-pytorch's DistributedStrategy).
inline constexpr double comm_opt = 1.0;    ///< every rank preconditions every layer
inline constexpr double hybrid_opt = 0.5;  ///< half the ranks per layer
inline constexpr double mem_opt = 0.0;     ///< means 1/W: one rank per layer

namespace assignment {

/// KAISA's grid of W ranks: g = max(1, W·f) rows (gradient workers per layer, f the gradient-worker
/// fraction, 0 meaning 1/W) by W/g columns; rank r sits in column r mod (W/g), row r div (W/g).
class kaisa_grid {
public:
    /// @throws kfac::error naming the valid fractions when W·f is not a divisor of W.
    kaisa_grid(int world_size, double grad_worker_fraction) : world_(world_size) {
        if (world_size <= 0) throw error("kaisa_grid: world size must be positive");
        if (!(grad_worker_fraction >= 0.0 && grad_worker_fraction <= 1.0))
            throw error("grad_worker_fraction = " + std::to_string(grad_worker_fraction) +
                        " is outside [0, 1]; " + valid_fractions(world_size));
        rows_ = grad_workers_for(world_size, grad_worker_fraction);
        if (rows_ == 0)
            throw error("grad_worker_fraction = " + std::to_string(grad_worker_fraction) + " gives " +
                        std::to_string(std::max(1.0, world_size * grad_worker_fraction)) +
                        " gradient workers per layer, which does not divide the world size " +
                        std::to_string(world_size) + "; " + valid_fractions(world_size));
        cols_ = world_size / rows_;
    }

    /// True when the fraction gives a whole number of gradient workers dividing the world.
    [[nodiscard]] static bool valid(int world_size, double grad_worker_fraction) {
        return world_size > 0 && grad_worker_fraction >= 0.0 && grad_worker_fraction <= 1.0 &&
               grad_workers_for(world_size, grad_worker_fraction) != 0;
    }

    /// "valid values at world size 4: 1 (COMM_OPT), 0.5, 0.25 or 0 (MEM_OPT)".
    static std::string valid_fractions(int world_size) {
        std::string s = "valid values at world size " + std::to_string(world_size) + ":";
        const char* sep = " ";
        for (int g = world_size; g >= 1; --g) {
            if (world_size % g) continue;
            char value[32];
            std::snprintf(value, sizeof value, "%g", static_cast<double>(g) / world_size);
            s += sep;
            s += value;
            if (g == world_size) s += " (COMM_OPT)";
            if (g == 1) s += " or 0 (MEM_OPT)";
            sep = ", ";
        }
        return s;
    }

    /// W: the number of ranks.
    [[nodiscard]] int world_size() const noexcept { return world_; }
    /// g: gradient workers per layer (rows of the grid).
    [[nodiscard]] int grad_workers() const noexcept { return rows_; }
    /// W/g: number of columns (gradient-worker groups).
    [[nodiscard]] int columns() const noexcept { return cols_; }
    /// The column (gradient-worker group) of `rank`.
    [[nodiscard]] int column_of(int rank) const noexcept { return rank % cols_; }
    /// The row of `rank`: its index within its column.
    [[nodiscard]] int row_of(int rank) const noexcept { return rank / cols_; }
    /// Ranks of column c, ascending.
    [[nodiscard]] std::vector<int> column(int c) const {
        std::vector<int> r;
        for (int i = 0; i < rows_; ++i) r.push_back(i * cols_ + c);
        return r;
    }
    /// All columns, in ascending order: the worker groups handed to the assignment.
    [[nodiscard]] std::vector<std::vector<int>> columns_list() const {
        std::vector<std::vector<int>> out;
        for (int c = 0; c < cols_; ++c) out.push_back(column(c));
        return out;
    }
    /// Second-order data is broadcast within columns unless each column is one rank.
    [[nodiscard]] bool broadcast_inverses() const noexcept { return rows_ > 1; }
    /// Preconditioned gradients are broadcast within rows unless each row is one rank.
    [[nodiscard]] bool broadcast_gradients() const noexcept { return rows_ < world_; }
    /// Name of the strategy: comm_opt, hybrid_opt or mem_opt (world size 1 is comm_opt).
    [[nodiscard]] const char* strategy_name() const noexcept {
        if (rows_ == world_) return "comm_opt";
        if (rows_ == 1) return "mem_opt";
        return "hybrid_opt";
    }

private:
    /// g = max(1, W·f) (f = 0 meaning 1/W), or 0 when it is not an integer dividing W.
    static int grad_workers_for(int world_size, double fraction) {
        const double workers = fraction == 0.0 ? 1.0 : std::max(1.0, world_size * fraction);
        const double rounded = std::round(workers);
        if (std::abs(workers - rounded) > 1e-9 * world_size) return 0;
        const int g = static_cast<int>(rounded);
        return world_size % g == 0 ? g : 0;
    }

    int world_ = 1;
    int rows_ = 1;
    int cols_ = 1;
};

}  // namespace assignment
}  // namespace kfac
