// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch.hpp
/// LibTorch adapter: K-FAC for the `torch::nn::Linear`, `Conv2d`, `Conv1d`, `Embedding`,
/// `LayerNorm` and `BatchNorm1d/2d/3d` members of an existing model, with no change to the
/// model or its hand-written `forward`. Optional: only
/// this header needs LibTorch (CMake: `find_package(Torch)`, link `${TORCH_LIBRARIES}`); it is
/// not included by `kfac/kfac.hpp`.
///
/// ```cpp
/// kfac::torch::tracker<float> tracker;              // observes forward passes on this thread
/// kfac::KFAC<> precond(opts);
/// const auto report = kfac::torch::register_modules(precond, tracker, model);  // by name
/// std::cout << report.summary() << '\n';            // what K-FAC took, what it left to SGD
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
/// * Conv2d, Conv1d: `aten::conv2d(input, weight, ...)`, `aten::conv1d(...)`, the calls
///   `Conv2dImpl::forward` and `Conv1dImpl::forward` make;
/// * Linear: `torch::nn::functional::linear` computes `addmm(bias, input, weight.t())` for a 2-D
///   input with bias and `input.matmul(weight.t())` otherwise, so an `aten::t` of the weight
///   marks the transposed weight and the `aten::addmm`, `aten::matmul` or `aten::mm` that
///   consumes it is the layer's product; an `aten::linear(input, weight, ...)` (what
///   `torch::linear` dispatches) is recognised too;
/// * Embedding: `aten::embedding(weight, indices, ...)`, the call `EmbeddingImpl::forward`
///   makes; the indices are kept converted to the tracker's scalar type (token ids are exact
///   in it up to the preconditioner's limit, which it checks at registration);
/// * LayerNorm, BatchNorm: `aten::layer_norm(input, normalized_shape, weight, bias, eps, ...)`
///   and `aten::batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
///   eps, ...)`. K-FAC sees their affine part y = weight ⊙ x̂ + bias, so the activations are x̂,
///   recomputed from the captured input as the operator normalised it (over the normalised
///   dimensions, or over every dimension but the channels with the batch statistics in
///   training, the running ones otherwise; biased variance, the call's eps), on factor-update
///   steps only. A LayerNorm over several dimensions is seen as one over their product.
///
/// The observer keeps that operator's input and registers a hook (`Tensor::register_hook`) on
/// its output; when the backward pass reaches the hook, the pair (input, dloss/doutput) is one
/// application of the layer in the current pass. Operators nested inside a recognised one are
/// ignored, so one call is captured once. (The alternatives need more of the user or of
/// LibTorch's internals: a drop-in module type means editing every member declaration, and
/// reading the inputs back from the autograd graph's saved variables means depending on
/// LibTorch's generated backward-node classes.) The weight and bias gradients are views of the
/// parameters' own `.grad()` buffers, which `step()` overwrites in place.
///
/// ## What a pass is
///
/// The applications collected since the preconditioner last finished an accumulate() or step()
/// form the pass it reads (kfac::layer_traits' per-application form), and it then forgets them:
/// * a module applied several times in one forward pass (shared weights) contributes every
///   application: the step's statistic is the mean of the applications' statistics, as in
///   KAISA and kfac-pytorch, which sum each call's statistic and divide by the count;
/// * a module not called in a step (a branch not taken) contributes nothing, and its factors
///   are left as they are, without decay, as kfac-pytorch leaves a module whose hooks did not
///   fire; if it has no gradient either (`.grad()` undefined), its gradient is left alone;
/// * only forward passes in training mode (`module->is_training()`) and with gradients enabled
///   are captured: evaluation (`model->eval()`, `torch::NoGradGuard`) between steps is
///   harmless;
/// * a frozen layer (weight with `requires_grad` false) has nothing to precondition:
///   register_modules leaves it out (and says so in its report).
///
/// Rules that follow from the mechanism:
/// * forward must run on the thread that created the tracker (the observer is thread-local;
///   the backward hooks may run on autograd's threads);
/// * the tracker must outlive the preconditioner's use of its layers, and be destroyed on the
///   thread that created it (elsewhere its observer stays installed, inert, until that thread
///   ends);
/// * while a tracker is alive every operator on its thread pays the observer's cost (the
///   arguments are boxed and the results kept, about a microsecond per operator);
/// * the parameters are CPU or CUDA tensors of the tracker's dtype (tracker<float> for kFloat,
///   tracker<double> for kDouble), dense and contiguous; views of CUDA tensors are marked
///   `memory_space::device`, for `kfac::backend::cuda` (a host backend rejects them with an
///   error naming the layer); anything else is a kfac::error naming the layer;
/// * a functional call that reuses a module's weight (`F::conv2d(x, conv->weight, ...)`) is an
///   application of that module: with other convolution options than the module's it is an
///   error at step() naming both (K-FAC describes the layer by the module's options);
/// * the captured tensors are references, not copies: do not modify a batch in place between
///   its forward pass and step().
///
/// Conv2d and Conv1d geometry is read from the module's options. Zero padding is described as padding;
/// with a `reflect`, `replicate` or `circular` padding mode LibTorch pads the input itself
/// before an unpadded convolution, so the factors are built from that padded input (padding 0
/// in the description), the patches the convolution really multiplies. A grouped or depthwise
/// convolution (`groups` ≠ 1) is preconditioned as one Kronecker block per group, registered as
/// "<name>/group<j>" (see layer_description); it needs a host backend.
///
/// An Embedding is preconditioned unless its gradient is not the plain one: `sparse` (a sparse
/// .grad()) and `scale_grad_by_freq` (a gradient already divided by the token counts, which A
/// would divide again) are left to the host's optimizer by register_modules, and refused by
/// track(). A weight tied to another module (an output projection using the embedding's weight)
/// gets its whole gradient preconditioned by the Embedding's factors alone.

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
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

namespace kfac::torch {

template <class Scalar>
class tracked_layer;

namespace detail {

/// One application of a module: its input and the gradient of the loss w.r.t. its output,
/// both contiguous; `problem` is set when the application cannot be used (said at step()).
/// How a normalisation operator normalised its input: x̂ = (x − mean) / √(var + eps), the
/// statistics over `dims` (biased variance) or, when `mean` is defined, BatchNorm's running
/// statistics of the channels (dimension 1). `shape` is the views' shape: a LayerNorm's
/// normalised dimensions flattened into one.
struct norm_call {
    std::vector<std::int64_t> dims;
    double eps = 1e-5;
    at::Tensor mean, var;
    std::vector<std::int64_t> shape;
};

/// x̂ of `x`, in x's dtype, shaped `n.shape` and contiguous.
inline at::Tensor normalized_input(const at::Tensor& x, const norm_call& n) {
    const c10::NoGradGuard no_grad;  // nor does the tracker's observer look at these operators
    at::Tensor mean, var;
    if (n.mean.defined()) {
        std::vector<std::int64_t> channels(static_cast<std::size_t>(x.dim()), 1);
        channels[1] = x.size(1);
        mean = n.mean.reshape(channels);
        var = n.var.reshape(channels);
    } else {
        mean = x.mean(n.dims, /*keepdim=*/true);
        var = (x - mean).square().mean(n.dims, /*keepdim=*/true);
    }
    return ((x - mean) * (var + n.eps).rsqrt()).reshape(n.shape).contiguous();
}

struct pass {
    at::Tensor input;
    at::Tensor grad_output;
    std::string problem;
    std::optional<norm_call> norm;  ///< set for a normalisation layer, whose activations are x̂

    /// What the layer's statistics read as its input: the captured input, or for a
    /// normalisation layer x̂, computed at the first call (on factor-update steps only).
    [[nodiscard]] const at::Tensor& activations() const {
        if (!norm) return input;
        std::call_once(normalized_once, [&] { normalized = normalized_input(input, *norm); });
        return normalized;
    }

private:
    mutable std::once_flag normalized_once;
    mutable at::Tensor normalized;
};

/// What the tracker knows of one module.
struct layer_state {
    std::string name;
    const char* type = "";  // "Linear", "Conv2d", "LayerNorm", "BatchNorm2d", ..., for messages
    layer_description description{};
    std::shared_ptr<::torch::nn::Module> module;  // keeps *weight and *bias alive
    at::Tensor* weight = nullptr;                 // the module's members
    at::Tensor* bias = nullptr;                   // `no_bias` for a module without one
    at::Tensor no_bias;
    c10::ScalarType scalar = c10::ScalarType::Float;  // the tracker's: an Embedding's ids are kept in it
    at::Tensor transposed;  // weight.t() seen in forward, awaiting its addmm/matmul/mm

    mutable std::mutex mutex;  // guards what the backward hooks write
    std::vector<std::shared_ptr<const pass>> applications;  // of the current pass
    std::shared_ptr<const pass> latest;                      // last application whose gradient arrived
    std::int64_t completed = 0;                              // number of such applications

    [[nodiscard]] std::string who() const { return "layer '" + name + "' (torch::nn::" + type + ")"; }
    [[nodiscard]] std::shared_ptr<const pass> latest_pass() const {
        std::lock_guard<std::mutex> lock(mutex);
        return latest;
    }
    [[nodiscard]] std::shared_ptr<const pass> application(std::int64_t i) const {
        std::lock_guard<std::mutex> lock(mutex);
        if (i < 0 || static_cast<std::size_t>(i) >= applications.size())
            throw error("torch adapter: " + who() + ": application " + std::to_string(i) + " of a pass with " +
                        std::to_string(applications.size()));
        return applications[static_cast<std::size_t>(i)];
    }
    [[nodiscard]] std::int64_t application_count() const {
        std::lock_guard<std::mutex> lock(mutex);
        return static_cast<std::int64_t>(applications.size());
    }
    void add(std::shared_ptr<const pass> p) {
        std::lock_guard<std::mutex> lock(mutex);
        applications.push_back(p);
        latest = std::move(p);
        ++completed;
    }
    void forget_applications() {
        std::lock_guard<std::mutex> lock(mutex);
        applications.clear();
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

enum class op_kind { none, transpose, addmm, matmul, mm, linear, conv2d, conv1d, embedding, layer_norm, batch_norm };

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
        case 'l':
            if (std::strcmp(op, "linear") == 0) return op_kind::linear;
            return std::strcmp(op, "layer_norm") == 0 ? op_kind::layer_norm : op_kind::none;
        case 'b': return std::strcmp(op, "batch_norm") == 0 ? op_kind::batch_norm : op_kind::none;
        case 'e': return std::strcmp(op, "embedding") == 0 ? op_kind::embedding : op_kind::none;
        case 'c':
            if (std::strcmp(op, "conv2d") == 0) return op_kind::conv2d;
            return std::strcmp(op, "conv1d") == 0 ? op_kind::conv1d : op_kind::none;
        default: return op_kind::none;
    }
}

/// Carried from an operator's start callback to its end callback.
struct observed_call : at::ObserverContext {
    std::shared_ptr<layer_state> layer;
    bool transpose = false;  // an aten::t of the weight, not the layer's product
    at::Tensor input;
    std::string problem;
    std::optional<norm_call> norm;
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
        case op_kind::embedding: return {1, 0, false};      // embedding(weight, indices, ...)
        case op_kind::layer_norm: return {0, 2, false};     // layer_norm(input, shape, weight, ...)
        case op_kind::batch_norm: return {0, 1, false};     // batch_norm(input, weight, ...)
        default: return {0, 1, false};                      // linear/conv2d/conv1d(input, weight, ...)
    }
}

/// The tracked layer, in training mode, whose weight (or transposed weight) `key` is, for an
/// operator of `kind`.
inline std::shared_ptr<layer_state> match(const thread_observer& obs, op_kind kind, const at::TensorImpl* key) {
    const bool transposed = positions(kind).transposed;
    for (const auto& weak : obs.trackers) {
        const auto core = weak.lock();
        if (!core) continue;
        for (const auto& l : core->layers) {
            if (!l->weight->defined() || !l->weight->requires_grad() || !l->module->is_training()) continue;
            const bool linear = l->description.kind == layer_kind::linear;
            const bool embedding = l->description.kind == layer_kind::embedding;
            if (kind == op_kind::layer_norm || kind == op_kind::batch_norm) {
                const layer_kind norm = kind == op_kind::layer_norm ? layer_kind::layer_norm : layer_kind::batch_norm;
                if (l->description.kind == norm && key == l->weight->unsafeGetTensorImpl()) return l;
            } else if (kind == op_kind::transpose || kind == op_kind::linear) {
                if (linear && key == l->weight->unsafeGetTensorImpl()) return l;
            } else if (transposed) {
                if (linear && l->transposed.defined() && key == l->transposed.unsafeGetTensorImpl()) return l;
            } else if (kind == op_kind::embedding) {
                if (embedding && key == l->weight->unsafeGetTensorImpl()) return l;
            } else if (is_convolution(l->description.kind) && key == l->weight->unsafeGetTensorImpl()) {
                // A call of the other kind of convolution is an application K-FAC cannot
                // describe: on_operator_start records why.
                return l;
            }
        }
    }
    return nullptr;
}

/// "[2, 2]".
inline std::string pair_text(const std::array<std::int64_t, 2>& p) { return kfac::detail::shape_text(p); }

/// An aten::conv2d or aten::conv1d call's options, as its arguments give them: (input, weight,
/// bias, stride, padding, dilation, groups), padding a list or, from `padding='same'`/`'valid'`,
/// a string. A conv1d's options are held as the 2-D ones of the Conv2d it equals ({1, v}).
struct conv_call {
    std::array<std::int64_t, 2> stride{1, 1}, padding{0, 0}, dilation{1, 1};
    std::int64_t groups = 1;
};

inline std::array<std::int64_t, 2> pair_arg(const c10::IValue& v, std::array<std::int64_t, 2> fallback,
                                            bool one_d) {
    if (!v.isIntList()) return fallback;
    const auto list = v.toIntVector();
    if (list.size() == 1) return {one_d ? fallback[0] : list[0], list[0]};
    if (list.size() >= 2) return {list[0], list[1]};
    return fallback;
}

inline conv_call read_conv_call(c10::ArrayRef<const c10::IValue> args, const conv2d_geometry& module, bool one_d) {
    conv_call c;
    if (args.size() > 3) c.stride = pair_arg(args[3], c.stride, one_d);
    if (args.size() > 5) c.dilation = pair_arg(args[5], c.dilation, one_d);
    if (args.size() > 6 && args[6].isInt()) c.groups = args[6].toInt();
    if (args.size() > 4) {
        if (args[4].isString()) {
            // 'same' pads dilation·(kernel − 1) in total per axis (the module's description
            // holds the half, and rejects an uneven split); 'valid' pads nothing.
            if (args[4].toStringRef() == "same")
                for (std::size_t i = 0; i < 2; ++i) c.padding[i] = c.dilation[i] * (module.kernel[i] - 1) / 2;
        } else {
            c.padding = pair_arg(args[4], c.padding, one_d);
        }
    }
    return c;
}

/// Empty when the call convolves with the geometry the layer is described by; else why not.
inline std::string conv_call_mismatch(const layer_state& l, c10::ArrayRef<const c10::IValue> args) {
    const conv2d_geometry& g = l.description.conv;
    const bool one_d = l.description.kind == layer_kind::conv1d;
    const conv_call c = read_conv_call(args, g, one_d);
    if (c.stride == g.stride && c.padding == g.padding && c.dilation == g.dilation && c.groups == g.groups) return {};
    auto text = [&](const std::array<std::int64_t, 2>& s, const std::array<std::int64_t, 2>& p,
                    const std::array<std::int64_t, 2>& d, std::int64_t groups) {
        auto axes = [&](const std::array<std::int64_t, 2>& v) {
            return one_d ? kfac::detail::shape_text({v[1]}) : pair_text(v);
        };
        return "stride " + axes(s) + ", padding " + axes(p) + ", dilation " + axes(d) + ", groups " +
               std::to_string(groups);
    };
    return "torch adapter: " + l.who() + ": its weight was used by a convolution with " +
           text(c.stride, c.padding, c.dilation, c.groups) + ", but the module's options, by which K-FAC describes "
           "the layer, give " + text(g.stride, g.padding, g.dilation, g.groups) +
           ": a functional call (F::conv2d, torch::conv1d, ...) reused the module's weight with other options. "
           "Call the module itself, give that call a module of its own, or leave the layer out with "
           "options.skip_layers";
}

/// How an aten::layer_norm or aten::batch_norm call normalises its input (its arguments are
/// listed at positions()); a problem when they are not what the schema says.
inline norm_call read_norm_call(op_kind kind, c10::ArrayRef<const c10::IValue> args, const layer_state& l,
                                std::string& problem) {
    norm_call n;
    const at::Tensor& x = args[0].toTensor();
    const auto rank = static_cast<std::int64_t>(x.dim());
    const bool layer_norm = kind == op_kind::layer_norm;
    const std::size_t eps_at = layer_norm ? 4 : 7;
    const bool readable = args.size() > eps_at && args[eps_at].isDouble() &&
                          (layer_norm ? args[1].isIntList() : args[5].isBool());
    if (!readable) {
        problem = "torch adapter: " + l.who() + ": the arguments of aten::" + (layer_norm ? "layer_norm" : "batch_norm") +
                  " are not those of its schema (this LibTorch's operator differs); leave the layer out with "
                  "options.skip_layers";
        return n;
    }
    n.eps = args[eps_at].toDouble();
    n.shape.assign(x.sizes().begin(), x.sizes().end());
    if (layer_norm) {
        const auto normalized = static_cast<std::int64_t>(args[1].toIntVector().size());
        for (std::int64_t i = rank - normalized; i < rank; ++i) n.dims.push_back(i);
        n.shape.resize(static_cast<std::size_t>(rank - normalized));
        n.shape.push_back(l.description.out);
    } else if (args[5].toBool() || !args[3].isTensor() || !args[4].isTensor()) {  // batch statistics
        for (std::int64_t i = 0; i < rank; ++i)
            if (i != 1) n.dims.push_back(i);
    } else {
        n.mean = args[3].toTensor().detach().clone();  // the buffers change with later training calls
        n.var = args[4].toTensor().detach().clone();
    }
    return n;
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
        if (kind == op_kind::conv2d || kind == op_kind::conv1d) {
            const bool module_one_d = layer->description.kind == layer_kind::conv1d;
            if (module_one_d != (kind == op_kind::conv1d))
                call->problem = "torch adapter: " + layer->who() + ": its weight was used by aten::" +
                                (kind == op_kind::conv1d ? "conv1d" : "conv2d") + ", another kind of convolution "
                                "than the module's; call the module itself or leave the layer out with "
                                "options.skip_layers";
            else
                call->problem = conv_call_mismatch(*layer, args);
        }
        if (kind == op_kind::layer_norm || kind == op_kind::batch_norm)
            call->norm = read_norm_call(kind, args, *layer, call->problem);
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
    out->register_hook([layer, input = std::move(call->input), problem = std::move(call->problem),
                        norm = std::move(call->norm)](const at::Tensor& grad) {
        const auto l = layer.lock();
        if (!l || !grad.defined()) return;
        auto p = std::make_shared<pass>();
        // An Embedding's indices are integers: its view holds them as the tracker's scalars.
        const bool ids = l->description.kind == layer_kind::embedding;
        p->input = ids ? input.detach().to(l->scalar).contiguous() : input.detach().contiguous();
        p->grad_output = grad.detach().contiguous();
        if (norm && problem.empty()) p->grad_output = p->grad_output.reshape(norm->shape);  // as x̂'s view
        p->problem = problem;
        p->norm = norm;
        l->add(std::move(p));
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

/// Where the elements of a tensor on `device` live, for its view: CUDA memory is device
/// memory (for kfac::backend::cuda), CPU memory host memory.
/// @throws kfac::error naming the layer for any other device.
inline memory_space memory_space_of(const layer_state& l, const char* what, const c10::Device& device) {
    if (device.is_cpu()) return memory_space::host;
    if (device.is_cuda()) return memory_space::device;
    throw error("torch adapter: " + l.who() + ": " + what + " is on device " + device.str() +
                "; kfac reads CPU tensors (every backend) and CUDA tensors (kfac::backend::cuda): move the "
                "model to the CPU or to a CUDA device");
}

/// Throws a kfac::error naming the layer unless `t` is a dense, C-contiguous CPU or CUDA
/// tensor of Scalar.
template <class Scalar>
void check_tensor(const layer_state& l, const char* what, const at::Tensor& t) {
    (void)memory_space_of(l, what, t.device());
    if (t.layout() != c10::kStrided)
        throw error("torch adapter: " + l.who() + ": " + what + " is not a dense (strided) tensor");
    if (t.scalar_type() != scalar_type_of<Scalar>())
        throw error("torch adapter: " + l.who() + ": " + what + " has dtype " +
                    std::string(c10::toString(t.scalar_type())) + " but the tracker's scalar type is " +
                    scalar_name<Scalar>() + "; use kfac::torch::tracker<" +
                    (std::is_same_v<Scalar, float> ? "double" : "float") +
                    "> with a backend of that scalar type (cpu_eigen, cuda), or convert the model");
    if (!t.is_contiguous())
        throw error("torch adapter: " + l.who() + ": " + what + " is not contiguous (sizes " +
                    c10::str(t.sizes()) + ", strides " + c10::str(t.strides()) +
                    "); kfac writes the preconditioned gradient in place and needs C-order "
                    "memory: keep the parameters and their .grad() contiguous (no channels_last)");
}

template <class T>
tensor_view<T> view_of(const layer_state& l, const char* what, const at::Tensor& t) {
    return tensor_view<T>::from_extents(static_cast<T*>(t.data_ptr()), t.sizes(), memory_space_of(l, what, t.device()));
}

template <class Scalar>
tensor_view<Scalar> gradient_view(const layer_state& l, const at::Tensor& param, const char* what) {
    if (!param.requires_grad())
        throw error("torch adapter: " + l.who() + ": the " + what + " has requires_grad = false (frozen), so "
                    "it has no gradient to precondition; leave the layer out (kfac::torch::register_modules "
                    "leaves frozen layers out) or unfreeze the whole layer");
    const at::Tensor& g = param.grad();
    if (!g.defined())
        throw error("torch adapter: " + l.who() + ": " + what + ".grad() is undefined while the layer's other "
                    "parameter has a gradient; run the backward pass before step() and keep requires_grad on "
                    "both the weight and the bias");
    const std::string name = std::string(what) + ".grad()";
    check_tensor<Scalar>(l, name.c_str(), g);
    return view_of<Scalar>(l, name.c_str(), g);
}

/// A module option as the two axes of the Conv2d geometry; a Conv1d's single axis is the
/// second, the first is `trivial` (1 for kernel, stride and dilation, 0 for padding).
template <std::size_t D>
std::array<std::int64_t, 2> axes_of(const ::torch::ExpandingArray<D>& a, std::int64_t trivial) {
    static_assert(D == 1 || D == 2);
    if constexpr (D == 1) return {trivial, (*a)[0]};
    else return {(*a)[0], (*a)[1]};
}

/// The description of a torch::nn::Conv2d or Conv1d (D spatial dimensions) from its options.
template <std::size_t D, class ConvImpl>
layer_description describe_conv(const std::string& name, const ConvImpl& m) {
    const auto& o = m.options;
    const char* type = D == 1 ? "torch::nn::Conv1d" : "torch::nn::Conv2d";
    conv2d_geometry g;
    g.kernel = axes_of<D>(o.kernel_size(), 1);
    g.stride = axes_of<D>(o.stride(), 1);
    g.dilation = axes_of<D>(o.dilation(), 1);
    g.groups = o.groups();
    const bool zeros = c10::get_if<::torch::enumtype::kZeros>(&o.padding_mode()) != nullptr;
    if (const auto* explicit_padding = c10::get_if<::torch::ExpandingArray<D>>(&o.padding())) {
        g.padding = axes_of<D>(*explicit_padding, 0);
    } else if (c10::get_if<::torch::enumtype::kValid>(&o.padding()) != nullptr) {
        g.padding = {0, 0};
    } else {  // kSame: total padding dilation·(kernel − 1) per axis, split left/right
        for (std::size_t i = 0; i < 2; ++i) {
            const std::int64_t total = g.dilation[i] * (g.kernel[i] - 1);
            if (zeros && total % 2 != 0)
                throw error("torch adapter: layer '" + name + "' (" + type + "): padding 'same' "
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
    layer_description d = conv2d_description(o.in_channels(), o.out_channels(), g, m.bias.defined());
    if constexpr (D == 1) d.kind = layer_kind::conv1d;
    return d;
}

/// Why register_modules leaves an Embedding out (empty when it can be preconditioned).
inline std::string embedding_left_out(const ::torch::nn::EmbeddingImpl& e) {
    if (e.options.sparse())
        return "sparse = true: a sparse gradient cannot be preconditioned in place";
    if (e.options.scale_grad_by_freq())
        return "scale_grad_by_freq = true: its gradient is already divided by the token counts, which K-FAC's "
               "A factor would divide again";
    return {};
}

/// The weight (scale) and bias (shift) of a normalisation module, its channels and its type.
struct norm_module {
    at::Tensor* weight = nullptr;
    at::Tensor* bias = nullptr;
    std::int64_t channels = 0;
    const char* type = "";
    layer_kind kind = layer_kind::layer_norm;
};

/// A LayerNorm or BatchNorm1d/2d/3d module's parts (nullopt for other modules).
inline std::optional<norm_module> as_norm_module(::torch::nn::Module* m) {
    if (auto* n = dynamic_cast<::torch::nn::LayerNormImpl*>(m)) {
        std::int64_t features = 1;
        for (auto e : n->options.normalized_shape()) features *= e;
        return norm_module{&n->weight, &n->bias, features, "LayerNorm", layer_kind::layer_norm};
    }
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm1dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm1d", layer_kind::batch_norm};
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm2dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm2d", layer_kind::batch_norm};
    if (auto* b = dynamic_cast<::torch::nn::BatchNorm3dImpl*>(m))
        return norm_module{&b->weight, &b->bias, b->options.num_features(), "BatchNorm3d", layer_kind::batch_norm};
    return std::nullopt;
}

/// The weight of a module the tracker can take (nullptr for other modules); undefined for a
/// normalisation module without affine parameters.
inline const at::Tensor* tracked_weight(::torch::nn::Module* m) {
    if (auto* c = dynamic_cast<::torch::nn::Conv2dImpl*>(m)) return &c->weight;
    if (auto* c = dynamic_cast<::torch::nn::Conv1dImpl*>(m)) return &c->weight;
    if (auto* l = dynamic_cast<::torch::nn::LinearImpl*>(m)) return &l->weight;
    if (auto* e = dynamic_cast<::torch::nn::EmbeddingImpl*>(m)) return &e->weight;
    if (const auto n = as_norm_module(m)) return n->weight;
    return nullptr;
}

/// The library's skip rule (preconditioner::register_layer): a pattern that matches the name
/// or a kind name.
inline bool skipped(const options& opts, const std::string& name, layer_kind kind) {
    const char* lower = kind_name(kind);
    const char* pytorch = pytorch_module_name(kind);
    for (const auto& pattern : opts.skip_layers) {
        const std::regex re(pattern, std::regex::ECMAScript);
        if (std::regex_search(name, re) || std::regex_search(lower, re) || std::regex_search(pytorch, re))
            return true;
    }
    return false;
}

/// The kind of a module the tracker can take (nullopt for any other module).
inline std::optional<layer_kind> trackable_kind(::torch::nn::Module* m) {
    if (dynamic_cast<const ::torch::nn::LinearImpl*>(m) != nullptr) return layer_kind::linear;
    if (dynamic_cast<const ::torch::nn::Conv2dImpl*>(m) != nullptr) return layer_kind::conv2d;
    if (dynamic_cast<const ::torch::nn::Conv1dImpl*>(m) != nullptr) return layer_kind::conv1d;
    if (dynamic_cast<const ::torch::nn::EmbeddingImpl*>(m) != nullptr) return layer_kind::embedding;
    if (const auto n = as_norm_module(m)) return n->kind;
    return std::nullopt;
}

}  // namespace detail

/// A tracked `torch::nn::Linear`, `Conv2d`, `Conv1d`, `Embedding`, `LayerNorm` or `BatchNorm1d/2d/3d`:
/// what the preconditioner registers
/// (through kfac::layer_traits). Owned by its tracker; only its tracker creates it.
///
/// @tparam Scalar float or double: the module's dtype and the backend's scalar type.
template <class Scalar>
class tracked_layer {
public:
    explicit tracked_layer(std::shared_ptr<detail::layer_state> state) : state_(std::move(state)) {}

    [[nodiscard]] const std::string& name() const noexcept { return state_->name; }
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
    [[nodiscard]] tensor_view<const Scalar> activations_view(std::int64_t i) const {
        const auto p = usable(i);
        detail::check_tensor<Scalar>(*state_, "the captured input", p->input);
        const at::Tensor& x = p->activations();
        return detail::view_of<const Scalar>(*state_, "the captured input", x);
    }
    [[nodiscard]] tensor_view<const Scalar> output_gradients_view(std::int64_t i) const {
        const auto p = usable(i);
        detail::check_tensor<Scalar>(*state_, "the captured output gradient", p->grad_output);
        return detail::view_of<const Scalar>(*state_, "the captured output gradient", p->grad_output);
    }
    /// Whether backward gave the layer a gradient (false: not called in this step, with the
    /// gradients set to none, or never called).
    [[nodiscard]] bool has_gradient() const {
        return state_->weight->grad().defined() || (state_->bias->defined() && state_->bias->grad().defined());
    }
    /// The weight's own .grad() buffer. @throws kfac::error if undefined, not contiguous, not
    /// on the CPU or a CUDA device, or not of Scalar.
    [[nodiscard]] tensor_view<Scalar> weight_gradient_view() const {
        return flat_for_norm(detail::gradient_view<Scalar>(*state_, *state_->weight, "weight"));
    }
    /// The bias's own .grad() buffer, or an empty view without bias.
    [[nodiscard]] tensor_view<Scalar> bias_gradient_view() const {
        if (!state_->description.bias) return {};
        return flat_for_norm(detail::gradient_view<Scalar>(*state_, *state_->bias, "bias"));
    }
    /// Forgets the current pass's applications (the preconditioner calls it when done).
    void end_pass() { state_->forget_applications(); }

private:
    /// A normalisation layer's parameter gradient as one dimension (a LayerNorm's
    /// normalized_shape flattened, as its description counts the features).
    tensor_view<Scalar> flat_for_norm(tensor_view<Scalar> v) const {
        if (!is_normalization(state_->description.kind) || v.empty()) return v;
        return tensor_view<Scalar>::from_extents(v.data, std::array<std::int64_t, 1>{v.size()}, v.space);
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
    /// @throws kfac::error for a duplicate name or module, a frozen weight, or a module not of
    ///         Scalar on the CPU or a CUDA device; nothing is tracked then.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Linear& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a Conv2d module under `name`.
    /// @throws kfac::error as above, or for padding 'same' that pads unevenly.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Conv2d& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a Conv1d module under `name`.
    /// @throws kfac::error as above, or for padding 'same' that pads unevenly.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Conv1d& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks an Embedding module under `name`.
    /// @throws kfac::error as above, or for a sparse or scale_grad_by_freq Embedding.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::Embedding& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a LayerNorm module under `name` (with its elementwise affine parameters).
    /// @throws kfac::error as above, or for a LayerNorm without them.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::LayerNorm& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a BatchNorm2d module under `name` (BatchNorm1d and 3d through the overload below).
    /// @throws kfac::error as above, or for a BatchNorm without affine parameters.
    tracked_layer<Scalar>& track(const std::string& name, const ::torch::nn::BatchNorm2d& module) {
        return track(name, std::static_pointer_cast<::torch::nn::Module>(module.ptr()));
    }
    /// Tracks a module that is a torch::nn::LinearImpl, Conv2dImpl, Conv1dImpl, EmbeddingImpl,
    /// LayerNormImpl or BatchNorm1d/2d/3dImpl.
    /// @throws kfac::error for any other module, and as above.
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
    [[nodiscard]] std::size_t size() const noexcept { return layers_.size(); }

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
            s->description = detail::describe_conv<2>(name, *conv);
        } else if (auto* conv1d = dynamic_cast<::torch::nn::Conv1dImpl*>(module.get())) {
            s->type = "Conv1d";
            s->weight = &conv1d->weight;
            s->bias = &conv1d->bias;
            s->description = detail::describe_conv<1>(name, *conv1d);
        } else if (auto* embedding = dynamic_cast<::torch::nn::EmbeddingImpl*>(module.get())) {
            s->type = "Embedding";
            s->weight = &embedding->weight;
            s->bias = &s->no_bias;
            s->description = embedding_description(embedding->options.num_embeddings(),
                                                   embedding->options.embedding_dim());
            if (const std::string why = detail::embedding_left_out(*embedding); !why.empty())
                throw error("torch adapter: " + s->who() + ": " + why + "; leave the layer out "
                            "(kfac::torch::register_modules does) or construct it without that option");
        } else if (const auto norm = detail::as_norm_module(module.get())) {
            s->type = norm->type;
            s->weight = norm->weight;
            s->bias = norm->bias->defined() ? norm->bias : &s->no_bias;
            s->description = norm->kind == layer_kind::layer_norm ? layer_norm_description(norm->channels, s->bias->defined())
                                                                  : batch_norm_description(norm->channels, s->bias->defined());
            if (!s->weight->defined())
                throw error("torch adapter: " + s->who() + " has no affine parameters (elementwise_affine or affine "
                            "is false), so there is nothing to precondition; leave it out (kfac::torch::register_modules "
                            "does)");
        } else {
            throw error("torch adapter: module '" + name + "' (" +
                        (module ? module->name() : std::string("null")) +
                        ") is none of torch::nn::Linear, Conv2d, Conv1d, Embedding, LayerNorm, BatchNorm1d/2d/3d");
        }
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

private:
    std::shared_ptr<detail::tracker_core> core_;
    std::vector<std::unique_ptr<tracked_layer<Scalar>>> layers_;  // stable addresses
};

/// What register_modules did with each module of the model.
struct registration {
    /// A module left to the host's optimizer (or frozen), and why.
    struct left_out {
        std::string name;    ///< as named_modules() names it
        std::string module;  ///< its type, "torch::nn::GroupNorm"
        std::string reason;
    };
    std::vector<std::string> registered;  ///< in registration order
    std::vector<left_out> not_preconditioned;

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
    for (const auto& item : model->named_modules(prefix, /*include_self=*/true)) {
        const std::shared_ptr<::torch::nn::Module>& m = item.value();
        const std::string name = item.key().empty() ? m->name() : item.key();
        const auto kind = trackable_kind(m.get());
        if (!kind) {
            if (has_own_parameters(*m))
                report.not_preconditioned.push_back({name, module_type(*m), "no K-FAC block for this module type"});
            continue;
        }
        auto left_out = [&](std::string reason) {
            report.not_preconditioned.push_back({name, module_type(*m), std::move(reason)});
        };
        if (skipped(opts, name, *kind)) {
            left_out("matched by options.skip_layers");
            continue;
        }
        const at::Tensor& weight = *tracked_weight(m.get());
        const auto* embedding = dynamic_cast<const ::torch::nn::EmbeddingImpl*>(m.get());
        if (!weight.defined() && is_normalization(*kind)) continue;  // no affine parameters: nothing to precondition
        if (weight.defined() && !weight.requires_grad()) {
            left_out("frozen: the weight has requires_grad = false");
            continue;
        }
        if (embedding)
            if (std::string why = embedding_left_out(*embedding); !why.empty()) {
                left_out(std::move(why));
                continue;
            }
        auto s = tracker.prepare(name, m, states);
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
    registration report;
    std::vector<tracked_layer<Scalar>*> layers;
};

/// Tracks every module of `model` that register_modules() would register
/// precondition (as register_modules() chooses them, with `opts.skip_layers`), without
/// registering them: for a preconditioner that this translation unit cannot instantiate,
/// through kfac::any_layer (see any_layer.hpp). All or nothing.
/// @throws kfac::error as tracker::track does; nothing is tracked then.
template <class Scalar, class Model>
tracked_modules<Scalar> track_modules(tracker<Scalar>& tracker, const Model& model, const options& opts = {},
                                      const std::string& prefix = "") {
    auto [report, states] = detail::prepare_modules(tracker, model, opts, prefix);
    return {std::move(report), tracker.adopt(std::move(states))};
}

/// Tracks and registers every torch::nn::Linear, Conv2d, Conv1d, Embedding, LayerNorm and
/// BatchNorm1d/2d/3d of `model` (a
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
    const auto tracked = tracker.adopt(std::move(states));
    std::vector<std::pair<std::string, tracked_layer<Scalar>*>> list;
    for (auto* l : tracked) list.emplace_back(l->name(), l);
    try {
        preconditioner.register_layers(list);
    } catch (...) {
        tracker.drop_last(tracked.size());
        throw;
    }
    return report;
}

}  // namespace kfac::torch

namespace kfac {

/// The adapter of a tracked LibTorch module, in the per-application form: the views read the
/// tensors the tracker captured in the current pass and the parameters' own .grad() buffers.
template <class Scalar>
struct layer_traits<torch::tracked_layer<Scalar>> {
    using scalar_type = Scalar;
    using layer = torch::tracked_layer<Scalar>;
    static layer_description describe(const layer& l) { return l.description(); }
    static std::int64_t applications(const layer& l) { return l.applications(); }
    static tensor_view<const Scalar> activations(const layer& l, std::int64_t i) { return l.activations_view(i); }
    static tensor_view<const Scalar> output_gradients(const layer& l, std::int64_t i) {
        return l.output_gradients_view(i);
    }
    static bool has_gradient(const layer& l) { return l.has_gradient(); }
    static tensor_view<Scalar> weight_gradient(layer& l) { return l.weight_gradient_view(); }
    static tensor_view<Scalar> bias_gradient(layer& l) { return l.bias_gradient_view(); }
    static void end_pass(layer& l) { l.end_pass(); }
};

}  // namespace kfac
