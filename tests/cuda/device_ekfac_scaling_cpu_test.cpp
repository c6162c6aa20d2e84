// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's EKFAC scaling (kfac/backend/detail/device_ekfac_scaling.cuh) run on the CPU:
// its Thrust kernels through Thrust's CPP system, its cuBLAS GEMMs by a host emulation taking
// the same arguments (transposes, sizes, leading dimensions, batch strides), against the CPU
// backend's kernel (cpu_ekfac_scaling.hpp, itself checked against the definition in
// factor_statistics_test). Every layout and order of the device code: a Linear layer with one
// row per example, with tokens (both product orders), reduce, convolutions (both orders,
// stride, padding, dilation, Conv1d), several applications, beta, and chunks of examples.

// Chunks of a few examples (the library's cap is 2²⁶ elements), so every case below runs
// several chunks, the last one shorter.
#define KFAC_CUDA_EKFAC_CHUNK_ELEMENTS 400

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include <thrust/system/cpp/execution_policy.h>

#include <kfac/backend/detail/cpu_ekfac_scaling.hpp>
#include <kfac/backend/detail/device_ekfac_scaling.cuh>
#include <kfac/detail/statistics_views.hpp>

#include "unit/test_util.hpp"

namespace {

using kfac_test::mat;
using kfac_test::random_vector;
using kfac_test::rel_err;
using count_t = std::int64_t;
using T = double;
using views = std::vector<kfac::tensor_view<const T>>;

/// Host emulation of the GEMMs: cuBLAS's column-major semantics, beta = 0 not reading C.
struct host_library {
    static auto policy() { return thrust::cpp::par; }
    static void gemm(bool ta, bool tb, count_t m, count_t n, count_t k, T alpha, const T* a, count_t lda, const T* b, count_t ldb,
                     T beta, T* c, count_t ldc) {
        for (count_t j = 0; j < n; ++j)
            for (count_t i = 0; i < m; ++i) {
                T s = 0;
                for (count_t p = 0; p < k; ++p) s += (ta ? a[p + i * lda] : a[i + p * lda]) * (tb ? b[j + p * ldb] : b[p + j * ldb]);
                c[i + j * ldc] = (beta == T(0) ? T(0) : beta * c[i + j * ldc]) + alpha * s;
            }
    }
    static void gemm_strided_batched(bool ta, bool tb, count_t m, count_t n, count_t k, T alpha, const T* a, count_t lda,
                                     count_t stride_a, const T* b, count_t ldb, count_t stride_b, T beta, T* c, count_t ldc,
                                     count_t stride_c, count_t batch) {
        for (count_t e = 0; e < batch; ++e)
            gemm(ta, tb, m, n, k, alpha, a + e * stride_a, lda, b + e * stride_b, ldb, beta, c + e * stride_c, ldc);
    }
};

/// Scratch that starts as NaN: an entry the device code reads before writing shows.
struct nan_buffer {
    std::vector<T> v;
    void reserve(std::size_t n) {
        if (v.size() < n) v.assign(n, std::numeric_limits<T>::quiet_NaN());
    }
    T* data() { return v.data(); }
};

/// The device code's Ŝᵀ (beta·start + Ŝᵀ) and the CPU backend's, for the same views.
struct both_results {
    mat<T> device, cpu;
};
both_results scalings(const kfac::layer_description& d, const views& a, const views& g, std::uint32_t seed, T beta) {
    const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), seed);
    const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), seed + 1);
    const auto start_values = random_vector<T>(static_cast<std::size_t>(d.a_dim() * d.g_dim()), seed + 2);
    const mat<T> start = beta == T(0) ? mat<T>::Constant(d.a_dim(), d.g_dim(), std::numeric_limits<T>::quiet_NaN())
                                      : mat<T>(Eigen::Map<const mat<T>>(start_values.data(), d.a_dim(), d.g_dim()));
    both_results r{start, start};
    kfac::backend::device_ekfac::scratch<nan_buffer> ws;
    kfac::backend::device_ekfac::accumulate_scaling<host_library>(r.device.data(), r.device.rows(), r.device.cols(), d, a,
                                                                  g, q_a.data(), q_a.rows(), q_a.cols(), q_g.data(), q_g.rows(),
                                                                  q_g.cols(), beta, ws);
    kfac::backend::detail::ekfac_scaling_scratch<T> cpu_ws;
    kfac::backend::detail::accumulate_ekfac_scaling(r.cpu, d, a, g, q_a, q_g, beta, cpu_ws);
    return r;
}

// Both compute the same sums of products (k ≤ A_dim + G_dim + positions ≈ 100 terms each, in
// other orders): in double their difference is within ~k·2⁻⁵³ of the entries' magnitude, 1e-14;
// 1e-12 leaves room and still fails any wrong count_t (an O(1) difference).
constexpr double tolerance = 1e-12;

}  // namespace

TEST_CASE("EKFAC scaling on the device: Linear layers, every order, against the CPU backend", "[cuda][kernels][ekfac]") {
    struct l_case {
        const char* what;
        count_t n, r, in, out;
        bool bias;
        kfac::weight_sharing sharing;
        bool gradient_first;  ///< the order the device code takes (asserted, so both stay covered)
    };
    const std::vector<l_case> cases = {
        {"one row per example, bias", 9, 1, 5, 3, true, kfac::weight_sharing::expand, false},
        {"one row per example, no bias", 7, 1, 4, 6, false, kfac::weight_sharing::expand, false},
        {"3 tokens: rows projected first", 7, 3, 4, 5, true, kfac::weight_sharing::expand, false},
        {"12 tokens: gradients first", 5, 12, 4, 3, false, kfac::weight_sharing::expand, true},
        {"12 tokens with bias: gradients first", 5, 12, 3, 4, true, kfac::weight_sharing::expand, true},
        {"reduce", 6, 4, 4, 3, true, kfac::weight_sharing::reduce, false},
    };
    for (const auto& lc : cases) {
        INFO(lc.what);
        auto d = kfac::linear_description(lc.in, lc.out, lc.bias);
        d.sharing = lc.sharing;
        const count_t rows = lc.sharing == kfac::weight_sharing::reduce ? 1 : lc.r;
        CHECK((rows > 1 && kfac::backend::detail::example_gradient_first(rows, d.a_dim(), d.g_dim())) == lc.gradient_first);
        const auto x = random_vector<T>(static_cast<std::size_t>(lc.n * lc.r * lc.in), 31);
        const auto y = random_vector<T>(static_cast<std::size_t>(lc.n * lc.r * lc.out), 32, 0.1);
        const views a{kfac::tensor_view<const T>(x.data(), {lc.n, lc.r, lc.in})};
        const views g{kfac::tensor_view<const T>(y.data(), {lc.n, lc.r, lc.out})};
        for (const T beta : {T(0), T(0.25)}) {
            const both_results r = scalings(d, a, g, 33, beta);
            CHECK(r.device.allFinite());
            CHECK(rel_err(r.device, r.cpu) <= tolerance);
        }
    }
}

TEST_CASE("EKFAC scaling on the device: convolutions, every order, against the CPU backend", "[cuda][kernels][ekfac]") {
    struct c_case {
        const char* what;
        count_t n, c, h, w, c_out;
        kfac::conv2d_geometry g;
        bool bias, conv1d;
        kfac::weight_sharing sharing = kfac::weight_sharing::expand;
    };
    const std::vector<c_case> cases = {
        {"3x3, padding 1: gradients first", 5, 2, 6, 6, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, false},
        {"stride 2, no bias", 4, 3, 7, 6, 2, {{2, 3}, {2, 1}, {0, 1}, {1, 1}, 1}, false, false},
        {"dilated", 3, 2, 8, 8, 3, {{3, 3}, {1, 1}, {2, 2}, {2, 2}, 1}, true, false},
        {"Conv1d", 4, 2, 1, 9, 2, {{1, 3}, {1, 2}, {0, 1}, {1, 1}, 1}, true, true},
        {"one position against A_dim 55: rows projected first", 4, 6, 3, 3, 3, {{3, 3}, {1, 1}, {0, 0}, {1, 1}, 1}, true,
         false},
        {"4 positions against A_dim 55: rows projected first", 3, 6, 4, 4, 3, {{3, 3}, {1, 1}, {0, 0}, {1, 1}, 1}, true,
         false},
        {"reduce", 5, 2, 5, 5, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, false, kfac::weight_sharing::reduce},
    };
    bool gradient_first = false, projected_first = false;
    for (const auto& cc : cases) {
        INFO(cc.what);
        auto d = cc.conv1d ? kfac::conv1d_description(cc.c, cc.c_out, {cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1],
                                                                       cc.g.dilation[1], 1}, cc.bias)
                           : kfac::conv2d_description(cc.c, cc.c_out, cc.g, cc.bias);
        d.sharing = cc.sharing;
        const count_t ho = kfac::conv_output_extent(cc.h, cc.g.kernel[0], cc.g.stride[0], cc.g.padding[0], cc.g.dilation[0]);
        const count_t wo = kfac::conv_output_extent(cc.w, cc.g.kernel[1], cc.g.stride[1], cc.g.padding[1], cc.g.dilation[1]);
        if (cc.sharing == kfac::weight_sharing::expand) {
            const bool first = kfac::backend::detail::example_gradient_first(ho * wo, d.a_dim(), d.g_dim());
            (first ? gradient_first : projected_first) = true;
        }
        const auto x = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c * cc.h * cc.w), 41);
        const auto y = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c_out * ho * wo), 42, 0.1);
        const auto xv = cc.conv1d ? kfac::tensor_view<const T>(x.data(), {cc.n, cc.c, cc.w})
                                  : kfac::tensor_view<const T>(x.data(), {cc.n, cc.c, cc.h, cc.w});
        const auto gv = cc.conv1d ? kfac::tensor_view<const T>(y.data(), {cc.n, cc.c_out, wo})
                                  : kfac::tensor_view<const T>(y.data(), {cc.n, cc.c_out, ho, wo});
        const views a{kfac::detail::statistic_view(d, xv)}, g{kfac::detail::statistic_view(d, gv)};
        for (const T beta : {T(0), T(2)}) {
            const both_results r = scalings(d, a, g, 43, beta);
            CHECK(r.device.allFinite());
            CHECK(rel_err(r.device, r.cpu) <= tolerance);
        }
    }
    CHECK(gradient_first);
    CHECK(projected_first);
}

TEST_CASE("EKFAC scaling on the device: a layer applied several times, against the CPU backend", "[cuda][kernels][ekfac]") {
    const count_t n = 5;
    for (const auto sharing : {kfac::weight_sharing::expand, kfac::weight_sharing::reduce}) {
        for (const count_t r1 : {1, 14}) {  // 2 + 1 tokens: rows projected first; 2 + 14: gradients first
            INFO("Linear, applications of 2 and " << r1 << " tokens, " << (sharing == kfac::weight_sharing::reduce ? "reduce" : "expand"));
            auto d = kfac::linear_description(4, 3, true);
            d.sharing = sharing;
            const count_t r0 = 2;
            const auto x0 = random_vector<T>(static_cast<std::size_t>(n * r0 * d.in), 51);
            const auto g0 = random_vector<T>(static_cast<std::size_t>(n * r0 * d.out), 52, 0.1);
            const auto x1 = random_vector<T>(static_cast<std::size_t>(n * r1 * d.in), 53);
            const auto g1 = random_vector<T>(static_cast<std::size_t>(n * r1 * d.out), 54, 0.1);
            const views a{kfac::tensor_view<const T>(x0.data(), {n, r0, d.in}), kfac::tensor_view<const T>(x1.data(), {n, r1, d.in})};
            const views g{kfac::tensor_view<const T>(g0.data(), {n, r0, d.out}),
                          kfac::tensor_view<const T>(g1.data(), {n, r1, d.out})};
            const both_results r = scalings(d, a, g, 55, T(0));
            CHECK(rel_err(r.device, r.cpu) <= tolerance);
        }
    }
    INFO("Conv2d, two applications on 6x6 and 5x7 inputs");
    const kfac::conv2d_geometry geometry{{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1};
    const auto d = kfac::conv2d_description(2, 3, geometry, true);
    const auto x0 = random_vector<T>(static_cast<std::size_t>(n * 2 * 6 * 6), 61);
    const auto g0 = random_vector<T>(static_cast<std::size_t>(n * 3 * 6 * 6), 62, 0.1);
    const auto x1 = random_vector<T>(static_cast<std::size_t>(n * 2 * 5 * 7), 63);
    const auto g1 = random_vector<T>(static_cast<std::size_t>(n * 3 * 5 * 7), 64, 0.1);
    const views a{kfac::tensor_view<const T>(x0.data(), {n, 2, 6, 6}), kfac::tensor_view<const T>(x1.data(), {n, 2, 5, 7})};
    const views g{kfac::tensor_view<const T>(g0.data(), {n, 3, 6, 6}), kfac::tensor_view<const T>(g1.data(), {n, 3, 5, 7})};
    const both_results r = scalings(d, a, g, 65, T(0));
    CHECK(rel_err(r.device, r.cpu) <= tolerance);
}

TEST_CASE("EKFAC scaling on the device refuses what the CPU backend refuses", "[cuda][kernels][ekfac]") {
    const auto d = kfac::linear_description(4, 3, true);
    const auto x = random_vector<T>(4 * 4, 71), y = random_vector<T>(4 * 3, 72);
    const mat<T> q_a = kfac_test::random_orthonormal<T>(d.a_dim(), 73);
    const mat<T> q_g = kfac_test::random_orthonormal<T>(d.g_dim(), 74);
    mat<T> s(d.a_dim(), d.g_dim());
    kfac::backend::device_ekfac::scratch<nan_buffer> ws;
    auto run = [&](const kfac::layer_description& desc, const views& a, const views& g, count_t q_a_dim) {
        kfac::backend::device_ekfac::accumulate_scaling<host_library>(s.data(), s.rows(), s.cols(), desc, a, g, q_a.data(),
                                                                      q_a_dim, q_a_dim, q_g.data(), q_g.rows(), q_g.cols(),
                                                                      T(0), ws);
    };
    const views a{kfac::tensor_view<const T>(x.data(), {4, 4})}, g{kfac::tensor_view<const T>(y.data(), {4, 3})};
    CHECK_THROWS_WITH(run(d, a, g, d.a_dim() - 1), Catch::Contains("got Q_A 4x4"));
    CHECK_THROWS_WITH(run(d, a, views{}, d.a_dim()), Catch::Contains("got 1 activations and 0 output gradients"));
    const views a2{a[0], kfac::tensor_view<const T>(x.data(), {2, 2, 4})}, g2{g[0], kfac::tensor_view<const T>(y.data(), {2, 2, 3})};
    CHECK_THROWS_WITH(run(d, a2, g2, d.a_dim()), Catch::Contains("application 1 holds 2 examples, application 0 4"));
}

TEST_CASE("EKFAC's element-wise kernels equal the CPU backend's expressions bit for bit", "[cuda][kernels][ekfac]") {
    // One rounding per entry in both: the same values exactly.
    using cpu_ops = kfac::backend::detail::cpu_ekfac_operations<T>;
    namespace kernels = kfac::backend::kernels;
    const count_t m = 5, n = 3;
    const auto a_values = random_vector<T>(m, 81), g_values = random_vector<T>(n, 82);
    const cpu_ops::vector a = Eigen::Map<const cpu_ops::vector>(a_values.data(), m).cwiseAbs();
    const cpu_ops::vector g = Eigen::Map<const cpu_ops::vector>(g_values.data(), n).cwiseAbs();
    mat<T> expected, got(m, n);
    cpu_ops::outer_product(a, g, expected);
    kernels::outer_product(thrust::cpp::par, a.data(), m, g.data(), n, got.data());
    CHECK(got == expected);

    const auto v_values = random_vector<T>(static_cast<std::size_t>(m * n), 83);
    const mat<T> v = Eigen::Map<const mat<T>>(v_values.data(), m, n);
    mat<T> v_cpu = v, v_device = v;
    cpu_ops::divide_by_damped(v_cpu, expected, T(0.01));
    kernels::divide_by_damped_scaling(thrust::cpp::par, v_device.data(), expected.data(), m * n, T(0.01));
    CHECK(v_device == v_cpu);
    CHECK(v_device != v);

    v_cpu = v, v_device = v;
    cpu_ops::divide(v_cpu, T(7));
    kernels::divide(thrust::cpp::par, v_device.data(), m * n, T(7));
    CHECK(v_device == v_cpu);
    CHECK(v_device != v);
}
