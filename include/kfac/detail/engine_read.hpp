// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_read.hpp
/// The plan phase of a step: every scheduled option it reads and every view of the host's
/// adapter, read once and checked before anything changes, with the same verdict on every rank.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/group_views.hpp"
#include "kfac/detail/view_conversion.hpp"

namespace kfac::detail {

/// Every scheduled option this step reads, and every view it will read, checked before
/// anything changes; every rank reaches the same verdict.
template <class Backend, class CommPolicy, class ComputeMethod>
step_plan engine<Backend, CommPolicy, ComputeMethod>::read_plan() {
    comm::announce_phase(comm_, "the step's plan (reading and checking the views)");
    detail::step_plan plan;
    agree_on([&] {
        if (steps_ == std::numeric_limits<std::int64_t>::max())
            throw error("step(): the step count is " + std::to_string(steps_) +
                        ", the largest a std::int64_t holds, and cannot advance; start from a checkpoint of an earlier step");
        plan = detail::read_step_plan<scalar_type>(options_, steps_);
        if (plan.factor_update) {
            if (passes_ + 1 != options_.accumulation_steps)
                throw error("step() after " + std::to_string(passes_) +
                            " accumulate() call(s) with "
                            "accumulation_steps = " +
                            std::to_string(options_.accumulation_steps) +
                            "; call accumulate() after each of the first accumulation_steps - 1 "
                            "forward/backward passes, and step() after the last");
            check_statistics();
            check_some_layer_applied();
        }
        check_gradients();
    });
    agree_on_scheduled_values(plan);
    agree_on_gradient_presence();
    return plan;
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::has_schedule() const {
    const options& o = options_;
    return o.damping.is_schedule() || o.factor_decay.is_schedule() || o.lr.is_schedule() || o.kl_clip.is_schedule() ||
           o.factor_update_steps.is_schedule() || o.inv_update_steps.is_schedule() || o.loss_scale.is_schedule();
}

/// A schedule is the host's code, and may return another value on some rank (from a
/// rank-local clock or random state, say): the values this step read must be the same on
/// every rank, or gradients would drift apart silently and the collectives of a factor
/// update made by some ranks only would never match. One allgather of a digest; free
/// without schedules (the constants are in the configuration every rank agreed on).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::agree_on_scheduled_values(const step_plan& plan) {
    if (!has_schedule()) return;
    using detail::exact_number_text;
    const std::string at = " at step " + std::to_string(plan.step);
    std::vector<detail::config_item> items{
        {"options.factor_update_steps" + at, plan.factor_update ? "a factor update" : "no factor update"},
        {"options.inv_update_steps" + at, plan.inverse_update ? "an inverse update" : "no inverse update"},
        {"options.damping" + at, exact_number_text(plan.damping)},
        {"options.factor_decay" + at, exact_number_text(plan.factor_decay)},
        {"options.kl_clip" + at, plan.kl_clip ? exact_number_text(*plan.kl_clip) : "none"},
        {"options.lr" + at, exact_number_text(plan.lr)}};
    if (loss_scaling(options_)) items.push_back({"options.loss_scale" + at, exact_number_text(plan.loss_scale)});
    check_items_agree(items, "the values of the scheduled options", schedule_fix);
}

/// A layer without a gradient on one rank must have none on every rank (which layers
/// are preconditioned and shared is the same everywhere). One small allreduce, made only
/// when some layer's adapter can report a missing gradient. Collective.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::agree_on_gradient_presence() {
    if (std::none_of(layers_.begin(), layers_.end(),
                     [](const layer_record& l) { return l.host.has_gradient != nullptr; }))
        return;
    const std::size_t n = layers_.size();
    std::vector<std::int64_t> seen(2 * n);  // [i]: some rank has it, [n + i]: some rank lacks it
    for (std::size_t i = 0; i < n; ++i) {
        seen[i] = layers_[i].scratch.active ? 1 : 0;
        seen[n + i] = layers_[i].scratch.active ? 0 : 1;
    }
    comm::announce_phase(comm_, "the step's plan (the vote on which layers have gradients)");
    comm_.allreduce_max(seen);
    for (std::size_t i = 0; i < n; ++i)
        if (seen[i] != 0 && seen[n + i] != 0)
            throw layer_error(named(layers_[i]),
                              "has a gradient on some ranks and none on others; every rank must run the same "
                              "layers in its forward pass (or the host must give the unused layer a zero gradient)");
}

/// Reads the pass from the host's adapter (scratch.applications, .activations and
/// .output_gradients: capture_pass() asks the adapter nothing) and checks every view. Views in
/// another format than the compute type are converted here, once per layer: the records of a
/// grouped convolution's groups share the reading of their layer's views.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_statistics() {
    for (std::size_t k = 0; k < layers_.size(); ++k) {
        auto& l = layers_[k];
        in_layer(l, [&] {
            auto& s = l.scratch;
            s.activations.clear();
            s.output_gradients.clear();
            s.applications = l.host.applications_now();
            if (!l.role.holds_factors) return;
            if (s.applications < 0)
                throw layer_error(named(l),
                                  "the adapter's applications() returned " + std::to_string(s.applications) +
                                      "; it counts calls of the layer in the pass (0 when it was not called)");
            const layer_record* same_layer = k > 0 && l.host.group > 0 ? &layers_[k - 1] : nullptr;
            if (same_layer != nullptr && same_layer->role.holds_factors &&
                same_layer->scratch.applications == s.applications) {
                s.activations = same_layer->scratch.activations;  // checked and converted there
                s.output_gradients = same_layer->scratch.output_gradients;
                return;
            }
            s.converted.resize(2 * static_cast<std::size_t>(s.applications));
            for (std::int64_t i = 0; i < s.applications; ++i) {
                const auto a = l.host.activations_of(i);
                const auto g = l.host.output_gradients_of(i);
                const named_layer who = named(l);
                for (const auto& [view, what] : {std::pair{&a, "activations"}, std::pair{&g, "output gradients"}}) {
                    detail::check_extents(who, what, *view);
                    detail::check_memory_space(who, what, *view, device_backend, device_probe);
                    detail::check_convertible<Backend>(who, what, *view);
                }
                const auto j = 2 * static_cast<std::size_t>(i);
                s.activations.push_back(detail::in_compute_precision(a, s.converted[j]));
                s.output_gradients.push_back(detail::in_compute_precision(g, s.converted[j + 1]));
                detail::check_statistics_views(l.host.name, l.host.description, s.activations.back(),
                                               s.output_gradients.back(), steps_, device_backend, device_probe);
            }
        });
    }
}

/// A factor-update step in which no layer was applied at all has nothing to learn from:
/// with an adapter that captures calls, that is a capture that saw nothing (the forward
/// pass ran where it could not see it), never a model that ran no layer.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_some_layer_applied() const {
    if (layers_.empty() || applied_in_step_) return;
    for (const auto& l : layers_)
        if (l.scratch.applications != 0) return;
    throw error("factor-update step " + std::to_string(steps_) +
                ": no registered layer was applied in any pass "
                "of the step (every adapter reported 0 applications), so there is nothing to update the factors "
                "with; run the forward and backward passes before step() (kfac::torch's tracker sees only "
                "forward passes in training mode, with gradients enabled, on the thread that created it, and "
                "not while at::enableRecordFunction(false) is in force)");
}

/// Marks the layers that have a gradient this step (scratch.active), reads their gradient
/// views (the record's group rows, into scratch: the step asks the adapter nothing later;
/// copies in the compute type when the host's format differs) and checks them.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_gradients() {
    for (auto& l : layers_)
        in_layer(l, [&] {
            auto& s = l.scratch;
            s.active = l.host.gradient_present();
            if (!s.active) return;
            const auto w = l.host.weight_gradient(l.host.layer);
            const auto b = l.host.bias_gradient(l.host.layer);
            detail::check_gradient_views(l.host.name, l.host.description, w, b, device_backend, device_probe);
            const named_layer who = named(l);
            detail::check_convertible<Backend>(who, "weight gradient", w);
            detail::check_convertible<Backend>(who, "bias gradient", b);
            s.host_weight_gradient = group_rows(w, l.host.group, l.host.description.groups());
            s.host_bias_gradient = group_rows(b, l.host.group, l.host.description.groups());
            s.weight_gradient = detail::in_compute_precision(s.host_weight_gradient, s.weight_copy);
            s.bias_gradient = detail::in_compute_precision(s.host_bias_gradient, s.bias_copy);
        });
}

}  // namespace kfac::detail
