// SPDX-License-Identifier: Apache-2.0
#pragma once
// A test layer in kfac::layer_traits' per-application form, with every optional member.

#include <cstdint>
#include <optional>
#include <vector>

#include <kfac/kfac.hpp>

#include "test_util.hpp"

namespace kfac_test {

/// A Linear layer that reports each of its applications in the current pass, as a host with
/// hooks (kfac::torch's tracker) does.
template <class T>
struct applied_layer {
    kfac::layer_description description;
    std::vector<owned_layer<T>> applications;  // this pass's (their input/grad_output)
    std::vector<T> grad_weight, grad_bias;
    bool gradient = true;
    int ended = 0;                         // end_pass() calls
    std::optional<std::int64_t> reported;  // what applications() says instead of the count

    applied_layer(std::int64_t in, std::int64_t out, bool bias)
        : description(kfac::linear_description(in, out, bias)),
          grad_weight(random_vector<T>(static_cast<std::size_t>(in * out), 91, 0.1)),
          grad_bias(random_vector<T>(static_cast<std::size_t>(out), 92, 0.1)) {}

    void apply(std::int64_t rows, std::uint32_t seed) {
        applications.push_back(random_linear<T>(rows, description.in, description.out, description.bias, seed));
        for (auto& a : applications) a.bind();
    }
};

}  // namespace kfac_test

template <class T>
struct kfac::layer_traits<kfac_test::applied_layer<T>> {
    using scalar_type = T;
    using layer = kfac_test::applied_layer<T>;
    static layer_description describe(const layer& l) { return l.description; }
    static std::int64_t applications(const layer& l) {
        return l.reported.value_or(static_cast<std::int64_t>(l.applications.size()));
    }
    static tensor_view<const T> activations(const layer& l, std::int64_t i) {
        return l.applications[static_cast<std::size_t>(i)].view.input;
    }
    static tensor_view<const T> output_gradients(const layer& l, std::int64_t i) {
        return l.applications[static_cast<std::size_t>(i)].view.grad_output;
    }
    static bool has_gradient(const layer& l) { return l.gradient; }
    static tensor_view<T> weight_gradient(layer& l) {
        if (!l.gradient) return {};
        return {l.grad_weight.data(), {l.description.out, l.description.in}};
    }
    static tensor_view<T> bias_gradient(layer& l) {
        if (!l.gradient || !l.description.bias) return {};
        return {l.grad_bias.data(), {l.description.out}};
    }
    static void end_pass(layer& l) {
        ++l.ended;
        l.applications.clear();
    }
};

static_assert(kfac::layer_adapter<kfac_test::applied_layer<double>>);
