// SPDX-License-Identifier: Apache-2.0
#pragma once
// One layer of every kind the preconditioner supports beyond the plain Linear and Conv2d, with
// seeded buffers: for tests that run a whole model of them through two configurations (the CUDA
// backend against the CPU one, host staging against direct collectives) and compare.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "unit/test_util.hpp"

namespace kfac_test {

/// One layer of every kind and weight sharing beyond `expand` Linear/Conv2d, with and without
/// bias or shift, named: a Linear layer and a Conv2d under `reduce`, a Conv1d, a grouped and a
/// depthwise convolution, an Embedding, LayerNorms and BatchNorms under both weight sharings, a
/// GroupNorm and an InstanceNorm;
/// each bound to its own buffers.
template <class T>
std::vector<std::pair<std::string, owned_layer<T>>> every_kind() {
    std::vector<std::pair<std::string, owned_layer<T>>> layers;
    {  // a Linear layer over [N, positions, features] under `reduce`
        auto l = random_linear<T>(20, 6, 3, true, 11);
        l.view.description.sharing = kfac::weight_sharing::reduce;
        l.input_shape = {4, 5, 6};
        l.output_shape = {4, 5, 3};
        l.bind();
        layers.emplace_back("fc_reduce", l);
    }
    {
        auto l = random_conv<T>(3, 2, 4, {{3, 3}, {2, 1}, {1, 1}, {1, 1}, 1}, false, 6, 5, 13);
        l.view.description.sharing = kfac::weight_sharing::reduce;
        l.bind();
        layers.emplace_back("conv_reduce", l);
    }
    {  // Conv1d 2 → 3, kernel 3, stride 2, padding 1, over length 9: 5 outputs
        owned_layer<T> l;
        l.view.description = kfac::conv1d_description(2, 3, {3, 2, 1, 1, 1}, true);
        l.input = random_vector<T>(4 * 2 * 9, 15);
        l.grad_output = random_vector<T>(4 * 3 * 5, 16, 0.25);
        l.grad_weight = random_vector<T>(3 * 2 * 3, 17, 0.1);
        l.grad_bias = random_vector<T>(3, 18, 0.1);
        l.input_shape = {4, 2, 9};
        l.output_shape = {4, 3, 5};
        l.bind();
        layers.emplace_back("conv1d", l);
    }
    layers.emplace_back("grouped", random_conv<T>(3, 4, 6, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 2}, true, 5, 5, 19));
    layers.emplace_back("depthwise", random_conv<T>(3, 4, 4, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 4}, false, 5, 5, 23));
    layers.emplace_back("embedding", random_embedding<T>(10, 4, 3, 5, 3, 27));
    layers.emplace_back("ln", random_norm<T>(kfac::layer_norm_description(6, true), {3, 4, 6}, 29));
    layers.emplace_back("ln_noshift", random_norm<T>(kfac::layer_norm_description(5, false), {7, 5}, 31));
    layers.emplace_back("bn", random_norm<T>(kfac::batch_norm_description(3, true), {4, 3, 2, 3}, 33));
    layers.emplace_back("bn_expand",
                        random_norm<T>(kfac::with_sharing(kfac::batch_norm_description(3, true),
                                                                     kfac::weight_sharing::expand),
                                                  {4, 3, 2, 2}, 35));
    layers.emplace_back("bn_noshift", random_norm<T>(kfac::batch_norm_description(2, false), {5, 2, 3}, 37));
    layers.emplace_back("gn", random_norm<T>(kfac::group_norm_description(4, true), {3, 4, 2, 2}, 39));
    layers.emplace_back("in_noshift", random_norm<T>(kfac::instance_norm_description(3, false), {4, 3, 5}, 41));
    for (auto& entry : layers) entry.second.bind();  // views on the vector's own buffers (a copy must bind again)
    return layers;
}

/// New seeded gradients in the buffers the layer's views point to (an assignment of a new vector
/// would move its storage in and leave the views dangling).
template <class T>
void refill_gradients(owned_layer<T>& l, std::uint32_t seed) {
    const auto w = random_vector<T>(l.grad_weight.size(), seed, 0.1);
    const auto b = random_vector<T>(l.grad_bias.size(), seed + 1, 0.1);
    std::copy(w.begin(), w.end(), l.grad_weight.begin());
    std::copy(b.begin(), b.end(), l.grad_bias.begin());
}

}  // namespace kfac_test
