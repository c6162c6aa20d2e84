// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/tracker.hpp
/// tracked_layer (a module as the preconditioner sees it, with its layer_traits) and tracker (the
/// observer's owner and the tracked layers').
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
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"
#include "kfac/layers/torch/observer.hpp"
#include "kfac/layers/torch/views.hpp"
#include "kfac/layers/torch/modules.hpp"

namespace kfac::torch {

template <class Scalar>
class tracker;
template <class Scalar>
class tracked_layer;

namespace detail {
/// The registration's way to a tracker's internals (prepare, adopt, drop_last), which are not
/// part of its interface.
struct tracker_access {
    template <class Scalar>
    static std::shared_ptr<layer_state> prepare(const tracker<Scalar>& t, const std::string& name,
                                                const std::shared_ptr<::torch::nn::Module>& module,
                                                const std::vector<std::shared_ptr<layer_state>>& pending) {
        return t.prepare(name, module, pending);
    }
    template <class Scalar>
    static std::vector<tracked_layer<Scalar>*> adopt(tracker<Scalar>& t, std::vector<std::shared_ptr<layer_state>> states) {
        return t.adopt(std::move(states));
    }
    template <class Scalar>
    static void drop_last(tracker<Scalar>& t, std::size_t count) noexcept {
        t.drop_last(count);
    }
};
}  // namespace detail

/// A tracked `torch::nn::Linear`, `Conv2d`, `Conv1d`, `Embedding`, `LayerNorm`,
/// `BatchNorm1d/2d/3d`, `GroupNorm` or `InstanceNorm1d/2d/3d`:
/// what the preconditioner registers
/// (through kfac::layer_traits). Owned by its tracker; only its tracker creates it.
///
/// @tparam Scalar float or double: the module's dtype and the backend's scalar type.
template <class Scalar>
class tracked_layer {
public:
    /// The layer of `state` (the tracker's; not for the host to call).
    explicit tracked_layer(std::shared_ptr<detail::layer_state> state) : state_(std::move(state)) {}

    [[nodiscard]] const std::string& name() const noexcept { return state_->name; }  ///< as it was tracked
    /// Its kind and shapes, from the module's options.
    [[nodiscard]] const layer_description& description() const noexcept { return state_->description; }
    /// The module (a torch::nn::LinearImpl, Conv2dImpl, Conv1dImpl, EmbeddingImpl, LayerNormImpl, BatchNorm2dImpl, ...).
    [[nodiscard]] const std::shared_ptr<::torch::nn::Module>& module() const noexcept { return state_->module; }
    /// Applications (forward calls whose gradient arrived) captured so far, in all passes.
    [[nodiscard]] std::int64_t passes() const {
        std::lock_guard<std::mutex> lock(state_->mutex);
        return state_->completed;
    }
    /// Applications in the current pass (since the preconditioner last ended a pass).
    [[nodiscard]] std::int64_t applications() const { return state_->application_count(); }
    /// The input of the latest captured application (undefined before the first).
    [[nodiscard]] at::Tensor input() const {
        const auto p = state_->latest_pass();
        return p ? p->input : at::Tensor();
    }
    /// The gradient w.r.t. the output of the latest captured application (undefined before the first).
    [[nodiscard]] at::Tensor grad_output() const {
        const auto p = state_->latest_pass();
        return p ? p->grad_output : at::Tensor();
    }

    /// The input of application `i` of the current pass (an Embedding's indices as Scalar, a
    /// normalisation layer's x̂).
    /// @throws kfac::error when the application cannot be used (a functional call with other
    ///         options) or its tensors are not CPU/CUDA tensors of Scalar.
    [[nodiscard]] number_view<const void> activations_view(std::int64_t i) const {
        const auto p = usable(i);
        detail::check_tensor<Scalar>(*state_, "the captured input", p->input);
        const at::Tensor& x = p->activations();
        return detail::view_of<const void>(*state_, "the captured input", x);
    }
    /// The output gradient of application `i` of the current pass.
    /// @throws kfac::error as activations_view().
    [[nodiscard]] number_view<const void> output_gradients_view(std::int64_t i) const {
        const auto p = usable(i);
        detail::check_tensor<Scalar>(*state_, "the captured output gradient", p->grad_output);
        return detail::view_of<const void>(*state_, "the captured output gradient", p->grad_output);
    }
    /// Whether backward gave the layer a gradient (false: not called in this step, with the
    /// gradients set to none, or never called).
    [[nodiscard]] bool has_gradient() const {
        return state_->weight->grad().defined() || (state_->bias->defined() && state_->bias->grad().defined());
    }
    /// The weight's own .grad() buffer. @throws kfac::error if undefined, not contiguous, not
    /// on the CPU or a CUDA device, or not of Scalar.
    [[nodiscard]] number_view<void> weight_gradient_view() const {
        return flat_for_norm(detail::gradient_view<Scalar>(*state_, *state_->weight, "weight"));
    }
    /// The bias's own .grad() buffer, or an empty view without bias.
    [[nodiscard]] number_view<void> bias_gradient_view() const {
        if (!state_->description.bias) return {};
        return flat_for_norm(detail::gradient_view<Scalar>(*state_, *state_->bias, "bias"));
    }
    /// Forgets the current pass's applications (the preconditioner calls it when done).
    void end_pass() { state_->forget_applications(); }

private:
    /// A normalisation layer's parameter gradient as one dimension (a LayerNorm's
    /// normalized_shape flattened, as its description counts the features).
    number_view<void> flat_for_norm(number_view<void> v) const {
        if (!is_normalization(state_->description.kind) || v.empty()) return v;
        v.extents[0] = v.size();
        v.rank = 1;
        return v;
    }

    std::shared_ptr<const detail::pass> usable(std::int64_t i) const {
        auto p = state_->application(i);
        if (!p->problem.empty()) throw error(p->problem);
        return p;
    }

    std::shared_ptr<detail::layer_state> state_;
};

/// Observes the forward passes of the current thread and captures, for every module tracked,
/// the input and output gradient of each application in the current pass (see the file
/// comment). Create it on the thread that runs forward; it must outlive the preconditioner's
/// use of its layers (the preconditioner keeps pointers to them). Neither copyable nor movable.
///
/// @tparam Scalar float (torch::kFloat models, a float backend) or double.
template <class Scalar = float>
class tracker {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::torch::tracker<Scalar>: Scalar must be float or double");

public:
    /// Starts observing this thread's operator calls (a thread-local RecordFunction callback,
    /// shared by the thread's trackers).
    tracker() : core_(std::make_shared<detail::tracker_core>()) {
        detail::thread_observer& obs = detail::observer;
        if (obs.handle == at::INVALID_CALLBACK_HANDLE)
            obs.handle = at::addThreadLocalCallback(
                at::RecordFunctionCallback(&detail::on_operator_start, &detail::on_operator_end)
                    .needsInputs(true)
                    .needsOutputs(true)
                    .scopes({at::RecordScope::FUNCTION}));
        obs.trackers.push_back(core_);
    }

    /// Stops observing; the last tracker of the thread removes the callback.
    ~tracker() {
        detail::thread_observer& obs = detail::observer;
        std::erase_if(obs.trackers, [this](const std::weak_ptr<detail::tracker_core>& w) {
            const auto p = w.lock();
            return !p || p == core_;
        });
        if (obs.trackers.empty() && obs.handle != at::INVALID_CALLBACK_HANDLE) {
            try {
                at::removeCallback(obs.handle);
            } catch (...) {  // not installed on this thread: it stays, inert
            }
            obs.handle = at::INVALID_CALLBACK_HANDLE;
        }
    }

    tracker(const tracker&) = delete;
    tracker& operator=(const tracker&) = delete;

    /// Tracks a module (a holder: torch::nn::Linear, Conv2d, Conv1d, Embedding, LayerNorm,
    /// BatchNorm1d/2d/3d, GroupNorm, InstanceNorm1d/2d/3d; detail::module_types lists them)
    /// under `name`.
    /// @throws kfac::error for a duplicate name or module, a frozen weight, a module not of
    ///         Scalar on the CPU or a CUDA device, padding 'same' that pads unevenly, a sparse or
    ///         scale_grad_by_freq Embedding, a normalisation module without affine parameters;
    ///         nothing is tracked then.
    template <detail::known_module_holder Holder>
    tracked_layer<Scalar>& track(const std::string& name, const Holder& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a module of one of those types held as a torch::nn::Module.
    /// @throws kfac::error for a module of any other type, and as above.
    tracked_layer<Scalar>& track(const std::string& name, const std::shared_ptr<::torch::nn::Module>& module) {
        auto s = prepare(name, module, {});
        return *adopt({std::move(s)}).front();
    }

    /// The layer tracked under `name`. @throws kfac::error if there is none.
    [[nodiscard]] tracked_layer<Scalar>& layer(const std::string& name) {
        for (auto& l : layers_)
            if (l->name() == name) return *l;
        throw error("torch adapter: no layer named '" + name + "' is tracked");
    }
    [[nodiscard]] std::size_t size() const noexcept { return layers_.size(); }  ///< the number of tracked layers

private:
    // The steps of an all-or-nothing registration (kfac/layers/torch/registration.hpp), through
    // detail::tracker_access: prepare every state, then adopt them all, or drop them again.
    friend struct detail::tracker_access;

    /// A checked state for `module` under `name`, also checked against `pending` (states
    /// about to be adopted with it); changes nothing.
    /// @throws kfac::error as track().
    [[nodiscard]] std::shared_ptr<detail::layer_state> prepare(
        const std::string& name, const std::shared_ptr<::torch::nn::Module>& module,
        const std::vector<std::shared_ptr<detail::layer_state>>& pending) const {
        auto s = std::make_shared<detail::layer_state>();
        s->name = name;
        s->module = module;
        s->scalar = detail::scalar_type_of<Scalar>();
        const auto parts = detail::parts_of(module.get());
        if (!parts)
            throw error("torch adapter: module '" + name + "' (" + (module ? module->name() : std::string("null")) +
                        ") is none of " + detail::module_type_list());
        s->type = parts->type;
        s->weight = parts->weight;
        s->bias = parts->bias != nullptr ? parts->bias : &s->no_bias;
        s->description = parts->describe(name);
        if (!parts->left_out.empty())
            throw error("torch adapter: " + s->who() + ": " + parts->left_out + "; leave the layer out "
                        "(kfac::torch::register_modules does) or construct it without that option");
        if (!s->weight->defined())  // a normalisation module without affine parameters
            throw error("torch adapter: " + s->who() + " has no affine parameters (elementwise_affine or affine "
                        "is false), so there is nothing to precondition; leave it out (kfac::torch::register_modules "
                        "does)");
        const std::vector<std::shared_ptr<detail::layer_state>>& tracked = core_->layers;
        for (const auto* list : {&tracked, &pending})
            for (const auto& l : *list) {
                if (l->name == name)
                    throw error("torch adapter: a layer named '" + name + "' is already tracked");
                if (l->module == module)
                    throw error("torch adapter: " + s->who() + " is already tracked as '" + l->name + "'");
            }
        detail::check_tensor<Scalar>(*s, "weight", *s->weight);
        if (s->bias->defined()) detail::check_tensor<Scalar>(*s, "bias", *s->bias);
        if (!s->weight->requires_grad())
            throw error("torch adapter: " + s->who() + ": the weight has requires_grad = false (a frozen "
                        "layer), so there is no gradient to precondition; leave it out "
                        "(kfac::torch::register_modules does) or set requires_grad(true) before tracking");
        return s;
    }

    /// Tracks prepared states, all of them (allocation aside, nothing here can fail).
    std::vector<tracked_layer<Scalar>*> adopt(std::vector<std::shared_ptr<detail::layer_state>> states) {
        std::vector<std::unique_ptr<tracked_layer<Scalar>>> made;
        made.reserve(states.size());
        for (const auto& s : states) made.push_back(std::make_unique<tracked_layer<Scalar>>(s));
        core_->layers.reserve(core_->layers.size() + states.size());
        layers_.reserve(layers_.size() + made.size());
        std::vector<tracked_layer<Scalar>*> out;
        out.reserve(made.size());
        for (std::size_t i = 0; i < made.size(); ++i) {
            core_->layers.push_back(states[i]);
            out.push_back(made[i].get());
            layers_.push_back(std::move(made[i]));
        }
        return out;
    }

    /// Stops tracking the last `count` layers adopted (undoes a failed registration).
    void drop_last(std::size_t count) noexcept {
        for (; count > 0 && !layers_.empty(); --count) {
            core_->layers.pop_back();
            layers_.pop_back();
        }
    }

    std::shared_ptr<detail::tracker_core> core_;
    std::vector<std::unique_ptr<tracked_layer<Scalar>>> layers_;  // stable addresses
};
}  // namespace kfac::torch

namespace kfac {


/// The adapter of a tracked LibTorch module, in the per-application form: the views read the
/// tensors the tracker captured in the current pass and the parameters' own .grad() buffers.
template <class Scalar>
struct layer_traits<torch::tracked_layer<Scalar>> {
    ///@{
    /// The layer_traits members (kfac/layers/layer_traits.hpp), each forwarded to the tracked
    /// layer's member of that role.
    using scalar_type = Scalar;
    using layer = torch::tracked_layer<Scalar>;
    static layer_description describe(const layer& l) { return l.description(); }
    static std::int64_t applications(const layer& l) { return l.applications(); }
    static number_view<const void> activations(const layer& l, std::int64_t i) { return l.activations_view(i); }
    static number_view<const void> output_gradients(const layer& l, std::int64_t i) {
        return l.output_gradients_view(i);
    }
    static bool has_gradient(const layer& l) { return l.has_gradient(); }
    static number_view<void> weight_gradient(layer& l) { return l.weight_gradient_view(); }
    static number_view<void> bias_gradient(layer& l) { return l.bias_gradient_view(); }
    static void end_pass(layer& l) { l.end_pass(); }
    ///@}
};

}  // namespace kfac
