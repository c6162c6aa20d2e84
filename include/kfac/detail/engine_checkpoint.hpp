// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_checkpoint.hpp
/// save() and load() of the engine's state. Save: the records' state gathered onto rank 0 by
/// the distribution plan into a checkpoint::state_dict (kfac/checkpoint/state_dict.hpp),
/// which becomes the archive. Load: rank 0 reads the bytes and broadcasts them; every rank
/// reads the state_dict, checks all of it against its records (detail::checkpoint_io) and
/// builds its part aside; only when every rank succeeded does any state change.
///
/// Which rank holds what: rank 0 holds every running factor under KAISA; under DP-KFAC each
/// layer's owner broadcasts them. Second-order data comes from the rank that computed a
/// layer's G data, which holds the whole layer's data (KAISA shares A's within the column;
/// MEM_OPT and DP-KFAC compute both on one rank). One tensor travels at a time.

#include <cmath>
#include <exception>
#include <filesystem>
#include <istream>
#include <iterator>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/blocks/block.hpp"
#include "kfac/checkpoint/files.hpp"
#include "kfac/checkpoint/state_dict.hpp"
#include "kfac/detail/checkpoint_io.hpp"
#include "kfac/detail/engine.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::save(const std::filesystem::path& path,
                                                      const checkpoint::save_options& o) {
    const auto state = gather_state(o);
    agree_on([&] {
        if (state) checkpoint::write_file(path, checkpoint::to_archive(*state));
    });
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::string engine<Backend, CommPolicy, ComputeMethod>::save_bytes(const checkpoint::save_options& o) {
    comm::announce_phase(comm_, "saving a checkpoint");
    const auto state = gather_state(o);
    std::string bytes;
    agree_on([&] {
        if (state) bytes = checkpoint::serialize(checkpoint::to_archive(*state));
    });
    return bytes;
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::save(std::ostream& out, const checkpoint::save_options& o) {
    const std::string bytes = save_bytes(o);
    agree_on([&] {
        if (comm_.rank() != 0) return;
        out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        if (!out) throw error("save(): writing " + std::to_string(bytes.size()) + " bytes to the stream failed");
    });
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load(const std::filesystem::path& path,
                                                      const checkpoint::load_options& o) {
    std::string bytes;
    agree_on([&] {
        // A folder, a device or a pipe is refused by its type, and every failure is a
        // kfac::error naming the file (kfac/checkpoint/files.hpp), which every rank raises.
        if (comm_.rank() == 0) bytes = checkpoint::read_bytes(path);
    });
    load_from(std::move(bytes), path.string(), o);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load_bytes(std::string_view bytes, const checkpoint::load_options& o) {
    load_from(comm_.rank() == 0 ? std::string(bytes) : std::string(), "(bytes in memory)", o);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load(std::istream& in, const checkpoint::load_options& o) {
    std::string bytes;
    agree_on([&] {
        if (comm_.rank() != 0) return;
        try {  // a stream with exceptions() set, or bytes beyond memory: named as load()'s
            bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        } catch (const std::exception& e) {
            throw error(std::string("load(): reading the stream failed: ") + e.what());
        }
        if (in.bad()) throw error("load(): reading the stream failed");
    });
    load_from(std::move(bytes), "(stream)", o);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load_from(std::string bytes, const std::string& source,
                                                           const checkpoint::load_options& o) {
    setup();
    comm::announce_phase(comm_, "loading a checkpoint");
    agree_on([&] { check_between_steps("load()"); });
    bytes = comm_.broadcast_text(bytes, 0);
    staged_state<Backend, method> staged;
    agree_on([&] {
        const auto state = checkpoint::from_archive(checkpoint::parse(bytes, source), source);
        staged = checkpoint_io<engine>::stage(*this, state, source, o);
    });
    const bool recompute = staged.recompute;
    adopt_state(std::move(staged));
    if (!recompute) return;
    // The file holds no second-order data to use: computed from the loaded factors now,
    // as an inverse update with the damping it was last computed with would.
    detail::step_plan plan;
    plan.step = steps_;
    plan.damping = second_order_damping_;
    step_outcome outcome;
    const blas_threads_guard blas_threads(serial_blas_);
    // adopt_state() left every layer without second-order data, so no previous
    // eigenvectors are kept: every factor is decomposed exactly.
    update_second_order(plan, outcome);
    finish_second_order_broadcasts();
    health_.add(outcome.health);
}

/// A checkpoint holds the state between steps: the statistics of a step's accumulate() passes
/// are not part of it, so save() would lose them and load() would drop them (the next step()
/// would then blame the host for calling it after no accumulate()).
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::check_between_steps(const char* call) const {
    if (passes_ == 0) return;
    throw error(std::string(call) + " after " + std::to_string(passes_) +
                " accumulate() call(s) of a step that has not finished; a checkpoint holds the state between "
                "steps, without a step's pending statistics: " + call + " before the step's first accumulate() or "
                "after its step()");
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::optional<checkpoint::state_dict> engine<Backend, CommPolicy, ComputeMethod>::gather_state(
    const checkpoint::save_options& o) {
    setup();
    agree_on([&] { check_between_steps("save()"); });
    const bool writer = comm_.rank() == 0;
    const bool second = o.second_order && steps_ > 0;
    checkpoint::state_dict state;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& l = layers_[i];
        const auto& place = plan_.layers[i];
        const auto& d = l.host.description;
        const int factor_source = place.factor_holders.front();
        const blocks::block_layout b = l.block->layout(d);
        {
            // options.factor_storage: the stored factors widened here, recorded in their dtype.
            const bool packed = storage_.packs();
            const matrix a = packed ? storage_.value(l.state, true) : matrix{};
            const matrix g = packed ? storage_.value(l.state, false) : matrix{};
            gather_tensor(packed ? a : l.state.a_factor, b.a_rows, b.a_cols, factor_source, writer, state.tensors,
                          l.host.name + ".A", b.a_tensor_rank);
            gather_tensor(packed ? g : l.state.g_factor, b.g_dim, b.g_dim, factor_source, writer, state.tensors,
                          l.host.name + ".G", 2);
            if (writer && storage_.packs())
                for (auto* t : {&state.tensors[state.tensors.size() - 2], &state.tensors.back()})
                    *t = checkpoint::to_packed_tensor(*t, *storage_.format);
        }
        if (!second) continue;
        // Every rank walks the same list of tensors: the source its own data, the others
        // empty stand-ins of the same sizes.
        typename method::layer_data expected{};
        l.block->prepare_full(expected, d, options_);
        const bool source = comm_.rank() == place.g_worker;
        std::vector<std::pair<const char*, std::pair<std::int64_t, std::int64_t>>> shapes;
        method::for_each_tensor(expected, [&](const char* name, const auto& x, int) {
            shapes.push_back({name, {static_cast<std::int64_t>(x.rows()), static_cast<std::int64_t>(x.cols())}});
        });
        agree_on([&] {
            if (!source) return;
            std::size_t k = 0;
            method::for_each_tensor(l.state.second, [&](const char* name, const auto& x, int) {
                const auto& [rows, cols] = shapes[k++].second;
                if (x.rows() != rows || x.cols() != cols)
                    throw error(describe_layer(l.host.name, d) + ": its second-order data '" + name + "' is " +
                                std::to_string(x.rows()) + " x " + std::to_string(x.cols()) + " on rank " +
                                std::to_string(comm_.rank()) + ", not " + std::to_string(rows) + " x " +
                                std::to_string(cols) + " (an internal inconsistency; please report it)");
            });
        });
        std::size_t k = 0;
        method::for_each_tensor(source ? l.state.second : expected, [&](const char* name, const auto& x, int rank) {
            const auto& [rows, cols] = shapes[k++].second;
            if (rows * cols == 0) return;
            gather_tensor(x, rows, cols, place.g_worker, writer, state.tensors, l.host.name + "." + name, rank);
        });
    }
    const std::vector<double> weights = gather_statistics_weights();
    if (!writer) return std::nullopt;
    for (std::size_t i = 0; i < layers_.size(); ++i)
        if (!std::isnan(weights[i])) state.statistics_weights[layers_[i].host.name] = weights[i];
    state.step = steps_;
    state.scalar = sizeof(scalar_type) == sizeof(float) ? "float" : "double";
    state.method = compute_method_name<ComputeMethod>();
    state.second_order = steps_ == 0 ? "none yet" : o.second_order ? "included" : "omitted";
    state.damping = second_order_damping_;
    state.world_size = comm_.size();
    state.strategy = plan_.name;
    state.health = health_;
    for (const auto& l : layers_) state.layers[l.host.name] = layer_signature(l.host.name, l.host.description);
    for (auto& [name, value] : saved_option_values(configuration())) state.options[name] = std::move(value);
    return state;
}

/// Every layer's W (layer_state::statistics_weight) as the first rank that holds its factors
/// has it, on rank 0: one broadcast from each other rank that is such a first holder.
template <class Backend, class CommPolicy, class ComputeMethod>
std::vector<double> engine<Backend, CommPolicy, ComputeMethod>::gather_statistics_weights() {
    std::vector<double> weights(layers_.size());
    for (std::size_t i = 0; i < layers_.size(); ++i) weights[i] = layers_[i].state.statistics_weight;
    for (int source = 1; source < comm_.size(); ++source) {
        std::vector<std::size_t> held;
        for (std::size_t i = 0; i < layers_.size(); ++i)
            if (plan_.layers[i].factor_holders.front() == source) held.push_back(i);
        if (held.empty()) continue;
        std::vector<double> part(held.size());
        for (std::size_t k = 0; k < held.size(); ++k) part[k] = weights[held[k]];
        comm::announce_phase(comm_, "saving a checkpoint (gathering statistics weights)");
        comm::broadcast_host(comm_, part.data(), part.size(), source, comm_.world());
        comm_.wait();
        for (std::size_t k = 0; k < held.size(); ++k) weights[held[k]] = part[k];
    }
    return weights;
}

template <class Backend, class CommPolicy, class ComputeMethod>
template <class Storage>
void engine<Backend, CommPolicy, ComputeMethod>::gather_tensor(const Storage& x, std::int64_t rows, std::int64_t cols,
                                                               int source, bool writer,
                                                               std::vector<checkpoint::tensor>& tensors,
                                                               std::string name, int tensor_rank) {
    if (source == 0) {
        if (writer) tensors.push_back(checkpoint::to_tensor<scalar_type>(std::move(name), Backend::to_host(x), tensor_rank));
        return;
    }
    typename Backend::host_matrix h(rows, cols);
    if (comm_.rank() == source) h = Backend::to_host(x);
    comm::announce_phase(comm_, "saving a checkpoint (gathering tensors)");
    comm::broadcast_host(comm_, h.data(), static_cast<std::size_t>(h.size()), source, comm_.world());
    comm_.wait();
    if (writer) tensors.push_back(checkpoint::to_tensor<scalar_type>(std::move(name), h, tensor_rank));
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::adopt_state(staged_state<Backend, method>&& s) {
    for (std::size_t i = 0; i < layers_.size(); ++i) {
        auto& st = layers_[i].state;
        if (s.a_factor[i] || s.g_factor[i]) {  // options.factor_storage: rounded into it
            storage_.widen(st);
            if (s.a_factor[i]) st.a_factor = std::move(*s.a_factor[i]);
            if (s.g_factor[i]) st.g_factor = std::move(*s.g_factor[i]);
            const blocks::block_layout b = layers_[i].block->layout(layers_[i].host.description);
            storage_.store_loaded(st, b.a_structure, b.g_structure);
        }
        st.statistics_weight = s.statistics_weights[i];
        st.has_second = false;
        if (s.second[i]) {
            st.second = std::move(*s.second[i]);
            st.has_second = true;
        }
    }
    steps_ = s.step;
    passes_ = 0;
    applied_in_step_ = false;
    health_ = s.health;
    last_kl_scale_ = 1.0;
    second_order_damping_ = s.second_order_damping;
}

}  // namespace kfac::detail
