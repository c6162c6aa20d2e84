// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_factors.hpp
/// Statistics and running factors: a pass's applications folded into the step's sums
/// (capture_pass), the host told its pass was read (end_pass), and the running averages
/// F ← ξF + (1 − ξ)F̂, averaged over ranks (update_factors).

#include <algorithm>
#include <cmath>
#include <exception>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/group_views.hpp"
#include "kfac/detail/statistic_scale.hpp"
#include "kfac/detail/statistics_views.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::accumulate() {
    setup();
    bool factor_update = false;
    double loss_scale = 1.0;
    agree_on([&] {
        factor_update = detail::is_factor_update_step(options_, steps_);
        if (!factor_update) return;
        loss_scale = detail::read_loss_scale<scalar_type>(options_, steps_);
        if (passes_ + 1 >= options_.accumulation_steps)
            throw error("accumulate() called " + std::to_string(passes_ + 1) +
                        " times in one step with accumulation_steps = " + std::to_string(options_.accumulation_steps) +
                        "; call it after each of the first accumulation_steps - 1 passes only, "
                        "step() takes the last pass");
        check_statistics();
    });
    std::vector<config_item> scheduled;
    if (options_.factor_update_steps.is_schedule())
        scheduled.push_back({"options.factor_update_steps at step " + std::to_string(steps_),
                             factor_update ? "a factor update" : "no factor update"});
    if (options_.loss_scale.is_schedule())
        scheduled.push_back({"options.loss_scale at step " + std::to_string(steps_), exact_number_text(loss_scale)});
    if (!scheduled.empty()) check_items_agree(scheduled, "the values of the scheduled options", schedule_fix);
    const blas_threads_guard blas_threads(serial_blas_);
    finish_pass(factor_update, loss_scale);
    if (factor_update) {
        for (auto& l : layers_) {
            l.statistics.captured_rows = total_rows(l);
            l.statistics.captured_applications = total_applications(l);
            if (l.scratch.applications != 0) applied_in_step_ = true;
        }
        ++passes_;
    }
}

/// Rows of this step's statistics so far, the pass just captured included.
template <class Backend, class CommPolicy, class ComputeMethod>
auto engine<Backend, CommPolicy, ComputeMethod>::total_rows(const layer_record& l) const -> scalar_type {
    return (passes_ == 0 ? scalar_type(0) : l.statistics.captured_rows) + l.statistics.pass_rows;
}

/// Applications of the layer in this step so far, the pass just captured included.
template <class Backend, class CommPolicy, class ComputeMethod>
std::int64_t engine<Backend, CommPolicy, ComputeMethod>::total_applications(const layer_record& l) const {
    return (passes_ == 0 ? 0 : l.statistics.captured_applications) + l.statistics.pass_applications;
}

/// Folds every application of this pass into a_sum/g_sum (scratch until the step
/// commits; the first application of the step overwrites them); one task per factor.
/// A group of a grouped convolution reads its own channels as the groups = 1 layer of its
/// block (layer_description::group_block()).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::capture_pass(bool post_factor_sums) {
    std::vector<std::vector<detail::task>> layer_tasks(layers_.size());
    for (std::size_t li = 0; li < layers_.size(); ++li) {
        auto& l = layers_[li];
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
                a[i] = detail::gather_group_channels_for<Backend>(a[i], l.host.group, groups,
                                                                  l.scratch.group_channels[2 * i]);
                g[i] = detail::gather_group_channels_for<Backend>(g[i], l.host.group, groups,
                                                                  l.scratch.group_channels[2 * i + 1]);
            }
            rows += detail::statistic_rows(d, a[i]);
            a_elements += static_cast<double>(a[i].size());
            g_elements += static_cast<double>(g[i].size());
        }
        l.statistics.pass_rows = static_cast<scalar_type>(rows);
        l.statistics.pass_applications = n;
        if (n == 0) continue;
        if constexpr (method_estimating_scaling<method>)  // the rows update_scaling() reads
            method::keep_rows(l.scratch.method_ws, a, g, pass_loss_scale_, /*first_pass=*/passes_ == 0);
        std::vector<statistic_scales> scales;
        if (options_.statistics == statistic_scale::per_example) {
            const layer_description block = d.group_block();
            for (std::size_t i = 0; i < a.size(); ++i)
                scales.push_back(per_example_scales(block, a[i], g[i], options_.conv_patches));
        }
        if (pass_loss_scale_ != 1.0) without_loss_scale(scales, a.size(), d, pass_loss_scale_);
        blocks::statistic_pass<scalar_type> pass{std::move(a),
                                                 std::move(g),
                                                 passes_ == 0 ? 0 : l.statistics.captured_applications,
                                                 a_elements,
                                                 g_elements,
                                                 options_.conv_patches,
                                                 std::move(scales)};
        for (auto& t : l.block->statistic_tasks(l, std::move(pass))) layer_tasks[li].push_back(layer_task(l, std::move(t)));
    }
    if (post_factor_sums) return capture_and_post(layer_tasks);
    std::vector<detail::task> tasks;
    for (auto& t : layer_tasks) std::move(t.begin(), t.end(), std::back_inserter(tasks));
    agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::averages_factors_over_ranks() const {
    return options_.strategy == distribution::kaisa && comm_.size() > 1;
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::posts_factor_sums_early() const {
    return options_.overlap_factor_allreduce && averages_factors_over_ranks() && staging_.direct();
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::size_t engine<Backend, CommPolicy, ComputeMethod>::factor_bucket_cap_bytes() const {
    return static_cast<std::size_t>(options_.allreduce_bucket_cap_mb * 1024.0 * 1024.0);
}

/// The rows' sums travel first, in an allreduce of their own, so that each layer's count is
/// known when its statistics land (update_factors_overlapped()); they also stay the last item,
/// so the buckets are those of update_factors() without overlap and so are the sums. Then layer
/// by layer: its tasks (on the threads, as capture_pass() runs them all), its statistics made
/// what the ranks sum, both added to the allreduce, whose buckets start as they fill while the
/// later layers' tasks run. Every rank must add the same items, so a rank whose tasks fail
/// keeps the first failure, adds the layer's statistics as zeros of their shape and goes on;
/// the failure is agreed once every item is added, and factor_sums_ then completes the buckets
/// when finish_pass() releases it. (The rows are whole numbers: their sums are exact, and equal
/// to the buckets' copy, while they stay below 2²⁴ in float, 2⁵³ in double.)
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::capture_and_post(std::vector<std::vector<detail::task>>& layer_tasks) {
    factor_rows_.clear();
    for (const auto& l : layers_) factor_rows_.push_back(total_rows(l));
    factor_rows_sum_ = factor_rows_;
    comm::announce_phase(comm_, "the factor update (the allreduce of its rows)");
    comm_.allreduce_sum(std::vector<allreduce_item<scalar_type>>{{factor_rows_sum_.data(), factor_rows_sum_.size(), false, 0}},
                        0, false, comm_.world());
    comm::announce_phase(comm_, "the factor update (its allreduce, started during the capture)");
    factor_sums_ =
        comm::start_allreduce<scalar_type>(comm_, factor_bucket_cap_bytes(), options_.symmetry_aware, comm_.world());
    std::exception_ptr failure;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        try {
            detail::run_tasks<typename Backend::serial_blas_scope>(layer_tasks[i], threads_);
        } catch (...) {
            if (!failure) failure = std::current_exception();
            l.block->clear_statistic(l.statistics, l.host.description);
        }
        weighted_statistics(l, [&](const allreduce_item<scalar_type>& item) { factor_sums_->add(item); });
        comm::progress(comm_);  // MPICH moves the started buckets only inside MPI calls
    }
    factor_sums_->add({factor_rows_.data(), factor_rows_.size(), false, 0});
    factor_sums_->close();
    agree_on([&] {
        if (failure) std::rethrow_exception(failure);
    });
}

template <class Backend, class CommPolicy, class ComputeMethod>
template <class Add>
auto engine<Backend, CommPolicy, ComputeMethod>::weighted_statistics(layer_record& l, Add&& add) -> scalar_type {
    // Mean over applications, times this rank's rows: Σ_r rows_r · F̂_r is summed.
    const auto rows = total_rows(l);
    const auto applications = total_applications(l);
    if (applications == 0)  // this rank contributes nothing (the sums are stale)
        l.block->clear_statistic(l.statistics, l.host.description);
    else
        l.block->scale_statistic(l.statistics, rows / static_cast<scalar_type>(applications));
    for (matrix* sum : {&l.statistics.a_sum, &l.statistics.g_sum}) {  // a square statistic may be a triangle
        const auto n = static_cast<std::size_t>(sum->size());
        const bool triangle =
            sum->cols() == sum->rows() && (sum == &l.statistics.g_sum || l.block->a_statistic_is_triangle());
        add(allreduce_item<scalar_type>{staging_.stage(sum->data(), n, transfer::send_and_receive), n, triangle,
                                        sum->rows()});
    }
    return rows;
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
void engine<Backend, CommPolicy, ComputeMethod>::finish_pass(bool factor_update, double loss_scale, bool last_pass) {
    pass_loss_scale_ = loss_scale;
    std::vector<std::pair<matrix, matrix>> folded;  // a_sum, g_sum before this pass (accumulate() passes only)
    if (factor_update && passes_ > 0)
        for (const auto& l : layers_) folded.emplace_back(l.statistics.a_sum, l.statistics.g_sum);
    std::vector<std::size_t> kept_passes;  // the passes a scaling estimate keeps, before this one
    if constexpr (method_estimating_scaling<method>)
        for (const auto& l : layers_) kept_passes.push_back(passes_ == 0 ? 0 : method::kept_passes(l.scratch.method_ws));
    try {
        if (factor_update) capture_pass(last_pass && posts_factor_sums_early());
        agree_on([&] { end_pass(); });
        // The pass is folded in: copies of views in another format than the compute type go
        // (they would double a bf16 model's activation memory between steps).
        for (auto& l : layers_) {
            l.scratch.activations.clear();
            l.scratch.output_gradients.clear();
            std::vector<converted_view<Backend>>().swap(l.scratch.converted);
        }
    } catch (...) {
        factor_sums_.reset();  // (agreed by every rank) its buckets completed, their sums unused
        for (std::size_t i = 0; i < folded.size(); ++i) {
            layers_[i].statistics.a_sum = std::move(folded[i].first);
            layers_[i].statistics.g_sum = std::move(folded[i].second);
        }
        if constexpr (method_estimating_scaling<method>)
            for (std::size_t i = 0; i < kept_passes.size(); ++i) method::keep_only(layers_[i].scratch.method_ws, kept_passes[i]);
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
    comm::announce_phase(comm_, "the factor update");
    abandon_early_decompositions();  // of a step that failed before its inverse update
    // Started by capture_and_post(); released (its buckets completed) however this returns.
    const std::unique_ptr<comm::posted_allreduce<scalar_type>> posted = std::move(factor_sums_);
    if (posted) return update_factors_overlapped(plan, outcome, *posted);
    const bool averaged = averages_factors_over_ranks();
    std::vector<scalar_type> weights;
    if (averaged) {
        std::vector<allreduce_item<scalar_type>> items;
        for (auto& l : layers_)
            weights.push_back(weighted_statistics(l, [&](const allreduce_item<scalar_type>& item) { items.push_back(item); }));
        items.push_back({weights.data(), weights.size(), false, 0});
        comm::announce_phase(comm_, "the factor update (its allreduce)");
        comm_.allreduce_sum(items, factor_bucket_cap_bytes(), options_.symmetry_aware, comm_.world());
        staging_.complete();
    }
    for (std::size_t i = 0; i < layers_.size(); ++i)
        average_layer(i, plan, outcome,
                      averaged ? static_cast<double>(weights[i]) : static_cast<double>(total_applications(layers_[i])));
}

/// The allreduce capture_and_post() started, completed bucket by bucket: a layer is averaged as
/// soon as both its statistics have landed, and on an inverse-update step its decompositions run
/// then, while the later buckets travel.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::update_factors_overlapped(const step_plan& plan, step_outcome& outcome,
                                                                           comm::posted_allreduce<scalar_type>& sums) {
    const bool decompose = plan.inverse_update;
    if (decompose) second_order_results_.assign(layers_.size(), {});
    std::vector<int> landed_items(layers_.size(), 0);  // of a layer's two statistics
    std::size_t next = 0;                               // layers averaged so far, in order
    const auto landed = [&](std::size_t first, std::size_t last) {
        for (std::size_t k = first; k < last && k < 2 * layers_.size(); ++k) ++landed_items[k / 2];
        for (; next < layers_.size() && landed_items[next] == 2; ++next) {
            average_layer(next, plan, outcome, static_cast<double>(factor_rows_sum_[next]));
            if (decompose) decompose_early(next, plan.damping);
            comm::progress(comm_);  // MPICH moves the later buckets only inside MPI calls
        }
    };
    comm::announce_phase(comm_, "the factor update (its allreduce, overlapped)");
    try {
        sums.complete(landed);
    } catch (...) {
        abandon_early_decompositions();
        throw;
    }
    staging_.complete();
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::average_layer(std::size_t i, const step_plan& plan,
                                                               step_outcome& outcome, double count) {
    const double decay = plan.factor_decay;
    const auto xi = static_cast<scalar_type>(decay);
    auto& l = layers_[i];
    if (!l.role.holds_factors) return;
    if (count == 0.0) return;  // applied on no rank in this step: no data, no decay
    if (!l.block->statistic_finite(l.statistics)) {
        outcome.add(l, non_finite_source::factor_statistics, plan.step, &health_counters::skipped_factor_updates);
        return;
    }
    double& w = l.state.statistics_weight;
    storage_.widen(l.state);
    if (options_.averaging == factor_averaging::bias_corrected) {
        // F = R/W: F ← (ξW·F + (1 − ξ)F̂) / W', W' = ξW + (1 − ξ). Unknown W: F taken as a full average.
        const double before = std::isnan(w) ? 1.0 : w;
        const double after = std::min(1.0, decay * before + (1.0 - decay));
        l.block->average(l.state, l.statistics, static_cast<scalar_type>(decay * before / after),
                         static_cast<scalar_type>((1.0 - decay) / (after * count)));
        w = after;
    } else {
        l.block->average(l.state, l.statistics, xi, static_cast<scalar_type>((1.0 - decay) / count));
        w = decay * w + (1.0 - decay);
        if (w > 1.0) w = 1.0;  // W ≤ 1 whatever the rounding (a checkpoint checks it); NaN stays unknown
    }
    const blocks::block_layout b = l.block->layout(l.host.description);
    for (int k = storage_.store(l.state, b.a_structure, b.g_structure); k > 0; --k)
        outcome.add(l, non_finite_source::factor_storage, plan.step, &health_counters::storage_fallbacks);
}

}  // namespace kfac::detail
