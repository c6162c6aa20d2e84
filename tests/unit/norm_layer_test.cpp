// SPDX-License-Identifier: Apache-2.0
// Normalisation layers (LayerNorm, BatchNorm): K-FAC sees their affine part y = γ ⊙ x̂ + β,
// whose curvature is not a Kronecker product but one exact block per channel c (frontier.md
// §3.4; kfac-jax's ScaleAndShift blocks): F_c = mean over rows r of t_{r,c} t_{r,c}ᵀ with the
// per-row gradient t_{r,c} = (Σ x̂ ⊙ dy, Σ dy) of (γ_c, β_c), summed over the row's positions.
// Here every block is checked against that definition written out as loops over (example,
// position, channel), and the preconditioned gradient against the solve (F_c + γI) P_c = Γ_c.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "unit/test_util.hpp"

using namespace kfac_test;

// Which kinds hold their features last: the one property every layout decision reads.
static_assert(kfac::features_last(kfac::layer_kind::linear) && kfac::features_last(kfac::layer_kind::layer_norm));
static_assert(!kfac::features_last(kfac::layer_kind::batch_norm) && !kfac::features_last(kfac::layer_kind::group_norm) &&
              !kfac::features_last(kfac::layer_kind::instance_norm) && !kfac::features_last(kfac::layer_kind::conv2d));
static_assert(kfac::default_sharing(kfac::layer_kind::group_norm) == kfac::weight_sharing::reduce &&
              kfac::default_sharing(kfac::layer_kind::instance_norm) == kfac::weight_sharing::reduce &&
              kfac::default_sharing(kfac::layer_kind::layer_norm) == kfac::weight_sharing::expand);

namespace {


/// The definition: F_c = (1/R) Σ_rows t tᵀ, t = (Σ x̂ dy, Σ dy) over the row's positions; a
/// row is one example (weight sharing reduce) or one (example, position) pair (expand). The
/// layout: LayerNorm [N, positions..., C] (a rank-1 view one example), BatchNorm, GroupNorm
/// and InstanceNorm [N, C, spatial...]. Returns the k × k blocks, k = 2 with a shift, 1 without.
template <class T>
std::vector<Eigen::MatrixXd> definition_blocks(const kfac::layer_description& d, const std::vector<std::int64_t>& shape,
                                               const std::vector<T>& x, const std::vector<T>& dy) {
    // The layouts as the kinds define them, stated here apart from the library's features_last().
    const bool layer_norm = d.kind == kfac::layer_kind::layer_norm;  // [rows..., C], else [N, C, spatial...]
    const std::int64_t c_count = d.out, n_count = layer_norm && shape.size() == 1 ? 1 : shape[0];
    const auto total = static_cast<std::int64_t>(x.size());
    const std::int64_t p_count = total / (n_count * c_count);
    const bool per_example = d.sharing == kfac::weight_sharing::reduce;
    auto at = [&](std::int64_t n, std::int64_t p, std::int64_t c) {
        return static_cast<std::size_t>(layer_norm ? (n * p_count + p) * c_count + c : (n * c_count + c) * p_count + p);
    };
    const int k = d.bias ? 2 : 1;
    std::vector<Eigen::MatrixXd> f(static_cast<std::size_t>(c_count), Eigen::MatrixXd::Zero(k, k));
    const std::int64_t rows = per_example ? n_count : n_count * p_count;
    for (std::int64_t c = 0; c < c_count; ++c) {
        auto add = [&](double t_gamma, double t_beta) {
            Eigen::VectorXd t(k);
            t(0) = t_gamma;
            if (k == 2) t(1) = t_beta;
            f[static_cast<std::size_t>(c)] += t * t.transpose() / double(rows);
        };
        for (std::int64_t n = 0; n < n_count; ++n) {
            double sum_gamma = 0.0, sum_beta = 0.0;
            for (std::int64_t p = 0; p < p_count; ++p) {
                const double xv = double(x[at(n, p, c)]), g = double(dy[at(n, p, c)]);
                if (per_example) {
                    sum_gamma += xv * g;
                    sum_beta += g;
                } else {
                    add(xv * g, g);
                }
            }
            if (per_example) add(sum_gamma, sum_beta);
        }
    }
    return f;
}

/// Block c of the preconditioner's storage (C × 3: F_γγ, F_γβ, F_ββ; C × 1 without shift).
template <class M>
Eigen::MatrixXd stored_block(const M& a, std::int64_t c) {
    if (a.cols() == 1) return Eigen::MatrixXd::Constant(1, 1, double(a(c, 0)));
    Eigen::MatrixXd b(2, 2);
    b << double(a(c, 0)), double(a(c, 1)), double(a(c, 1)), double(a(c, 2));
    return b;
}

struct norm_case {
    const char* name;
    kfac::layer_description description;
    std::vector<std::int64_t> shape;
};

std::vector<norm_case> norm_cases() {
    using kfac::weight_sharing;
    return {
        {"LayerNorm over tokens, expand", kfac::layer_norm_description(5, true), {3, 4, 5}},
        {"LayerNorm, reduce", kfac::with_sharing(kfac::layer_norm_description(5, true), weight_sharing::reduce), {3, 4, 5}},
        {"LayerNorm without shift", kfac::layer_norm_description(4, false), {7, 4}},
        {"LayerNorm of one example", kfac::layer_norm_description(6, true), {6}},
        {"BatchNorm2d", kfac::batch_norm_description(5, true), {3, 5, 2, 3}},
        {"BatchNorm1d, expand", kfac::with_sharing(kfac::batch_norm_description(5, true), weight_sharing::expand), {2, 5, 4}},
        {"BatchNorm2d without shift", kfac::batch_norm_description(3, false), {4, 3, 3, 3}},
        {"GroupNorm", kfac::group_norm_description(4, true), {3, 4, 2, 3}},
        {"InstanceNorm1d without shift", kfac::instance_norm_description(3, false), {2, 3, 5}},
        {"InstanceNorm2d, expand", kfac::with_sharing(kfac::instance_norm_description(2, true), weight_sharing::expand), {2, 2, 3, 2}},
        // 3 channels with shift: the blocks' storage is a square 3 × 3, which must not be read
        // as a symmetric matrix's triangle (it was mirrored, channel 1's F_γγ over channel 0's F_γβ).
        {"BatchNorm2d of 3 channels", kfac::batch_norm_description(3, true), {4, 3, 2, 2}},
    };
}

}  // namespace

TEMPLATE_TEST_CASE("normalisation layer blocks match their definition", "[statistics][norm]", float, double) {
    using T = TestType;
    for (const auto& c : norm_cases()) {
        INFO(c.name);
        const auto& d = c.description;
        kfac::options opts;
        opts.factor_decay = 0.1;
        opts.threads = 1;
        kfac::KFAC<backend<T>> p(opts);
        auto l = random_norm<T>(d, c.shape, 7);
        p.register_layer("norm", l.view);
        p.step();
        const auto f = definition_blocks(d, c.shape, l.input, l.grad_output);
        const auto& a = p.a_factor("norm");
        const std::int64_t k = d.bias ? 2 : 1;
        REQUIRE(a.rows() == d.out);
        REQUIRE(a.cols() == k * (k + 1) / 2);
        // First update: ξ·I + (1 − ξ)·F̂. Each entry of F̂ is a mean over R rows of products of
        // sums of P products (R, P ≤ M = elements per channel): rounding ≲ (P + R + 2)·u ≤
        // (2M + 2)·u of the entries' scale, plus the two roundings of the running average.
        const double positions = 2.0 * double(l.input.size()) / double(d.out);
        double largest = 0.0, error = 0.0;
        for (std::int64_t ch = 0; ch < d.out; ++ch) {
            const Eigen::MatrixXd expected = 0.1 * Eigen::MatrixXd::Identity(k, k) + 0.9 * f[static_cast<std::size_t>(ch)];
            largest = std::max(largest, expected.cwiseAbs().maxCoeff());
            error = std::max(error, (stored_block(a, ch) - expected).cwiseAbs().maxCoeff());
        }
        CHECK(error <= 4 * (positions + 4) * eps<T>() * largest);
        // G is the identity, never estimated.
        CHECK(p.g_factor("norm").rows() == 1);
        CHECK(p.g_factor("norm")(0, 0) == T(1));
        CHECK(p.layers()[0].kind == d.kind);
        CHECK(p.layers()[0].a_dim == k);
        CHECK(p.layers()[0].g_dim == d.out);
    }
}

TEMPLATE_TEST_CASE("a normalisation layer's gradient is solved with its damped blocks", "[preconditioner][norm]",
                   kfac::compute::eigendecomposition, kfac::compute::inverse) {
    using T = double;
    using method = TestType;
    const bool eigen = std::is_same_v<method, kfac::compute::eigendecomposition>;
    for (const bool precomputed : {true, false}) {
        if (!eigen && !precomputed) continue;  // the option belongs to the eigen method
        for (const auto& c : norm_cases()) {
            INFO(c.name << (precomputed ? "" : ", damping applied at each step"));
            const auto& d = c.description;
            kfac::options opts;
            opts.damping = 0.003;
            opts.factor_decay = 0.8;
            opts.kl_clip = std::nullopt;
            opts.compute_eigenvalue_outer_product = precomputed;
            opts.threads = 2;
            kfac::KFAC<backend<T>, kfac::comm::serial, method> p(opts);
            auto l = random_norm<T>(d, c.shape, 11);
            p.register_layer("norm", l.view);
            for (int step = 0; step < 3; ++step) {
                const auto seed = static_cast<std::uint32_t>(20 * step + 1);
                l.input = random_vector<T>(l.input.size(), seed);
                l.grad_output = random_vector<T>(l.grad_output.size(), seed + 1, 0.1);
                l.grad_weight = random_vector<T>(l.grad_weight.size(), seed + 2, 0.1);
                l.grad_bias = random_vector<T>(l.grad_bias.size(), seed + 3, 0.1);
                l.bind();
                const std::vector<T> gamma_w = l.grad_weight, gamma_b = l.grad_bias;
                p.step();
                // P_c solves (F_c + γI) P_c = (∇γ_c, ∇β_c) with the factor just updated (both
                // intervals are 1). The closed-form inverse and this LU solve differ by a few
                // roundings times κ(F_c + γI) ≤ (‖F_c‖ + γ)/γ.
                const auto& a = p.a_factor("norm");
                for (std::int64_t ch = 0; ch < d.out; ++ch) {
                    const Eigen::MatrixXd f = stored_block(a, ch);
                    const auto k = f.rows();
                    Eigen::VectorXd gamma(k), got(k);
                    gamma(0) = gamma_w[static_cast<std::size_t>(ch)];
                    got(0) = l.grad_weight[static_cast<std::size_t>(ch)];
                    if (k == 2) {
                        gamma(1) = gamma_b[static_cast<std::size_t>(ch)];
                        got(1) = l.grad_bias[static_cast<std::size_t>(ch)];
                    }
                    const Eigen::MatrixXd damped = f + 0.003 * Eigen::MatrixXd::Identity(k, k);
                    const Eigen::VectorXd expected = damped.fullPivLu().solve(gamma);
                    const double kappa = (damped.norm() + 0.003) / 0.003;
                    CHECK(rel_err(got, expected) <= 32 * kappa * eps<T>());
                }
            }
        }
    }
}

TEST_CASE("normalisation layers resume bitwise from a checkpoint", "[checkpoint][norm]") {
    using T = float;
    auto run = [&](auto& p, std::vector<owned_layer<T>>& ls, int first, int last) {
        for (int step = first; step < last; ++step) {
            for (std::size_t i = 0; i < ls.size(); ++i) {
                const auto seed = static_cast<std::uint32_t>(100 * step + 10 * i);
                auto& l = ls[i];
                l.input = random_vector<T>(l.input.size(), seed);
                l.grad_output = random_vector<T>(l.grad_output.size(), seed + 1, 0.1);
                l.grad_weight = random_vector<T>(l.grad_weight.size(), seed + 2, 0.1);
                l.grad_bias = random_vector<T>(l.grad_bias.size(), seed + 3, 0.1);
                l.bind();
            }
            p.step();
        }
    };
    auto make_layers = [] {
        std::vector<owned_layer<T>> ls;
        ls.push_back(random_norm<T>(kfac::layer_norm_description(6, true), {2, 3, 6}, 1));
        ls.push_back(random_norm<T>(kfac::batch_norm_description(4, false), {3, 4, 2, 2}, 2));
        return ls;
    };
    auto check_method = [&](auto method_tag) {
        using method = decltype(method_tag);
        kfac::options opts;
        opts.inv_update_steps = 2;
        opts.threads = 1;
        auto la = make_layers(), lb = make_layers(), lc = make_layers();
        kfac::KFAC<backend<T>, kfac::comm::serial, method> straight(opts), first(opts), resumed(opts);
        for (auto [p, ls] : {std::pair{&straight, &la}, std::pair{&first, &lb}, std::pair{&resumed, &lc}}) {
            p->register_layer("ln", (*ls)[0].view);
            p->register_layer("bn", (*ls)[1].view);
        }
        run(straight, la, 0, 5);
        run(first, lb, 0, 3);
        const std::string bytes = first.save_bytes();
        resumed.load_bytes(bytes);
        run(resumed, lc, 3, 5);
        for (std::size_t i = 0; i < 2; ++i) {
            CHECK(la[i].grad_weight == lc[i].grad_weight);
            CHECK(la[i].grad_bias == lc[i].grad_bias);
        }
        CHECK(straight.a_factor("ln") == resumed.a_factor("ln"));
        CHECK(straight.a_factor("bn") == resumed.a_factor("bn"));
        return bytes;
    };
    const std::string bytes = check_method(kfac::compute::eigendecomposition{});
    check_method(kfac::compute::inverse{});
    // The blocks are a [C, 3] (or [C, 1]) tensor; G the 1 × 1 identity.
    const auto archive = kfac::checkpoint::parse(bytes, "test");
    auto shape_of = [&](const std::string& name) {
        for (const auto& t : archive.tensors)
            if (t.name == name) return t.shape;
        return std::vector<std::int64_t>{};
    };
    CHECK(shape_of("ln.A") == std::vector<std::int64_t>{6, 3});
    CHECK(shape_of("bn.A") == std::vector<std::int64_t>{4, 1});
    CHECK(shape_of("ln.G") == std::vector<std::int64_t>{1, 1});
    // A BatchNorm of the same channel count is another layer: the file refuses it by name.
    auto other_layers = make_layers();
    auto as_batch_norm = random_norm<T>(kfac::batch_norm_description(6, true), {2, 6, 3}, 3);
    kfac::options saved_options;
    saved_options.inv_update_steps = 2;
    kfac::KFAC<backend<T>> other(saved_options);
    other.register_layer("ln", as_batch_norm.view);
    other.register_layer("bn", other_layers[1].view);
    CHECK_THROWS_WITH(other.load_bytes(bytes), Catch::Contains("'ln' (layer_norm 6, shift)") &&
                                                   Catch::Contains("'ln' (batch_norm 6, shift)"));
}

TEST_CASE("normalisation layer errors name the layer, the shapes and the fix", "[errors][norm]") {
    using T = float;
    auto l = random_norm<T>(kfac::batch_norm_description(4, true), {2, 4, 3}, 5);
    SECTION("a description whose in and out differ") {
        kfac::KFAC<backend<T>> p;
        auto wrong = l.view;
        wrong.description.in = 5;
        CHECK_THROWS_WITH(p.register_layer("bn", wrong), Catch::Contains("layer 'bn' (batch_norm 4, shift)") &&
                                                              Catch::Contains("but they are 5 and 4") &&
                                                              Catch::Contains("kfac::batch_norm_description()"));
        CHECK(p.layer_count() == 0);
    }
    SECTION("views of the wrong shapes leave the preconditioner as it was") {
        kfac::KFAC<backend<T>> p;
        p.register_layer("bn", l.view);
        l.input_shape = {2, 3, 4};  // channels last: a LayerNorm's layout
        l.output_shape = {2, 3, 4};
        l.bind();
        CHECK_THROWS_WITH(p.step(), Catch::Contains("layer 'bn' (batch_norm 4, shift)") &&
                                        Catch::Contains("normalised input has shape [2, 3, 4]") &&
                                        Catch::Contains("expected [N, 4, spatial...]"));
        l.input_shape = {2, 4, 3};
        l.output_shape = {2, 4, 1, 3};
        l.bind();
        CHECK_THROWS_WITH(p.step(), Catch::Contains("output gradient has shape [2, 4, 1, 3] but the normalised "
                                                    "input [2, 4, 3]"));
        l.output_shape = {2, 4, 3};
        l.bind();
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {4, 1});
        CHECK_THROWS_WITH(p.step(), Catch::Contains("scale (weight) gradient has shape [4, 1]; expected [4]"));
        l.bind();
        l.view.grad_bias = {};
        CHECK_THROWS_WITH(p.step(), Catch::Contains("shift (bias) gradient has shape (empty); expected [4]"));
        CHECK(p.steps() == 0);
        CHECK(p.a_factor("bn")(0, 0) == 1.0f);  // the identity blocks, untouched
        l.bind();
        p.step();
        CHECK(p.steps() == 1);
    }
    SECTION("skip and reduce patterns see the kind") {
        kfac::options o;
        o.skip_layers = {"LayerNorm"};
        o.reduce_layers = {"^ln"};
        kfac::KFAC<backend<T>> p(o);
        auto ln = random_norm<T>(kfac::layer_norm_description(4, true), {3, 4}, 6);
        CHECK_FALSE(p.register_layer("x", ln.view));
        kfac::options r;
        r.reduce_layers = {"^ln"};
        kfac::KFAC<backend<T>> q(r);
        CHECK(q.register_layer("ln1", ln.view));
        CHECK(q.register_layer("bn", l.view));
        const auto sig = q.save_bytes();
        CHECK(sig.find("'ln1' (layer_norm 4, shift, weight sharing reduce)") != std::string::npos);
        CHECK(sig.find("'bn' (batch_norm 4, shift)") != std::string::npos);  // reduce is BatchNorm's default
    }
}
