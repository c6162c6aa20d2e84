// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file checkpoint_io.hpp
/// save() and load() of the preconditioner: which rank holds what (the distribution plan),
/// gathering it onto rank 0, and setting it back on every rank that needs it, at any world
/// size. The format is kfac/checkpoint/format.hpp. A friend of detail::engine (kfac/detail/engine.hpp), whose fields it reads and sets.
///
/// Save: rank 0 already holds every running factor under KAISA; under DP-KFAC each layer's
/// owner broadcasts them. Second-order data comes from the rank that computed a layer's G
/// data, which holds the whole layer's data (KAISA shares A's within the column; MEM_OPT and
/// DP-KFAC compute both on one rank). One layer travels at a time.
/// Load: rank 0 reads the bytes and broadcasts them; every rank checks the whole file (its
/// checksum, metadata and every tensor's values, whichever layers the rank will hold) and
/// builds its new state aside; only when every rank succeeded does any state change.

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/blocks/block.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/checkpoint/value_checks.hpp"
#include "kfac/detail/configuration_check.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/health.hpp"

namespace kfac::detail {

template <class Method>
constexpr const char* compute_method_name() {
    if constexpr (requires { Method::name; }) return Method::name;
    else return "custom";
}

template <class Engine>
struct checkpoint_io {
    using P = Engine;
    using backend = typename P::backend_type;
    using scalar = typename P::scalar_type;
    using method = typename P::method;
    using host_matrix = typename backend::host_matrix;

    /// The archive on rank 0 (std::nullopt on other ranks). Collective.
    static std::optional<checkpoint::archive> collect(P& p, const checkpoint::save_options& o) {
        p.setup();
        p.agree_on([&] {
            if (p.passes_ != 0)
                throw error("save() after " + std::to_string(p.passes_) + " accumulate() call(s) of a step that has "
                            "not finished; save after step(), when the step's statistics are folded in");
        });
        const bool writer = p.comm_.rank() == 0;
        const bool second = o.second_order && p.steps_ > 0;
        checkpoint::archive a;
        for (std::size_t i = 0; i < p.layers_.size(); ++i) {
            auto& l = p.layers_[i];
            const auto& place = p.plan_.layers[i];
            const auto& d = l.host.description;
            const int factor_source = place.factor_holders.front();
            const blocks::block_layout b = l.block->layout(d);
            gather(p, l.state.a_factor, b.a_rows, b.a_cols, factor_source, writer, a, l.host.name + ".A", b.a_tensor_rank);
            gather(p, l.state.g_factor, b.g_dim, b.g_dim, factor_source, writer, a, l.host.name + ".G", 2);
            if (!second) continue;
            // Every rank walks the same list of tensors: the source its own data, the others
            // empty stand-ins of the same sizes.
            typename method::layer_data expected{};
            l.block->prepare_full(expected, d, p.options_);
            const bool source = p.comm_.rank() == place.g_worker;
            std::vector<std::pair<const char*, std::pair<std::int64_t, std::int64_t>>> shapes;
            method::for_each_tensor(expected, [&](const char* name, const auto& x, int) {
                shapes.push_back({name, {static_cast<std::int64_t>(x.rows()), static_cast<std::int64_t>(x.cols())}});
            });
            p.agree_on([&] {
                if (!source) return;
                std::size_t k = 0;
                method::for_each_tensor(l.state.second, [&](const char* name, const auto& x, int) {
                    const auto& [rows, cols] = shapes[k++].second;
                    if (x.rows() != rows || x.cols() != cols)
                        throw error(describe_layer(l.host.name, d) + ": its second-order data '" + name + "' is " +
                                    std::to_string(x.rows()) + " x " + std::to_string(x.cols()) + " on rank " +
                                    std::to_string(p.comm_.rank()) + ", not " + std::to_string(rows) + " x " +
                                    std::to_string(cols) + " (an internal inconsistency; please report it)");
                });
            });
            std::size_t k = 0;
            method::for_each_tensor(source ? l.state.second : expected, [&](const char* name, const auto& x, int rank) {
                const auto& [rows, cols] = shapes[k++].second;
                if (rows * cols == 0) return;
                gather(p, x, rows, cols, place.g_worker, writer, a, l.host.name + "." + name, rank);
            });
        }
        if (!writer) return std::nullopt;
        describe(p, o, a);
        return a;
    }

    /// One tensor onto rank 0, from `source` (a broadcast when the source is another rank).
    template <class Storage>
    static void gather(P& p, const Storage& x, std::int64_t rows, std::int64_t cols, int source, bool writer,
                       checkpoint::archive& a, std::string name, int tensor_rank) {
        if (source == 0) {
            if (writer) a.tensors.push_back(checkpoint::to_tensor<scalar>(std::move(name), backend::to_host(x), tensor_rank));
            return;
        }
        host_matrix h(rows, cols);
        if (p.comm_.rank() == source) h = backend::to_host(x);
        p.comm_.broadcast(h.data(), static_cast<std::size_t>(h.size()), source, p.comm_.world());
        p.comm_.wait();
        if (writer) a.tensors.push_back(checkpoint::to_tensor<scalar>(std::move(name), h, tensor_rank));
    }

    static void describe(const P& p, const checkpoint::save_options& o, checkpoint::archive& a) {
        namespace key = checkpoint::key;
        auto& m = a.metadata;
        m[key::format] = checkpoint::format_name;
        m[key::version] = std::to_string(checkpoint::format_version);
        m[key::library] = checkpoint::library_version();
        m[key::step] = std::to_string(p.steps_);
        m[key::scalar] = sizeof(scalar) == sizeof(float) ? "float" : "double";
        m[key::method] = compute_method_name<typename P::compute_method>();
        m[key::second_order] = p.steps_ == 0 ? "none yet" : o.second_order ? "included" : "omitted";
        m[key::layers] = std::to_string(p.layers_.size());
        m[key::world_size] = std::to_string(p.comm_.size());
        m[key::strategy] = p.plan_.name;
        m[key::damping] = exact_number_text(p.second_order_damping_);
        for (const auto& l : p.layers_) m[key::layer_prefix + l.host.name] = layer_signature(l.host.name, l.host.description);
        for (const auto& item : p.configuration()) {
            if (item.key.rfind("options.", 0) != 0) continue;
            m[key::option_prefix + item.key.substr(8)] = item.value == "a schedule" ? "schedule" : item.value;
        }
        m[key::health_prefix + "skipped_factor_updates"] = std::to_string(p.health_.skipped_factor_updates);
        m[key::health_prefix + "kept_decompositions"] = std::to_string(p.health_.kept_decompositions);
        m[key::health_prefix + "zeroed_gradients"] = std::to_string(p.health_.zeroed_gradients);
        m[key::checksum_scope] = checkpoint::checksum_scope_all;
        checkpoint::seal(a);  // last: the checksum digests every other entry
    }

    /// What load() sets, built before anything changes.
    struct staged {
        std::int64_t step = 0;
        health_counters health{};
        double second_order_damping = 0.0;
        bool recompute = false;  ///< second-order data to be recomputed from the factors
        std::vector<std::optional<typename backend::matrix>> a_factor, g_factor;
        std::vector<std::optional<typename method::layer_data>> second;
    };

    /// Checks the whole file against this preconditioner and builds what this rank will hold.
    /// @throws kfac::error naming the source, the layer, what was expected and found, the fix.
    static staged stage(const P& p, std::string_view bytes, const std::string& source, const checkpoint::load_options& o) {
        namespace key = checkpoint::key;
        const checkpoint::archive a = checkpoint::parse(bytes, source);
        const checkpoint::header h = checkpoint::check_header(a, source);
        const std::string where = "checkpoint " + source + ": ";
        const std::string ours = compute_method_name<typename P::compute_method>();
        const bool file_has_second = h.second_order == "included";
        const bool use_file_second = file_has_second && !o.recompute_second_order;
        if (use_file_second && h.method != ours)
            throw error(where + "it holds " + h.method + " data, but this preconditioner uses the " + ours +
                        " method; load with load_options{.recompute_second_order = true} to recompute the data "
                        "from the saved factors");
        check_options(p, a, where, o, use_file_second);
        // Layers: the registered ones and the file's must be the same set, with the same shapes.
        std::map<std::string, std::string> file_layers;
        for (const auto& [k, v] : a.metadata)
            if (k.rfind(key::layer_prefix, 0) == 0) file_layers[k.substr(key::layer_prefix.size())] = v;
        if (const auto declared = checkpoint::metadata_count(a, key::layers, source);
            declared != static_cast<std::int64_t>(file_layers.size()))
            throw error(where + "metadata '" + key::layers + "' = '" + std::to_string(declared) + "' but it holds " +
                        std::to_string(file_layers.size()) + " layer entries; the file is corrupt (use an earlier "
                        "checkpoint)");
        for (const auto& l : p.layers_) {
            const auto it = file_layers.find(l.host.name);
            const std::string signature = layer_signature(l.host.name, l.host.description);
            if (it == file_layers.end())
                throw error(where + "layer " + signature + " is registered but not in the file (it holds " +
                            std::to_string(file_layers.size()) + " layers" + layer_list(file_layers) +
                            "); register the layers the run was saved with, under the same names");
            if (it->second != signature)
                throw error(where + "layer '" + l.host.name + "' was saved as " + it->second + " but is registered as " +
                            signature + "; register it with the shapes it was saved with");
        }
        for (const auto& [name, signature] : file_layers) {
            bool known = false;
            for (const auto& l : p.layers_) known = known || l.host.name == name;
            if (!known)
                throw error(where + "it holds layer " + signature + ", which is not registered; register every layer "
                            "the run was saved with (a checkpoint is never loaded in part)");
        }
        // Tensors: every expected one present with its shape, and no other.
        std::map<std::string, const checkpoint::tensor*> unclaimed;
        for (const auto& t : a.tensors) unclaimed[t.name] = &t;
        auto take = [&](const std::string& layer, const std::string& name, std::vector<std::int64_t> shape) {
            const auto it = unclaimed.find(name);
            if (it == unclaimed.end())
                throw error(where + "layer '" + layer + "': tensor '" + name + "' (shape " + shape_text(shape) +
                            ") is missing (the file is incomplete or corrupt)");
            const checkpoint::tensor& t = *it->second;
            if (t.type == checkpoint::dtype::i64)
                throw error(where + "layer '" + layer + "': tensor '" + name + "' has dtype I64; factors are F32 or F64");
            if (t.shape != shape)
                throw error(where + "layer '" + layer + "': tensor '" + name + "' has shape " +
                            shape_text(t.shape) + ", expected " + shape_text(shape));
            unclaimed.erase(it);
            return &t;
        };
        // Values no save() writes (a NaN, an asymmetric factor, a negative variance), in a
        // file whose checksum is valid; checked on every rank, whatever it will hold, so that
        // all ranks agree. `structure`: a running factor's, absent for second-order data.
        auto check_values = [&](const std::string& layer, const checkpoint::tensor& t, std::int64_t cols,
                                std::optional<factor_structure> structure) {
            const std::string fault =
                structure ? checkpoint::factor_fault(t, *structure, cols) : checkpoint::non_finite_fault(t, cols);
            if (!fault.empty())
                throw error(where + "layer '" + layer + "': tensor '" + t.name + "' " + fault +
                            "; save() never writes that, so the file is corrupt or was edited (use an earlier checkpoint)");
            const std::string range = checkpoint::range_fault<scalar>(t, cols);
            if (!range.empty()) throw error(where + "layer '" + layer + "': tensor '" + t.name + "' " + range);
        };
        staged s;
        s.step = h.step;
        s.recompute = h.step > 0 && !use_file_second;
        s.second_order_damping = h.damping;
        if (const auto gamma = static_cast<scalar>(h.damping); h.step > 0 && !std::isfinite(scalar(1) / gamma))
            throw error(where + "metadata '" + key::damping + "' = '" + a.metadata.at(key::damping) + "' is too small for " +
                        (sizeof(scalar) == sizeof(float) ? "float" : "double") + ": as for options.damping, 1/damping "
                        "must be finite in the precision of the preconditioner; " +
                        (sizeof(scalar) == sizeof(float) ? "load the file into a double preconditioner"
                                                         : "the file is corrupt (use an earlier checkpoint)"));
        s.health.skipped_factor_updates = checkpoint::metadata_count(a, key::health_prefix + "skipped_factor_updates", source);
        s.health.kept_decompositions = checkpoint::metadata_count(a, key::health_prefix + "kept_decompositions", source);
        s.health.zeroed_gradients = checkpoint::metadata_count(a, key::health_prefix + "zeroed_gradients", source);
        for (const auto& l : p.layers_) {
            const auto& d = l.host.description;
            const auto& name = l.host.name;
            // The block's storage: a diagonal A is saved as the vector of its diagonal, unit-wise
            // blocks as their C × k(k+1)/2 matrix, a normalisation layer's G as the 1 × 1 identity.
            const blocks::block_layout b = l.block->layout(d);
            const auto a_rows = b.a_rows, a_cols = b.a_cols, g_dim = b.g_dim;
            const auto* ta = take(name, name + ".A", checkpoint::stored_shape(a_rows, a_cols, b.a_tensor_rank));
            const auto* tg = take(name, name + ".G", {g_dim, g_dim});
            check_values(name, *ta, a_cols, b.a_structure);
            check_values(name, *tg, g_dim, b.g_structure);
            auto& fa = s.a_factor.emplace_back();
            auto& fg = s.g_factor.emplace_back();
            if (l.role.holds_factors) {
                fa = to_storage(*ta, a_rows, a_cols);
                fg = to_storage(*tg, g_dim, g_dim);
            }
            auto& second = s.second.emplace_back();
            if (!file_has_second) continue;
            typename method::layer_data data{};
            l.block->prepare_full(data, d, p.options_);
            const bool mine = use_file_second && l.role.grad_worker;
            method::for_each_tensor(data, [&](const char* suffix, auto& x, int rank) {
                const auto rows = static_cast<std::int64_t>(x.rows()), cols = static_cast<std::int64_t>(x.cols());
                if (rows * cols == 0) return;
                const std::string tensor_name = name + "." + suffix;
                if (!use_file_second) return;
                const auto* t = take(name, tensor_name, checkpoint::stored_shape(rows, cols, rank));
                check_values(name, *t, cols, std::nullopt);
                if (mine) x = to_storage(*t, rows, cols);
            });
            if (mine) second = std::move(data);
        }
        if (file_has_second && !use_file_second)  // the file's second-order data, not used
            std::erase_if(unclaimed, [&](const auto& entry) {
                for (const auto& l : p.layers_)
                    if (entry.first.rfind(l.host.name + ".", 0) == 0) return true;
                return false;
            });
        if (!unclaimed.empty())
            throw error(where + "tensor '" + unclaimed.begin()->first + "' belongs to no registered layer (" +
                        std::to_string(unclaimed.size()) + " such tensor(s)); the file was not written by this "
                        "preconditioner's save(), or with other layers");
        return s;
    }

    /// Options that shape the numbers must be the file's, unless the caller allows changes;
    /// compute_eigenvalue_outer_product must be whenever the file's data is loaded (it
    /// decides which tensors the data has).
    static void check_options(const P& p, const checkpoint::archive& a, const std::string& where,
                              const checkpoint::load_options& o, bool use_file_second) {
        for (const auto& item : p.configuration()) {
            if (item.key.rfind("options.", 0) != 0) continue;
            const std::string option = item.key.substr(8);
            const bool structural = option == "compute_eigenvalue_outer_product" && use_file_second;
            if (!checkpoint::shapes_the_numbers(option) || (o.allow_changed_options && !structural)) continue;
            const auto it = a.metadata.find(checkpoint::key::option_prefix + option);
            const std::string mine = item.value == "a schedule" ? "schedule" : item.value;
            const std::string older = checkpoint::value_before_option_existed(option);
            if (it == a.metadata.end() && !older.empty()) {
                if (same_option_value(older, mine)) continue;
                throw error(where + "options." + option + " did not exist when it was saved (as if " + older +
                            ") and is " + mine + " now; a resume is exact only with the same options. Set it to " +
                            older + ", or load with load_options{.allow_changed_options = true}");
            }
            if (it == a.metadata.end())
                throw error(where + "the metadata entry 'option." + option + "' is missing (the file is corrupt)");
            if (same_option_value(it->second, mine)) continue;
            if (structural)
                throw error(where + "its eigendecompositions were saved with compute_eigenvalue_outer_product = " +
                            it->second + ", this preconditioner has " + mine + "; set the option as saved, or load "
                            "with load_options{.recompute_second_order = true}");
            throw error(where + "options." + option + " was " + it->second + " when it was saved and is " + mine +
                        " now; a resume is exact only with the same options. Set it as saved, or load with "
                        "load_options{.allow_changed_options = true} to continue with the new value");
        }
    }

    /// Whether an option's saved text and its text now are the same value. Exact decimal text
    /// is one per double but for ±0: "-0" and "0" are the same option (−0.0 == 0.0 in every
    /// use), so they are compared as numbers where both are numbers.
    static bool same_option_value(const std::string& saved, const std::string& now) {
        if (saved == now) return true;
        auto number = [](const std::string& text, double& v) {
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            return ec == std::errc() && end == text.data() + text.size();
        };
        double x = 0.0, y = 0.0;
        return number(saved, x) && number(now, y) && x == y;
    }

    static std::string layer_list(const std::map<std::string, std::string>& layers) {
        std::string s;
        std::size_t shown = 0;
        for (const auto& [name, signature] : layers) {
            if (shown++ == 8) return s + ", ...";
            s += (shown == 1 ? ": '" : ", '") + name + "'";
        }
        return s;
    }

    static typename backend::matrix to_storage(const checkpoint::tensor& t, std::int64_t rows, std::int64_t cols) {
        host_matrix h(rows, cols);
        checkpoint::from_tensor<scalar>(t, h);
        return backend::from_host(std::move(h));
    }

    /// Sets the staged state: nothing here can fail but a device copy.
    static void commit(P& p, staged&& s) {
        for (std::size_t i = 0; i < p.layers_.size(); ++i) {
            auto& st = p.layers_[i].state;
            if (s.a_factor[i]) st.a_factor = std::move(*s.a_factor[i]);
            if (s.g_factor[i]) st.g_factor = std::move(*s.g_factor[i]);
            st.has_second = false;
            if (s.second[i]) {
                st.second = std::move(*s.second[i]);
                st.has_second = true;
            }
        }
        p.steps_ = s.step;
        p.passes_ = 0;
        p.applied_in_step_ = false;
        p.health_ = s.health;
        p.last_kl_scale_ = 1.0;
        p.second_order_damping_ = s.second_order_damping;
    }
};

}  // namespace kfac::detail
