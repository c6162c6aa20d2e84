// SPDX-License-Identifier: Apache-2.0
// options.fp64_retry and options.fp64_decompositions: a float backend's failed decomposition
// is retried in double, counted, and gives what a straight double decomposition gives.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

/// A float CPU backend whose float decompositions can be made to fail; its double ones
/// (symmetric_eigen_fp64, damped_inverse_fp64) are the CPU backend's, unless fail_fp64.
struct failing_float_backend : kfac::backend::cpu_eigen<float> {
    using base = kfac::backend::cpu_eigen<float>;
    static inline bool fail = false, fail_fp64 = false;
    static bool symmetric_eigen(const matrix& m, matrix& q, vector& lambda) {
        return !fail && base::symmetric_eigen(m, q, lambda);
    }
    static bool damped_inverse(const matrix& m, float damping, matrix& inverse) {
        return !fail && base::damped_inverse(m, damping, inverse);
    }
    static bool symmetric_eigen_fp64(const matrix& m, matrix& q, vector& lambda) {
        return !fail_fp64 && base::symmetric_eigen_fp64(m, q, lambda);
    }
    static bool damped_inverse_fp64(const matrix& m, double damping, matrix& inverse) {
        return !fail_fp64 && base::damped_inverse_fp64(m, damping, inverse);
    }
};

struct failure_guard {
    failure_guard(bool f, bool f64) {
        failing_float_backend::fail = f;
        failing_float_backend::fail_fp64 = f64;
    }
    ~failure_guard() { failing_float_backend::fail = failing_float_backend::fail_fp64 = false; }
};

/// Two layers, two steps; returns the last step's gradients.
template <class P>
std::vector<std::vector<float>> two_steps(P& p) {
    std::vector<owned_layer<float>> layers{random_linear<float>(12, 5, 4, true, 3),
                                           random_conv<float>(3, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 5, 4, 5)};
    for (auto& l : layers) l.bind();  // the copies' own buffers
    for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer("l" + std::to_string(i), layers[i].view);
    p.step();
    p.step();
    return {layers[0].grad_weight, layers[0].grad_bias, layers[1].grad_weight, layers[1].grad_bias};
}

template <class Method>
void check_retry() {
    kfac::options fp64;
    fp64.fp64_decompositions = true;
    kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::serial, Method> straight(fp64);
    const auto expected = two_steps(straight);

    const failure_guard failing(true, false);
    kfac::KFAC<failing_float_backend, kfac::comm::serial, Method> retried;
    const auto got = two_steps(retried);
    CHECK(got == expected);  // the retry is the double decomposition, bit for bit
    CHECK(retried.health().fp64_retries == 2 * 2 * 2);  // two factors of two layers, two steps
    CHECK(retried.health().kept_decompositions == 0);
}

}  // namespace

TEST_CASE("a failed float decomposition is retried in double and equals a straight double one", "[fp64_retry]") {
    check_retry<kfac::compute::eigendecomposition>();
    check_retry<kfac::compute::inverse>();
}

TEST_CASE("without fp64_retry, or when the retry fails too, the previous decomposition is kept", "[fp64_retry]") {
    SECTION("retry off") {
        kfac::options o;
        o.fp64_retry = false;
        const failure_guard failing(true, false);
        kfac::KFAC<failing_float_backend> p(o);
        two_steps(p);
        CHECK(p.health().fp64_retries == 0);
        CHECK(p.health().kept_decompositions == 2 * 2);  // each layer, each step
    }
    SECTION("retry fails") {
        const failure_guard failing(true, true);
        kfac::KFAC<failing_float_backend> p;
        two_steps(p);
        CHECK(p.health().fp64_retries == 2 * 2 * 2);
        CHECK(p.health().kept_decompositions == 2 * 2);
    }
}

TEST_CASE("a decomposition that succeeds is the same with fp64_retry on or off", "[fp64_retry]") {
    kfac::options off;
    off.fp64_retry = false;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> with_retry, without(off);
    CHECK(two_steps(with_retry) == two_steps(without));
    CHECK(with_retry.health().fp64_retries == 0);
}

TEST_CASE("fp64_decompositions on a float backend: double eigenpairs rounded once", "[fp64_retry]") {
    // The eigenvectors a float backend gets are the double backend's, rounded to float: the
    // preconditioned gradients agree with the double backend's to the rounding of Q, λ and of
    // the float products (≲ 8·n·u_fp32 for these n ≤ 19 sums, damping 0.001 → κ ≤ 10³ on λ's
    // reciprocal: 8·19·10³·2^-24 ≈ 1e-2, taken as the bound), and with fp64 on, the float result
    // differs from the float decomposition's.
    kfac::options o;
    o.fp64_decompositions = true;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> p(o), plain;
    const auto got = two_steps(p);
    const auto in_float = two_steps(plain);
    CHECK(got != in_float);
    kfac::KFAC<kfac::backend::cpu_eigen<double>> d;
    std::vector<owned_layer<double>> layers{random_linear<double>(12, 5, 4, true, 3),
                                            random_conv<double>(3, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 5, 4, 5)};
    for (auto& l : layers) l.bind();
    for (std::size_t i = 0; i < layers.size(); ++i) d.register_layer("l" + std::to_string(i), layers[i].view);
    d.step();
    d.step();
    const std::vector<std::vector<double>> exact{layers[0].grad_weight, layers[0].grad_bias, layers[1].grad_weight,
                                                 layers[1].grad_bias};
    for (std::size_t i = 0; i < exact.size(); ++i) {
        std::vector<double> g(got[i].begin(), got[i].end());
        CHECK(buffer_rel_err(g, exact[i]) <= 1e-2);
    }
}

TEST_CASE("a checkpoint saved with fp64_decompositions resumes exactly only with it", "[fp64_retry]") {
    kfac::options fp64;
    fp64.fp64_decompositions = true;
    kfac::KFAC<kfac::backend::cpu_eigen<float>> saved(fp64), plain, same(fp64);
    two_steps(saved);
    const std::string bytes = saved.save_bytes();
    two_steps(plain);
    const auto before = plain.save_bytes();
    CHECK_THROWS_WITH(plain.load_bytes(bytes), Catch::Contains("fp64_decompositions") && Catch::Contains("true"));
    CHECK(plain.save_bytes() == before);  // unchanged by the refused load
    two_steps(same);
    same.load_bytes(bytes);
    CHECK(same.steps() == 2);
    plain.load_bytes(bytes, {.allow_changed_options = true});
    CHECK(plain.steps() == 2);
}
