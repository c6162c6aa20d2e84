// SPDX-License-Identifier: Apache-2.0
// compute::ekfac (kfac/compute/ekfac.hpp) from its definition: the scaling S a step leaves is
// the scaling statistic of that step's rows in the bases then in force (restarted at a new
// basis, a running average otherwise); the gradient is divided by S + γ in the eigenbasis; with
// S = λ_A λ_Gᵀ the method is the eigen method bit for bit; a checkpoint resumes it bit for bit;
// what it does not support is refused by name.
#include <catch2/catch.hpp>

#include <kfac/backend/detail/cpu_ekfac_scaling.hpp>

#include "unit/applied_layer.hpp"
#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {

using ekfac_precond = kfac::KFAC<kfac::backend::cpu_eigen<double>, kfac::comm::serial, kfac::compute::ekfac>;

/// New seeded values in the layer's buffers, in place (its views stay valid).
void ekfac_refill(owned_layer<double>& l, std::uint32_t seed) {
    const auto rows = static_cast<double>(l.input_shape.front());
    auto fill = [](std::vector<double>& v, std::uint32_t s, double scale) {
        const auto r = random_vector<double>(v.size(), s, scale);
        std::copy(r.begin(), r.end(), v.begin());
    };
    fill(l.input, seed, 1.0);
    fill(l.grad_output, seed + 1, 1.0 / rows);
    fill(l.grad_weight, seed + 2, 0.1);
    fill(l.grad_bias, seed + 3, 0.1);
}

/// The layer's gradient as Γᵀ (A_dim × G_dim): dWᵀ with db as the last row.
mat<double> ekfac_gamma_t(const owned_layer<double>& l) {
    const auto& d = l.view.description;
    mat<double> g(d.a_dim(), d.g_dim());
    for (std::int64_t o = 0; o < d.out; ++o) {
        for (std::int64_t i = 0; i < d.in; ++i) g(i, o) = l.grad_weight[static_cast<std::size_t>(o * d.in + i)];
        if (d.bias) g(d.in, o) = l.grad_bias[static_cast<std::size_t>(o)];
    }
    return g;
}

/// Steps k = from, ..., to − 1 of `p`, each on the layer refilled with seed + 10k, and returns
/// the gradient (as Γᵀ) each step left.
template <class P>
std::vector<mat<double>> ekfac_steps(P& p, owned_layer<double>& layer, std::uint32_t seed, std::uint32_t from,
                                     std::uint32_t to) {
    std::vector<mat<double>> grads;
    for (std::uint32_t k = from; k < to; ++k) {
        ekfac_refill(layer, seed + 10 * k);
        p.step();
        grads.push_back(ekfac_gamma_t(layer));
    }
    return grads;
}

/// A saved tensor of `rows` × `cols` (C order) as a matrix.
mat<double> ekfac_saved(const kfac::checkpoint::archive& a, const std::string& name, std::int64_t rows,
                        std::int64_t cols) {
    const auto* t = a.find(name);
    REQUIRE(t != nullptr);
    const std::vector<double> v = t->values<double>();
    REQUIRE(static_cast<std::int64_t>(v.size()) == rows * cols);
    return Eigen::Map<const row_mat<double>>(v.data(), rows, cols);
}

/// Ŝᵀ of the layer's current rows in bases q_a, q_g (the definition's kernel).
mat<double> ekfac_estimate(const owned_layer<double>& l, const mat<double>& q_a, const mat<double>& q_g) {
    mat<double> s;
    kfac::backend::detail::ekfac_scaling_scratch<double> ws;
    kfac::backend::detail::accumulate_ekfac_scaling(s, l.view.description, l.view.input, l.view.grad_output, q_a, q_g,
                                                    0.0, ws);
    return s;
}

}  // namespace

TEST_CASE("ekfac: S is the step's scaling statistic in the new bases, then its running average", "[ekfac]") {
    auto layer = random_linear<double>(12, 5, 4, true, 31);
    const auto& d = layer.view.description;
    kfac::options o;
    o.inv_update_steps = 2;  // step 0: factors and bases; step 1: factors only
    o.kl_clip = std::nullopt;
    o.damping = 0.01;
    ekfac_precond p(o);
    p.register_layer("fc", layer.view);

    p.step();  // S ← Ŝ₀ in the bases just computed
    const auto first = kfac::checkpoint::parse(p.save_bytes(), "step 0");
    const mat<double> q_a = ekfac_saved(first, "fc.A.eigenvectors", d.a_dim(), d.a_dim());
    const mat<double> q_g = ekfac_saved(first, "fc.G.eigenvectors", d.g_dim(), d.g_dim());
    const mat<double> s0 = ekfac_saved(first, "fc.scaling", d.a_dim(), d.g_dim());
    CHECK(s0 == ekfac_estimate(layer, q_a, q_g));  // the same kernel on the same rows and bases

    ekfac_refill(layer, 77);
    const mat<double> gamma_t = ekfac_gamma_t(layer);
    p.step();  // no new bases: S ← ξ S₀ + (1 − ξ) Ŝ₁
    const auto second = kfac::checkpoint::parse(p.save_bytes(), "step 1");
    CHECK(ekfac_saved(second, "fc.A.eigenvectors", d.a_dim(), d.a_dim()) == q_a);
    const mat<double> s1 = ekfac_saved(second, "fc.scaling", d.a_dim(), d.g_dim());
    const double xi = 0.95;  // options.factor_decay's default
    const mat<double> expected = xi * s0 + (1.0 - xi) * ekfac_estimate(layer, q_a, q_g);
    CHECK(s1 == expected);
    CHECK(s1 != s0);

    // Pᵀ = Q_A ((Q_Aᵀ Γᵀ Q_G) ⊘ (Sᵀ + γ)) Q_Gᵀ, computed here with Eigen's products where the
    // backend uses BLAS: each of the four products of orthonormal bases adds at most
    // (A_dim + G_dim)·u of the largest entry, and the division is exact to u, so 10 × 4 × 11 × u
    // bounds the difference relative to max|P| (no kl_clip: the gradient is P itself).
    const mat<double> v = q_a.transpose() * gamma_t * q_g;
    const mat<double> p_t = q_a * (v.array() / (s1.array() + 0.01)).matrix() * q_g.transpose();
    const mat<double> got = ekfac_gamma_t(layer);
    CHECK(rel_err(got.reshaped(), p_t.reshaped()) < 440 * eps<double>());
}

TEST_CASE("ekfac: S of a step of several accumulate() passes is the mean over all its examples", "[ekfac]") {
    // 12 examples in passes of 5 and 7. Under the reference statistics each pass's estimate is
    // the mean over its examples of their gradients squared in the basis (the host's gradients as
    // given), and the step's S the mean over all 12: N_p-weighted. Under the per-example ones a
    // pass's gradients carry its own mean loss's 1/N_p, and S is the mean of the examples' own
    // squared gradients: the definition's kernel over all 12 rows with their own gradients. The
    // passes' means are formed and weighted in another order than one pass's: sums of 12 positive
    // terms, ≤ 3 roundings more per entry, 100u bounds them.
    const std::int64_t n = 12, in = 5, out = 4, split = 5;
    const auto x = random_vector<double>(static_cast<std::size_t>(n * in), 41);
    const auto own = random_vector<double>(static_cast<std::size_t>(n * out), 42);  // each example's own dL_n/dy
    for (const auto statistics : {kfac::statistic_scale::reference, kfac::statistic_scale::per_example}) {
        INFO(kfac::detail::option_value_name(statistics));
        const bool per_example = statistics == kfac::statistic_scale::per_example;
        kfac::options o;
        o.accumulation_steps = 2;
        o.statistics = statistics;
        if (per_example) o.averaging = kfac::factor_averaging::bias_corrected;
        o.damping = 0.01;
        ekfac_precond p(o);
        auto layer = random_linear<double>(n, in, out, true, 43);
        p.register_layer("fc", layer.view);
        auto load = [&](std::int64_t from, std::int64_t count) {  // examples [from, from + count)
            layer.input.assign(x.begin() + from * in, x.begin() + (from + count) * in);
            layer.grad_output.assign(own.begin() + from * out, own.begin() + (from + count) * out);
            if (per_example)  // the pass's mean loss
                for (auto& v : layer.grad_output) v /= static_cast<double>(count);
            layer.input_shape = {count, in};
            layer.output_shape = {count, out};
            layer.bind();
        };
        load(0, split);
        p.accumulate();
        load(split, n - split);
        p.step();
        const auto saved = kfac::checkpoint::parse(p.save_bytes(), "step 0");
        const auto& d = layer.view.description;
        const mat<double> q_a = ekfac_saved(saved, "fc.A.eigenvectors", d.a_dim(), d.a_dim());
        const mat<double> q_g = ekfac_saved(saved, "fc.G.eigenvectors", d.g_dim(), d.g_dim());
        const mat<double> s = ekfac_saved(saved, "fc.scaling", d.a_dim(), d.g_dim());
        auto all = random_linear<double>(n, in, out, true, 44);
        all.input = x;
        all.grad_output = own;  // as the host gave them (reference), or each example's own (per_example)
        all.bind();
        const mat<double> expected = ekfac_estimate(all, q_a, q_g);
        CHECK(rel_err(s.reshaped(), expected.reshaped()) < 100 * eps<double>());
        // Not the passes' plain mean (1/2)(Ŝ₁ + Ŝ₂), which weighs the 5 examples as the 7.
        load(0, split);
        const mat<double> s1 = ekfac_estimate(layer, q_a, q_g);
        load(split, n - split);
        const mat<double> s2 = ekfac_estimate(layer, q_a, q_g);
        const double f1 = per_example ? double(split * split) : 1.0, f2 = per_example ? double((n - split) * (n - split)) : 1.0;
        CHECK(rel_err(s.reshaped(), mat<double>((f1 * s1 + f2 * s2) / 2.0).reshaped()) > 1e-3);
    }
}

TEST_CASE("ekfac: a layer applied twice in a pass sums each example's two gradients", "[ekfac]") {
    // A shared weight applied to both halves of a pair (a siamese branch): example n's gradient is
    // Γ_{n,1} + Γ_{n,2}, squared after the sum. S after the step is the applications' kernel over
    // both, in the bases the step computed: the same kernel on the same rows, to the bit.
    kfac_test::applied_layer<double> shared(4, 3, true);
    shared.apply(6, 11);
    shared.apply(6, 21);
    auto first = shared.applications[0], second = shared.applications[1];
    first.bind();  // the copies' views point into their own buffers
    second.bind();
    kfac::options o;
    o.damping = 0.01;
    ekfac_precond p(o);
    p.register_layer("shared", shared);
    p.step();
    const auto saved = kfac::checkpoint::parse(p.save_bytes(), "step 0");
    const auto& d = shared.description;
    const mat<double> q_a = ekfac_saved(saved, "shared.A.eigenvectors", d.a_dim(), d.a_dim());
    const mat<double> q_g = ekfac_saved(saved, "shared.G.eigenvectors", d.g_dim(), d.g_dim());
    mat<double> expected;
    kfac::backend::detail::ekfac_scaling_scratch<double> ws;
    kfac::backend::detail::accumulate_ekfac_scaling(
        expected, d, std::vector<kfac::tensor_view<const double>>{first.view.input, second.view.input},
        std::vector<kfac::tensor_view<const double>>{first.view.grad_output, second.view.grad_output}, q_a, q_g, 0.0, ws);
    CHECK(ekfac_saved(saved, "shared.scaling", d.a_dim(), d.g_dim()) == expected);
}

TEST_CASE("ekfac: the curvature report summarises S and its share S / (S + γ)", "[ekfac][curvature]") {
    auto layer = random_linear<double>(12, 5, 4, true, 31), other = layer;
    other.bind();
    const auto& d = layer.view.description;
    kfac::options o;
    o.damping = 0.01;
    ekfac_precond p(o);
    p.register_layer("fc", layer.view);
    CHECK(p.curvature().front().scaling.dim == 0);  // no S before an inverse update makes it
    CHECK(std::isnan(p.curvature().front().scaling_share));
    p.step();
    const mat<double> s = ekfac_saved(kfac::checkpoint::parse(p.save_bytes(), "step 0"), "fc.scaling", d.a_dim(), d.g_dim());
    const kfac::layer_curvature c = p.curvature().front();
    CHECK(c.scaling.dim == d.a_dim() * d.g_dim());
    CHECK(c.scaling.min == s.minCoeff());
    CHECK(c.scaling.max == s.maxCoeff());
    // Means of 20 positive terms summed in another order than Eigen's: ≤ 20u apart.
    CHECK(c.scaling.mean == Approx(s.mean()).epsilon(20 * eps<double>()));
    const double share = (s.array() / (s.array() + 0.01)).mean();
    CHECK(c.scaling_share == Approx(share).epsilon(40 * eps<double>()));
    CHECK(c.scaling_share > 0.0);
    CHECK(c.scaling_share < 1.0);
    kfac::KFAC<kfac::backend::cpu_eigen<double>> eigen(o);  // K-FAC's methods have no S
    eigen.register_layer("fc", other.view);
    eigen.step();
    CHECK(eigen.curvature().front().scaling.dim == 0);
    CHECK(std::isnan(eigen.curvature().front().scaling_share));
    CHECK(eigen.curvature().front().curvature_share == Approx(c.curvature_share).epsilon(1e-12));  // the same factors
}

TEST_CASE("ekfac: with S = λ_A λ_Gᵀ it is the eigen method bit for bit, and not with its own S", "[ekfac]") {
    // factor_update_steps 2 and inv_update_steps 3: step 3 computes new bases without a factor
    // update, so EKFAC's S is K-FAC's λ_A λ_Gᵀ there; at step 0 it is the estimate.
    kfac::options o;
    o.factor_update_steps = 2;
    o.inv_update_steps = 3;
    o.compute_eigenvalue_outer_product = false;  // the eigen method then divides, as EKFAC does
    auto run = [&](auto& p, owned_layer<double>& layer) {
        p.register_layer("fc", layer.view);
        return ekfac_steps(p, layer, 500, 0, 4);
    };
    auto a = random_linear<double>(10, 6, 3, true, 5), b = a;
    a.bind();
    b.bind();
    ekfac_precond ekfac(o);
    kfac::KFAC<kfac::backend::cpu_eigen<double>> eigen(o);
    const auto by_ekfac = run(ekfac, a), by_eigen = run(eigen, b);
    CHECK(by_ekfac[0] != by_eigen[0]);  // S = Ŝ₀ at step 0
    CHECK(by_ekfac[3] == by_eigen[3]);  // S = λ_A λ_Gᵀ at step 3
}

TEST_CASE("ekfac: per-example statistics make S N² times the statistic, and a loss scale leaves it as it is",
          "[ekfac][curvature_modes][loss_scale]") {
    // Under statistic_scale::per_example S is the per-example Fisher's diagonal in the eigenbasis:
    // each example's gradient, formed from the host's mean-loss output gradients (1/N of its
    // own), is scaled back by N, so S = N² Ŝ (kfac/detail/statistic_scale.hpp), exactly that
    // product. With a loss scale s = 2⁶ the host's output gradients are s times as large and Ŝ
    // s² times; dividing by s² is exact for a power of two, so S and the bases do not change.
    auto layer = random_linear<double>(12, 5, 4, true, 31);  // N = 12 examples
    const auto& d = layer.view.description;
    kfac::options o;
    o.statistics = kfac::statistic_scale::per_example;
    o.averaging = kfac::factor_averaging::bias_corrected;
    o.kl_clip = std::nullopt;
    o.damping = 0.01;
    auto scaled_layer = layer;
    scaled_layer.bind();
    for (auto* v : {&scaled_layer.grad_output, &scaled_layer.grad_weight, &scaled_layer.grad_bias})
        for (auto& x : *v) x *= 64.0;
    kfac::options scaled = o;
    scaled.loss_scale = 64.0;
    ekfac_precond p(o), q(scaled);
    p.register_layer("fc", layer.view);
    q.register_layer("fc", scaled_layer.view);
    p.step();
    q.step();
    const auto saved = kfac::checkpoint::parse(p.save_bytes(), "per-example");
    const mat<double> q_a = ekfac_saved(saved, "fc.A.eigenvectors", d.a_dim(), d.a_dim());
    const mat<double> q_g = ekfac_saved(saved, "fc.G.eigenvectors", d.g_dim(), d.g_dim());
    const mat<double> s = ekfac_saved(saved, "fc.scaling", d.a_dim(), d.g_dim());
    CHECK(s == 144.0 * ekfac_estimate(layer, q_a, q_g));
    const auto loss_scaled = kfac::checkpoint::parse(q.save_bytes(), "loss-scaled");
    CHECK(ekfac_saved(loss_scaled, "fc.G.eigenvectors", d.g_dim(), d.g_dim()) == q_g);
    CHECK(ekfac_saved(loss_scaled, "fc.scaling", d.a_dim(), d.g_dim()) == s);
}

TEST_CASE("ekfac: a checkpoint resumes it bit for bit", "[ekfac][checkpoint]") {
    kfac::options o;
    o.inv_update_steps = 3;
    auto whole_layer = random_linear<double>(9, 4, 5, true, 8), split_layer = whole_layer;
    whole_layer.bind();
    split_layer.bind();
    ekfac_precond whole(o), before(o), after(o);
    whole.register_layer("fc", whole_layer.view);
    before.register_layer("fc", split_layer.view);
    after.register_layer("fc", split_layer.view);
    const auto expected = ekfac_steps(whole, whole_layer, 900, 0, 7);
    ekfac_steps(before, split_layer, 900, 0, 4);  // the save falls between two inverse updates
    after.load_bytes(before.save_bytes());
    const auto resumed = ekfac_steps(after, split_layer, 900, 4, 7);
    for (std::size_t k = 0; k < resumed.size(); ++k) CHECK(resumed[k] == expected[4 + k]);
    CHECK(whole.save_bytes() == after.save_bytes());
}

TEST_CASE("ekfac: what it does not support is refused by name", "[ekfac][errors]") {
    kfac::options o;
    auto embedding = random_embedding<double>(10, 4, 3, 2, 1, 1);
    ekfac_precond p(o);
    CHECK_THROWS_WITH(p.register_layer("emb", embedding.view),
                      Catch::Contains("'emb'") && Catch::Contains("compute::ekfac preconditions layers whose factors "
                                                                  "are a dense Kronecker pair"));
    kfac::options skipping;
    skipping.skip_layers = {"emb"};  // the fix the message gives
    ekfac_precond q(skipping);
    CHECK_FALSE(q.register_layer("emb", embedding.view));
    kfac::options factored;
    factored.damping_mode = kfac::damping_form::factored;
    CHECK_THROWS_WITH(ekfac_precond(factored), Catch::Contains("relative or factored damping"));
}
