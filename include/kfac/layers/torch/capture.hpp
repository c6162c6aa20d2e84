// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/capture.hpp
/// What the observer captures: one application of a module (its input and output gradient), a
/// tracked module's state, the thread's observer, and how an operator is recognised as a tracked
/// module's computation.
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
#include <torch/nn/functional/instancenorm.h>  // before the module, whose header uses it unincluded
#include <torch/nn/modules/instancenorm.h>
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
/// statistics over `dims` (biased variance), over each example's `groups` groups of channels
/// (GroupNorm, when groups > 0) or, when `mean` is defined, the running statistics of the
/// channels (dimension 1: BatchNorm, InstanceNorm). `shape` is the views' shape: a LayerNorm's
/// normalised dimensions flattened into one.
struct norm_call {
    std::vector<std::int64_t> dims;
    std::int64_t groups = 0;
    double eps = 1e-5;
    at::Tensor mean, var;
    std::vector<std::int64_t> shape;
};

/// x̂ of `x`, shaped `n.shape` and contiguous: in x's dtype, but for a bfloat16 or half x in
/// float (x̂ is formed from x by a mean and a variance, which 8 or 11 bits would round away).
inline at::Tensor normalized_input(const at::Tensor& input, const norm_call& n) {
    const c10::NoGradGuard no_grad;  // nor does the tracker's observer look at these operators
    const bool reduced = input.scalar_type() == c10::ScalarType::BFloat16 || input.scalar_type() == c10::ScalarType::Half;
    const at::Tensor x = reduced ? input.to(c10::ScalarType::Float) : input;
    at::Tensor mean, var;
    if (n.mean.defined()) {
        std::vector<std::int64_t> channels(static_cast<std::size_t>(x.dim()), 1);
        channels[1] = x.size(1);
        mean = n.mean.reshape(channels).to(x.scalar_type());
        var = n.var.reshape(channels).to(x.scalar_type());
    } else if (n.groups > 0) {  // [N, groups, channels of a group · spatial]
        const at::Tensor grouped = x.reshape({x.size(0), n.groups, -1});
        mean = grouped.mean({2}, /*keepdim=*/true);
        var = (grouped - mean).square().mean({2}, /*keepdim=*/true);
        return ((grouped - mean) * (var + n.eps).rsqrt()).reshape(n.shape).contiguous();
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

enum class op_kind {
    none,
    transpose,
    addmm,
    matmul,
    mm,
    linear,
    conv2d,
    conv1d,
    embedding,
    layer_norm,
    batch_norm,
    group_norm,
    instance_norm
};

/// The families of recognised operators, each with one handler: which tracked layers its calls
/// apply (match() below), and what its arguments say (read_call() in operator_calls.hpp):
///   transpose  aten::t of a Linear's weight: marks the transposed weight a product will take
///   linear     aten::addmm, matmul, mm of that transposed weight, or aten::linear
///   conv       aten::conv2d, conv1d: the call's geometry against the module's
///   embedding  aten::embedding
///   norm       aten::layer_norm, batch_norm, group_norm, instance_norm: how the call normalised
///              its input
enum class op_family { none, transpose, linear, conv, embedding, norm };

inline constexpr op_family family_of(op_kind k) noexcept {
    switch (k) {
        case op_kind::transpose: return op_family::transpose;
        case op_kind::addmm:
        case op_kind::matmul:
        case op_kind::mm:
        case op_kind::linear: return op_family::linear;
        case op_kind::conv2d:
        case op_kind::conv1d: return op_family::conv;
        case op_kind::embedding: return op_family::embedding;
        case op_kind::layer_norm:
        case op_kind::batch_norm:
        case op_kind::group_norm:
        case op_kind::instance_norm: return op_family::norm;
        default: return op_family::none;
    }
}

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
        case 'g': return std::strcmp(op, "group_norm") == 0 ? op_kind::group_norm : op_kind::none;
        case 'i': return std::strcmp(op, "instance_norm") == 0 ? op_kind::instance_norm : op_kind::none;
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
        case op_kind::group_norm: return {0, 2, false};     // group_norm(input, num_groups, weight, ...)
        case op_kind::instance_norm: return {0, 1, false};  // instance_norm(input, weight, ...)
        default: return {0, 1, false};                      // linear/conv2d/conv1d(input, weight, ...)
    }
}

/// The layer kind a normalisation operator applies (InstanceNorm's aten::instance_norm calls
/// aten::batch_norm with the weight repeated per example, a tensor no module owns).
inline constexpr layer_kind normalized_kind(op_kind k) noexcept {
    switch (k) {
        case op_kind::layer_norm: return layer_kind::layer_norm;
        case op_kind::group_norm: return layer_kind::group_norm;
        case op_kind::instance_norm: return layer_kind::instance_norm;
        default: return layer_kind::batch_norm;
    }
}

/// Whether a call of `kind` (of its family) whose weight operand is `key` applies layer `l`.
inline bool applies(const layer_state& l, op_kind kind, const at::TensorImpl* key) {
    const bool own_weight = key == l.weight->unsafeGetTensorImpl();
    switch (family_of(kind)) {
        case op_family::transpose: return l.description.kind == layer_kind::linear && own_weight;
        case op_family::linear:
            if (!positions(kind).transposed) return l.description.kind == layer_kind::linear && own_weight;  // aten::linear
            return l.description.kind == layer_kind::linear && l.transposed.defined() &&
                   key == l.transposed.unsafeGetTensorImpl();
        // A call of the other kind of convolution is an application K-FAC cannot describe:
        // read_call() records why.
        case op_family::conv: return is_convolution(l.description.kind) && own_weight;
        case op_family::embedding: return l.description.kind == layer_kind::embedding && own_weight;
        case op_family::norm: return l.description.kind == normalized_kind(kind) && own_weight;
        default: return false;
    }
}

/// The tracked layer, in training mode, whose weight (or transposed weight) `key` is, for an
/// operator of `kind`.
inline std::shared_ptr<layer_state> match(const thread_observer& obs, op_kind kind, const at::TensorImpl* key) {
    for (const auto& weak : obs.trackers) {
        const auto core = weak.lock();
        if (!core) continue;
        for (const auto& l : core->layers) {
            if (!l->weight->defined() || !l->weight->requires_grad() || !l->module->is_training()) continue;
            if (applies(*l, kind, key)) return l;
        }
    }
    return nullptr;
}

}  // namespace detail
}  // namespace kfac::torch
