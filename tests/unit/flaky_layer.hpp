// SPDX-License-Identifier: Apache-2.0
#pragma once
// A Linear test layer (applied_layer) whose adapter throws from a chosen member of
// kfac::layer_traits once that member has been called a given number of times: the host's
// failures at every point of a step (tests/unit/reliability_test.cpp, tests/mpi).

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include <kfac/kfac.hpp>

#include "applied_layer.hpp"
#include "test_util.hpp"

namespace kfac_test {

/// The members of kfac::layer_traits a step calls.
enum member : int { applications, activations, output_gradients, has_gradient, weight_gradient, bias_gradient, end_pass, members };
inline constexpr std::array<const char*, members> member_names{"applications",  "activations",   "output_gradients", "has_gradient",
                                                        "weight_gradient", "bias_gradient", "end_pass"};

/// applied_layer whose adapter throws from one member once it has been called `after` times.
struct flaky_layer {
    applied_layer<double> inner;
    std::optional<member> fail;
    int after = 0;
    mutable std::array<int, members> calls{};
    /// Called at every call of a member, before it may throw (tests that watch a step's order).
    std::function<void(member)> observe;

    flaky_layer(std::int64_t in, std::int64_t out, bool bias) : inner(in, out, bias) {}
    void touch(member m) const {
        if (observe) observe(m);
        if (fail == m && calls[m]++ >= after) throw std::runtime_error(std::string("the host's ") + member_names[m] + " failed");
    }
    /// One forward/backward pass of seeded data: the layer's applications and its gradients.
    void pass(std::uint32_t seed) {
        inner.applications.clear();
        inner.apply(8, seed);
        inner.grad_weight = random_vector<double>(inner.grad_weight.size(), seed + 7, 0.1);
        inner.grad_bias = random_vector<double>(inner.grad_bias.size(), seed + 8, 0.1);
    }
};

}  // namespace kfac_test

template <>
struct kfac::layer_traits<kfac_test::flaky_layer> {
    using scalar_type = double;
    using inner = kfac::layer_traits<kfac_test::applied_layer<double>>;
    static layer_description describe(const kfac_test::flaky_layer& l) { return l.inner.description; }
    static std::int64_t applications(const kfac_test::flaky_layer& l) {
        l.touch(kfac_test::member::applications);
        return inner::applications(l.inner);
    }
    static tensor_view<const double> activations(const kfac_test::flaky_layer& l, std::int64_t i) {
        l.touch(kfac_test::member::activations);
        return inner::activations(l.inner, i);
    }
    static tensor_view<const double> output_gradients(const kfac_test::flaky_layer& l, std::int64_t i) {
        l.touch(kfac_test::member::output_gradients);
        return inner::output_gradients(l.inner, i);
    }
    static bool has_gradient(const kfac_test::flaky_layer& l) {
        l.touch(kfac_test::member::has_gradient);
        return inner::has_gradient(l.inner);
    }
    static tensor_view<double> weight_gradient(kfac_test::flaky_layer& l) {
        l.touch(kfac_test::member::weight_gradient);
        return inner::weight_gradient(l.inner);
    }
    static tensor_view<double> bias_gradient(kfac_test::flaky_layer& l) {
        l.touch(kfac_test::member::bias_gradient);
        return inner::bias_gradient(l.inner);
    }
    static void end_pass(kfac_test::flaky_layer& l) {
        l.touch(kfac_test::member::end_pass);
        inner::end_pass(l.inner);
    }
};

