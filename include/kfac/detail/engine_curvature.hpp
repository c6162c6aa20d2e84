// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_curvature.hpp
/// The curvature report (kfac/curvature_report.hpp): each layer's running factors on this
/// rank, decomposed on demand, against the damping an inverse update at this step would use.

#include <cmath>
#include <limits>
#include <vector>

#include "kfac/curvature_report.hpp"
#include "kfac/detail/engine.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
std::vector<layer_curvature> engine<Backend, CommPolicy, ComputeMethod>::curvature() const {
    const double gamma = options_.damping(steps_);
    std::vector<layer_curvature> out;
    for (const auto& l : layers_) {
        layer_curvature c;
        c.name = l.host.name;
        c.held = l.role.holds_factors;
        if (c.held) {
            const double w = l.state.statistics_weight;
            c.identity_weight = options_.averaging == factor_averaging::bias_corrected ? (w > 0.0 ? 0.0 : 1.0)
                                : std::isnan(w)                                        ? w
                                                                                       : 1.0 - w;
            auto state = l.state;  // factors widened from options.factor_storage (a diagnostic: a copy is fine)
            storage_.widen(state);
            const auto [lambda_a, lambda_g] = l.block->spectra(state);
            c.a = summarise(lambda_a);
            c.g = summarise(lambda_g);
            c.mean_product = c.a.mean * c.g.mean;
            const damping_terms t = l.block->damping_of(state, gamma, options_);
            c.damping = gamma;
            c.damping_a = t.a;
            c.damping_g = t.g;
            c.damping_product = t.product;
            c.curvature_share = detail::curvature_share(lambda_a, lambda_g, t.a, t.g, t.product);
        }
        if constexpr (method_estimating_scaling<method>) {
            if (l.state.has_second) {  // the scaling, where this rank keeps it
                const auto& s = Backend::to_host(l.state.second.scaling);
                const std::vector<double> entries(s.data(), s.data() + s.size());
                c.scaling = summarise(entries);
                c.scaling_share = detail::scaling_share(entries, gamma);
            }
        }
        out.push_back(std::move(c));
    }
    return out;
}

}  // namespace kfac::detail
