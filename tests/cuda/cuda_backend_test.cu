// SPDX-License-Identifier: Apache-2.0
// backend::cuda on a GPU, against backend::cpu_eigen: every backend call, whole
// preconditioners over several steps (both compute methods, host and device views, kl_clip),
// and the errors. Compiled in gpu_tests.cu, the GPU test program's one translation unit.

#include <catch2/catch.hpp>

#include "support/catch_session.hpp"

#include <cstdio>
#include <vector>

#include <kfac/backend/cuda.cuh>
#include <kfac/kfac.hpp>

#include "cuda/twin_layer.hpp"
#include "unit/test_util.hpp"

namespace {

using kfac_test::eps;
using kfac_test::mat;
using kfac_test::random_vector;
using kfac_test::rel_err;
using index = std::int64_t;
using kfac_test::device_copy;
using kfac_test::twin_layer;

template <class T>
mat<T> lower_of(const mat<T>& m) {
    return m.template triangularView<Eigen::Lower>();
}

TEMPLATE_TEST_CASE("statistics match the CPU backend for host and device views", "[cuda]", float, double) {
    using T = TestType;
    using gpu = kfac::backend::cuda<T>;
    using cpu = kfac::backend::cpu_eigen<T>;
    // Sums of O(rows) products in a different order: a few ε per term at most.
    const double tol = 50 * eps<T>();
    const std::vector<kfac::layer_description> layers = {
        kfac::linear_description(7, 5, true), kfac::linear_description(6, 4, false),
        kfac::conv2d_description(3, 4, {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 1}, true),
        kfac::conv2d_description(2, 3, {{2, 3}, {1, 2}, {2, 0}, {2, 1}, 1}, false)};
    const index n = 5, h = 9, w = 8;
    for (const auto& d : layers) {
        for (auto mode : {kfac::conv_patch_mode::reference, kfac::conv_patch_mode::dilated}) {
            const bool conv = d.kind == kfac::layer_kind::conv2d;
            const auto a_host = random_vector<T>(static_cast<std::size_t>(conv ? n * d.in * h * w : n * d.in), 1);
            const index ho = conv ? kfac::conv_output_extent(h, d.conv.kernel[0], d.conv.stride[0], d.conv.padding[0], d.conv.dilation[0]) : 1;
            const index wo = conv ? kfac::conv_output_extent(w, d.conv.kernel[1], d.conv.stride[1], d.conv.padding[1], d.conv.dilation[1]) : 1;
            const auto g_host = random_vector<T>(static_cast<std::size_t>(n * d.out * ho * wo), 2);
            const device_copy<T> a_dev(a_host), g_dev(g_host);
            for (auto space : {kfac::memory_space::host, kfac::memory_space::device}) {
                const bool dev = space == kfac::memory_space::device;
                const auto a = conv ? kfac::tensor_view<const T>(dev ? a_dev.data : a_host.data(), {n, d.in, h, w}, space)
                                    : kfac::tensor_view<const T>(dev ? a_dev.data : a_host.data(), {n, d.in}, space);
                const auto g = conv ? kfac::tensor_view<const T>(dev ? g_dev.data : g_host.data(), {n, d.out, ho, wo}, space)
                                    : kfac::tensor_view<const T>(dev ? g_dev.data : g_host.data(), {n, d.out}, space);
                auto host_a = a, host_g = g;
                host_a.data = a_host.data(), host_a.space = kfac::memory_space::host;
                host_g.data = g_host.data(), host_g.space = kfac::memory_space::host;
                mat<T> a_ref = mat<T>::Zero(d.a_dim(), d.a_dim()), g_ref = mat<T>::Zero(d.g_dim(), d.g_dim());
                typename cpu::workspace cws;
                cpu::accumulate_a_statistic(a_ref, d, host_a, mode, T(0), cws);
                cpu::accumulate_g_statistic(g_ref, d, host_g, T(0), cws);
                auto a_sum = gpu::zeros(d.a_dim(), d.a_dim()), g_sum = gpu::zeros(d.g_dim(), d.g_dim());
                typename gpu::workspace ws;
                gpu::accumulate_a_statistic(a_sum, d, a, mode, T(0), ws);
                gpu::accumulate_g_statistic(g_sum, d, g, T(0), ws);
                CHECK(rel_err(lower_of<T>(gpu::to_host(a_sum)), lower_of<T>(a_ref)) < tol);
                CHECK(rel_err(lower_of<T>(gpu::to_host(g_sum)), lower_of<T>(g_ref)) < tol);
                // beta = 1 adds a second batch.
                gpu::accumulate_a_statistic(a_sum, d, a, mode, T(1), ws);
                CHECK(rel_err(lower_of<T>(gpu::to_host(a_sum)), lower_of<T>(mat<T>(2 * a_ref))) < tol);
            }
        }
    }
}

TEMPLATE_TEST_CASE("decompositions, products and gradient transfer match the CPU backend", "[cuda]", float, double) {
    using T = TestType;
    using gpu = kfac::backend::cuda<T>;
    using cpu = kfac::backend::cpu_eigen<T>;
    for (index n : {5, 64, 300}) {
        // A Wishart matrix with eigenvalues of order one: κ ≈ 1e2 at most, so eigenvectors
        // and inverses carry errors of a few hundred ε.
        const auto x = random_vector<T>(static_cast<std::size_t>(n * 3 * n), 3);
        const mat<T> xm = mat<T>::Map(x.data(), n, 3 * n);
        const mat<T> m = xm * xm.transpose() / T(3 * n) + T(0.1) * mat<T>::Identity(n, n);
        const auto md = gpu::from_host(m);
        typename gpu::matrix q;
        typename gpu::vector lambda;
        REQUIRE(gpu::symmetric_eigen(md, q, lambda));
        const mat<T> qh = gpu::to_host(q), lh = gpu::to_host(lambda);
        const mat<T> rebuilt = qh * lh.col(0).asDiagonal() * qh.transpose();
        CHECK(rel_err(rebuilt, m) < 1e3 * eps<T>());
        typename cpu::matrix q_cpu;
        typename cpu::vector l_cpu;
        REQUIRE(cpu::symmetric_eigen(m, q_cpu, l_cpu));
        CHECK(rel_err(lh, l_cpu) < 1e3 * eps<T>());
        for (index i = 1; i < n; ++i) CHECK(lh(i) >= lh(i - 1));  // ascending

        typename gpu::matrix inv;
        REQUIRE(gpu::damped_inverse(md, T(0.003), inv));
        typename cpu::matrix inv_cpu;
        REQUIRE(cpu::damped_inverse(m, T(0.003), inv_cpu));
        CHECK(rel_err(gpu::to_host(inv), inv_cpu) < 1e3 * eps<T>());

        typename gpu::matrix c;
        gpu::multiply(md, true, q, false, c);
        typename cpu::matrix c_cpu;
        cpu::multiply(m, true, qh, false, c_cpu);
        CHECK(rel_err(gpu::to_host(c), c_cpu) < 100 * n * eps<T>());
    }
    // A non-finite matrix gives no usable decomposition.
    mat<T> bad = mat<T>::Identity(4, 4);
    bad(2, 1) = std::numeric_limits<T>::quiet_NaN();
    typename gpu::matrix q;
    typename gpu::vector lambda;
    CHECK_FALSE(gpu::symmetric_eigen(gpu::from_host(bad), q, lambda));
    CHECK_FALSE(gpu::all_finite(gpu::from_host(bad)));
    CHECK(gpu::lower_all_finite(gpu::from_host(mat<T>(bad.transpose()))));

    // Γᵀ in and scale·Pᵀ out, host and device views.
    const index out = 3, in = 4;
    auto w = random_vector<T>(static_cast<std::size_t>(out * in), 4);
    auto b = random_vector<T>(static_cast<std::size_t>(out), 5);
    typename gpu::matrix gamma;
    gpu::load_gradient(gamma, kfac::tensor_view<const T>(w.data(), {out, in}), kfac::tensor_view<const T>(b.data(), {out}));
    typename cpu::matrix gamma_cpu;
    cpu::load_gradient(gamma_cpu, kfac::tensor_view<const T>(w.data(), {out, in}), kfac::tensor_view<const T>(b.data(), {out}));
    CHECK(gpu::to_host(gamma) == gamma_cpu);
    const device_copy<T> wd(w), bd(b);
    gpu::store_gradient(gamma, T(0.5), kfac::tensor_view<T>(wd.data, {out, in}, kfac::memory_space::device),
                        kfac::tensor_view<T>(bd.data, {out}, kfac::memory_space::device));
    auto w_cpu = w, b_cpu = b;
    cpu::store_gradient(gamma_cpu, T(0.5), kfac::tensor_view<T>(w_cpu.data(), {out, in}), kfac::tensor_view<T>(b_cpu.data(), {out}));
    CHECK(wd.to_host(w.size()) == w_cpu);
    CHECK(bd.to_host(b.size()) == b_cpu);
    CHECK(gpu::frobenius_dot(gamma, gamma) == Approx(cpu::frobenius_dot(gamma_cpu, gamma_cpu)).epsilon(1e-12));
}

TEMPLATE_TEST_CASE("a CUDA preconditioner matches the CPU one step by step", "[cuda]", float, double) {
    using T = TestType;
    // Both run the same formulas; the float tolerance is the golden replay's (γ = 0.01).
    const double tol = std::is_same_v<T, float> ? 10 * eps<T>() * (1 + 0.01) / 0.01 : 1e-10;
    for (bool device_views : {false, true}) {
        for (bool eigen : {true, false}) {
            kfac::options o;
            o.damping = 0.01;
            o.kl_clip = 0.001;
            o.lr = 0.1;
            o.inv_update_steps = 2;
            auto run = [&]<class Method>(Method) {
                kfac::KFAC<kfac::backend::cpu_eigen<T>, kfac::comm::serial, Method> cpu(o);
                kfac::KFAC<kfac::backend::cuda<T>, kfac::comm::serial, Method> gpu(o);
                std::vector<twin_layer<T>> layers(2);
                layers[0].cpu = kfac_test::random_linear<T>(8, 6, 4, true, 21);
                layers[1].cpu = kfac_test::random_conv<T>(4, 2, 3, {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, 6, 5, 22);
                for (auto& l : layers) {
                    l.gpu = l.cpu;
                    l.cpu.bind();
                    l.gpu.bind();
                    if (device_views) l.make_device_views();
                }
                cpu.register_layer("fc", layers[0].cpu.view);
                cpu.register_layer("conv", layers[1].cpu.view);
                gpu.register_layer("fc", layers[0].gpu.view);
                gpu.register_layer("conv", layers[1].gpu.view);
                for (int step = 0; step < 4; ++step) {
                    cpu.step();
                    gpu.step();
                    for (auto& l : layers) CHECK(rel_err(Eigen::Map<const mat<T>>(l.gpu_weight_gradient().data(), 1, l.cpu.grad_weight.size()),
                                                         Eigen::Map<const mat<T>>(l.cpu.grad_weight.data(), 1, l.cpu.grad_weight.size())) < tol);
                    CHECK(gpu.last_kl_scale() == Approx(cpu.last_kl_scale()).epsilon(tol));
                    CHECK(rel_err(kfac::backend::cuda<T>::to_host(gpu.a_factor("conv")), cpu.a_factor("conv")) < tol);
                    // The next step's gradients: the preconditioned ones fed back, as a loop would.
                    for (auto& l : layers) {
                        l.gpu.grad_weight = l.cpu.grad_weight;
                        if (l.w_dev) l.w_dev = std::make_unique<device_copy<T>>(l.gpu.grad_weight), l.gpu.view.grad_weight.data = l.w_dev->data;
                    }
                }
            };
            if (eigen) run(kfac::compute::eigendecomposition{});
            else run(kfac::compute::inverse{});
        }
    }
}

TEST_CASE("a host pointer marked device memory is refused before anything changes", "[cuda][errors]") {
    // Never run on a device before 2026-11-23: on an H100 this pointer reached
    // cudaMemcpy2DAsync, which does not report a bad address but crashes inside the driver.
    using T = float;
    kfac::KFAC<kfac::backend::cuda<T>> precond;
    auto layer = kfac_test::random_linear<T>(5, 4, 3, false, 1);
    layer.bind();
    std::vector<T> host_gradient(12, T(1));
    layer.view.grad_weight = kfac::tensor_view<T>(host_gradient.data(), {3, 4}, kfac::memory_space::device);
    precond.register_layer("fc1", layer.view);
    try {
        precond.step();
        FAIL("step() with a host pointer marked device memory did not throw");
    } catch (const kfac::error& e) {
        const std::string what = e.what();
        CHECK_THAT(what, Catch::Contains("layer 'fc1'"));
        CHECK_THAT(what, Catch::Contains("weight gradient"));
        CHECK_THAT(what, Catch::Contains("not device memory"));
    }
    CHECK(precond.steps() == 0);
    CHECK(host_gradient == std::vector<T>(12, T(1)));
    // The same buffer marked as host memory is accepted.
    layer.view.grad_weight = kfac::tensor_view<T>(host_gradient.data(), {3, 4}, kfac::memory_space::host);
    kfac::KFAC<kfac::backend::cuda<T>> fresh;
    fresh.register_layer("fc1", layer.view);
    fresh.step();
    CHECK(fresh.steps() == 1);
}

TEST_CASE("a CUDA preconditioner saves and loads the state a CPU one has", "[cuda][checkpoint]") {
    // The same three steps on the CPU and on the device, then each one's checkpoint into the
    // other backend: the factors and the next step's gradients agree to the backends'
    // rounding differences (cuSOLVER and LAPACK order their sums differently), as in the
    // step-by-step test above.
    using T = double;
    auto cpu_layer = kfac_test::random_linear<T>(16, 6, 5, true, 21);
    auto gpu_layer = kfac_test::random_linear<T>(16, 6, 5, true, 21);
    kfac::options o;
    o.damping = 0.01;
    o.inv_update_steps = 2;
    kfac::KFAC<kfac::backend::cpu_eigen<T>> cpu(o);
    kfac::KFAC<kfac::backend::cuda<T>> gpu(o);
    cpu.register_layer("fc", cpu_layer.view);
    gpu.register_layer("fc", gpu_layer.view);
    for (int k = 0; k < 3; ++k) {
        cpu_layer.grad_weight = kfac_test::random_vector<T>(30, 100 + k, 0.1);
        gpu_layer.grad_weight = cpu_layer.grad_weight;
        cpu_layer.bind();
        gpu_layer.bind();
        cpu.step();
        gpu.step();
    }
    kfac::KFAC<kfac::backend::cpu_eigen<T>> cpu_from_gpu(o);
    kfac::KFAC<kfac::backend::cuda<T>> gpu_from_cpu(o);
    cpu_from_gpu.register_layer("fc", cpu_layer.view);
    gpu_from_cpu.register_layer("fc", gpu_layer.view);
    cpu_from_gpu.load_bytes(gpu.save_bytes());
    gpu_from_cpu.load_bytes(cpu.save_bytes());
    CHECK(cpu_from_gpu.steps() == 3);
    CHECK(gpu_from_cpu.steps() == 3);
    // A bitwise round trip of the device data: the CPU copy holds exactly the device's values.
    CHECK(cpu_from_gpu.a_factor("fc") == kfac::backend::cuda<T>::to_host(gpu.a_factor("fc")));
    CHECK(kfac::backend::cuda<T>::to_host(gpu_from_cpu.g_factor("fc")) == cpu.g_factor("fc"));
    // One more step (no inverse update: 3 % 2 != 0) uses the loaded second-order data.
    for (auto* p : {&cpu_layer, &gpu_layer}) {
        p->grad_weight = kfac_test::random_vector<T>(30, 200, 0.1);
        p->bind();
    }
    cpu_from_gpu.step();
    const auto from_gpu = cpu_layer.grad_weight;
    gpu_from_cpu.step();
    const auto from_cpu = gpu_layer.grad_weight;
    // Rounding of two solvers, amplified by at most 1/γ = 100 over n = 7: ~1e-13; 1e-10 of margin.
    using vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
    CHECK(kfac_test::rel_err(Eigen::Map<const vec>(from_gpu.data(), 30), Eigen::Map<const vec>(from_cpu.data(), 30)) < 1e-10);
}

}  // namespace
