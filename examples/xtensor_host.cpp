// SPDX-License-Identifier: Apache-2.0
// xtensor_host: a host that keeps a Linear layer's tensors in xt::xarray<double> hands them to
// K-FAC through kfac::xtensor_layer, which reads the containers in place (no copies).
//
// The layer (4 → 3, with bias) is fitted to a fixed "teacher" layer by least squares; each
// step prints the loss, the norm of the raw gradient and that of the K-FAC preconditioned one.

#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>

#include <xtensor/xarray.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xrandom.hpp>
#include <xtensor/xview.hpp>

#include <kfac/kfac.hpp>
#include <kfac/layers/xtensor_layer.hpp>  // not in kfac.hpp: only this header needs xtensor

namespace {

using array = xt::xarray<double>;  // row-major by default, as kfac requires

/// x [n, in] times wᵀ [in, out] plus b, with broadcasting only (no BLAS binding needed).
array linear_forward(const array& x, const array& w, const array& b) {
    auto products = xt::view(x, xt::all(), xt::newaxis(), xt::all()) *
                    xt::view(w, xt::newaxis(), xt::all(), xt::all());  // [n, out, in]
    return xt::sum(products, {2}) + b;
}

double frobenius_norm(const array& a) { return std::sqrt(xt::sum(a * a)()); }

}  // namespace

int main() {
    try {
        constexpr int batch = 32, in = 4, out = 3;
        constexpr double lr = 0.1;
        xt::random::seed(1);

        // The host's tensors. kfac::xtensor_layer holds pointers to these containers, so they
        // may be reassigned (even resized) between steps; they must simply outlive it.
        array weight = 0.5 * xt::random::randn<double>({out, in});
        array bias = xt::zeros<double>({out});
        array input, grad_output, grad_weight, grad_bias;

        const array teacher_weight = xt::random::randn<double>({out, in});
        const array teacher_bias = xt::random::randn<double>({out});

        kfac::xtensor_layer<array> layer;
        layer.description = kfac::linear_description(in, out, /*bias=*/true);
        layer.input = &input;
        layer.grad_output = &grad_output;
        layer.grad_weight = &grad_weight;
        layer.grad_bias = &grad_bias;

        kfac::options opts;
        opts.damping = 0.01;
        opts.kl_clip = std::nullopt;  // no clipping, so the printed norm is the raw K-FAC step
        opts.lr = lr;
        // Double-precision containers need the double backend (a float one fails to compile).
        kfac::KFAC<kfac::backend::cpu_eigen<double>> precond(opts);
        precond.register_layer("fc", layer);

        std::printf("step   loss        |grad|      |K-FAC grad|\n");
        for (int step = 0; step < 6; ++step) {
            // Inputs with very different scales per feature: the case where a curvature-aware
            // step differs most from the raw gradient.
            const array scales = {1.0, 0.1, 3.0, 0.5};
            input = xt::random::randn<double>({batch, in}) * scales;
            const array target = linear_forward(input, teacher_weight, teacher_bias);

            // Forward and backward of loss = mean over the batch of ½‖y − target‖².
            const array residual = linear_forward(input, weight, bias) - target;
            const double loss = 0.5 * xt::sum(residual * residual)() / batch;
            grad_output = residual / static_cast<double>(batch);  // dloss/dy, [batch, out]
            grad_weight = xt::sum(xt::view(grad_output, xt::all(), xt::all(), xt::newaxis()) *
                                      xt::view(input, xt::all(), xt::newaxis(), xt::all()),
                                  {0});                     // [out, in]
            grad_bias = xt::sum(grad_output, {0});          // [out]
            const double raw_norm = std::hypot(frobenius_norm(grad_weight), frobenius_norm(grad_bias));

            precond.step();  // overwrites grad_weight and grad_bias in place

            const double kfac_norm = std::hypot(frobenius_norm(grad_weight), frobenius_norm(grad_bias));
            std::printf("%4d   %-10.4g  %-10.4g  %-10.4g\n", step, loss, raw_norm, kfac_norm);
            weight -= lr * grad_weight;
            bias -= lr * grad_bias;
        }
        const auto& a = precond.a_factor("fc");
        const auto& g = precond.g_factor("fc");
        std::printf("A factor %lldx%lld (in + 1 for the bias), G factor %lldx%lld\n",
                    static_cast<long long>(a.rows()), static_cast<long long>(a.cols()),
                    static_cast<long long>(g.rows()), static_cast<long long>(g.cols()));
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "xtensor_host: %s\n", e.what());
        return 1;
    }
}
