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

#include "kfac/comm/serial.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/view_conversion.hpp"

namespace kfac::detail {

/// Pᵀ of every layer into l.scratch.preconditioned (shared from the gradient workers), then the
/// verdict per layer: a layer whose Γ or P is not finite on any rank is zeroed on every
/// rank, so ranks never drift apart (a host that forgot to average its gradients, say). A
/// backend with gradient_checks (kfac/backend/gradient_checks.hpp) answers every layer's
/// verdict and kl_clip's ⟨P, Γ⟩ in one call; it preconditions a non-finite Γ like any other,
/// whose P the verdict then catches with it (the same layers are zeroed either way).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::precondition_all(const step_plan& plan, step_outcome& outcome) {
    comm::announce_phase(comm_, "preconditioning");
    const double damping = plan.damping;
    // With the second-order broadcasts still travelling (options.overlap_communication), the
    // layers whose data this rank holds go first and the layers that receive after the wait.
    std::vector<detail::task> tasks, receiving;
    for (auto& l : layers_) {
        if (!l.scratch.active) continue;  // no gradient: nothing to precondition or share
        const bool receives = second_order_in_flight_ && l.role.receives_second_order();
        (receives ? receiving : tasks).push_back({l.block->precondition_cost(l.host.description), [&l, damping, this] {
                             in_layer(l, [&] {
                                 l.block->load_gradient(l);
                                 if (!l.role.grad_worker)
                                     l.scratch.preconditioned.resize(l.host.description.a_dim(),
                                                                     l.host.description.g_dim());
                                 else if (!batched_gradient_checks && !Backend::all_finite(l.scratch.gamma))
                                     l.scratch.preconditioned =
                                         Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
                                 else if (l.state.has_second)
                                     l.block->precondition(l.state.second, l.scratch.gamma, damping, options_,
                                                           l.scratch.method_ws, l.scratch.preconditioned);
                                 else
                                     l.scratch.preconditioned = l.scratch.gamma;  // no second-order data yet: plain SGD
                             });
                         }});
    }
    // On one thread, each local task is followed by a chance for the broadcasts to move.
    if (second_order_in_flight_ && threads_ <= 1 && !receiving.empty())
        for (auto& t : tasks)
            t.run = [run = std::move(t.run), this] {
                run();
                comm::progress(comm_);
            };
    try {
        agree_on([&] {
            detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_);
            comm::announce_phase(comm_, "preconditioning (the wait for second-order data)");
            finish_second_order_broadcasts();
            comm::announce_phase(comm_, "preconditioning");
            detail::run_tasks<typename Backend::serial_blas_scope>(receiving, threads_);
        });
    } catch (...) {
        // Every rank raises the error; the broadcasts it may have left travelling end first.
        try {
            finish_second_order_broadcasts();
        } catch (...) {  // a transport failing twice: the first error is the one reported
        }
        throw;
    }
    comm::announce_phase(comm_, "preconditioning (the broadcast of preconditioned gradients)");
    for (auto& l : layers_)
        if (l.role.share_gradient && l.scratch.active) {
            const auto n = static_cast<std::size_t>(l.scratch.preconditioned.size());
            comm_.broadcast(staging_.stage(l.scratch.preconditioned.data(), n, broadcast_transfer(l.role.grad_worker)),
                            n, l.role.grad_root, gradient_group_);
        }
    comm_.wait();
    staging_.complete();
    // One more entry after the layers': whether this rank's gradient views of the step include
    // one narrower than the compute type (write_back() then checks what it writes).
    std::vector<std::int64_t> unusable(layers_.size() + 1);
    if constexpr (batched_gradient_checks) {
        std::vector<const matrix*> gammas, preconditioned;
        std::vector<std::size_t> which;
        for (std::size_t i = 0; i < layers_.size(); ++i)
            if (layers_[i].scratch.active) {
                gammas.push_back(&layers_[i].scratch.gamma);
                preconditioned.push_back(&layers_[i].scratch.preconditioned);
                which.push_back(i);
            }
        std::vector<std::int64_t> non_finite;
        std::vector<double> dots;
        Backend::gradient_checks(gammas, preconditioned, non_finite, dots);
        gradient_dots_.assign(layers_.size(), 0.0);
        for (std::size_t k = 0; k < which.size(); ++k) {
            unusable[which[k]] = non_finite[k] > 0 ? 1 : 0;
            gradient_dots_[which[k]] = dots[k];
        }
    } else {
        for (std::size_t i = 0; i < layers_.size(); ++i)
            unusable[i] = layers_[i].scratch.active && !(Backend::all_finite(layers_[i].scratch.gamma) &&
                                                         Backend::all_finite(layers_[i].scratch.preconditioned));
    }
    unusable.back() = std::any_of(layers_.begin(), layers_.end(), [](const layer_record& l) {
        return l.scratch.active && (narrower_than_compute<scalar_type>(l.scratch.host_weight_gradient) ||
                                    narrower_than_compute<scalar_type>(l.scratch.host_bias_gradient));
    });
    comm::announce_phase(comm_, "preconditioning (the vote on unusable gradients)");
    comm_.allreduce_max(unusable);
    narrow_gradient_views_ = unusable.back() != 0;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        l.scratch.usable = unusable[i] == 0;
        if (l.scratch.usable) continue;
        l.scratch.preconditioned = Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
        outcome.add(l, non_finite_source::gradient, plan.step, &health_counters::zeroed_gradients);
    }
}

/// ν = min(1, √(κ / |η² Σ_layers ⟨P, Γ⟩|)), 1 without kl_clip or when the sum is 0.
template <class Backend, class CommPolicy, class ComputeMethod>
double engine<Backend, CommPolicy, ComputeMethod>::kl_clip_scale(const step_plan& plan) const {
    if (!plan.kl_clip) return 1.0;
    double vg_sum = 0.0;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        const auto& l = layers_[i];
        if (!l.scratch.active || !l.scratch.usable) continue;
        if constexpr (batched_gradient_checks) vg_sum += gradient_dots_[i];  // from precondition_all's checks
        else vg_sum += Backend::frobenius_dot(l.scratch.preconditioned, l.scratch.gamma);
    }
    vg_sum *= plan.lr * plan.lr;
    return vg_sum == 0.0 ? 1.0 : std::min(1.0, std::sqrt(*plan.kl_clip / std::abs(vg_sum)));
}

/// ν·Pᵀ goes into the host's buffers, or into the compute-type copies of views in another
/// format, which are then rounded once into the views. Before that rounding, a layer whose
/// values would not all round to finite values of a narrower view (an fp16 view of a float
/// backend holds nothing above 65504) is zeroed on every rank, as a P that overflows the
/// compute type is: the vote is an allreduce_max, made only when some rank has such a view. ν
/// was computed with the layer in it (it is checked after ν scales P, so that a P that fits
/// once scaled is written), so the step stays within kl_clip's bound.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::write_back(const step_plan& plan, double scale, step_outcome& outcome) {
    for (auto& l : layers_)
        if (l.scratch.active) in_layer(l, [&] { l.block->store_gradient(l, static_cast<scalar_type>(scale)); });
    if (narrow_gradient_views_) {
        std::vector<std::int64_t> beyond(layers_.size());
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            const auto& l = layers_[i];
            if (l.scratch.active)
                in_layer(l, [&] {
                    beyond[i] = !(converted_fits(l.scratch.weight_copy, l.scratch.host_weight_gradient) &&
                                  converted_fits(l.scratch.bias_copy, l.scratch.host_bias_gradient));
                });
        }
        comm::announce_phase(comm_, "writing back (the vote on gradients beyond their views' format)");
        comm_.allreduce_max(beyond);
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            if (beyond[i] == 0) continue;
            l.scratch.preconditioned = Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
            in_layer(l, [&] { l.block->store_gradient(l, scalar_type(1)); });
            outcome.add(l, non_finite_source::gradient, plan.step, &health_counters::zeroed_gradients);
        }
    }
    for (auto& l : layers_)
        if (l.scratch.active)
            in_layer(l, [&] {
                detail::store_converted(l.scratch.weight_copy, l.scratch.host_weight_gradient);
                detail::store_converted(l.scratch.bias_copy, l.scratch.host_bias_gradient);
            });
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
    health_.add(outcome.health);
    ++steps_;  // below its largest value: read_plan() refuses a step that could not count
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
