// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/registration.hpp
/// register_modules and track_modules: a model's modules found by name, prepared, tracked and
/// registered, with the report of what was left out and why.
/// A room of the LibTorch adapter (kfac/layers/torch.hpp, which says how the adapter works).

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "kfac/config.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/detail/layer_patterns.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"
#include "kfac/layers/torch/tracker.hpp"

namespace kfac::torch {

/// What register_modules did with each module of the model.
struct registration {
    /// A module left to the host's optimizer (or frozen), and why.
    struct left_out {
        std::string name;    ///< as named_modules() names it
        std::string module;  ///< its type, "torch::nn::GroupNorm"
        std::string reason;  ///< why it is left out: "no K-FAC block for this module type", ...
    };
    std::vector<std::string> registered;  ///< in registration order
    std::vector<left_out> not_preconditioned;  ///< the modules with parameters it left out

    /// The number of modules registered.
    [[nodiscard]] std::size_t size() const noexcept { return registered.size(); }
    /// "K-FAC preconditions 10 layers; not preconditioned (...): torch::nn::GroupNorm (no K-FAC
    /// block for this module type): gn1, layer1.gn1; ...": the modules grouped by type and reason.
    [[nodiscard]] std::string summary() const {
        std::string s = "K-FAC preconditions " + std::to_string(registered.size()) +
                        (registered.size() == 1 ? " layer" : " layers");
        if (not_preconditioned.empty()) return s + "; every module with parameters is preconditioned";
        s += "; not preconditioned (their parameters are the host optimizer's alone):";
        std::vector<bool> done(not_preconditioned.size(), false);
        for (std::size_t i = 0; i < not_preconditioned.size(); ++i) {
            if (done[i]) continue;
            const auto& first = not_preconditioned[i];
            s += (i ? "; " : " ") + first.module + " (" + first.reason + "): " + first.name;
            for (std::size_t j = i + 1; j < not_preconditioned.size(); ++j) {
                const auto& other = not_preconditioned[j];
                if (done[j] || other.module != first.module || other.reason != first.reason) continue;
                s += ", " + other.name;
                done[j] = true;
            }
        }
        return s;
    }
};

namespace detail {

/// "torch::nn::BatchNorm2d" for a torch::nn::BatchNorm2dImpl.
inline std::string module_type(const ::torch::nn::Module& m) {
    std::string n = m.name();
    if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.erase(n.size() - 4);
    return n;
}

inline bool has_own_parameters(const ::torch::nn::Module& m) {
    return !m.named_parameters(/*recurse=*/false).is_empty();
}

}  // namespace detail

namespace detail {

/// The modules of `model` that K-FAC can precondition, prepared for `tracker` (nothing is
/// tracked yet), and the report of the others.
template <class Scalar, class Model>
std::pair<registration, std::vector<std::shared_ptr<layer_state>>> prepare_modules(
    const tracker<Scalar>& tracker, const Model& model, const options& opts, const std::string& prefix) {
    registration report;
    std::vector<std::shared_ptr<layer_state>> states;
    // The preconditioner's rule, compiled once (a malformed pattern is a kfac::error here too).
    const kfac::detail::layer_patterns skip = kfac::detail::skip_filter(opts);
    for (const auto& item : model->named_modules(prefix, /*include_self=*/true)) {
        const std::shared_ptr<::torch::nn::Module>& m = item.value();
        const std::string name = item.key().empty() ? m->name() : item.key();
        const auto parts = parts_of(m.get());
        if (!parts) {
            if (has_own_parameters(*m))
                report.not_preconditioned.push_back({name, module_type(*m), "no K-FAC block for this module type"});
            continue;
        }
        auto left_out = [&](std::string reason) {
            report.not_preconditioned.push_back({name, module_type(*m), std::move(reason)});
        };
        if (skip.match_layer(name, parts->kind)) {
            left_out("matched by options.skip_layers");
            continue;
        }
        const at::Tensor& weight = *parts->weight;
        if (!weight.defined() && is_normalization(parts->kind)) continue;  // no affine parameters: nothing to precondition
        if (weight.defined() && !weight.requires_grad()) {
            left_out("frozen: the weight has requires_grad = false");
            continue;
        }
        if (!parts->left_out.empty()) {
            left_out(parts->left_out);
            continue;
        }
        auto s = tracker_access::prepare(tracker, name, m, states);
        kfac::detail::check_description(name, s->description);
        states.push_back(std::move(s));
    }
    for (const auto& s : states) report.registered.push_back(s->name);
    return {std::move(report), std::move(states)};
}

}  // namespace detail

/// What track_modules() tracked: the report and the tracked layers, in the report's order.
template <class Scalar>
struct tracked_modules {
    registration report;                         ///< what was tracked, and what was left out
    std::vector<tracked_layer<Scalar>*> layers;  ///< owned by the tracker
};

/// Tracks every module of `model` that register_modules() would register (as
/// register_modules() chooses them, with `opts.skip_layers`), without registering them: for a
/// preconditioner that this translation unit cannot instantiate, through kfac::any_layer (see
/// any_layer.hpp). All or nothing.
/// @throws kfac::error as tracker::track does, or if a skip pattern is not a regular
/// expression; nothing is tracked then.
template <class Scalar, class Model>
tracked_modules<Scalar> track_modules(tracker<Scalar>& tracker, const Model& model, const options& opts = {},
                                      const std::string& prefix = "") {
    auto [report, states] = detail::prepare_modules(tracker, model, opts, prefix);
    return {std::move(report), detail::tracker_access::adopt(tracker, std::move(states))};
}

/// Tracks and registers every torch::nn::Linear, Conv2d, Conv1d, Embedding, LayerNorm,
/// BatchNorm1d/2d/3d, GroupNorm and InstanceNorm1d/2d/3d of `model` (a
/// std::shared_ptr to a module or a module holder) that K-FAC can precondition, named as
/// `model->named_modules()` names them ("conv1", "layer1.0.conv1", ...; a `prefix` "p" makes them
/// "p.conv1", ...). All or nothing: every module is checked before any is tracked or registered,
/// so after an error the tracker and the preconditioner are as they were. Left out, and
/// listed in the report with the reason: layers options.skip_layers matches, frozen layers
/// (weight with requires_grad false), sparse or scale_grad_by_freq Embeddings, and every other
/// module with parameters of its own (GroupNorm, MultiheadAttention, ...), whose parameters
/// stay the host optimizer's alone. Normalisation modules without affine parameters have
/// nothing to precondition and are not listed.
/// @throws kfac::error as tracker::track and preconditioner::register_layer do.
template <class Preconditioner, class Scalar, class Model>
registration register_modules(Preconditioner& preconditioner, tracker<Scalar>& tracker, const Model& model,
                              const std::string& prefix = "") {
    auto [report, states] = detail::prepare_modules(tracker, model, preconditioner.get_options(), prefix);
    for (const auto& s : states)
        if (preconditioner.is_registered(s->name))
            throw error("torch adapter: layer '" + s->name + "' is already registered with the preconditioner; "
                        "register a model once (or give register_modules a prefix)");
    // Everything checked: the preconditioner takes all layers or none, and the tracker follows.
    const auto tracked = detail::tracker_access::adopt(tracker, std::move(states));
    std::vector<std::pair<std::string, tracked_layer<Scalar>*>> list;
    for (auto* l : tracked) list.emplace_back(l->name(), l);
    try {
        preconditioner.register_layers(list);
    } catch (...) {
        detail::tracker_access::drop_last(tracker, tracked.size());
        throw;
    }
    return report;
}
}  // namespace kfac::torch
