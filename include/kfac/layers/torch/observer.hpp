// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/observer.hpp
/// The RecordFunction observer: at an operator's start, the recognised module's input kept; at its
/// end, a hook on its output that adds the application when the backward pass reaches it.
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
#include "kfac/layers/torch/operator_calls.hpp"

namespace kfac::torch {
namespace detail {

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
        read_call(kind, args, *layer, *call);
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

}  // namespace detail
}  // namespace kfac::torch
