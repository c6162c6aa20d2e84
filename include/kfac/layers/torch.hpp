// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch.hpp
/// LibTorch adapter: K-FAC for the `torch::nn::Linear` and `torch::nn::Conv2d` members of an
/// existing model, with no change to the model or its hand-written `forward`. Optional: only
/// this header needs LibTorch (CMake: `find_package(Torch)`, link `${TORCH_LIBRARIES}`); it is
/// not included by `kfac/kfac.hpp`.
///
/// ```cpp
/// kfac::torch::tracker<float> tracker;              // observes forward passes on this thread
/// kfac::KFAC<> precond(opts);
/// kfac::torch::register_modules(precond, tracker, model);  // every Linear/Conv2d, by name
/// for (...) {
///     optimizer.zero_grad();
///     auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);  // as written
///     loss.backward();
///     precond.step();    // .grad() of every tracked weight and bias is now preconditioned
///     optimizer.step();
/// }
/// ```
///
/// ## How the inputs and output gradients are captured
///
/// LibTorch's C++ `torch::nn::Module` has no forward hooks, and `LinearImpl::forward` and
/// `Conv2dImpl::forward` are not virtual, so neither a hook nor a subclass sees a module called
/// from a user's `forward`. What every call does reach is the operator dispatcher, which runs
/// the RecordFunction observers (`at::addThreadLocalCallback`, the profiler's API) with each
/// operator's arguments and results. A `tracker` installs one such observer on its thread and
/// recognises a tracked module's computation by the identity of its weight tensor:
///
/// * Conv2d: `aten::conv2d(input, weight, ...)`, the call `Conv2dImpl::forward` makes;
/// * Linear: `torch::nn::functional::linear` computes `addmm(bias, input, weight.t())` for a 2-D
///   input with bias and `input.matmul(weight.t())` otherwise, so an `aten::t` of the weight
///   marks the transposed weight and the `aten::addmm`, `aten::matmul` or `aten::mm` that
///   consumes it is the layer's product; an `aten::linear(input, weight, ...)` (what
///   `torch::linear` dispatches) is recognised too.
///
/// The observer keeps that operator's input and registers a hook (`Tensor::register_hook`) on
/// its output; when the backward pass reaches the hook, the pair (input, dloss/doutput) becomes
/// the layer's latest pass, which `activations()` and `output_gradients()` hand to K-FAC.
/// Operators nested inside a recognised one are ignored, so one call is captured once.
/// (The alternatives need more of the user or of LibTorch's internals: a drop-in module type
/// means editing every member declaration, and reading the inputs back from the autograd
/// graph's saved variables means depending on LibTorch's generated backward-node classes.)
/// Forward passes without gradient (under `torch::NoGradGuard`, or with `requires_grad`
/// off) are not captured and leave the previous pass in place, so evaluation between steps is
/// harmless. The weight and bias gradients are views of the parameters' own `.grad()`
/// buffers, which `step()` overwrites in place.
///
/// Rules that follow from the mechanism:
/// * forward must run on the thread that created the tracker (the observer is thread-local;
///   autograd's CPU backward runs on the same thread);
/// * the tracker must outlive the preconditioner's use of its layers, and be destroyed on the
///   thread that created it (elsewhere its observer stays installed, inert, until that thread
///   ends);
/// * while a tracker is alive every operator on its thread pays the observer's cost (the
///   arguments are boxed and the results kept, about a microsecond per operator: a training
///   step of a three-layer CNN at batch 32 went from 0.44 to 0.56 ms on one core);
/// * a module applied several times in one forward pass contributes the pair of one
///   application (the last whose gradient arrives), not a sum over applications;
/// * the model stays on the CPU in the tracker's dtype (tracker<float> for kFloat, tracker<double>
///   for kDouble): anything else is a kfac::error naming the layer;
/// * the captured tensors are references, not copies: do not modify a batch in place between
///   its forward pass and step().
///
/// Conv2d geometry is read from the module's options. Zero padding is described as padding;
/// with a `reflect`, `replicate` or `circular` padding mode LibTorch pads the input itself
/// before an unpadded convolution, so the factors are built from that padded input (padding 0
/// in the description), the patches the convolution really multiplies. `groups` ≠ 1 is
/// rejected by the preconditioner (skip such layers with options.skip_layers).

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "kfac/config.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac::torch {

template <class Scalar>
class tracked_layer;

namespace detail {

/// One application of a module: its input and the gradient of the loss w.r.t. its output,
/// both contiguous.
struct pass {
    at::Tensor input;
    at::Tensor grad_output;
};

/// What the tracker knows of one module.
struct layer_state {
    std::string name;
    const char* type = "";  // "Linear" or "Conv2d", for messages
    layer_description description{};
    std::shared_ptr<::torch::nn::Module> module;  // keeps *weight and *bias alive
    at::Tensor* weight = nullptr;                 // the module's members
    at::Tensor* bias = nullptr;
    at::Tensor transposed;  // weight.t() seen in forward, awaiting its addmm/matmul/mm

    mutable std::mutex mutex;            // guards latest (written by backward hooks)
    std::shared_ptr<const pass> latest;  // last application whose gradient arrived
    std::int64_t completed = 0;          // number of such passes

    [[nodiscard]] std::string who() const { return "layer '" + name + "' (torch::nn::" + type + ")"; }
    [[nodiscard]] std::shared_ptr<const pass> latest_pass() const {
        std::lock_guard<std::mutex> lock(mutex);
        return latest;
    }
};

/// The layers of one tracker, shared with the thread's observer.
struct tracker_core {
    std::vector<std::shared_ptr<layer_state>> layers;
};

/// The observer's state on one thread: the trackers created there, the callback handle
/// (installed while at least one tracker lives) and the nesting of recognised operators.
struct thread_observer {
    std::vector<std::weak_ptr<tracker_core>> trackers;
    at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
    int depth = 0;
};

inline thread_local thread_observer observer;

#ifdef NDEBUG
inline c10::ArrayRef<const c10::IValue> recorded_inputs(const at::RecordFunction& fn) {
    return fn.inputs();
}
#else
// Built without NDEBUG, RecordFunction::inputs() asserts a flag (inputs_valid_) that only a
// LibTorch itself built without NDEBUG ever sets, so against the release LibTorch that Debian
// and PyPI ship it fails in every start callback of a debug build. The member it returns is
// read directly instead: an explicit instantiation may name a private member, and the friend
// defined by the instantiated class returns exactly what inputs() would. (Every translation
// unit repeats the instantiation; its only member is that inline friend, which the linker
// merges like any inline function.)
template <c10::ArrayRef<const c10::IValue> at::RecordFunction::*Member>
struct record_function_inputs {
    friend c10::ArrayRef<const c10::IValue> recorded_inputs(const at::RecordFunction& fn) {
        return fn.*Member;
    }
};
c10::ArrayRef<const c10::IValue> recorded_inputs(const at::RecordFunction& fn);
template struct record_function_inputs<&at::RecordFunction::inputs_>;
#endif

enum class op_kind { none, transpose, addmm, matmul, mm, linear, conv2d };

/// The operators the observer looks at, by schema name.
inline op_kind classify(const char* name) noexcept {
    if (name == nullptr || std::strncmp(name, "aten::", 6) != 0) return op_kind::none;
    const char* op = name + 6;
    switch (op[0]) {
        case 't': return std::strcmp(op, "t") == 0 ? op_kind::transpose : op_kind::none;
        case 'a': return std::strcmp(op, "addmm") == 0 ? op_kind::addmm : op_kind::none;
        case 'm':
            if (std::strcmp(op, "matmul") == 0) return op_kind::matmul;
            return std::strcmp(op, "mm") == 0 ? op_kind::mm : op_kind::none;
        case 'l': return std::strcmp(op, "linear") == 0 ? op_kind::linear : op_kind::none;
        case 'c': return std::strcmp(op, "conv2d") == 0 ? op_kind::conv2d : op_kind::none;
        default: return op_kind::none;
    }
}

/// Carried from an operator's start callback to its end callback.
struct observed_call : at::ObserverContext {
    std::shared_ptr<layer_state> layer;
    bool transpose = false;  // an aten::t of the weight, not the layer's product
    at::Tensor input;
};

inline const at::TensorImpl* tensor_arg(c10::ArrayRef<const c10::IValue> args, std::size_t i) {
    return i < args.size() && args[i].isTensor() ? args[i].toTensor().unsafeGetTensorImpl() : nullptr;
}

/// Which argument is the input and which the weight (or the transposed weight).
struct operand_positions {
    std::size_t input, weight;
    bool transposed;
};

inline operand_positions positions(op_kind k) noexcept {
    switch (k) {
        case op_kind::addmm: return {1, 2, true};           // addmm(bias, input, weight.t())
        case op_kind::matmul:                               // matmul(input, weight.t())
        case op_kind::mm: return {0, 1, true};              // mm(input, weight.t())
        default: return {0, 1, false};                      // linear/conv2d(input, weight, ...)
    }
}

/// The tracked layer whose weight (or transposed weight) `key` is, for an operator of `kind`.
inline std::shared_ptr<layer_state> match(const thread_observer& obs, op_kind kind, const at::TensorImpl* key) {
    const bool transposed = positions(kind).transposed;
    for (const auto& weak : obs.trackers) {
        const auto core = weak.lock();
        if (!core) continue;
        for (const auto& l : core->layers) {
            if (!l->weight->defined() || !l->weight->requires_grad()) continue;
            const bool linear = l->description.kind == layer_kind::linear;
            if (kind == op_kind::transpose || kind == op_kind::linear) {
                if (linear && key == l->weight->unsafeGetTensorImpl()) return l;
            } else if (transposed) {
                if (linear && l->transposed.defined() && key == l->transposed.unsafeGetTensorImpl()) return l;
            } else if (!linear && key == l->weight->unsafeGetTensorImpl()) {  // conv2d
                return l;
            }
        }
    }
    return nullptr;
}

inline std::unique_ptr<at::ObserverContext> on_operator_start(const at::RecordFunction& fn) {
    thread_observer& obs = observer;
    if (obs.depth > 0 || obs.trackers.empty()) return nullptr;
    const op_kind kind = classify(fn.name());
    if (kind == op_kind::none || !c10::GradMode::is_enabled()) return nullptr;
    const auto args = recorded_inputs(fn);
    const operand_positions where = positions(kind);
    const at::TensorImpl* key = tensor_arg(args, kind == op_kind::transpose ? 0 : where.weight);
    if (key == nullptr) return nullptr;
    auto layer = match(obs, kind, key);
    if (!layer) return nullptr;
    auto call = std::make_unique<observed_call>();
    if (kind == op_kind::transpose) {
        call->transpose = true;
    } else {
        if (where.transposed) layer->transposed.reset();
        call->input = args[where.input].toTensor();
        ++obs.depth;  // operators nested in this one are not looked at
    }
    call->layer = std::move(layer);
    return call;
}

inline void on_operator_end(const at::RecordFunction& fn, at::ObserverContext* context) {
    if (context == nullptr) return;
    auto* call = static_cast<observed_call*>(context);
    const auto& outputs = fn.outputs();
    const at::Tensor* out = !outputs.empty() && outputs[0].isTensor() ? &outputs[0].toTensor() : nullptr;
    if (call->transpose) {
        if (out != nullptr) call->layer->transposed = *out;
        return;
    }
    --observer.depth;
    if (out == nullptr || !out->defined() || !out->requires_grad()) return;
    std::weak_ptr<layer_state> layer = call->layer;
    at::Tensor input = std::move(call->input);
    out->register_hook([layer, input](const at::Tensor& grad) {
        const auto l = layer.lock();
        if (!l || !grad.defined()) return;
        auto p = std::make_shared<pass>();
        p->input = input.detach().contiguous();
        p->grad_output = grad.detach().contiguous();
        std::lock_guard<std::mutex> lock(l->mutex);
        l->latest = std::move(p);
        ++l->completed;
    });
}

template <class Scalar>
constexpr c10::ScalarType scalar_type_of() noexcept {
    return std::is_same_v<Scalar, float> ? c10::ScalarType::Float : c10::ScalarType::Double;
}

template <class Scalar>
const char* scalar_name() noexcept {
    return std::is_same_v<Scalar, float> ? "float (torch::kFloat)" : "double (torch::kDouble)";
}

/// Throws a kfac::error naming the layer unless `t` is a dense, C-contiguous CPU tensor of
/// Scalar.
template <class Scalar>
void check_tensor(const layer_state& l, const char* what, const at::Tensor& t) {
    if (!t.device().is_cpu())
        throw error("torch adapter: " + l.who() + ": " + what + " is on device " + t.device().str() +
                    "; kfac's CPU backend reads and writes host memory: keep the model on the CPU");
    if (t.layout() != c10::kStrided)
        throw error("torch adapter: " + l.who() + ": " + what + " is not a dense (strided) tensor");
    if (t.scalar_type() != scalar_type_of<Scalar>())
        throw error("torch adapter: " + l.who() + ": " + what + " has dtype " +
                    std::string(c10::toString(t.scalar_type())) + " but the tracker's scalar type is " +
                    scalar_name<Scalar>() + "; use kfac::torch::tracker<" +
                    (std::is_same_v<Scalar, float> ? "double" : "float") +
                    "> with the matching kfac::backend::cpu_eigen, or convert the model");
    if (!t.is_contiguous())
        throw error("torch adapter: " + l.who() + ": " + what + " is not contiguous (sizes " +
                    c10::str(t.sizes()) + ", strides " + c10::str(t.strides()) +
                    "); kfac writes the preconditioned gradient in place and needs C-order "
                    "memory: keep the parameters and their .grad() contiguous (no channels_last)");
}

template <class T>
tensor_view<T> view_of(const at::Tensor& t) {
    return tensor_view<T>::from_extents(static_cast<T*>(t.data_ptr()), t.sizes());
}

template <class Scalar>
tensor_view<Scalar> gradient_view(const layer_state& l, const at::Tensor& param, const char* what) {
    const at::Tensor& g = param.grad();
    if (!g.defined())
        throw error("torch adapter: " + l.who() + ": " + what + ".grad() is undefined; run the "
                    "backward pass before step() (and keep requires_grad on the parameter)");
    check_tensor<Scalar>(l, (std::string(what) + ".grad()").c_str(), g);
    return view_of<Scalar>(g);
}

inline std::array<std::int64_t, 2> pair_of(const ::torch::ExpandingArray<2>& a) {
    return {(*a)[0], (*a)[1]};
}

inline layer_description describe_conv2d(const std::string& name, const ::torch::nn::Conv2dImpl& m) {
    const auto& o = m.options;
    conv2d_geometry g;
    g.kernel = pair_of(o.kernel_size());
    g.stride = pair_of(o.stride());
    g.dilation = pair_of(o.dilation());
    g.groups = o.groups();
    const bool zeros = c10::get_if<::torch::enumtype::kZeros>(&o.padding_mode()) != nullptr;
    if (const auto* explicit_padding = c10::get_if<::torch::ExpandingArray<2>>(&o.padding())) {
        g.padding = pair_of(*explicit_padding);
    } else if (c10::get_if<::torch::enumtype::kValid>(&o.padding()) != nullptr) {
        g.padding = {0, 0};
    } else {  // kSame: total padding dilation·(kernel − 1) per axis, split left/right
        for (std::size_t i = 0; i < 2; ++i) {
            const std::int64_t total = g.dilation[i] * (g.kernel[i] - 1);
            if (zeros && total % 2 != 0)
                throw error("torch adapter: layer '" + name + "' (torch::nn::Conv2d): padding 'same' "
                            "with kernel " + std::to_string(g.kernel[i]) + " and dilation " +
                            std::to_string(g.dilation[i]) + " pads unevenly (" + std::to_string(total / 2) +
                            " and " + std::to_string(total - total / 2) + "), which K-FAC's patch "
                            "extraction cannot describe; use an odd kernel or explicit padding, or "
                            "exclude the layer with options.skip_layers");
            g.padding[i] = total / 2;
        }
    }
    // A non-zero padding mode pads the input itself before an unpadded convolution, and that
    // padded input is what the observer captures.
    if (!zeros) g.padding = {0, 0};
    return conv2d_description(o.in_channels(), o.out_channels(), g, m.bias.defined());
}

/// The library's skip rule (preconditioner::register_layer): a pattern that matches the name
/// or a kind name.
inline bool skipped(const options& opts, const std::string& name, layer_kind kind) {
    const char* lower = kind_name(kind);
    const char* pytorch = kind == layer_kind::linear ? "Linear" : "Conv2d";
    for (const auto& pattern : opts.skip_layers) {
        const std::regex re(pattern, std::regex::ECMAScript);
        if (std::regex_search(name, re) || std::regex_search(lower, re) || std::regex_search(pytorch, re))
            return true;
    }
    return false;
}

}  // namespace detail

/// A tracked `torch::nn::Linear` or `torch::nn::Conv2d`: what the preconditioner registers
/// (through kfac::layer_traits). Owned by its tracker; only its tracker creates it.
///
/// @tparam Scalar float or double: the module's dtype and the backend's scalar type.
template <class Scalar>
class tracked_layer {
public:
    explicit tracked_layer(std::shared_ptr<detail::layer_state> state) : state_(std::move(state)) {}

    [[nodiscard]] const std::string& name() const noexcept { return state_->name; }
    [[nodiscard]] const layer_description& description() const noexcept { return state_->description; }
    /// The module (a torch::nn::LinearImpl or torch::nn::Conv2dImpl).
    [[nodiscard]] const std::shared_ptr<::torch::nn::Module>& module() const noexcept { return state_->module; }
    /// Forward/backward passes captured so far.
    [[nodiscard]] std::int64_t passes() const {
        std::lock_guard<std::mutex> lock(state_->mutex);
        return state_->completed;
    }
    /// The input of the latest captured pass (undefined before the first).
    [[nodiscard]] at::Tensor input() const {
        const auto p = state_->latest_pass();
        return p ? p->input : at::Tensor();
    }
    /// The gradient w.r.t. the output of the latest captured pass (undefined before the first).
    [[nodiscard]] at::Tensor grad_output() const {
        const auto p = state_->latest_pass();
        return p ? p->grad_output : at::Tensor();
    }

    /// @throws kfac::error when no pass was captured or the tensors are not CPU tensors of Scalar.
    [[nodiscard]] tensor_view<const Scalar> activations_view() const {
        const auto p = captured();
        detail::check_tensor<Scalar>(*state_, "the captured input", p->input);
        return detail::view_of<const Scalar>(p->input);
    }
    [[nodiscard]] tensor_view<const Scalar> output_gradients_view() const {
        const auto p = captured();
        detail::check_tensor<Scalar>(*state_, "the captured output gradient", p->grad_output);
        return detail::view_of<const Scalar>(p->grad_output);
    }
    /// The weight's own .grad() buffer. @throws kfac::error if undefined, not contiguous, not
    /// on the CPU or not of Scalar.
    [[nodiscard]] tensor_view<Scalar> weight_gradient_view() const {
        return detail::gradient_view<Scalar>(*state_, *state_->weight, "weight");
    }
    /// The bias's own .grad() buffer, or an empty view without bias.
    [[nodiscard]] tensor_view<Scalar> bias_gradient_view() const {
        if (!state_->description.bias) return {};
        return detail::gradient_view<Scalar>(*state_, *state_->bias, "bias");
    }

private:
    std::shared_ptr<const detail::pass> captured() const {
        auto p = state_->latest_pass();
        if (!p)
            throw error("torch adapter: " + state_->who() + ": no forward and backward pass has "
                        "been captured yet; run forward (with gradients enabled, on the thread that "
                        "created the kfac::torch::tracker) and backward before step()" +
                        (at::isRecordFunctionEnabled() ? std::string()
                                                       : std::string(" (RecordFunction is disabled on this "
                                                                     "thread, at::enableRecordFunction(false), "
                                                                     "which stops the capture)")));
        return p;
    }

    std::shared_ptr<detail::layer_state> state_;
};

/// Observes the forward passes of the current thread and captures, for every module tracked,
/// the input and output gradient of its latest forward/backward pass (see the file comment).
/// Create it on the thread that runs forward; it must outlive the preconditioner's use of
/// its layers (the preconditioner keeps pointers to them). Neither copyable nor movable.
///
/// @tparam Scalar float (torch::kFloat models, kfac::backend::cpu_eigen<float>) or double.
template <class Scalar = float>
class tracker {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::torch::tracker<Scalar>: Scalar must be float or double");

public:
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

    /// Tracks a Linear module under `name`.
    /// @throws kfac::error for a duplicate name or module, or a module not of Scalar on the CPU.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Linear& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a Conv2d module under `name`.
    /// @throws kfac::error as above, or for padding 'same' that pads unevenly.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Conv2d& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a module that is a torch::nn::LinearImpl or torch::nn::Conv2dImpl.
    /// @throws kfac::error for any other module, and as above.
    tracked_layer<Scalar>& track(const std::string& name, const std::shared_ptr<::torch::nn::Module>& module) {
        auto s = std::make_shared<detail::layer_state>();
        s->name = name;
        s->module = module;
        if (auto* linear = dynamic_cast<::torch::nn::LinearImpl*>(module.get())) {
            s->type = "Linear";
            s->weight = &linear->weight;
            s->bias = &linear->bias;
            s->description = linear_description(linear->options.in_features(),
                                                linear->options.out_features(), linear->bias.defined());
        } else if (auto* conv = dynamic_cast<::torch::nn::Conv2dImpl*>(module.get())) {
            s->type = "Conv2d";
            s->weight = &conv->weight;
            s->bias = &conv->bias;
            s->description = detail::describe_conv2d(name, *conv);
        } else {
            throw error("torch adapter: module '" + name + "' (" +
                        (module ? module->name() : std::string("null")) +
                        ") is neither a torch::nn::Linear nor a torch::nn::Conv2d");
        }
        for (const auto& l : core_->layers) {
            if (l->name == name)
                throw error("torch adapter: a layer named '" + name + "' is already tracked");
            if (l->module == module)
                throw error("torch adapter: " + s->who() + " is already tracked as '" + l->name + "'");
        }
        detail::check_tensor<Scalar>(*s, "weight", *s->weight);
        if (s->bias->defined()) detail::check_tensor<Scalar>(*s, "bias", *s->bias);
        core_->layers.push_back(s);
        layers_.push_back(std::make_unique<tracked_layer<Scalar>>(std::move(s)));
        return *layers_.back();
    }

    /// The layer tracked under `name`. @throws kfac::error if there is none.
    [[nodiscard]] tracked_layer<Scalar>& layer(const std::string& name) {
        for (auto& l : layers_)
            if (l->name() == name) return *l;
        throw error("torch adapter: no layer named '" + name + "' is tracked");
    }
    [[nodiscard]] std::size_t size() const noexcept { return layers_.size(); }

private:
    std::shared_ptr<detail::tracker_core> core_;
    std::vector<std::unique_ptr<tracked_layer<Scalar>>> layers_;  // stable addresses
};

/// Tracks and registers every torch::nn::Linear and torch::nn::Conv2d of `model` (a
/// std::shared_ptr to a module or a module holder), named as `model->named_modules()` names
/// them ("conv1", "features.0", ...; `prefix` is prepended). Layers that the preconditioner's
/// options.skip_layers matches are neither tracked nor registered; other module types are
/// ignored (their children are visited).
/// @return the number of layers registered.
/// @throws kfac::error as tracker::track and preconditioner::register_layer do.
template <class Preconditioner, class Scalar, class Model>
std::size_t register_modules(Preconditioner& preconditioner, tracker<Scalar>& tracker, const Model& model,
                             const std::string& prefix = "") {
    std::size_t count = 0;
    for (const auto& item : model->named_modules(prefix, /*include_self=*/true)) {
        const std::shared_ptr<::torch::nn::Module>& m = item.value();
        layer_kind kind;
        if (dynamic_cast<::torch::nn::LinearImpl*>(m.get()) != nullptr)
            kind = layer_kind::linear;
        else if (dynamic_cast<::torch::nn::Conv2dImpl*>(m.get()) != nullptr)
            kind = layer_kind::conv2d;
        else
            continue;
        const std::string name = item.key().empty() ? m->name() : item.key();
        if (detail::skipped(preconditioner.get_options(), name, kind)) continue;
        if (preconditioner.register_layer(name, tracker.track(name, m))) ++count;
    }
    return count;
}

}  // namespace kfac::torch

namespace kfac {

/// The adapter of a tracked LibTorch module; the views read the tensors the tracker captured
/// and the parameters' own .grad() buffers.
template <class Scalar>
struct layer_traits<torch::tracked_layer<Scalar>> {
    using scalar_type = Scalar;
    using layer = torch::tracked_layer<Scalar>;
    static layer_description describe(const layer& l) { return l.description(); }
    static tensor_view<const Scalar> activations(const layer& l) { return l.activations_view(); }
    static tensor_view<const Scalar> output_gradients(const layer& l) { return l.output_gradients_view(); }
    static tensor_view<Scalar> weight_gradient(layer& l) { return l.weight_gradient_view(); }
    static tensor_view<Scalar> bias_gradient(layer& l) { return l.bias_gradient_view(); }
};

}  // namespace kfac
