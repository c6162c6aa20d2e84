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
#include "kfac/layers/tensor_view.hpp"
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

}  // namespace detail
}  // namespace kfac::torch
