// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_info.hpp
/// What the preconditioner tells about itself: its registered layers and where their work
/// runs (preconditioner::layers()), and the memory it holds (preconditioner::memory_usage()).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kfac/layers/layer_description.hpp"

namespace kfac {

/// One registered layer.
struct layer_info {
    /// The name it was registered under (a group block's "<name>/group<j>").
    std::string name;
    /// What the layer is (kfac/layers/layer_description.hpp).
    layer_kind kind = layer_kind::linear;
    std::int64_t a_dim = 0;  ///< A factor's dimension (inputs, + 1 with bias; conv: C_in·k_h·k_w [+ 1]; norm: 1 or 2, its blocks' size)
    std::int64_t g_dim = 0;  ///< G factor's dimension (outputs; a norm layer's channels, its G being the identity)
    bool bias = false;  ///< whether the layer has a bias, folded into A
    int a_worker = 0;                 ///< rank computing the A factor's second-order data
    int g_worker = 0;                 ///< rank computing the G factor's second-order data
    std::vector<int> factor_holders;  ///< ranks keeping the running factors
    std::vector<int> grad_workers;    ///< ranks holding the second-order data and preconditioning
};

/// Bytes one rank holds for K-FAC (host or device memory, as the backend keeps it).
struct memory_report {
    std::size_t factors = 0;       ///< running A and G factors
    std::size_t statistics = 0;    ///< batch statistics of the step in progress
    std::size_t second_order = 0;  ///< eigendecompositions or inverses in force
    std::size_t gradients = 0;     ///< Γ and P buffers of the preconditioning
    /// The sum of the four.
    [[nodiscard]] std::size_t total() const noexcept { return factors + statistics + second_order + gradients; }
};

}  // namespace kfac
