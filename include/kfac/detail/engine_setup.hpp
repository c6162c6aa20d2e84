// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_setup.hpp
/// Construction (options validated, patterns compiled), the configuration every rank agrees
/// on, the placement of every layer's work (a pure function of the layers and the options,
/// planned by the assignment strategy), setup() at the first step, and the reports.

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/assignment/kaisa_grid.hpp"
#include "kfac/assignment/placement_costs.hpp"
#include "kfac/backend/eigenbasis_reuse.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/fwd.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
engine<Backend, CommPolicy, ComputeMethod>::engine(options opts, CommPolicy comm, assignment_policy assignment)
    : options_(std::move(opts)), comm_(std::move(comm)), assignment_(assignment) {
    agree_on([&] {
        validate(options_);
        if (!options_.damping.is_schedule()) detail::check_damping_representable<scalar_type>(options_.damping(0));
        if (!options_.loss_scale.is_schedule())
            detail::check_loss_scale_representable<scalar_type>(options_.loss_scale(0));
        check_method_supported();
        check_eigenbasis_reuse_supported();
        check_damping_supported();
        skip_filter_ = skip_filter(options_);
        reduce_filter_ = reduce_filter(options_);
        if (options_.factor_storage) {
            check_factor_storage(*options_.factor_storage, precision_of<scalar_type>);
            if (*options_.factor_storage != precision_of<scalar_type>) storage_.format = options_.factor_storage;
        }
        if (!device_backend && detail::reads_device_memory(comm_))
            throw error("the communication policy reads device memory (a process group built with a CUDA "
                        "payload_device) but this backend keeps its matrices in host memory; build the policy "
                        "without a payload device (Gloo), or use the CUDA backend");
    });
    staging_.follow(detail::reads_device_memory(comm_));
}

/// What compute::ekfac supports so far (kfac/compute/ekfac.hpp): the reference damping, new
/// eigenvectors at every inverse update.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_method_supported() const {
    if constexpr (method_estimating_scaling<method>) {
        auto refuse = [](const std::string& what) {
            throw error("compute::ekfac does not support " + what +
                        " yet (kfac/compute/ekfac.hpp lists what it supports); use compute::eigendecomposition");
        };
        if (damping_reads_factors(options_)) refuse("relative or factored damping");
        if (options_.eigenbasis_reuse_tolerance != 0.0)
            refuse("options.eigenbasis_reuse_tolerance (its scaling is re-estimated in every new eigenbasis)");
    }
}

/// options.eigenbasis_reuse_tolerance keeps eigenvectors: the eigen method's, on a backend
/// that can measure them (kfac/backend/eigenbasis_reuse.hpp).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_eigenbasis_reuse_supported() const {
    if (options_.eigenbasis_reuse_tolerance == 0.0) return;
    const std::string option =
        "options.eigenbasis_reuse_tolerance = " + detail::number_text(options_.eigenbasis_reuse_tolerance);
    if (!std::is_same_v<ComputeMethod, compute::eigendecomposition>)
        throw error(option + " needs the eigendecomposition compute method (this preconditioner uses '" +
                    ComputeMethod::name +
                    "', which has no eigenvectors to keep); use kfac::compute::eigendecomposition "
                    "or set the tolerance to 0");
    if (!detail::backend_with_eigenbasis_reuse<Backend>)
        throw error(option +
                    " is not supported by this backend (it lacks rayleigh_quotients, "
                    "kfac/backend/eigenbasis_reuse.hpp); set the tolerance to 0 or use the CPU backend");
}

/// Relative and factored damping fix each layer's damping at the inverse update; the eigen
/// method without the precomputed outer product divides by the step's damping at every step
/// instead, where the per-layer value is not at hand.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_damping_supported() const {
    if (!damping_reads_factors(options_) || !std::is_same_v<ComputeMethod, compute::eigendecomposition> ||
        options_.compute_eigenvalue_outer_product)
        return;
    throw error(std::string("options.") +
                (options_.relative_damping ? "relative_damping = true" : "damping_mode = damping_form::factored") +
                " needs options.compute_eigenvalue_outer_product = true with the eigendecomposition method (the "
                "per-layer damping is fixed at each inverse update, in the eigenvalue outer product); set it to "
                "true, or use the reference damping");
}

/// What every rank must agree on: the layers in order, then the options that shape the
/// computation (a schedule is code; only its presence is compared).
template <class Backend, class CommPolicy, class ComputeMethod>
std::vector<config_item> engine<Backend, CommPolicy, ComputeMethod>::configuration() const {
    // −0 and 0 are one value of every option (the text of −0 would be "-0").
    auto exact_number_text = [](double v) { return detail::exact_number_text(v + 0.0); };
    std::vector<detail::config_item> items;
    for (std::size_t i = 0; i < layers_.size(); ++i)
        items.push_back({"layer #" + std::to_string(i),
                         detail::layer_signature(layers_[i].host.name, layers_[i].host.description)});
    items.push_back({"the scalar type", sizeof(scalar_type) == sizeof(float) ? "float" : "double"});
    // Ranks of different methods or strategies would issue different collectives.
    items.push_back({"the compute method", ComputeMethod::name});
    items.push_back({"the assignment strategy", assignment_.name});
    auto number = [&](const char* name, const hyperparameter<double>& h) {
        items.push_back({std::string("options.") + name, h.is_schedule() ? "a schedule" : exact_number_text(h(0))});
    };
    auto count = [&](const char* name, const hyperparameter<std::int64_t>& h) {
        items.push_back({std::string("options.") + name, h.is_schedule() ? "a schedule" : std::to_string(h(0))});
    };
    number("damping", options_.damping);
    number("factor_decay", options_.factor_decay);
    number("lr", options_.lr);
    items.push_back({"options.kl_clip", options_.kl_clip.is_schedule() ? "a schedule"
                                        : options_.kl_clip(0)          ? exact_number_text(*options_.kl_clip(0))
                                                                       : "none"});
    count("factor_update_steps", options_.factor_update_steps);
    count("inv_update_steps", options_.inv_update_steps);
    auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
    items.push_back({"options.accumulation_steps", std::to_string(options_.accumulation_steps)});
    items.push_back({"options.compute_eigenvalue_outer_product", flag(options_.compute_eigenvalue_outer_product)});
    items.push_back({"options.eigenbasis_reuse_tolerance", exact_number_text(options_.eigenbasis_reuse_tolerance)});
    items.push_back(
        {"options.conv_patches", option_value_name(options_.conv_patches)});
    items.push_back({"options.statistics", option_value_name(options_.statistics)});
    items.push_back({"options.averaging", option_value_name(options_.averaging)});
    items.push_back({"options.damping_mode", option_value_name(options_.damping_mode)});
    items.push_back({"options.relative_damping", flag(options_.relative_damping)});
    items.push_back({"options.strategy", option_value_name(options_.strategy)});
    items.push_back({"options.grad_worker_fraction", exact_number_text(options_.grad_worker_fraction)});
    items.push_back({"options.colocate_factors", flag(options_.colocate_factors)});
    items.push_back({"options.allreduce_bucket_cap_mb", exact_number_text(options_.allreduce_bucket_cap_mb)});
    items.push_back({"options.symmetry_aware", flag(options_.symmetry_aware)});
    // The mixed-precision options, named only when set away from their defaults (so that the
    // digest of a configuration without them is what it was before they existed).
    if (loss_scaling(options_))
        items.push_back({"options.loss_scale", options_.loss_scale.is_schedule()
                                                   ? "a schedule"
                                                   : exact_number_text(options_.loss_scale(0))});
    if (options_.fp64_decompositions) items.push_back({"options.fp64_decompositions", "true"});
    if (options_.overlap_factor_allreduce) items.push_back({"options.overlap_factor_allreduce", "true"});
    if (!options_.fp64_retry) items.push_back({"options.fp64_retry", "false"});
    if (storage_.packs()) items.push_back({"options.factor_storage", precision_name(*storage_.format)});
    return items;
}

/// Ranks compare one digest of their configuration; when they differ, rank 0's
/// configuration travels to every rank, and the first rank that differs names the first
/// layer or option where it does. Collective.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_configuration_agrees() {
    check_items_agree(configuration(), detail::configuration_subject, detail::configuration_fix);
}

/// Ranks compare one digest of `items`; when they differ, rank 0's items travel to every
/// rank, and the first rank that differs names the first item where it does. `subject`
/// names the items in the message, `fix` says what to do. Collective.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_items_agree(const std::vector<config_item>& items,
                                                                   const std::string& subject, const std::string& fix) {
    const auto digests = comm_.allgather(detail::configuration_digest(items));
    if (std::all_of(digests.begin(), digests.end(), [&](auto d) { return d == digests[0]; })) return;
    const auto reference = detail::deserialize(comm_.broadcast_text(detail::serialize(items), 0));
    if (auto agreed = comm_.agree(detail::first_difference(reference, items, comm_.rank(), subject, fix)))
        throw error(*agreed);
    throw error("ranks disagree on " + subject + " (their digests differ). " + fix);
}

/// Once, at the first accumulate()/step(): checks that all ranks agree, places the
/// second-order work and builds the communication groups. Collective.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::setup() {
    if (started_) return;
    comm::announce_phase(comm_, "the set-up (configuration agreement, placement, groups)");
    int threads = 1;
    agree_on([&] { threads = options_.threads > 0 ? options_.threads : detail::default_thread_count(comm_.size()); });
    if constexpr (device_backend) threads = 1;  // a device backend queues from one host thread
    // Several ranks on one machine already use its cores: unless told otherwise, each rank
    // runs its BLAS single-threaded too. A BLAS thread pool per rank that spins while its
    // rank waits in a collective slowed a 2-rank step on 2 cores 100-fold (scipy-openblas32).
    const bool serial_blas = options_.threads == 0 && comm_.size() > 1 && !detail::thread_count_in_environment();
    check_configuration_agrees();
    const int me = comm_.rank();
    const bool eigen_product =
        options_.compute_eigenvalue_outer_product && std::is_same_v<ComputeMethod, compute::eigendecomposition>;
    agree_on([&] {
        plan_ = distribution();
        if (plan_.kaisa() && !options_.colocate_factors && eigen_product)
            throw error(
                "options.colocate_factors = false with compute_eigenvalue_outer_product: the "
                "product needs both eigenvalue sets on one rank; set colocate_factors = true or "
                "compute_eigenvalue_outer_product = false");
    });
    column_group_ = comm_.split(plan_.column_of(me));
    gradient_group_ = plan_.kaisa() ? comm_.split(plan_.row_of(me)) : comm_.world();
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        l.role = plan_.role(i, me);
        if (l.role.grad_worker && !(l.role.computes_a && l.role.computes_g))
            l.block->prepare_receive(l.state.second, l.host.description, options_);
    }
    threads_ = threads;
    serial_blas_ = serial_blas;
    started_ = true;
}

/// The placement of every block's work at this world size: the placement chain
/// (kfac/assignment/placement_costs.hpp) over the registered layers, a pure function of the
/// layers and the options that kfac_schedule_study calls too.
template <class Backend, class CommPolicy, class ComputeMethod>
assignment::distribution_plan engine<Backend, CommPolicy, ComputeMethod>::distribution() const {
    std::vector<layer_description> described;  // each layer once: its group 0 record
    for (const auto& l : layers_)
        if (l.host.group == 0) described.push_back(l.host.description);
    const auto dims = assignment::placement_costs(described);
    return assignment_.plan(dims, comm_.size(), options_.strategy, options_.grad_worker_fraction,
                            options_.colocate_factors);
}

/// The plan in force after setup(), else the one setup() will make.
template <class Backend, class CommPolicy, class ComputeMethod>
assignment::distribution_plan engine<Backend, CommPolicy, ComputeMethod>::placement() const {
    return started_ ? plan_ : distribution();
}

template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::is_registered(const std::string& name) const {
    for (const auto& l : layers_)
        if (l.host.name == name || l.host.registered_name == name) return true;
    return false;
}

/// Under DP-KFAC a layer's factors live on its owner alone; another rank's matrices are the
/// identity they started at, which would read as a factor that never learned anything.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::throw_factor_not_held(std::size_t i, bool a) const {
    const auto& l = layers_[i];
    const int owner = plan_.layers[i].factor_holders.empty() ? -1 : plan_.layers[i].factor_holders.front();
    throw layer_error(named(l), std::string(a ? "a_factor()" : "g_factor()") + ": rank " + std::to_string(comm_.rank()) +
                                    " does not keep this layer's factors under " + strategy_name() + "; rank " +
                                    std::to_string(owner) +
                                    " does (its owner): read them there, or save() a checkpoint, which gathers "
                                    "every layer's factors");
}

template <class Backend, class CommPolicy, class ComputeMethod>
assignment::factor_workers engine<Backend, CommPolicy, ComputeMethod>::workers(const std::string& name) const {
    const auto plan = placement();
    const auto& p = plan.layers[index_of(name)];
    return {p.a_worker, p.g_worker};
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::vector<layer_info> engine<Backend, CommPolicy, ComputeMethod>::layers() const {
    const auto plan = placement();
    std::vector<layer_info> out;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        const auto& d = layers_[i].host.description;
        const auto& p = plan.layers[i];
        out.push_back({layers_[i].host.name, d.kind, d.a_dim(), d.g_dim(), d.bias, p.a_worker, p.g_worker,
                       p.factor_holders, p.grad_workers});
    }
    return out;
}

template <class Backend, class CommPolicy, class ComputeMethod>
memory_report engine<Backend, CommPolicy, ComputeMethod>::memory_usage() const {
    memory_report m;
    auto bytes = [](const auto& x) { return static_cast<std::size_t>(x.size()) * sizeof(scalar_type); };
    for (const auto& l : layers_) {
        m.factors += storage_.bytes(l.state);
        m.statistics += bytes(l.statistics.a_sum) + bytes(l.statistics.g_sum);
        for (const auto& copy : l.scratch.converted) m.statistics += copy.bytes();
        m.gradients += l.scratch.weight_copy.bytes() + l.scratch.bias_copy.bytes();
        for (const auto& channels : l.scratch.group_channels) m.statistics += channels.size() * sizeof(scalar_type);
        method::for_each_tensor(l.state.second, [&](const char*, const auto& x, int) { m.second_order += bytes(x); });
        m.gradients += bytes(l.scratch.gamma) + bytes(l.scratch.preconditioned);
    }
    return m;
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::string engine<Backend, CommPolicy, ComputeMethod>::strategy_name() const {
    if (options_.strategy == distribution::dp_kfac) return "dp_kfac";
    return assignment::kaisa_grid(comm_.size(), options_.grad_worker_fraction).strategy_name();
}

}  // namespace kfac::detail
