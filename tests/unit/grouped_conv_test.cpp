// SPDX-License-Identifier: Apache-2.0
// Grouped and depthwise convolutions: one Kronecker block per group (frontier.md §3.6). Each
// block's factors and preconditioned gradient against the definition written out from the
// group's patches and output gradients, and the grouped layer against the `groups` separate
// convolutions it equals.
#include <catch2/catch.hpp>

#include <string_view>

#include <Eigen/Dense>

#include "unit/test_util.hpp"

using namespace kfac_test;

namespace {


/// Channels [group·c/groups, (group + 1)·c/groups) of an [n, c, inner...] array, contiguous.
template <class T>
std::vector<T> channels_of(const std::vector<T>& x, std::int64_t n, std::int64_t c, std::int64_t groups,
                           std::int64_t group) {
    const std::int64_t per = c / groups, inner = static_cast<std::int64_t>(x.size()) / (n * c);
    std::vector<T> out;
    for (std::int64_t s = 0; s < n; ++s) {
        const auto first = x.begin() + (s * c + group * per) * inner;
        out.insert(out.end(), first, first + per * inner);
    }
    return out;
}

/// A ⊗ B: block (i, j) is A(i, j)·B.
inline Eigen::MatrixXd kronecker(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
    Eigen::MatrixXd k(a.rows() * b.rows(), a.cols() * b.cols());
    for (Eigen::Index i = 0; i < a.rows(); ++i)
        for (Eigen::Index j = 0; j < a.cols(); ++j) k.block(i * b.rows(), j * b.cols(), b.rows(), b.cols()) = a(i, j) * b;
    return k;
}

}  // namespace

TEST_CASE("a grouped convolution's blocks match their definition", "[preconditioner][grouped_conv]") {
    using T = double;
    const std::int64_t n = 3, c_in = 4, c_out = 6, groups = 2, h = 5, w = 4;
    kfac::conv2d_geometry geo;
    geo.kernel = {3, 2};
    geo.stride = {2, 1};
    geo.padding = {1, 1};
    geo.groups = groups;
    auto l = random_conv<T>(n, c_in, c_out, geo, true, h, w, 7);
    const auto& d = l.view.description;
    const std::int64_t per_in = c_in / groups, per_out = c_out / groups, kk = 3 * 2;
    REQUIRE(d.a_dim() == per_in * kk + 1);
    REQUIRE(d.g_dim() == per_out);
    const std::int64_t ho = l.output_shape[2], wo = l.output_shape[3], s = ho * wo;
    const Eigen::VectorXd grad_w = Eigen::Map<const Eigen::VectorXd>(l.grad_weight.data(), static_cast<Eigen::Index>(l.grad_weight.size()));
    const Eigen::VectorXd grad_b = Eigen::Map<const Eigen::VectorXd>(l.grad_bias.data(), c_out);

    const double damping = 0.05, xi = 0.9;
    kfac::options opts;
    opts.damping = damping;
    opts.factor_decay = xi;
    opts.kl_clip = std::nullopt;
    opts.threads = 1;
    kfac::KFAC<backend<T>> p(opts);
    REQUIRE(p.register_layer("conv", l.view));
    CHECK(p.layer_count() == 2);
    CHECK(p.is_registered("conv"));
    CHECK(p.is_registered("conv/group1"));
    p.step();

    for (std::int64_t j = 0; j < groups; ++j) {
        INFO("group " << j);
        const std::string name = "conv/group" + std::to_string(j);
        // Definition (reference patches, golden §4.2): patch p_{n,i} of group j holds
        // x[n, j·C_in/g + c, i_h·s_h + u − p_h, i_w·s_w + v − p_w] at (c·k_h + u)·k_w + v (0 outside),
        // then 1; Â_j = Σ p pᵀ / (N·S³), Ĝ_j = Σ y yᵀ / (N·S³) over the group's output channels
        // y = dy[n, j·C_out/g + o, i]; the first update is ξ·I + (1 − ξ)·F̂.
        Eigen::MatrixXd a_hat = Eigen::MatrixXd::Zero(d.a_dim(), d.a_dim());
        Eigen::MatrixXd g_hat = Eigen::MatrixXd::Zero(per_out, per_out);
        for (std::int64_t e = 0; e < n; ++e)
            for (std::int64_t ih = 0; ih < ho; ++ih)
                for (std::int64_t iw = 0; iw < wo; ++iw) {
                    Eigen::VectorXd patch = Eigen::VectorXd::Ones(d.a_dim());
                    for (std::int64_t c = 0; c < per_in; ++c)
                        for (std::int64_t u = 0; u < 3; ++u)
                            for (std::int64_t v = 0; v < 2; ++v) {
                                const std::int64_t y = ih * 2 + u - 1, x = iw + v - 1;
                                const auto at = ((e * c_in + j * per_in + c) * h + y) * w + x;
                                patch((c * 3 + u) * 2 + v) =
                                    y >= 0 && y < h && x >= 0 && x < w ? l.input[static_cast<std::size_t>(at)] : 0.0;
                            }
                    a_hat += patch * patch.transpose();
                    Eigen::VectorXd dy(per_out);
                    for (std::int64_t o = 0; o < per_out; ++o)
                        dy(o) = l.grad_output[static_cast<std::size_t>(((e * c_out + j * per_out + o) * ho + ih) * wo + iw)];
                    g_hat += dy * dy.transpose();
                }
        const double norm = double(n) * double(s * s * s);
        const Eigen::MatrixXd a_ref = xi * Eigen::MatrixXd::Identity(d.a_dim(), d.a_dim()) + (1 - xi) * a_hat / norm;
        const Eigen::MatrixXd g_ref = xi * Eigen::MatrixXd::Identity(per_out, per_out) + (1 - xi) * g_hat / norm;
        // Sums of N·S products of O(1) terms: error ≲ N·S·u of the largest entry.
        CHECK(rel_err(p.a_factor(name).reshaped(), a_ref.reshaped()) < 4.0 * double(n * s) * eps<T>());
        CHECK(rel_err(p.g_factor(name).reshaped(), g_ref.reshaped()) < 4.0 * double(n * s) * eps<T>());

        // Γ_j: the group's rows of the weight gradient, [C_out/g, (C_in/g)·k²], bias last. The
        // eigen method's P_j = Q_G[(Q_Gᵀ Γ_j Q_A) ⊘ (λ_G λ_Aᵀ + γ)]Q_Aᵀ is the solution of
        // (A_j ⊗ G_j + γI) vec(P_j) = vec(Γ_j) (column-major vec; both factors symmetric).
        const std::int64_t cols = per_in * kk;
        Eigen::MatrixXd gamma(per_out, cols + 1);
        for (std::int64_t o = 0; o < per_out; ++o) {
            const std::int64_t row = j * per_out + o;
            gamma.row(o).head(cols) = grad_w.segment(row * cols, cols).transpose();
            gamma(o, cols) = grad_b(row);
        }
        const Eigen::MatrixXd kron = kronecker(a_ref, g_ref);
        const Eigen::VectorXd vec_gamma = gamma.reshaped();
        const Eigen::MatrixXd system = kron + damping * Eigen::MatrixXd::Identity(kron.rows(), kron.cols());
        const Eigen::MatrixXd p_ref = system.ldlt().solve(vec_gamma).reshaped(per_out, cols + 1);
        Eigen::MatrixXd p_got(per_out, cols + 1);
        for (std::int64_t o = 0; o < per_out; ++o) {
            const std::int64_t row = j * per_out + o;
            for (std::int64_t c = 0; c < cols; ++c) p_got(o, c) = l.grad_weight[static_cast<std::size_t>(row * cols + c)];
            p_got(o, cols) = l.grad_bias[static_cast<std::size_t>(row)];
        }
        // Two symmetric eigensolves and a solve of condition ≤ (‖A‖‖G‖ + γ)/γ ≈ 20 here:
        // errors of a few hundred u of the result.
        CHECK(rel_err(p_got.reshaped(), p_ref.reshaped()) < 1e3 * eps<T>());
    }
}

TEST_CASE("a grouped convolution preconditions as its groups run as separate convolutions", "[preconditioner][grouped_conv]") {
    using T = float;
    struct g_case {
        const char* what;
        kfac::layer_kind kind;
        std::int64_t c_in, c_out, groups, k, stride, padding, dilation;
        bool bias;
    };
    const std::vector<g_case> cases = {
        {"grouped conv2d", kfac::layer_kind::conv2d, 6, 4, 2, 3, 1, 1, 1, true},
        {"depthwise conv2d, multiplier 2, stride 2", kfac::layer_kind::conv2d, 3, 6, 3, 3, 2, 1, 1, false},
        {"grouped conv1d, dilation 2", kfac::layer_kind::conv1d, 4, 8, 4, 3, 1, 2, 2, true},
    };
    const std::int64_t n = 3, h = 6, w = 7;
    for (const auto& cc : cases) {
        for (const char* method : {"eigen", "inverse", "ekfac"}) {
            INFO(cc.what << ", " << method);
            const bool one_d = cc.kind == kfac::layer_kind::conv1d;
            const std::int64_t height = one_d ? 1 : h;
            auto geometry = [&](std::int64_t groups) {
                kfac::conv2d_geometry g;
                g.kernel = {one_d ? 1 : cc.k, cc.k};
                g.stride = {one_d ? 1 : cc.stride, cc.stride};
                g.padding = {one_d ? 0 : cc.padding, cc.padding};
                g.dilation = {one_d ? 1 : cc.dilation, cc.dilation};
                g.groups = groups;
                return g;
            };
            auto describe = [&](std::int64_t c_in, std::int64_t c_out, std::int64_t groups) {
                auto d = kfac::conv2d_description(c_in, c_out, geometry(groups), cc.bias);
                d.kind = cc.kind;
                return d;
            };
            const auto g = geometry(cc.groups);
            const std::int64_t ho = kfac::conv_output_extent(height, g.kernel[0], g.stride[0], g.padding[0], g.dilation[0]);
            const std::int64_t wo = kfac::conv_output_extent(w, g.kernel[1], g.stride[1], g.padding[1], g.dilation[1]);
            const std::int64_t per_in = cc.c_in / cc.groups, per_out = cc.c_out / cc.groups;
            const std::int64_t taps = g.kernel[0] * g.kernel[1];
            auto shape = [&](std::int64_t c, std::int64_t y, std::int64_t x) {
                return one_d ? std::vector<std::int64_t>{n, c, x} : std::vector<std::int64_t>{n, c, y, x};
            };
            auto bind = [&](owned_layer<T>& l, std::int64_t c_in) {
                l.bind();
                const auto& d = l.view.description;
                if (one_d)
                    l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {d.out, c_in, cc.k});
            };

            kfac::options opts;
            opts.damping = 0.03;
            opts.conv_patches = kfac::conv_patch_mode::dilated;
            opts.inv_update_steps = 2;
            opts.threads = 2;
            using eigen_kfac = kfac::KFAC<backend<T>, kfac::comm::serial, kfac::compute::eigendecomposition>;
            using inverse_kfac = kfac::KFAC<backend<T>, kfac::comm::serial, kfac::compute::inverse>;
            using ekfac_kfac = kfac::KFAC<backend<T>, kfac::comm::serial, kfac::compute::ekfac>;
            auto run = [&](auto& grouped, auto& separate) {
                owned_layer<T> whole;
                whole.view.description = describe(cc.c_in, cc.c_out, cc.groups);
                whole.input_shape = shape(cc.c_in, height, w);
                whole.output_shape = shape(cc.c_out, ho, wo);
                std::vector<owned_layer<T>> parts(static_cast<std::size_t>(cc.groups));
                for (std::int64_t j = 0; j < cc.groups; ++j) {
                    auto& part = parts[static_cast<std::size_t>(j)];
                    part.view.description = describe(per_in, per_out, 1);
                    part.input_shape = shape(per_in, height, w);
                    part.output_shape = shape(per_out, ho, wo);
                }
                REQUIRE(grouped.register_layer("conv", whole.view));
                for (std::int64_t j = 0; j < cc.groups; ++j)
                    separate.register_layer("conv/group" + std::to_string(j), parts[static_cast<std::size_t>(j)].view);
                REQUIRE(grouped.layer_count() == static_cast<std::size_t>(cc.groups));
                for (int step = 0; step < 3; ++step) {
                    INFO("step " << step);
                    const auto seed = static_cast<std::uint32_t>(10 * step);
                    whole.input = random_vector<T>(static_cast<std::size_t>(n * cc.c_in * height * w), seed + 1);
                    whole.grad_output = random_vector<T>(static_cast<std::size_t>(n * cc.c_out * ho * wo), seed + 2, 0.3);
                    whole.grad_weight = random_vector<T>(static_cast<std::size_t>(cc.c_out * per_in * taps), seed + 3, 0.1);
                    whole.grad_bias = random_vector<T>(static_cast<std::size_t>(cc.c_out), seed + 4, 0.1);
                    bind(whole, per_in);
                    for (std::int64_t j = 0; j < cc.groups; ++j) {
                        auto& part = parts[static_cast<std::size_t>(j)];
                        part.input = channels_of(whole.input, n, cc.c_in, cc.groups, j);
                        part.grad_output = channels_of(whole.grad_output, n, cc.c_out, cc.groups, j);
                        // The group's output channels are contiguous rows of the weight and bias.
                        const auto rows = static_cast<std::ptrdiff_t>(per_out * per_in * taps);
                        part.grad_weight.assign(whole.grad_weight.begin() + j * rows, whole.grad_weight.begin() + (j + 1) * rows);
                        part.grad_bias.assign(whole.grad_bias.begin() + j * per_out, whole.grad_bias.begin() + (j + 1) * per_out);
                        bind(part, per_in);
                    }
                    grouped.step();
                    separate.step();
                    // The same numbers through the same code (kl_clip's sum in the same order): bitwise.
                    for (std::int64_t j = 0; j < cc.groups; ++j) {
                        const auto& part = parts[static_cast<std::size_t>(j)];
                        const auto rows = static_cast<std::ptrdiff_t>(per_out * per_in * taps);
                        CHECK(std::equal(part.grad_weight.begin(), part.grad_weight.end(), whole.grad_weight.begin() + j * rows));
                        if (cc.bias)
                            CHECK(std::equal(part.grad_bias.begin(), part.grad_bias.end(), whole.grad_bias.begin() + j * per_out));
                        const std::string name = "conv/group" + std::to_string(j);
                        CHECK(grouped.a_factor(name) == separate.a_factor(name));
                        CHECK(grouped.g_factor(name) == separate.g_factor(name));
                    }
                    CHECK(grouped.last_kl_scale() == separate.last_kl_scale());
                }
            };
            if (method == std::string_view("eigen")) {
                eigen_kfac grouped(opts), separate(opts);
                run(grouped, separate);
            } else if (method == std::string_view("inverse")) {
                inverse_kfac grouped(opts), separate(opts);
                run(grouped, separate);
            } else {  // each group's scaling from its own channels' per-example gradients
                ekfac_kfac grouped(opts), separate(opts);
                run(grouped, separate);
            }
        }
    }
}

TEST_CASE("grouped convolution names, checkpoints and errors", "[grouped_conv][checkpoint][errors]") {
    using T = double;
    kfac::conv2d_geometry geo;
    geo.kernel = {3, 3};
    geo.padding = {1, 1};
    geo.groups = 2;
    kfac::options opts;
    opts.threads = 1;
    opts.inv_update_steps = 2;

    SECTION("blocks are named, listed and checkpointed per group") {
        auto run = [&](kfac::KFAC<backend<T>>& p, owned_layer<T>& l, int first, int last) {
            for (int step = first; step < last; ++step) {
                const auto seed = static_cast<std::uint32_t>(step);
                l.input = random_vector<T>(l.input.size(), seed + 1);
                l.grad_output = random_vector<T>(l.grad_output.size(), seed + 2, 0.3);
                l.grad_weight = random_vector<T>(l.grad_weight.size(), seed + 3, 0.1);
                l.grad_bias = random_vector<T>(l.grad_bias.size(), seed + 4, 0.1);
                l.bind();
                p.step();
            }
        };
        auto la = random_conv<T>(2, 4, 6, geo, true, 5, 5, 1), lb = la, lc = la;
        kfac::KFAC<backend<T>> straight(opts), first(opts), resumed(opts);
        straight.register_layer("conv", la.view);
        first.register_layer("conv", lb.view);
        resumed.register_layer("conv", lc.view);
        const auto info = straight.layers();
        REQUIRE(info.size() == 2);
        CHECK(info[1].name == "conv/group1");
        CHECK(info[1].a_dim == 2 * 9 + 1);
        CHECK(info[1].g_dim == 3);
        run(straight, la, 0, 5);
        run(first, lb, 0, 3);
        const std::string bytes = first.save_bytes();
        CHECK(bytes.find("\"conv/group1.A\"") != std::string::npos);
        CHECK(bytes.find("groups 2") != std::string::npos);
        resumed.load_bytes(bytes);
        run(resumed, lc, 3, 5);
        CHECK(la.grad_weight == lc.grad_weight);
        CHECK(straight.a_factor("conv/group0") == resumed.a_factor("conv/group0"));

        // The same layer without groups is another layer: the file refuses it by name.
        auto dense_geo = geo;
        dense_geo.groups = 1;
        auto dense = random_conv<T>(2, 4, 6, dense_geo, true, 5, 5, 1);
        kfac::KFAC<backend<T>> other(opts);
        other.register_layer("conv", dense.view);
        CHECK_THROWS_WITH(other.load_bytes(bytes), Catch::Contains("conv/group0"));
    }
    SECTION("groups that do not divide the channels") {
        kfac::layer_view<T> v;
        auto bad = geo;
        bad.groups = 4;
        v.description = kfac::conv2d_description(4, 6, bad, false);
        kfac::KFAC<backend<T>> p(opts);
        CHECK_THROWS_WITH(p.register_layer("dw", v), Catch::Contains("layer 'dw'") && Catch::Contains("groups = 4") &&
                                                         Catch::Contains("divide both 4 input and 6 output"));
        bad.groups = 0;
        v.description = kfac::conv2d_description(4, 6, bad, false);
        CHECK_THROWS_WITH(p.register_layer("dw", v), Catch::Contains("groups = 0"));
        CHECK(p.layer_count() == 0);
    }
    SECTION("names taken by a group block") {
        auto l = random_conv<T>(2, 4, 6, geo, false, 5, 5, 1);
        auto other = random_linear<T>(3, 4, 2, false, 2);
        kfac::KFAC<backend<T>> p(opts);
        p.register_layer("conv", l.view);
        CHECK_THROWS_WITH(p.register_layer("conv/group1", other.view), Catch::Contains("already registered"));
        CHECK_THROWS_WITH(p.register_layer("conv", other.view), Catch::Contains("already registered"));
        CHECK_THROWS_WITH(p.register_layer("again", l.view), Catch::Contains("already registered as 'conv'"));
        CHECK(p.layer_count() == 2);
        // A plain layer that took a block's name first.
        auto second = random_conv<T>(2, 4, 6, geo, false, 5, 5, 3);
        kfac::KFAC<backend<T>> q(opts);
        q.register_layer("dw/group1", other.view);
        CHECK_THROWS_WITH(q.register_layer("dw", second.view), Catch::Contains("'dw' is already registered"));
        CHECK(q.layer_count() == 1);
    }
    SECTION("a dense-shaped weight gradient names the grouped shape") {
        auto l = random_conv<T>(2, 4, 6, geo, false, 5, 5, 1);
        l.grad_weight = random_vector<T>(6 * 4 * 9, 3);
        l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {6, 4, 3, 3});
        kfac::KFAC<backend<T>> p(opts);
        p.register_layer("conv", l.view);
        CHECK_THROWS_WITH(p.step(), Catch::Contains("groups 2") && Catch::Contains("expected [6, 2, 3, 3]"));
        CHECK(p.steps() == 0);
        l.bind();
        p.step();
        CHECK(p.steps() == 1);
    }
}
