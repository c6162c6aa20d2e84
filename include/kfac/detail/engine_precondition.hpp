// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_precondition.hpp
/// Preconditioning and the end of a step: Pᵀ of every layer on its gradient workers, shared
/// and checked on every rank, kl_clip's ν, the write-back into the host's buffers and the
/// commit of the step count and health counters.

#include <algorithm>
#include <cmath>
#include <exception>
#include <vector>

#include "kfac/backend/diagonal_factors.hpp"
#include "kfac/detail/engine.hpp"

namespace kfac::detail {

/// Pᵀ of every layer into l.scratch.preconditioned (shared from the gradient workers), then the
/// verdict per layer: a layer whose Γ or P is not finite on any rank is zeroed on every
/// rank, so ranks never drift apart (a host that forgot to average its gradients, say).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::precondition_all(const step_plan& plan, step_outcome& outcome) {
    const double damping = plan.damping;
    std::vector<detail::task> tasks;
    for (auto& l : layers_) {
        if (!l.scratch.active) continue;  // no gradient: nothing to precondition or share
        const auto& d = l.host.description;
        const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_dim());
        const double a_side = d.a_structure() == factor_structure::diagonal ? 1.0 : n_a;  // a row scaling
        // Unit-wise blocks: an a_dim × a_dim product per channel, no G side.
        const double cost =
            d.a_structure() == factor_structure::unit_wise ? n_a * n_a * n_g : n_a * n_g * (a_side + n_g);
        tasks.push_back({cost, [&l, damping, this] {
                             in_layer(l, [&] {
                                 load_gradient(l);
                                 if (!l.role.grad_worker)
                                     l.scratch.preconditioned.resize(l.host.description.a_dim(),
                                                                     l.host.description.g_dim());
                                 else if (!Backend::all_finite(l.scratch.gamma))
                                     l.scratch.preconditioned =
                                         Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
                                 else if (l.state.has_second)
                                     method::precondition(l.state.second, l.scratch.gamma, damping, options_,
                                                          l.scratch.method_ws, l.scratch.preconditioned);
                                 else
                                     l.scratch.preconditioned = l.scratch.gamma;  // no second-order data yet: plain SGD
                             });
                         }});
    }
    agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
    for (auto& l : layers_)
        if (l.role.share_gradient && l.scratch.active) {
            const auto n = static_cast<std::size_t>(l.scratch.preconditioned.size());
            comm_.broadcast(staging_.stage(l.scratch.preconditioned.data(), n, l.role.grad_worker, !l.role.grad_worker),
                            n, l.role.grad_root, gradient_group_);
        }
    comm_.wait();
    staging_.complete();
    std::vector<std::int64_t> unusable(layers_.size());
    for (std::size_t i = 0; i < layers_.size(); ++i)
        unusable[i] = layers_[i].scratch.active && !(Backend::all_finite(layers_[i].scratch.gamma) &&
                                                     Backend::all_finite(layers_[i].scratch.preconditioned));
    comm_.allreduce_max(unusable);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        l.scratch.usable = unusable[i] == 0;
        if (l.scratch.usable) continue;
        l.scratch.preconditioned = Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
        outcome.add(l, non_finite_source::gradient, plan.step, &health_counters::zeroed_gradients);
    }
}

/// l.scratch.gamma ← Γᵀ (A_dim × G_dim) from the host's gradient views (read by
/// check_gradients(): the record's group rows of the layer's).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load_gradient(layer_record& l) {
    const auto w = as_const(l.scratch.weight_gradient);
    if constexpr (detail::backend_with_diagonal_factors<Backend>)
        if (l.host.description.weight_is_in_by_out()) return Backend::load_gradient_transposed(l.scratch.gamma, w);
    Backend::load_gradient(l.scratch.gamma, w, as_const(l.scratch.bias_gradient));
}

/// The host's gradient views ← scale · Pᵀ, as load_gradient read them.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::store_gradient(layer_record& l, scalar_type scale) {
    const auto& w = l.scratch.weight_gradient;
    if constexpr (detail::backend_with_diagonal_factors<Backend>)
        if (l.host.description.weight_is_in_by_out())
            return Backend::store_gradient_transposed(l.scratch.preconditioned, scale, w);
    Backend::store_gradient(l.scratch.preconditioned, scale, w, l.scratch.bias_gradient);
}

/// ν = min(1, √(κ / |η² Σ_layers ⟨P, Γ⟩|)), 1 without kl_clip or when the sum is 0.
template <class Backend, class CommPolicy, class ComputeMethod>
double engine<Backend, CommPolicy, ComputeMethod>::kl_clip_scale(const step_plan& plan) const {
    if (!plan.kl_clip) return 1.0;
    double vg_sum = 0.0;
    for (const auto& l : layers_)
        if (l.scratch.active && l.scratch.usable)
            vg_sum += Backend::frobenius_dot(l.scratch.preconditioned, l.scratch.gamma);
    vg_sum *= plan.lr * plan.lr;
    return vg_sum == 0.0 ? 1.0 : std::min(1.0, std::sqrt(*plan.kl_clip / std::abs(vg_sum)));
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::write_back(double scale) {
    for (auto& l : layers_)
        if (l.scratch.active) in_layer(l, [&] { store_gradient(l, static_cast<scalar_type>(scale)); });
}

/// The step is done: count it, then tell the host what was contained. The callback runs
/// last, so whatever it throws, the gradients are written and nothing non-finite is left
/// in them; every event is delivered and the first exception is rethrown.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::commit(const step_plan& plan, double scale, step_outcome outcome) {
    if (plan.factor_update) {
        passes_ = 0;
        applied_in_step_ = false;
    }
    last_kl_scale_ = scale;
    health_.skipped_factor_updates += outcome.health.skipped_factor_updates;
    health_.kept_decompositions += outcome.health.kept_decompositions;
    health_.zeroed_gradients += outcome.health.zeroed_gradients;
    ++steps_;
    if (!on_non_finite_) return;
    std::exception_ptr first;
    for (const auto& event : outcome.events) {
        try {
            on_non_finite_(event);
        } catch (...) {
            if (!first) first = std::current_exception();
        }
    }
    if (first) std::rethrow_exception(first);
}

}  // namespace kfac::detail
