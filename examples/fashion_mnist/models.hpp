// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file models.hpp
/// The flagship's two models for 1×28×28 images, as ordinary LibTorch code: modules declared as
/// members and a hand-written forward. kfac::torch::register_modules finds their Conv2d and
/// Linear layers by name; nothing here knows about K-FAC.

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

namespace kfac_examples::fashion {

namespace nn = torch::nn;

/// A small CNN: conv(1→16, 3×3) → ReLU → max-pool → conv(16→32, 3×3) → ReLU → max-pool →
/// max-pool → Linear(288→128) → ReLU → Linear(128→10). The third pooling keeps the first
/// Linear's input at 32·3·3 = 288, so its A factor (289²) is cheap to decompose.
struct cnn_impl : nn::Module {
    nn::Conv2d conv1{nullptr}, conv2{nullptr};
    nn::Linear fc1{nullptr}, fc2{nullptr};

    cnn_impl() {
        conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)));
        conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)));
        fc1 = register_module("fc1", nn::Linear(32 * 3 * 3, 128));
        fc2 = register_module("fc2", nn::Linear(128, 10));
    }

    torch::Tensor forward(torch::Tensor x) {
        x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 16×14×14
        x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 32×7×7
        x = torch::max_pool2d(x, 2).flatten(1);            // 32×3×3
        return fc2(torch::relu(fc1(x)));
    }
};
TORCH_MODULE_IMPL(cnn, cnn_impl);

/// A basic residual block (He et al. 2016): conv 3×3 → BatchNorm → ReLU → conv 3×3 → BatchNorm,
/// plus the input, or its strided 1×1 projection (conv + BatchNorm) when the shape changes;
/// then ReLU. Convolutions before a BatchNorm have no bias (the BatchNorm's shift is one).
struct basic_block_impl : nn::Module {
    nn::Conv2d conv1{nullptr}, conv2{nullptr}, projection{nullptr};
    nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, projection_bn{nullptr};

    basic_block_impl(std::int64_t in, std::int64_t out, std::int64_t stride) {
        conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
        bn1 = register_module("bn1", nn::BatchNorm2d(out));
        conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
        bn2 = register_module("bn2", nn::BatchNorm2d(out));
        if (stride != 1 || in != out) {
            projection = register_module("projection", nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
            projection_bn = register_module("projection_bn", nn::BatchNorm2d(out));
        }
    }

    torch::Tensor forward(const torch::Tensor& x) {
        auto y = torch::relu(bn1(conv1(x)));
        y = bn2(conv2(y));
        return torch::relu(y + (projection ? projection_bn(projection(x)) : x));
    }
};
TORCH_MODULE_IMPL(basic_block, basic_block_impl);

/// ResNet-8 for 28×28 images: a conv(1→16)-BatchNorm-ReLU stem, three basic blocks of 16, 32 and
/// 64 channels (the last two halve the resolution: 28 → 14 → 7, with projections), global
/// average pooling and a Linear(64→10) head: 10 Conv2d/Linear layers for K-FAC and 9
/// BatchNorm layers left to the optimizer.
struct resnet_impl : nn::Module {
    nn::Conv2d stem{nullptr};
    nn::BatchNorm2d stem_bn{nullptr};
    basic_block layer1{nullptr}, layer2{nullptr}, layer3{nullptr};
    nn::Linear fc{nullptr};

    resnet_impl() {
        stem = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)));
        stem_bn = register_module("stem_bn", nn::BatchNorm2d(16));
        layer1 = register_module("layer1", basic_block(16, 16, 1));
        layer2 = register_module("layer2", basic_block(16, 32, 2));
        layer3 = register_module("layer3", basic_block(32, 64, 2));
        fc = register_module("fc", nn::Linear(64, 10));
    }

    torch::Tensor forward(const torch::Tensor& x) {
        auto y = torch::relu(stem_bn(stem(x)));
        y = layer3(layer2(layer1(y)));
        return fc(y.mean({2, 3}));  // global average pooling
    }
};
TORCH_MODULE_IMPL(resnet, resnet_impl);

/// Either model behind one interface, so the training loop is written once.
struct classifier {
    std::string name;  ///< "cnn" or "resnet"
    std::shared_ptr<nn::Module> module;
    std::function<torch::Tensor(const torch::Tensor&)> forward;
};

inline classifier make_classifier(const std::string& name) {
    if (name == "cnn") {
        cnn m;
        return {name, m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
    }
    if (name == "resnet") {
        resnet m;
        return {name, m.ptr(), [m](const torch::Tensor& x) mutable { return m->forward(x); }};
    }
    throw std::invalid_argument("unknown model '" + name + "' (cnn or resnet)");
}

/// One line describing the model, for the program's header.
inline std::string describe(const std::string& name) {
    if (name == "cnn")
        return "CNN conv(1->16,3x3)-ReLU-pool, conv(16->32,3x3)-ReLU-pool-pool, linear(288->128)-ReLU, linear(128->10)";
    return "ResNet-8: conv(1->16)-BN-ReLU, basic blocks 16, 32/2, 64/2 (1x1 strided projections), global "
           "average pool, linear(64->10)";
}

}  // namespace kfac_examples::fashion
