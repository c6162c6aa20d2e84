// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch.hpp
/// LibTorch adapter: K-FAC for the `torch::nn::Linear`, `Conv2d`, `Conv1d`, `Embedding`,
/// `LayerNorm`, `BatchNorm1d/2d/3d`, `GroupNorm` and (affine) `InstanceNorm1d/2d/3d` members of an
/// existing model, with no change to the
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
/// * LayerNorm, BatchNorm, GroupNorm, InstanceNorm: `aten::layer_norm(input, normalized_shape,
///   weight, bias, eps, ...)`, `aten::batch_norm(input, weight, bias, running_mean, running_var,
///   training, momentum, eps, ...)`, `aten::group_norm(input, num_groups, weight, bias, eps,
///   ...)` and `aten::instance_norm(input, weight, bias, running_mean, running_var,
///   use_input_stats, momentum, eps, ...)`. K-FAC sees their affine part y = weight ⊙ x̂ + bias,
///   so the activations are x̂, recomputed from the captured input as the operator normalised
///   it (over the normalised dimensions; over every dimension but the channels with the batch
///   statistics in training; over each example's groups of channels; over each example's
///   positions of a channel; or by the running statistics it was given; biased variance, the
///   call's eps), on factor-update steps only. A LayerNorm over several dimensions is seen as
///   one over their product.
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
///
/// The adapter's rooms (kfac/layers/torch/): capture (an application, a tracked module's state,
/// the thread's observer), operator_calls (a recognised call's arguments), observer (the
/// RecordFunction callbacks and backward hooks), views (tensors as tensor_view), modules (the
/// table of module types: per type its parameters, description and why it is left out), tracker (tracked_layer, its
/// layer_traits, tracker), registration (register_modules, track_modules, the report).

#include "kfac/layers/torch/grad_scaler.hpp"
#include "kfac/layers/torch/registration.hpp"
#include "kfac/layers/torch/tracker.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace kfac {
/// LibTorch's 16-bit types as view elements (kfac/precision.hpp): c10::BFloat16 is bf16.
template <>
struct number_format<c10::BFloat16> {
    static constexpr precision format = precision::bf16;  ///< c10::BFloat16's format
};
/// c10::Half is fp16.
template <>
struct number_format<c10::Half> {
    static constexpr precision format = precision::fp16;  ///< c10::Half's format
};
}  // namespace kfac
