// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file checkpoint_io.hpp
/// load()'s check of a checkpoint's state (kfac/checkpoint/state_dict.hpp) against the
/// preconditioner that loads it, and the state this rank will hold, built aside: the layers
/// must be the registered ones with the same shapes, the options that shape the numbers the
/// same (unless allowed), every tensor present with its shape and plausible values, whichever
/// layers this rank will hold, so that every rank reaches the same verdict. It reads the
/// engine through its public members; the engine sets what it returns
/// (kfac/detail/engine_checkpoint.hpp), only when every rank succeeded.

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/blocks/block.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/checkpoint/second_order_checks.hpp"
#include "kfac/checkpoint/state_dict.hpp"
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

/// What load() sets, built before anything changes: this rank's part of a state_dict.
template <class Backend, class Method>
struct staged_state {
    std::int64_t step = 0;
    health_counters health{};
    double second_order_damping = 0.0;
    bool recompute = false;  ///< second-order data to be recomputed from the factors
    std::vector<std::optional<typename Backend::matrix>> a_factor, g_factor;
    std::vector<std::optional<typename Method::layer_data>> second;
    std::vector<double> statistics_weights;  ///< per layer; NaN: not in the file
};

/// The options among the configuration's items (engine::configuration()) as a checkpoint
/// records them, in the configuration's order: the name without "options.", the value in exact
/// decimal or "schedule" for a scheduled one. save() writes them; load() compares with them.
inline std::vector<std::pair<std::string, std::string>> saved_option_values(const std::vector<config_item>& items) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& item : items) {
        if (item.key.rfind("options.", 0) != 0) continue;
        out.emplace_back(item.key.substr(8), item.value == "a schedule" ? "schedule" : item.value);
    }
    return out;
}

template <class Engine>
struct checkpoint_io {
    using P = Engine;
    using backend = typename P::backend_type;
    using scalar = typename P::scalar_type;
    using method = typename P::method;
    using host_matrix = typename backend::host_matrix;
    using staged = staged_state<backend, method>;

    /// Checks a checkpoint's whole state (from_archive() of the file `source`) against this
    /// preconditioner and builds what this rank will hold.
    /// @throws kfac::error naming the source, the layer, what was expected and found, the fix.
    static staged stage(const P& p, const checkpoint::state_dict& h, const std::string& source,
                        const checkpoint::load_options& o) {
        namespace key = checkpoint::key;
        const std::string where = "checkpoint " + source + ": ";
        const std::string ours = compute_method_name<typename P::compute_method>();
        const bool file_has_second = h.second_order == "included";
        const bool use_file_second = file_has_second && !o.recompute_second_order;
        if (use_file_second && h.method != ours)
            throw error(where + "it holds " + h.method + " data, but this preconditioner uses the " + ours +
                        " method; load with load_options{.recompute_second_order = true} to recompute the data "
                        "from the saved factors");
        check_options(p, h, where, o, use_file_second);
        // Layers: the registered ones and the file's must be the same set, with the same shapes.
        const auto& file_layers = h.layers;
        for (const auto& l : p.records()) {
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
            for (const auto& l : p.records()) known = known || l.host.name == name;
            if (!known)
                throw error(where + "it holds layer " + signature + ", which is not registered; register every layer "
                            "the run was saved with (a checkpoint is never loaded in part)");
        }
        // Tensors: every expected one present with its shape, and no other.
        std::map<std::string, const checkpoint::tensor*> unclaimed;
        for (const auto& t : h.tensors) unclaimed[t.name] = &t;
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
            throw error(where + "metadata '" + key::damping + "' = '" + exact_number_text(h.damping) + "' is too small for " +
                        (sizeof(scalar) == sizeof(float) ? "float" : "double") + ": as for options.damping, 1/damping "
                        "must be finite in the precision of the preconditioner; " +
                        (sizeof(scalar) == sizeof(float) ? "load the file into a double preconditioner"
                                                         : "the file is corrupt (use an earlier checkpoint)"));
        s.health = h.health;
        for (const auto& l : p.records()) {
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
            const auto w = h.statistics_weights.find(name);
            s.statistics_weights.push_back(w == h.statistics_weights.end()
                                               ? std::numeric_limits<double>::quiet_NaN()
                                               : w->second);
            auto& fa = s.a_factor.emplace_back();
            auto& fg = s.g_factor.emplace_back();
            if (l.role.holds_factors) {
                fa = to_storage(*ta, a_rows, a_cols);
                fg = to_storage(*tg, g_dim, g_dim);
            }
            auto& second = s.second.emplace_back();
            if (!file_has_second) continue;
            typename method::layer_data data{};
            l.block->prepare_full(data, d, p.get_options());
            const bool mine = use_file_second && l.role.grad_worker;
            std::map<std::string, const checkpoint::tensor*, std::less<>> layer_tensors;  // by the method's names
            method::for_each_tensor(data, [&](const char* suffix, auto& x, int rank) {
                const auto rows = static_cast<std::int64_t>(x.rows()), cols = static_cast<std::int64_t>(x.cols());
                if (rows * cols == 0) return;
                const std::string tensor_name = name + "." + suffix;
                if (!use_file_second) return;
                const auto* t = take(name, tensor_name, checkpoint::stored_shape(rows, cols, rank));
                check_values(name, *t, cols, std::nullopt);
                layer_tensors[suffix] = t;
                if (mine) x = to_storage(*t, rows, cols);
            });
            if (use_file_second) check_second_order(h, b, name, layer_tensors, where);
            if (mine) second = std::move(data);
        }
        if (file_has_second && !use_file_second)  // the file's second-order data, not used
            std::erase_if(unclaimed, [&](const auto& entry) {
                for (const auto& l : p.records())
                    if (entry.first.rfind(l.host.name + ".", 0) == 0) return true;
                return false;
            });
        if (!unclaimed.empty())
            throw error(where + "tensor '" + unclaimed.begin()->first + "' belongs to no registered layer (" +
                        std::to_string(unclaimed.size()) + " such tensor(s)); the file was not written by this "
                        "preconditioner's save(), or with other layers");
        return s;
    }

    /// An option as the file recorded it: its text, or for a file written before the option
    /// existed the value that reproduces that library's behaviour.
    static std::string file_option(const checkpoint::state_dict& h, const std::string& option) {
        const auto it = h.options.find(option);
        return it != h.options.end() ? it->second : checkpoint::value_before_option_existed(option);
    }

    /// A layer's second-order data checked as its method says every save() writes it
    /// (compute_impl::loaded_fault, kfac/checkpoint/second_order_checks.hpp), on every rank.
    static void check_second_order(const checkpoint::state_dict& h, const blocks::block_layout& b,
                                   const std::string& layer,
                                   const std::map<std::string, const checkpoint::tensor*, std::less<>>& tensors,
                                   const std::string& where) {
        if constexpr (requires(const checkpoint::loaded_second_order& in) { method::loaded_fault(in); }) {
            checkpoint::loaded_second_order in;
            in.tensor_named = [&](const char* suffix) -> const checkpoint::tensor* {
                const auto it = tensors.find(std::string_view(suffix));
                return it == tensors.end() ? nullptr : it->second;
            };
            in.a_structure = b.a_structure;
            in.g_structure = b.g_structure;
            in.damping = h.damping;
            in.relative_damping = file_option(h, "relative_damping") == "true";
            in.factored_damping = file_option(h, "damping_mode") == "factored";
            // The coarser of the saving preconditioner's type and this one's (the tensors' dtypes
            // are added by the checks).
            in.unit_roundoff = std::max(unit_roundoff(h.scalar == "float" ? precision::fp32 : precision::fp64),
                                        unit_roundoff(precision_of<scalar>));
            if (const checkpoint::second_order_fault f = method::loaded_fault(in))
                throw error(where + "layer '" + layer + "': tensor '" + layer + "." + f.tensor + "' " + f.what +
                            "; save() never writes that, so the file is corrupt or was edited (use an earlier "
                            "checkpoint, or load with load_options{.recompute_second_order = true} to recompute the "
                            "data from the saved factors)");
        }
    }

    /// Options that shape the numbers must be the file's, unless the caller allows changes;
    /// compute_eigenvalue_outer_product must be whenever the file's data is loaded (it
    /// decides which tensors the data has).
    static void check_options(const P& p, const checkpoint::state_dict& h, const std::string& where,
                              const checkpoint::load_options& o, bool use_file_second) {
        for (const auto& [option, mine] : saved_option_values(p.configuration())) {
            const bool structural = option == "compute_eigenvalue_outer_product" && use_file_second;
            if (!checkpoint::shapes_the_numbers(option) || (o.allow_changed_options && !structural)) continue;
            const auto it = h.options.find(option);
            const std::string older = checkpoint::value_before_option_existed(option);
            if (it == h.options.end() && !older.empty()) {
                if (same_option_value(older, mine)) continue;
                throw error(where + "options." + option + " did not exist when it was saved (as if " + older +
                            ") and is " + mine + " now; a resume is exact only with the same options. Set it to " +
                            older + ", or load with load_options{.allow_changed_options = true}");
            }
            if (it == h.options.end())
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
        // An option this configuration leaves out at its default (the mixed-precision ones)
        // that the file recorded set.
        if (o.allow_changed_options) return;
        const auto mine = saved_option_values(p.configuration());
        for (const auto& [option, saved] : h.options) {
            const std::string implicit = checkpoint::value_before_option_existed(option);
            if (!checkpoint::shapes_the_numbers(option) || implicit.empty() || same_option_value(saved, implicit)) continue;
            if (std::any_of(mine.begin(), mine.end(), [&, &name = option](const auto& m) { return m.first == name; })) continue;
            throw error(where + "options." + option + " was " + saved + " when it was saved and is " + implicit +
                        " now; a resume is exact only with the same options. Set it as saved, or load with "
                        "load_options{.allow_changed_options = true} to continue with the new value");
        }
    }

    /// Whether an option's saved text and its text now are the same value. Exact decimal text
    /// is one per double but for ±0: "-0" and "0" are the same option (−0.0 == 0.0 in every
    /// use), so they are compared as numbers where both are numbers.
    static bool same_option_value(const std::string& saved, const std::string& now) {
        if (saved == now) return true;
        const auto x = checkpoint::saved_option_detail::number(saved), y = checkpoint::saved_option_detail::number(now);
        return x && y && *x == *y;
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

};

}  // namespace kfac::detail
