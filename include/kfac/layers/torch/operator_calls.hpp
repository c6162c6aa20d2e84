// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/operator_calls.hpp
/// The arguments of a recognised operator call read as the module's options, one handler per
/// operator family (read_call): a convolution's geometry (checked against the module's) and how
/// a normalisation operator normalised its input.
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

/// How an aten::layer_norm, batch_norm, group_norm or instance_norm call normalises its input
/// (its arguments are listed at positions()); a problem when they are not what the schema says.
///   layer_norm(input, normalized_shape, weight, bias, eps, ...)      the last dimensions
///   group_norm(input, num_groups, weight, bias, eps, ...)            each example's groups
///   batch_norm(input, weight, bias, mean, var, training, momentum, eps, ...)
///   instance_norm(input, weight, bias, mean, var, use_input_stats, momentum, eps, ...)
/// the last two over the batch's (BatchNorm) or each example's (InstanceNorm) positions of a
/// channel, or by the running statistics the call was given.
inline norm_call read_norm_call(op_kind kind, c10::ArrayRef<const c10::IValue> args, const layer_state& l,
                                std::string& problem) {
    norm_call n;
    const at::Tensor& x = args[0].toTensor();
    const auto rank = static_cast<std::int64_t>(x.dim());
    const bool layer_norm = kind == op_kind::layer_norm, group_norm = kind == op_kind::group_norm;
    const std::size_t eps_at = layer_norm || group_norm ? 4 : 7;
    const bool readable = args.size() > eps_at && args[eps_at].isDouble() &&
                          (layer_norm ? args[1].isIntList() : group_norm ? args[1].isInt() : args[5].isBool());
    if (!readable) {
        problem = "torch adapter: " + l.who() + ": the arguments of aten::" + kind_name(normalized_kind(kind)) +
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
    } else if (group_norm) {
        n.groups = args[1].toInt();
    } else if (args[5].toBool() || !args[3].isTensor() || !args[4].isTensor()) {  // the call's own statistics
        const std::int64_t first = kind == op_kind::instance_norm ? 2 : 0;  // InstanceNorm: per example
        for (std::int64_t i = first; i < rank; ++i)
            if (i != 1) n.dims.push_back(i);
    } else {
        n.mean = args[3].toTensor().detach().clone();  // the buffers change with later training calls
        n.var = args[4].toTensor().detach().clone();
    }
    return n;
}

/// Why a convolution call cannot be an application of the convolution layer `l` (empty when it
/// can): another kind of convolution than the module's, or other options.
inline std::string conv_call_problem(op_kind kind, const layer_state& l, c10::ArrayRef<const c10::IValue> args) {
    const bool module_one_d = l.description.kind == layer_kind::conv1d;
    if (module_one_d != (kind == op_kind::conv1d))
        return "torch adapter: " + l.who() + ": its weight was used by aten::" +
               (kind == op_kind::conv1d ? "conv1d" : "conv2d") + ", another kind of convolution than the module's; "
               "call the module itself or leave the layer out with options.skip_layers";
    return conv_call_mismatch(l, args);
}

/// What a recognised call's arguments say beyond its input and weight, by its family
/// (capture.hpp, op_family): a convolution's options checked against the module's, how a
/// normalisation normalised its input. A linear or embedding call's input and weight say it all.
inline void read_call(op_kind kind, c10::ArrayRef<const c10::IValue> args, const layer_state& l, observed_call& call) {
    switch (family_of(kind)) {
        case op_family::conv: call.problem = conv_call_problem(kind, l, args); return;
        case op_family::norm: call.norm = read_norm_call(kind, args, l, call.problem); return;
        default: return;
    }
}

}  // namespace detail
}  // namespace kfac::torch
