// SPDX-License-Identifier: Apache-2.0
#pragma once
// One K-FAC step on a tiny Linear layer, shared by the consumer's programs: the layer's
// buffers are filled deterministically, its gradient is preconditioned once, and the result
// must differ from the plain gradient and be finite.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <kfac/kfac.hpp>

namespace consumer {

/// y = x Wᵀ + b with 4 inputs, 3 outputs and a batch of 8, in row-major buffers.
struct tiny_linear {
    static constexpr std::int64_t in = 4, out = 3, batch = 8;
    std::vector<float> x, dy, dw, db;
    kfac::layer_view<float> view;

    tiny_linear() : x(batch * in), dy(batch * out), dw(out * in), db(out) {
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * static_cast<float>(i) + 0.1f);
        for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.05f * std::cos(1.3f * static_cast<float>(i));
        // dW = dYᵀ X, db = Σ_rows dY: what a backward pass would have left.
        for (std::int64_t o = 0; o < out; ++o) {
            for (std::int64_t n = 0; n < batch; ++n) {
                const float g = dy[static_cast<std::size_t>(n * out + o)];
                db[static_cast<std::size_t>(o)] += g;
                for (std::int64_t i = 0; i < in; ++i)
                    dw[static_cast<std::size_t>(o * in + i)] += g * x[static_cast<std::size_t>(n * in + i)];
            }
        }
        view.description = kfac::linear_description(in, out, /*bias=*/true);
        view.input = {x.data(), {batch, in}};
        view.grad_output = {dy.data(), {batch, out}};
        view.grad_weight = {dw.data(), {out, in}};
        view.grad_bias = {db.data(), {out}};
    }
};

inline kfac::options tiny_options() {
    kfac::options o;
    o.lr = 0.1;
    o.damping = 0.003;
    return o;
}

/// Registers `layer`, steps once and checks the gradients. Returns 0 on success.
template <class Preconditioner>
int step_and_check(Preconditioner& precond, tiny_linear& layer, const char* who) {
    precond.register_layer("fc", layer.view);
    const std::vector<float> dw0 = layer.dw, db0 = layer.db;
    precond.step();
    bool finite = true;
    double change = 0.0;
    for (std::size_t i = 0; i < dw0.size(); ++i) {
        finite = finite && std::isfinite(layer.dw[i]);
        change += std::fabs(static_cast<double>(layer.dw[i]) - dw0[i]);
    }
    for (std::size_t i = 0; i < db0.size(); ++i) {
        finite = finite && std::isfinite(layer.db[i]);
        change += std::fabs(static_cast<double>(layer.db[i]) - db0[i]);
    }
    const bool ok = finite && change > 0.0 && precond.steps() == 1;
    // kfac::engines' header (included first by the target) defines KFAC_ENGINES_ABI: the
    // engines were then linked from the library, not compiled here.
#ifdef KFAC_ENGINES_ABI
    const char* engines = "linked";
#else
    const char* engines = "compiled";
#endif
    std::printf("%s: engines=%s steps=%lld kl_scale=%g |change|=%g finite=%s: %s\n", who, engines,
                static_cast<long long>(precond.steps()), precond.last_kl_scale(), change,
                finite ? "yes" : "no", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}

}  // namespace consumer
