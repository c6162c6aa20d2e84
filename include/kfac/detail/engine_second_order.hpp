// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_second_order.hpp
/// Second-order data: each factor this rank owns decomposed (or inverted) as an independent
/// task, then kept, counted and broadcast to the ranks that precondition with it.

#include <type_traits>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/backend/batched_eigen.hpp"
#include "kfac/compute/eigendecomposition.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/statistic_scale.hpp"
#include "kfac/detail/statistics_views.hpp"

namespace kfac::detail {

/// Dense factors this rank decomposed or kept the basis of (eigenbasis_counts()), as the
/// compute method reports them (a method without eigenvectors reports none).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::count_bases(const layer_record& l,
                                                             const typename method::factor_data& a,
                                                             const typename method::factor_data& g) {
    const auto count = [&](bool computes, factor_side side, const typename method::factor_data& f) {
        if (!computes || !l.block->counts_basis(side)) return;
        const detail::basis_use use = method::basis_use_of(f);
        if (use == detail::basis_use::reused)
            ++bases_.reused;
        else if (use == detail::basis_use::decomposed)
            ++bases_.decomposed;
    };
    count(l.role.computes_a, factor_side::a, a);
    count(l.role.computes_g, factor_side::g, g);
}

/// Hands a backend with batched_eigen (kfac/backend/batched_eigen.hpp) every dense factor this
/// rank is about to decompose, so it can decompose small ones together; what the tasks do not
/// take is forgotten when the guard goes, whatever happened meanwhile. Nothing for other
/// backends or methods, or with an eigenbasis reuse tolerance (a kept basis would waste it).
template <class Backend, class CommPolicy, class ComputeMethod>
auto engine<Backend, CommPolicy, ComputeMethod>::prefetch_decompositions() -> prefetch_guard {
    if constexpr (backend_with_batched_eigen<Backend> && std::is_same_v<ComputeMethod, compute::eigendecomposition>) {
        if (options_.eigenbasis_reuse_tolerance != 0.0) return {};
        std::vector<const matrix*> dense;
        for (const auto& l : layers_) {
            if (l.role.computes_a && l.block->counts_basis(factor_side::a)) dense.push_back(&l.state.a_factor);
            if (l.role.computes_g && l.block->counts_basis(factor_side::g)) dense.push_back(&l.state.g_factor);
        }
        prefetch_guard guard{&Backend::clear_prefetched_eigen};
        Backend::prefetch_symmetric_eigen(dense);
        return guard;
    } else {
        return {};
    }
}

/// options.eigenbasis_reuse_tolerance may keep a factor's previous eigenvectors; only data
/// this rank computed in an earlier update (has_second) counts as previous.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::add_decomposition_tasks(std::size_t i, double damping,
                                                                         std::vector<detail::task>& tasks) {
    static const typename method::factor_data none{};
    auto& l = layers_[i];
    auto& r = second_order_results_[i];
    r.computed = true;
    const auto& d = l.host.description;
    // Before the first update a receiver's buffers are sized but hold nothing.
    const bool has_previous = l.state.has_second;
    const auto* previous_a = has_previous ? &l.state.second.a : &none;
    const auto* previous_g = has_previous ? &l.state.second.g : &none;
    if (l.role.computes_a || l.role.computes_g) {
        storage_.widen(l.state);  // released once the decompositions are done
        r.terms = l.block->damping_of(l.state, damping, options_);
    }
    if (l.role.computes_a)
        tasks.push_back(layer_task(l, {l.block->second_order_cost(d, factor_side::a), [&l, &r, previous_a, this] {
                                           r.ok_a = l.block->compute(factor_side::a, l.state.a_factor, r.terms.a,
                                                                     options_, *previous_a, r.a);
                                       }}));
    if (l.role.computes_g)
        tasks.push_back(layer_task(l, {l.block->second_order_cost(d, factor_side::g), [&l, &r, previous_g, this] {
                                           r.ok_g = l.block->compute(factor_side::g, l.state.g_factor, r.terms.g,
                                                                     options_, *previous_g, r.g);
                                       }}));
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::decompose_early(std::size_t i, double damping) {
    if (early_decomposition_failure_) return;  // the update fails at its agreement anyway
    try {
        std::vector<detail::task> tasks;
        add_decomposition_tasks(i, damping, tasks);
        detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_);
    } catch (...) {
        early_decomposition_failure_ = std::current_exception();
    }
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::abandon_early_decompositions() noexcept {
    if (second_order_results_.empty() && !early_decomposition_failure_) return;
    second_order_results_.clear();
    early_decomposition_failure_ = nullptr;
    for (auto& l : layers_) storage_.release(l.state);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::update_second_order(const step_plan& plan, step_outcome& outcome) {
    comm::announce_phase(comm_, "the second-order update");
    const double damping = plan.damping;
    second_order_damping_ = damping;
    // Decompose every factor this rank owns as independent tasks (those update_factors() has
    // not already decomposed while its allreduce travelled), then apply the results and share
    // them in layer order (every rank issues the broadcasts in that order).
    const bool started_early = !second_order_results_.empty();
    if (!started_early) second_order_results_.assign(layers_.size(), {});
    std::vector<detail::task> tasks;
    for (std::size_t i = 0; i < layers_.size(); ++i)
        if (!second_order_results_[i].computed) add_decomposition_tasks(i, damping, tasks);
    struct widened_factors {  // the factors widened for the tasks, released however they end
        engine& e;
        ~widened_factors() {
            for (auto& l : e.layers_) e.storage_.release(l.state);
            e.second_order_results_.clear();
            e.early_decomposition_failure_ = nullptr;
        }
    } widened{*this};
    auto& results = second_order_results_;
    agree_on([&] {
        if (early_decomposition_failure_) std::rethrow_exception(early_decomposition_failure_);
        // A backend's batched decompositions take the factors all at once: not when some were
        // decomposed one by one already.
        const auto prefetched = started_early ? prefetch_guard{} : prefetch_decompositions();
        detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_);
    });
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        auto& r = results[i];
        const auto& p = l.role;
        if (p.computes_a || p.computes_g) {
            outcome.health.fp64_retries += (p.computes_a && r.a.fp64_retry ? 1 : 0) + (p.computes_g && r.g.fp64_retry ? 1 : 0);
            if (r.ok_a && r.ok_g) {
                count_bases(l, r.a, r.g);
                if (p.computes_a) l.state.second.a = std::move(r.a);
                if (p.computes_g) l.state.second.g = std::move(r.g);
                if (p.computes_a && p.computes_g) l.block->finalize(l.state.second, r.terms.product, options_);
                l.state.has_second = true;
            } else {
                outcome.add(l, non_finite_source::decomposition, plan.step, &health_counters::kept_decompositions);
                if (!l.state.has_second) {  // nothing to keep: precondition with the identity's data
                    l.block->identity_data(l.state.second, l.host.description, r.terms, options_);
                    l.state.has_second = true;
                }
            }
        }
        if (p.share_second_order) {
            comm::announce_phase(comm_, "the second-order update (its broadcasts)");
            method::for_each_payload(l.state.second, factor_side::a, [&](scalar_type* d, std::size_t n) {
                comm_.broadcast(staging_.stage(d, n, broadcast_transfer(p.computes_a)), n, p.a_root, column_group_);
            });
            method::for_each_payload(l.state.second, factor_side::g, [&](scalar_type* d, std::size_t n) {
                comm_.broadcast(staging_.stage(d, n, broadcast_transfer(p.computes_g)), n, p.g_root, column_group_);
            });
            l.state.has_second = true;
        }
    }
    second_order_in_flight_ = true;
    if (!options_.overlap_communication) finish_second_order_broadcasts();
}

/// The scaling of every layer that holds second-order data, from the rows this step's capture
/// kept, in the bases in force.
/// - One rank, and DP-KFAC: the rank that holds a layer's data estimates it from its own rows
///   (under DP-KFAC the owner's own batch, from which its factors come too). No collective.
/// - KAISA: each rank projects its own rows into the layer's bases; each rank's estimate times
///   its examples is summed over the ranks with the examples in one bucketed allreduce, then
///   divided by their sum, which is the estimate over every rank's examples; a rank without rows
///   sends zeros. Under COMM_OPT every rank holds every layer's bases. Under HYBRID_OPT and
///   MEM_OPT only a layer's column does: its A and G workers first broadcast the bases to every
///   rank (which holds layers' data being agreed by an allreduce_max), the other ranks keep them
///   only for the estimate, and only the column keeps the scaling: the ranks outside it hold
///   nothing more between steps than the strategy gives them.
/// A non-finite estimate leaves the scaling as it was and is counted as a skipped factor update.
/// The rows are released.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::update_scaling(const step_plan& plan, step_outcome& outcome) {
    if constexpr (method_estimating_scaling<method>) {
        using layer_data = typename method::layer_data;
        auto update = [&](layer_record& l, bool finite) {
            if (finite)
                method::update_scaling(l.state.second, l.scratch.method_ws, plan.factor_decay,
                                       /*restart=*/plan.inverse_update);
            else
                outcome.add(l, non_finite_source::factor_statistics, plan.step, &health_counters::skipped_factor_updates);
        };
        auto estimate = [&](layer_record& l, const layer_data& bases) {
            bool finite = false;
            in_layer(l, [&] {
                finite = method::estimate_scaling(bases, l.host.description.group_block(),
                                                  options_.statistics == statistic_scale::per_example,
                                                  l.scratch.method_ws);
            });
            return finite;
        };
        if (comm_.size() == 1 || !plan_.kaisa()) {
            for (auto& l : layers_) {
                auto& w = l.scratch.method_ws;
                if (method::has_kept_rows(w) && l.state.has_second) update(l, estimate(l, l.state.second));
                method::release_rows(w);
            }
            return;
        }
        finish_second_order_broadcasts();  // the bases every rank of a column projects its rows into
        // Which layers' columns hold data (every rank's own state under COMM_OPT), and the bases
        // lent to the ranks outside a column.
        std::vector<std::int64_t> held(layers_.size());
        for (std::size_t i = 0; i < layers_.size(); ++i) held[i] = layers_[i].state.has_second ? 1 : 0;
        std::vector<layer_data> lent;
        const bool lend_bases = plan_.columns > 1;
        if (lend_bases) {
            comm::announce_phase(comm_, "the EKFAC bases' broadcasts");
            comm_.allreduce_max(held);
            lent.resize(layers_.size());
            for (std::size_t i = 0; i < layers_.size(); ++i) {
                if (held[i] == 0) continue;
                auto& l = layers_[i];
                const auto& d = l.host.description.group_block();
                const auto& placement = plan_.layers[i];
                // A rank of the column receives into its own bases, equal bit for bit to the root's.
                auto& bases = l.state.has_second ? l.state.second : lent[i];
                if (!l.state.has_second) {
                    bases.a.q.resize(d.a_dim(), d.a_dim());
                    bases.g.q.resize(d.g_dim(), d.g_dim());
                }
                const int me = comm_.rank();
                const auto share = [&](matrix& q, int root) {
                    const auto n = static_cast<std::size_t>(q.size());
                    comm_.broadcast(staging_.stage(q.data(), n, broadcast_transfer(me == root)), n, root, comm_.world());
                };
                share(bases.a.q, placement.a_worker);
                share(bases.g.q, placement.g_worker);
            }
            comm_.wait();
            staging_.complete();
        }
        std::vector<std::size_t> estimated;
        std::vector<scalar_type> examples;
        std::vector<allreduce_item<scalar_type>> items;
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            if (held[i] == 0) continue;  // on no rank
            auto& w = l.scratch.method_ws;
            scalar_type n = 0;
            if (method::has_kept_rows(w)) {
                estimate(l, l.state.has_second ? l.state.second : lent[i]);  // a non-finite sum is found after the allreduce
                n = static_cast<scalar_type>(method::kept_examples(l.host.description.group_block(), w));
                method::weight_estimate(w, n);
            } else {
                const auto& d = l.host.description;
                w.estimate = Backend::zeros(d.a_dim(), d.g_dim());
            }
            if (lend_bases && !l.state.has_second) lent[i] = layer_data{};  // the estimate no longer needs them
            estimated.push_back(i);
            examples.push_back(n);
            const auto count = static_cast<std::size_t>(w.estimate.size());
            items.push_back({staging_.stage(w.estimate.data(), count, transfer::send_and_receive), count, false, 0});
        }
        if (estimated.empty()) {  // no layer holds data yet, on any rank: no collective
            for (auto& l : layers_) method::release_rows(l.scratch.method_ws);
            return;
        }
        items.push_back({examples.data(), examples.size(), false, 0});
        comm::announce_phase(comm_, "the EKFAC scaling's allreduce");
        comm_.allreduce_sum(items, factor_bucket_cap_bytes(), false, comm_.world());
        staging_.complete();  // a device backend's sums back in its memory
        for (std::size_t k = 0; k < estimated.size(); ++k) {
            auto& l = layers_[estimated[k]];
            auto& w = l.scratch.method_ws;
            if (!l.state.has_second) {
                w.estimate = matrix{};  // the column keeps the scaling
            } else if (examples[k] > scalar_type(0)) {
                update(l, method::unweight_estimate(w, examples[k]));
            }
        }
        for (auto& l : layers_) method::release_rows(l.scratch.method_ws);
    } else {
        (void)plan, (void)outcome;
    }
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::finish_second_order_broadcasts() {
    if (!second_order_in_flight_) return;
    second_order_in_flight_ = false;
    comm_.wait();
    staging_.complete();
}

}  // namespace kfac::detail
