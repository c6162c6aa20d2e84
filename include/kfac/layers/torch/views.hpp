// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/views.hpp
/// Captured tensors and parameter gradients as kfac::tensor_view, checked for dtype, layout and
/// device.
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
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/precision.hpp"
#include "kfac/options.hpp"
#include "kfac/layers/torch/capture.hpp"

namespace kfac::torch {
namespace detail {

template <class Scalar>
constexpr c10::ScalarType scalar_type_of() noexcept {
    return std::is_same_v<Scalar, float> ? c10::ScalarType::Float : c10::ScalarType::Double;
}

template <class Scalar>
const char* scalar_name() noexcept {
    return std::is_same_v<Scalar, float> ? "float (torch::kFloat)" : "double (torch::kDouble)";
}

/// The format of a tensor's dtype, when kfac reads it: float, double, bfloat16 and half
/// (a model in bf16, or under autocast, hands the preconditioner tensors of each).
inline std::optional<precision> format_of(c10::ScalarType t) noexcept {
    switch (t) {
        case c10::ScalarType::Float: return precision::fp32;
        case c10::ScalarType::Double: return precision::fp64;
        case c10::ScalarType::BFloat16: return precision::bf16;
        case c10::ScalarType::Half: return precision::fp16;
        default: return std::nullopt;
    }
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
/// tensor of float, double, bfloat16 or half (converted to the backend's type as it is read:
/// docs/precision.md).
template <class Scalar>
void check_tensor(const layer_state& l, const char* what, const at::Tensor& t) {
    (void)memory_space_of(l, what, t.device());
    if (t.layout() != c10::kStrided)
        throw error("torch adapter: " + l.who() + ": " + what + " is not a dense (strided) tensor");
    if (!format_of(t.scalar_type()))
        throw error("torch adapter: " + l.who() + ": " + what + " has dtype " +
                    std::string(c10::toString(t.scalar_type())) +
                    ", which kfac does not read; kfac reads float, double, bfloat16 and half tensors (the "
                    "tracker's " + scalar_name<Scalar>() + " is the backend's compute type): convert the model");
    if (!t.is_contiguous())
        throw error("torch adapter: " + l.who() + ": " + what + " is not contiguous (sizes " +
                    c10::str(t.sizes()) + ", strides " + c10::str(t.strides()) +
                    "); kfac writes the preconditioned gradient in place and needs C-order "
                    "memory: keep the parameters and their .grad() contiguous (no channels_last)");
}

/// The view of a checked tensor, in its own format. `Void`: const void or void.
template <class Void>
number_view<Void> view_of(const layer_state& l, const char* what, const at::Tensor& t) {
    number_view<Void> v;
    static_cast<tensor_view<Void>&>(v) =
        tensor_view<Void>::from_extents(t.data_ptr(), t.sizes(), memory_space_of(l, what, t.device()));
    v.format = *format_of(t.scalar_type());
    return v;
}

template <class Scalar>
number_view<void> gradient_view(const layer_state& l, const at::Tensor& param, const char* what) {
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
    return view_of<void>(l, name.c_str(), g);
}

}  // namespace detail
}  // namespace kfac::torch
