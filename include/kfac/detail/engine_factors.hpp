// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_factors.hpp
/// Statistics and running factors: a pass's applications folded into the step's sums
/// (capture_pass), the host told its pass was read (end_pass), and the running averages
/// F ← ξF + (1 − ξ)F̂, averaged over ranks (update_factors).

#include <string>
#include <utility>
#include <vector>

#include "kfac/backend/unit_wise_factors.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/group_views.hpp"
#include "kfac/detail/statistics_views.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::accumulate() {
    setup();
    bool factor_update = false;
    agree_on([&] {
        factor_update = detail::is_factor_update_step(options_, steps_);
        if (!factor_update) return;
        if (passes_ + 1 >= options_.accumulation_steps)
            throw error("accumulate() called " + std::to_string(passes_ + 1) +
                        " times in one step with accumulation_steps = " + std::to_string(options_.accumulation_steps) +
                        "; call it after each of the first accumulation_steps - 1 passes only, "
                        "step() takes the last pass");
        check_statistics();
    });
    if (options_.factor_update_steps.is_schedule())
        check_items_agree({{"options.factor_update_steps at step " + std::to_string(steps_),
                            factor_update ? "a factor update" : "no factor update"}},
                          "the values of the scheduled options", schedule_fix);
    const blas_threads_guard blas_threads(serial_blas_);
    finish_pass(factor_update);
    if (factor_update) {
        for (auto& l : layers_) {
            l.state.captured_rows = total_rows(l);
            l.state.captured_applications = total_applications(l);
            if (l.scratch.applications != 0) applied_in_step_ = true;
        }
        ++passes_;
    }
}

/// Rows of this step's statistics so far, the pass just captured included.
template <class Backend, class CommPolicy, class ComputeMethod>
auto engine<Backend, CommPolicy, ComputeMethod>::total_rows(const layer_record& l) const -> scalar_type {
    return (passes_ == 0 ? scalar_type(0) : l.state.captured_rows) + l.state.pass_rows;
}

/// Applications of the layer in this step so far, the pass just captured included.
template <class Backend, class CommPolicy, class ComputeMethod>
std::int64_t engine<Backend, CommPolicy, ComputeMethod>::total_applications(const layer_record& l) const {
    return (passes_ == 0 ? 0 : l.state.captured_applications) + l.state.pass_applications;
}

/// Folds every application of this pass into a_sum/g_sum (scratch until the step
/// commits; the first application of the step overwrites them); one task per factor.
/// A group of a grouped convolution reads its own channels as the groups = 1 layer of its
/// block (layer_description::group_block()).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::capture_pass() {
    std::vector<detail::task> tasks;
    for (auto& l : layers_) {
        if (!l.role.holds_factors) continue;
        const std::int64_t n = l.scratch.applications;
        std::vector<tensor_view<const scalar_type>> a(static_cast<std::size_t>(n)), g(a.size());
        std::int64_t rows = 0;
        double a_elements = 0.0, g_elements = 0.0;
        const auto& d = l.host.description;
        const std::int64_t groups = d.groups();
        l.scratch.group_channels.resize(groups > 1 ? 2 * a.size() : 0);
        for (std::size_t i = 0; i < a.size(); ++i) {
            a[i] = detail::statistic_view(d, l.scratch.activations[i]);
            g[i] = detail::statistic_view(d, l.scratch.output_gradients[i]);
            if (groups > 1) {
                a[i] = detail::gather_group_channels(a[i], l.host.group, groups, l.scratch.group_channels[2 * i]);
                g[i] = detail::gather_group_channels(g[i], l.host.group, groups, l.scratch.group_channels[2 * i + 1]);
            }
            rows += detail::statistic_rows(d, a[i]);
            a_elements += static_cast<double>(a[i].size());
            g_elements += static_cast<double>(g[i].size());
        }
        l.state.pass_rows = static_cast<scalar_type>(rows);
        l.state.pass_applications = n;
        if (n == 0) continue;
        const std::int64_t folded = passes_ == 0 ? 0 : l.state.captured_applications;
        if (d.a_structure() == factor_structure::unit_wise) {  // one statistic of x̂ and dy together
            tasks.push_back(unit_wise_statistic_task(l, std::move(a), std::move(g), folded, a_elements));
            continue;
        }
        const double n_a = static_cast<double>(d.a_storage_cols()), n_g = static_cast<double>(d.g_dim());
        const layer_description block = d.group_block();
        // Cost ∝ rows of the product × n²: the input elements stand in for rows × n.
        tasks.push_back({a_elements * n_a, [&l, a = std::move(a), block, folded, this] {
                             in_layer(l, [&] {
                                 for (std::size_t i = 0; i < a.size(); ++i)
                                     Backend::accumulate_a_statistic(l.state.a_sum, block, a[i], options_.conv_patches,
                                                                     first_beta(folded, i), l.scratch.a_ws);
                             });
                         }});
        tasks.push_back({g_elements * n_g, [&l, g = std::move(g), block, folded] {
                             in_layer(l, [&] {
                                 for (std::size_t i = 0; i < g.size(); ++i)
                                     Backend::accumulate_g_statistic(l.state.g_sum, block, g[i], first_beta(folded, i),
                                                                     l.scratch.g_ws);
                             });
                         }});
    }
    agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
}

/// The unit-wise blocks of a normalisation layer from its applications' x̂ and dy views
/// (its G, the identity, has no statistic).
template <class Backend, class CommPolicy, class ComputeMethod>
task engine<Backend, CommPolicy, ComputeMethod>::unit_wise_statistic_task(layer_record& l,
                                                                          std::vector<tensor_view<const scalar_type>> a,
                                                                          std::vector<tensor_view<const scalar_type>> g,
                                                                          std::int64_t folded, double elements) {
    if constexpr (detail::backend_with_unit_wise_factors<Backend>) {
        return {elements * 3.0, [&l, a = std::move(a), g = std::move(g), folded] {
                    in_layer(l, [&] {
                        for (std::size_t i = 0; i < a.size(); ++i)
                            Backend::accumulate_unit_wise_statistic(l.state.a_sum, l.host.description, a[i], g[i],
                                                                    first_beta(folded, i), l.scratch.a_ws);
                    });
                }};
    } else {
        return {0.0, [] {}};  // not reached: registration refuses the layer on such a backend
    }
}

/// β of an application's statistic: 0 for the step's first (it overwrites the sum left
/// by the previous step), 1 after.
template <class Backend, class CommPolicy, class ComputeMethod>
auto engine<Backend, CommPolicy, ComputeMethod>::first_beta(std::int64_t folded_before, std::size_t i) -> scalar_type {
    return folded_before == 0 && i == 0 ? scalar_type(0) : scalar_type(1);
}

/// Tells every layer's host that the current pass has been read (traits' end_pass), once
/// per layer (a grouped convolution's records share their layer).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::end_pass() {
    for (auto& l : layers_)
        if (l.host.end_pass && l.host.group == 0) in_layer(l, [&] { l.host.end_pass(l.host.layer); });
}

/// The last use of the host's pass: its statistics on a factor-update step, then
/// end_pass(), agreed by every rank. Both come before the factors, the second-order data
/// or the host's gradients change; if either fails (on any rank), the statistics that
/// accumulate() folded in before are put back, so a retry sees the step as it was.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::finish_pass(bool factor_update) {
    std::vector<std::pair<matrix, matrix>> folded;  // a_sum, g_sum before this pass (accumulate() passes only)
    if (factor_update && passes_ > 0)
        for (const auto& l : layers_) folded.emplace_back(l.state.a_sum, l.state.g_sum);
    try {
        if (factor_update) capture_pass();
        agree_on([&] { end_pass(); });
    } catch (...) {
        for (std::size_t i = 0; i < folded.size(); ++i) {
            layers_[i].state.a_sum = std::move(folded[i].first);
            layers_[i].state.g_sum = std::move(folded[i].second);
        }
        throw;
    }
}

/// Running averages F ← ξF + (1 − ξ)F̂, F̂ the mean of the step's applications' batch
/// statistics. Under KAISA with several ranks F̂ is the average of the ranks' batch
/// statistics weighted by their rows (equal to KAISA's plain average for equal local
/// batches, and exact for unequal ones), summed in one bucketed allreduce pass that also
/// carries the weights. A layer applied nowhere in the step keeps its factors as they are.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::update_factors(const step_plan& plan, step_outcome& outcome) {
    const double decay = plan.factor_decay;
    const auto xi = static_cast<scalar_type>(decay);
    const bool averaged = options_.strategy == distribution::kaisa && comm_.size() > 1;
    std::vector<scalar_type> weights;
    if (averaged) {
        std::vector<allreduce_item<scalar_type>> items;
        for (auto& l : layers_) {
            // Mean over applications, times this rank's rows: Σ_r rows_r · F̂_r is summed.
            const auto rows = total_rows(l);
            const auto applications = total_applications(l);
            if (applications == 0) {  // this rank contributes nothing (the sums are stale)
                const auto& d = l.host.description;
                l.state.a_sum = Backend::zeros(d.a_storage_rows(), d.a_storage_cols());
                l.state.g_sum = Backend::zeros(d.g_factor_dim(), d.g_factor_dim());
            } else {
                const auto w = rows / static_cast<scalar_type>(applications);
                scale_a_statistic(l, w);
                Backend::scale_symmetric(l.state.g_sum, w);
            }
            for (matrix* sum : {&l.state.a_sum, &l.state.g_sum}) {  // a diagonal A or unit-wise blocks are no triangle
                const auto n = static_cast<std::size_t>(sum->size());
                const bool triangle = sum->cols() == sum->rows() && !(sum == &l.state.a_sum && unit_wise(l));
                items.push_back({staging_.stage(sum->data(), n, true, true), n, triangle, sum->rows()});
            }
            weights.push_back(rows);
        }
        items.push_back({weights.data(), weights.size(), false, 0});
        const auto cap = static_cast<std::size_t>(options_.allreduce_bucket_cap_mb * 1024.0 * 1024.0);
        comm_.allreduce_sum(items, cap, options_.symmetry_aware, comm_.world());
        staging_.complete();
    }
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        if (!l.role.holds_factors) continue;
        const double count = averaged ? static_cast<double>(weights[i]) : static_cast<double>(total_applications(l));
        if (count == 0.0) continue;  // applied on no rank in this step: no data, no decay
        const auto weight = static_cast<scalar_type>((1.0 - decay) / count);
        if (a_statistic_finite(l) && Backend::lower_all_finite(l.state.g_sum)) {
            average_a_factor(l, xi, weight);
            if (l.host.description.g_structure() == factor_structure::dense)  // the identity stays
                Backend::running_average(l.state.g_factor, l.state.g_sum, xi, weight);
        } else {
            outcome.add(l, non_finite_source::factor_statistics, plan.step, &health_counters::skipped_factor_updates);
        }
    }
}

// A dense factor's statistic is the lower triangle of a symmetric matrix (mirrored before
// use). Unit-wise blocks are no triangle, whatever their shape (C × 3 is square for C = 3):
// every entry is checked, scaled and averaged as it is.
template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::unit_wise(const layer_record& l) {
    return l.host.description.a_structure() == factor_structure::unit_wise;
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::a_statistic_finite(const layer_record& l) {
    return unit_wise(l) ? Backend::all_finite(l.state.a_sum) : Backend::lower_all_finite(l.state.a_sum);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::scale_a_statistic(layer_record& l, scalar_type s) {
    if constexpr (detail::backend_with_unit_wise_factors<Backend>)
        if (unit_wise(l)) return Backend::scale_blocks(l.state.a_sum, s);
    Backend::scale_symmetric(l.state.a_sum, s);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::average_a_factor(layer_record& l, scalar_type decay,
                                                                  scalar_type weight) {
    if constexpr (detail::backend_with_unit_wise_factors<Backend>)
        if (unit_wise(l)) return Backend::average_blocks(l.state.a_factor, l.state.a_sum, decay, weight);
    Backend::running_average(l.state.a_factor, l.state.a_sum, decay, weight);
}

}  // namespace kfac::detail
