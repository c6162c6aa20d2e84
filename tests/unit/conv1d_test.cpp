// SPDX-License-Identifier: Apache-2.0
// Conv1d: its factor statistics against the 1-D patch definition written out naively, and a
// preconditioner step through a Conv1d view equal to one through the Conv2d over [N, C, 1, L]
// that it is.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {


}  // namespace

TEMPLATE_TEST_CASE("conv1d statistics match the 1-D patch definition", "[statistics][conv1d]", float, double) {
    using T = TestType;
    struct c_case {
        std::int64_t n, c, len, c_out;
        kfac::conv1d_geometry g;
        bool bias;
        kfac::conv_patch_mode mode;
    };
    const std::vector<c_case> cases = {
        {3, 2, 11, 4, {3, 1, 1, 1, 1}, true, kfac::conv_patch_mode::reference},
        {2, 3, 12, 2, {4, 3, 2, 1, 1}, false, kfac::conv_patch_mode::reference},
        {2, 2, 13, 3, {3, 2, 2, 3, 1}, true, kfac::conv_patch_mode::dilated},
        {2, 2, 13, 3, {3, 2, 2, 3, 1}, true, kfac::conv_patch_mode::reference},  // dilation ignored, as kfac-pytorch
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& cc = cases[idx];
        INFO("case " << idx);
        const auto d = kfac::conv1d_description(cc.c, cc.c_out, cc.g, cc.bias);
        REQUIRE(d.a_dim() == cc.c * cc.g.kernel + (cc.bias ? 1 : 0));
        const auto x = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c * cc.len), 20 + static_cast<std::uint32_t>(idx));
        const mat<T> A = factor_statistic(d, x, {cc.n, cc.c, cc.len}, factor_side::a, cc.mode);

        // Definition: patch x̃_{n,j}[c·k + v] = x[n, c, j·s + v·δ − p] (0 outside), δ the
        // dilation the patches use, ones last; A = Σ x̃ x̃ᵀ / (N·L³) over the L patch positions.
        const std::int64_t dil = cc.mode == kfac::conv_patch_mode::dilated ? cc.g.dilation : 1;
        const std::int64_t lo = (cc.len + 2 * cc.g.padding - dil * (cc.g.kernel - 1) - 1) / cc.g.stride + 1;
        mat<double> a_ref = mat<double>::Zero(d.a_dim(), d.a_dim());
        for (std::int64_t n = 0; n < cc.n; ++n)
            for (std::int64_t j = 0; j < lo; ++j) {
                Eigen::VectorXd p = Eigen::VectorXd::Ones(d.a_dim());
                for (std::int64_t c = 0; c < cc.c; ++c)
                    for (std::int64_t v = 0; v < cc.g.kernel; ++v) {
                        const std::int64_t at = j * cc.g.stride + v * dil - cc.g.padding;
                        p(c * cc.g.kernel + v) =
                            at >= 0 && at < cc.len ? static_cast<double>(x[static_cast<std::size_t>((n * cc.c + c) * cc.len + at)]) : 0.0;
                    }
                a_ref += p * p.transpose();
            }
        a_ref /= double(cc.n) * double(lo * lo * lo);
        // Sums of N·L products of O(1) terms: error ≲ N·L·u of the largest entry.
        CHECK(rel_err(A.template cast<double>().reshaped(), a_ref.reshaped()) < 4 * cc.n * lo * eps<T>());

        // G over the true output positions (dilation always applies there): Σ g gᵀ / (N·L³).
        const std::int64_t lg = kfac::conv_output_extent(cc.len, cc.g.kernel, cc.g.stride, cc.g.padding, cc.g.dilation);
        const auto g = random_vector<T>(static_cast<std::size_t>(cc.n * cc.c_out * lg), 60 + static_cast<std::uint32_t>(idx));
        const mat<T> G = factor_statistic(d, g, {cc.n, cc.c_out, lg}, factor_side::g, cc.mode);
        mat<double> g_ref = mat<double>::Zero(cc.c_out, cc.c_out);
        for (std::int64_t n = 0; n < cc.n; ++n)
            for (std::int64_t j = 0; j < lg; ++j) {
                Eigen::VectorXd y(cc.c_out);
                for (std::int64_t o = 0; o < cc.c_out; ++o) y(o) = static_cast<double>(g[static_cast<std::size_t>((n * cc.c_out + o) * lg + j)]);
                g_ref += y * y.transpose();
            }
        g_ref /= double(cc.n) * double(lg * lg * lg);
        CHECK(rel_err(G.template cast<double>().reshaped(), g_ref.reshaped()) < 4 * cc.n * lg * eps<T>());
    }
}

TEST_CASE("a Conv1d layer preconditions exactly as the Conv2d over [N, C, 1, L]", "[preconditioner][conv1d]") {
    using T = double;
    const std::int64_t n = 4, c = 3, len = 10, c_out = 5, k = 3;
    const kfac::conv1d_geometry g1{k, 2, 1, 2, 1};
    const auto d1 = kfac::conv1d_description(c, c_out, g1, true);
    kfac::conv2d_geometry g2;
    g2.kernel = {1, k};
    g2.stride = {1, 2};
    g2.padding = {0, 1};
    g2.dilation = {1, 2};
    const auto d2 = kfac::conv2d_description(c, c_out, g2, true);
    const std::int64_t lo = kfac::conv_output_extent(len, k, 2, 1, 2);

    kfac::options opts;
    opts.damping = 0.05;
    opts.conv_patches = kfac::conv_patch_mode::dilated;
    opts.threads = 1;
    kfac::KFAC<backend<T>> one_d(opts), two_d(opts);
    owned_layer<T> l1, l2;
    l1.view.description = d1;
    l2.view.description = d2;
    for (auto* l : {&l1, &l2}) {
        l->input = random_vector<T>(static_cast<std::size_t>(n * c * len), 1);
        l->grad_output = random_vector<T>(static_cast<std::size_t>(n * c_out * lo), 2, 0.1);
    }
    l1.input_shape = {n, c, len};
    l1.output_shape = {n, c_out, lo};
    l2.input_shape = {n, c, 1, len};
    l2.output_shape = {n, c_out, 1, lo};
    one_d.register_layer("conv", l1.view);
    two_d.register_layer("conv", l2.view);
    for (int step = 0; step < 3; ++step) {
        INFO("step " << step);
        for (auto* l : {&l1, &l2}) {
            l->grad_weight = random_vector<T>(static_cast<std::size_t>(c_out * c * k), 10 + static_cast<std::uint32_t>(step), 0.1);
            l->grad_bias = random_vector<T>(static_cast<std::size_t>(c_out), 20 + static_cast<std::uint32_t>(step), 0.1);
        }
        // bind() gives Conv2d weight views [out, in, k_h, k_w]; a Conv1d's is [out, in, k].
        l1.bind();
        l1.view.grad_weight = kfac::tensor_view<T>(l1.grad_weight.data(), {c_out, c, k});
        l2.bind();
        one_d.step();
        two_d.step();
        // The same numbers through the same code: bitwise equal.
        CHECK(l1.grad_weight == l2.grad_weight);
        CHECK(l1.grad_bias == l2.grad_bias);
        CHECK(one_d.a_factor("conv") == two_d.a_factor("conv"));
        CHECK(one_d.g_factor("conv") == two_d.g_factor("conv"));
    }
    CHECK(one_d.layers()[0].kind == kfac::layer_kind::conv1d);
}

TEST_CASE("Conv1d errors name the layer, the shapes and the fix", "[errors][conv1d]") {
    using T = float;
    const auto d = kfac::conv1d_description(3, 4, {3, 1, 1, 1, 1}, false);
    SECTION("a geometry with a non-trivial first axis") {
        auto bad = d;
        bad.conv.kernel = {3, 3};
        kfac::layer_view<T> v;
        v.description = bad;
        kfac::KFAC<backend<T>> p;
        CHECK_THROWS_WITH(p.register_layer("c1", v), Catch::Contains("layer 'c1' (conv1d 3->4") &&
                                                         Catch::Contains("kfac::conv1d_description()"));
    }
    SECTION("views of the wrong rank or length") {
        owned_layer<T> l;
        l.view.description = d;
        l.input = random_vector<T>(2 * 3 * 8, 1);
        l.grad_output = random_vector<T>(2 * 4 * 8, 2);
        l.grad_weight = random_vector<T>(4 * 3 * 3, 3);
        l.input_shape = {2, 3, 1, 8};  // a Conv2d-shaped input
        l.output_shape = {2, 4, 8};
        l.bind();
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {4, 3, 3});
        kfac::KFAC<backend<T>> p;
        p.register_layer("c1", l.view);
        CHECK_THROWS_WITH(p.step(), Catch::Contains("layer 'c1' (conv1d 3->4, kernel 3") &&
                                        Catch::Contains("expected [N, 3, L]"));
        CHECK(p.steps() == 0);
        l.input_shape = {2, 3, 8};
        l.output_shape = {2, 4, 7};  // the output has 8 positions
        l.bind();
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {4, 3, 3});
        CHECK_THROWS_WITH(p.step(), Catch::Contains("the convolution's output is [2, 4, 8]"));
        l.output_shape = {2, 4, 8};
        l.bind();
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {4, 3, 1, 3});  // Conv2d-shaped
        CHECK_THROWS_WITH(p.step(), Catch::Contains("expected [4, 3, 3]"));
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {4, 3, 3});
        p.step();
        CHECK(p.steps() == 1);
    }
}
