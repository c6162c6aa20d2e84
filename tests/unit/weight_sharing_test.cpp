// SPDX-License-Identifier: Apache-2.0
// Weight sharing `reduce` (Eschenhagen et al., NeurIPS 2023): factors from the per-example
// aggregates ā_n = mean over positions of ã, ĝ_n = sum over positions of g, written out
// naively here; the Kronecker product of the reduce factors equals the per-example gradient's
// outer product where the paper says it is exact; and `expand` is unchanged.
#include <catch2/catch.hpp>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

/// (1/N) Σ_n v_n v_nᵀ over the columns v_n of V.
mat<double> mean_outer(const mat<double>& v) { return v * v.transpose() / double(v.cols()); }

}  // namespace

TEMPLATE_TEST_CASE("linear reduce factors match their definition", "[statistics][weight_sharing]", float, double) {
    using T = TestType;
    const std::int64_t n = 3, r = 5, in = 4, out = 3;
    for (bool bias : {false, true}) {
        INFO("bias " << bias);
        const auto d = kfac::with_sharing(kfac::linear_description(in, out, bias), kfac::weight_sharing::reduce);
        const auto a = random_vector<T>(static_cast<std::size_t>(n * r * in), 1);
        const auto g = random_vector<T>(static_cast<std::size_t>(n * r * out), 2);
        const mat<T> A = factor_statistic(d, a, {n, r, in}, factor_side::a);
        const mat<T> G = factor_statistic(d, g, {n, r, out}, factor_side::g);

        // ā_n = (1/R) Σ_r [a_{n,r}; 1], ĝ_n = Σ_r g_{n,r}; A = (1/N) Σ ā āᵀ, G = (1/N) Σ ĝ ĝᵀ.
        mat<double> abar = mat<double>::Zero(d.a_dim(), n), gsum = mat<double>::Zero(out, n);
        for (std::int64_t e = 0; e < n; ++e)
            for (std::int64_t p = 0; p < r; ++p) {
                for (std::int64_t i = 0; i < in; ++i) abar(i, e) += double(a[static_cast<std::size_t>((e * r + p) * in + i)]) / double(r);
                if (bias) abar(in, e) += 1.0 / double(r);
                for (std::int64_t o = 0; o < out; ++o) gsum(o, e) += double(g[static_cast<std::size_t>((e * r + p) * out + o)]);
            }
        // Means of R terms, then sums of N products: error ≲ (R + N)·u of the entries' scale.
        CHECK(rel_err(A.template cast<double>().reshaped(), mean_outer(abar).reshaped()) < 4 * (r + n) * eps<T>());
        CHECK(rel_err(G.template cast<double>().reshaped(), mean_outer(gsum).reshaped()) < 4 * (r + n) * eps<T>());
    }
}

TEMPLATE_TEST_CASE("convolution reduce factors match their definition", "[statistics][weight_sharing]", float, double) {
    using T = TestType;
    // Conv2d 2→3, kernel 3×2, stride 2×1, padding 1×0, bias, on [2, 2, 7, 6]; and the Conv1d
    // 2→3, kernel 3, stride 2, padding 1, dilation 2 (dilated patches) on [2, 2, 9].
    const std::int64_t n = 2, c = 2, c_out = 3;
    struct c_case {
        kfac::layer_description d;
        std::int64_t h, w;
        kfac::conv_patch_mode mode;
    };
    kfac::conv2d_geometry g2;
    g2.kernel = {3, 2};
    g2.stride = {2, 1};
    g2.padding = {1, 0};
    const std::vector<c_case> cases = {
        {kfac::with_sharing(kfac::conv2d_description(c, c_out, g2, true), kfac::weight_sharing::reduce), 7, 6,
         kfac::conv_patch_mode::reference},
        {kfac::with_sharing(kfac::conv1d_description(c, c_out, {3, 2, 1, 2, 1}, true), kfac::weight_sharing::reduce), 1, 9,
         kfac::conv_patch_mode::dilated},
    };
    for (std::size_t idx = 0; idx < cases.size(); ++idx) {
        const auto& cc = cases[idx];
        const auto& d = cc.d;
        const auto& geo = d.conv;
        INFO("case " << idx);
        const bool one_d = d.kind == kfac::layer_kind::conv1d;
        const auto x = random_vector<T>(static_cast<std::size_t>(n * c * cc.h * cc.w), 3 + static_cast<std::uint32_t>(idx));
        std::vector<std::int64_t> x_shape = one_d ? std::vector<std::int64_t>{n, c, cc.w} : std::vector<std::int64_t>{n, c, cc.h, cc.w};
        const mat<T> A = factor_statistic(d, x, x_shape, factor_side::a, cc.mode);

        // ā_n = (1/S) Σ_s x̃_{n,s}: the mean patch (zero padding included), ones last.
        const std::int64_t dh = cc.mode == kfac::conv_patch_mode::dilated ? geo.dilation[0] : 1;
        const std::int64_t dw = cc.mode == kfac::conv_patch_mode::dilated ? geo.dilation[1] : 1;
        const std::int64_t ho = kfac::conv_output_extent(cc.h, geo.kernel[0], geo.stride[0], geo.padding[0], dh);
        const std::int64_t wo = kfac::conv_output_extent(cc.w, geo.kernel[1], geo.stride[1], geo.padding[1], dw);
        mat<double> abar = mat<double>::Zero(d.a_dim(), n);
        for (std::int64_t e = 0; e < n; ++e)
            for (std::int64_t i = 0; i < ho; ++i)
                for (std::int64_t j = 0; j < wo; ++j) {
                    abar(d.a_dim() - 1, e) += 1.0 / double(ho * wo);
                    for (std::int64_t ch = 0; ch < c; ++ch)
                        for (std::int64_t u = 0; u < geo.kernel[0]; ++u)
                            for (std::int64_t v = 0; v < geo.kernel[1]; ++v) {
                                const std::int64_t ih = i * geo.stride[0] + u * dh - geo.padding[0];
                                const std::int64_t iw = j * geo.stride[1] + v * dw - geo.padding[1];
                                if (ih < 0 || ih >= cc.h || iw < 0 || iw >= cc.w) continue;
                                abar((ch * geo.kernel[0] + u) * geo.kernel[1] + v, e) +=
                                    double(x[static_cast<std::size_t>(((e * c + ch) * cc.h + ih) * cc.w + iw)]) / double(ho * wo);
                            }
                }
        const std::int64_t s = ho * wo;
        CHECK(rel_err(A.template cast<double>().reshaped(), mean_outer(abar).reshaped()) < 4 * (s + n) * eps<T>());

        // ĝ_n = Σ_s g_{n,:,s} over the true output positions.
        const std::int64_t gh = kfac::conv_output_extent(cc.h, geo.kernel[0], geo.stride[0], geo.padding[0], geo.dilation[0]);
        const std::int64_t gw = kfac::conv_output_extent(cc.w, geo.kernel[1], geo.stride[1], geo.padding[1], geo.dilation[1]);
        const auto gv = random_vector<T>(static_cast<std::size_t>(n * c_out * gh * gw), 40 + static_cast<std::uint32_t>(idx));
        std::vector<std::int64_t> g_shape = one_d ? std::vector<std::int64_t>{n, c_out, gw} : std::vector<std::int64_t>{n, c_out, gh, gw};
        const mat<T> G = factor_statistic(d, gv, g_shape, factor_side::g);
        mat<double> gsum = mat<double>::Zero(c_out, n);
        for (std::int64_t e = 0; e < n; ++e)
            for (std::int64_t o = 0; o < c_out; ++o)
                for (std::int64_t q = 0; q < gh * gw; ++q) gsum(o, e) += double(gv[static_cast<std::size_t>((e * c_out + o) * gh * gw + q)]);
        CHECK(rel_err(G.template cast<double>().reshaped(), mean_outer(gsum).reshaped()) < 4 * (gh * gw + n) * eps<T>());
    }
}

TEST_CASE("reduce is exact where the paper says: one example of a pooled linear model", "[statistics][weight_sharing]") {
    // A Linear layer applied at R positions whose outputs are averaged before the loss: every
    // position's output gradient is the same g = (1/R)·∂L/∂z. The example's weight gradient is
    // ∇W = Σ_r g x_rᵀ = ĝ āᵀ, so with one example the empirical Fisher vec(∇W)vec(∇W)ᵀ is
    // exactly A ⊗ G of the reduce factors (Eschenhagen et al. 2023, §3.2); expand's is not.
    using T = double;
    const std::int64_t r = 6, in = 3, out = 2;
    const auto x = random_vector<T>(static_cast<std::size_t>(r * in), 5);
    const auto dz = random_vector<T>(static_cast<std::size_t>(out), 6);
    std::vector<T> g(static_cast<std::size_t>(r * out));
    for (std::int64_t p = 0; p < r; ++p)
        for (std::int64_t o = 0; o < out; ++o) g[static_cast<std::size_t>(p * out + o)] = dz[static_cast<std::size_t>(o)] / double(r);

    // The per-example gradient from its definition, vectorised column-major (in × out of Γᵀ,
    // the order in which A ⊗ G acts: Γᵀ's column o is ∇W's row o).
    mat<double> grad = mat<double>::Zero(out, in);
    for (std::int64_t p = 0; p < r; ++p)
        for (std::int64_t o = 0; o < out; ++o)
            for (std::int64_t i = 0; i < in; ++i)
                grad(o, i) += g[static_cast<std::size_t>(p * out + o)] * x[static_cast<std::size_t>(p * in + i)];
    const Eigen::VectorXd v = grad.transpose().reshaped();
    const mat<double> fisher = v * v.transpose();

    for (auto sharing : {kfac::weight_sharing::reduce, kfac::weight_sharing::expand}) {
        const auto d = kfac::with_sharing(kfac::linear_description(in, out, false), sharing);
        const mat<T> A = factor_statistic(d, x, {1, r, in}, factor_side::a);
        const mat<T> G = factor_statistic(d, g, {1, r, out}, factor_side::g);
        mat<double> kron(in * out, in * out);
        for (std::int64_t a = 0; a < out; ++a)
            for (std::int64_t b = 0; b < out; ++b) kron.block(a * in, b * in, in, in) = G(a, b) * A;
        const double err = rel_err(kron.reshaped(), fisher.reshaped());
        if (sharing == kfac::weight_sharing::reduce) CHECK(err < 64 * eps<T>());  // O(R) roundings
        else CHECK(err > 0.1);  // expand approximates a different (per-position) curvature
    }
}

TEST_CASE("a reduce layer's running factors are those of expand on the per-example aggregates", "[preconditioner][weight_sharing]") {
    using T = double;
    const std::int64_t n = 4, r = 3, in = 5, out = 2;
    kfac::options opts;
    opts.threads = 1;
    opts.factor_decay = 0.9;
    kfac::KFAC<backend<T>> reduced(opts), aggregated(opts);
    owned_layer<T> seq, agg;
    seq.view.description = kfac::with_sharing(kfac::linear_description(in, out, true), kfac::weight_sharing::reduce);
    agg.view.description = kfac::linear_description(in, out, true);
    seq.grad_weight.assign(static_cast<std::size_t>(out * in), 0.1);
    seq.grad_bias.assign(static_cast<std::size_t>(out), 0.1);
    agg.grad_weight = seq.grad_weight;
    agg.grad_bias = seq.grad_bias;
    seq.input_shape = {n, r, in};
    seq.output_shape = {n, r, out};
    agg.input_shape = {n, in};
    agg.output_shape = {n, out};
    reduced.register_layer("fc", seq.view);
    aggregated.register_layer("fc", agg.view);
    CHECK(reduced.layers()[0].a_dim == in + 1);
    for (int step = 0; step < 2; ++step) {
        seq.input = random_vector<T>(static_cast<std::size_t>(n * r * in), 30 + static_cast<std::uint32_t>(step));
        seq.grad_output = random_vector<T>(static_cast<std::size_t>(n * r * out), 40 + static_cast<std::uint32_t>(step));
        agg.input.assign(static_cast<std::size_t>(n * in), 0.0);
        agg.grad_output.assign(static_cast<std::size_t>(n * out), 0.0);
        for (std::int64_t e = 0; e < n; ++e)
            for (std::int64_t p = 0; p < r; ++p) {
                for (std::int64_t i = 0; i < in; ++i)
                    agg.input[static_cast<std::size_t>(e * in + i)] += seq.input[static_cast<std::size_t>((e * r + p) * in + i)] / double(r);
                for (std::int64_t o = 0; o < out; ++o)
                    agg.grad_output[static_cast<std::size_t>(e * out + o)] += seq.grad_output[static_cast<std::size_t>((e * r + p) * out + o)];
            }
        seq.bind();
        agg.bind();
        reduced.step();
        aggregated.step();
        // The aggregates are formed in another order here: R-term sums differ by ~R·u.
        CHECK(rel_err(reduced.a_factor("fc").reshaped(), aggregated.a_factor("fc").reshaped()) < 16 * r * eps<T>());
        CHECK(rel_err(reduced.g_factor("fc").reshaped(), aggregated.g_factor("fc").reshaped()) < 16 * r * eps<T>());
    }
}

TEST_CASE("weight sharing errors and signatures", "[errors][weight_sharing]") {
    using T = float;
    owned_layer<T> l = random_linear<T>(6, 3, 2, true, 1);
    l.view.description.sharing = kfac::weight_sharing::reduce;
    l.input_shape = {2, 3, 3};   // 2 examples × 3 positions
    l.output_shape = {3, 2, 2};  // 3 "examples" × 2 positions: the same rows, another split
    l.bind();
    kfac::KFAC<backend<T>> p;
    p.register_layer("fc", l.view);
    CHECK_THROWS_WITH(p.step(), Catch::Contains("layer 'fc' (linear 3->2, weight sharing reduce, bias)") &&
                                    Catch::Contains("dimension 0 counts the examples"));
    CHECK(p.steps() == 0);
    l.output_shape = {2, 3, 2};
    l.bind();
    p.step();
    CHECK(p.steps() == 1);
    // Expand's signature is the one checkpoints always held; reduce's names it.
    CHECK(kfac::detail::layer_signature("fc", kfac::linear_description(3, 2, true)) == "'fc' (linear 3->2, bias)");
    CHECK(kfac::detail::layer_signature("fc", l.view.description) == "'fc' (linear 3->2, weight sharing reduce, bias)");

    auto bad = l.view.description;
    bad.sharing = static_cast<kfac::weight_sharing>(7);
    kfac::layer_view<T> v;
    v.description = bad;
    kfac::KFAC<backend<T>> q;
    CHECK_THROWS_WITH(q.register_layer("fc", v), Catch::Contains("not a kfac::weight_sharing"));
}

TEST_CASE("options.reduce_layers chooses reduce by layer name", "[options][weight_sharing]") {
    using T = float;
    kfac::options opts;
    opts.reduce_layers = {"^head"};
    kfac::KFAC<backend<T>> p(opts);
    owned_layer<T> head = random_linear<T>(6, 3, 2, true, 1), body = random_linear<T>(6, 3, 2, true, 5);
    p.register_layer("head.fc", head.view);
    p.register_layer("body.fc", body.view);
    // The layer table names the choice; the mean input of [6, 3] rows under reduce is 6 examples of one position.
    CHECK(kfac::detail::layer_signature("head.fc", kfac::with_sharing(head.view.description, kfac::weight_sharing::reduce)) ==
          "'head.fc' (linear 3->2, weight sharing reduce, bias)");
    p.step();
    // A 2-D input is one position per example, where reduce and expand agree.
    kfac::KFAC<backend<T>> plain;
    owned_layer<T> same = random_linear<T>(6, 3, 2, true, 1);
    plain.register_layer("head.fc", same.view);
    plain.step();
    CHECK(p.a_factor("head.fc") == plain.a_factor("head.fc"));

    kfac::options bad;
    bad.reduce_layers = {"("};
    CHECK_THROWS_WITH(kfac::KFAC<backend<T>>(bad), Catch::Contains("options.reduce_layers: '('"));
}
