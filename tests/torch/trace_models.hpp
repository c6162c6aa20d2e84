// SPDX-License-Identifier: Apache-2.0
#pragma once
// The models of the LibTorch adapter's fixtures: the flagship's (examples/fashion_mnist) and a
// small transformer-like stack with one module of every type the adapter takes (Embedding,
// LayerNorm, Linear expanding and reducing, Conv1d, BatchNorm1d, GroupNorm) and some that
// register_modules leaves out, each for another reason (a sparse Embedding, a frozen Linear, a
// PReLU, which has no K-FAC block, and a LayerNorm matched by a skip pattern); and their registration
// reports, which tests/data/traces/torch_registration.txt holds
// (kfac_torch_traces --registration writes them).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include "fashion_mnist/models.hpp"

namespace kfac_test {

struct transformer_stack_impl : torch::nn::Module {
    static constexpr std::int64_t vocabulary = 20, width = 8;
    torch::nn::Embedding tokens{nullptr}, positions{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear expand{nullptr}, reduce{nullptr}, frozen{nullptr};
    torch::nn::Conv1d mix{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
    torch::nn::GroupNorm group_norm{nullptr};
    torch::nn::PReLU act{nullptr};

    transformer_stack_impl() {
        tokens = register_module("tokens", torch::nn::Embedding(vocabulary, width));
        positions = register_module("positions", torch::nn::Embedding(torch::nn::EmbeddingOptions(6, width).sparse(true)));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
        expand = register_module("expand", torch::nn::Linear(width, 2 * width));
        reduce = register_module("reduce", torch::nn::Linear(2 * width, width));
        mix = register_module("mix", torch::nn::Conv1d(torch::nn::Conv1dOptions(width, width, 3).padding(1)));
        bn = register_module("bn", torch::nn::BatchNorm1d(width));
        group_norm = register_module("group_norm", torch::nn::GroupNorm(2, width));
        act = register_module("act", torch::nn::PReLU());
        frozen = register_module("frozen", torch::nn::Linear(width, width));
        frozen->weight.set_requires_grad(false);
        frozen->bias.set_requires_grad(false);
    }

    /// ids: (batch, sequence ≤ 6) token ids → (batch, sequence, width).
    torch::Tensor forward(const torch::Tensor& ids) {
        auto h = norm(tokens(ids));                                  // (N, L, W)
        h = h + reduce(torch::gelu(expand(h)));                      // expand/reduce MLP
        auto c = bn(mix(h.transpose(1, 2)));                         // (N, W, L)
        c = act(group_norm(c));
        return frozen(c.transpose(1, 2));
    }
};
TORCH_MODULE_IMPL(transformer_stack, transformer_stack_impl);

/// "<model>: <registration summary>" for each model and skip option of the fixture.
inline std::vector<std::string> registration_reports() {
    auto report = [](const std::string& name, const std::shared_ptr<torch::nn::Module>& model, kfac::options o) {
        kfac::torch::tracker<float> tracker;
        kfac::KFAC<> p(o);
        return name + ": " + kfac::torch::register_modules(p, tracker, model).summary();
    };
    kfac::options flagship;
    flagship.skip_layers = {"BatchNorm"};  // as kfac_fashion_mnist registers the ResNet-8
    kfac::options skip_norm;
    skip_norm.skip_layers = {"^norm$"};
    return {
        report("resnet8", kfac_examples::fashion::resnet().ptr(), {}),
        report("resnet8 skip BatchNorm", kfac_examples::fashion::resnet().ptr(), flagship),
        report("cnn", kfac_examples::fashion::cnn().ptr(), {}),
        report("stack", transformer_stack().ptr(), {}),
        report("stack skip norm", transformer_stack().ptr(), skip_norm),
    };
}

}  // namespace kfac_test
