// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file golden_case.hpp
/// Replays a golden case folder (format: ../shared/golden/README.md) through the public API.
/// Used by the kfac_replay tool and by the Catch2 suite. Handles every configuration that
/// case.json can describe; nothing here knows the particular cases.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xnpy.hpp>

#include <kfac/kfac.hpp>

namespace kfac_replay {

namespace fs = std::filesystem;
using json = nlohmann::json;

/// Tolerance for replaying a recording in float32 when it was made in float64.
/// Single precision rounds each operation by ε = 2⁻²⁴ ≈ 6e-8. Preconditioning solves
/// (A ⊗ G + γI)·vec(P) = vec(Γ); with the running factors' eigenvalues of order one (they
/// start at I and decay towards the batch statistics), the system's condition number is at
/// most about (1 + γ)/γ, which multiplies the rounding of the factors and of the
/// decomposition. Ten rounding steps of headroom give 10·ε·(1 + γ)/γ: 2e-4 at γ = 0.003,
/// while every formula mistake listed in golden/README.md §7 produces errors ≥ 1.5e-3.
inline double float_replay_rtol(double damping) {
    constexpr double eps = 5.960464477539063e-08;  // 2^-24
    return 10.0 * eps * (1.0 + damping) / damping;
}

struct replay_report {
    std::map<std::string, double> max_error;  ///< quantity -> largest error
    std::vector<std::string> problems;        ///< schedule mismatches and the like
    double worst = 0.0;
    double rtol = 0.0;
    [[nodiscard]] bool passed() const { return problems.empty() && worst <= rtol; }
};

/// max|x − r| / max|r| (golden/README.md §7); absolute when r is all zero.
template <class X, class R>
double relative_error(const X& x, const R& r) {
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < r.size(); ++i) {
        num = std::max(num, std::abs(static_cast<double>(x[i]) - static_cast<double>(r[i])));
        den = std::max(den, std::abs(static_cast<double>(r[i])));
    }
    return den > 0.0 ? num / den : num;
}

class golden_case {
public:
    explicit golden_case(fs::path folder) : folder_(std::move(folder)) {
        std::ifstream in(folder_ / "case.json");
        if (!in) throw kfac::error("cannot open " + (folder_ / "case.json").string());
        meta_ = json::parse(in);
    }

    [[nodiscard]] const json& meta() const { return meta_; }
    [[nodiscard]] const fs::path& folder() const { return folder_; }
    [[nodiscard]] std::string name() const { return meta_.value("case", folder_.filename().string()); }
    [[nodiscard]] std::string dtype() const { return meta_.at("dtype").get<std::string>(); }
    [[nodiscard]] double rtol() const {
        if (meta_.contains("tolerance") && meta_["tolerance"].contains("rtol"))
            return meta_["tolerance"]["rtol"].get<double>();
        return dtype() == "float64" ? 1e-10 : 1e-5;
    }

    [[nodiscard]] fs::path file(std::int64_t step, const std::string& layer, const std::string& what) const {
        return folder_ / ("s" + std::to_string(step) + "_" + layer + "_" + what + ".npy");
    }
    [[nodiscard]] fs::path file(std::int64_t step, const std::string& what) const {
        return folder_ / ("s" + std::to_string(step) + "_" + what + ".npy");
    }

    /// Loads an array stored in the case dtype, converted to T.
    /// A dumped result array (A, G, pgrad_*) as double; symmetric factors and C-order
    /// gradients compare element by element with the library's storage.
    [[nodiscard]] xt::xarray<double> reference(const fs::path& p) const { return load<double>(p); }

    template <class T>
    xt::xarray<T> load(const fs::path& p) const {
        if (!fs::exists(p)) throw kfac::error("missing array " + p.string());
        if (dtype() == "float64") return xt::xarray<T>(xt::load_npy<double>(p.string()));
        if (dtype() == "float32") return xt::xarray<T>(xt::load_npy<float>(p.string()));
        throw kfac::error("case.json dtype '" + dtype() + "' is neither float64 nor float32");
    }

private:
    fs::path folder_;
    json meta_;
};

/// Every sub-folder of `root` that holds a case.json, sorted.
inline std::vector<fs::path> discover_cases(const fs::path& root) {
    std::vector<fs::path> out;
    if (fs::exists(root / "case.json")) return {root};
    if (!fs::is_directory(root)) return out;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory() && fs::exists(e.path() / "case.json")) out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
}

inline kfac::layer_description description_of(const json& l) {
    const bool bias = l.at("bias").get<bool>();
    if (l.at("kind") == "linear")
        return kfac::linear_description(l.at("in_features"), l.at("out_features"), bias);
    if (l.at("kind") != "conv2d")
        throw kfac::error("layer '" + l.at("name").get<std::string>() + "': unknown kind " + l.at("kind").dump());
    kfac::conv2d_geometry g;
    auto pair = [&](const char* key, std::array<std::int64_t, 2>& out) {
        const auto& v = l.at(key);
        if (v.is_number()) out = {v.get<std::int64_t>(), v.get<std::int64_t>()};
        else out = {v.at(0).get<std::int64_t>(), v.at(1).get<std::int64_t>()};
    };
    pair("kernel_size", g.kernel);
    pair("stride", g.stride);
    pair("padding", g.padding);
    pair("dilation", g.dilation);
    g.groups = l.value("groups", std::int64_t{1});
    if (l.contains("padding_mode") && l["padding_mode"] != "zeros")
        throw kfac::error("layer '" + l.at("name").get<std::string>() + "': padding_mode " +
                          l["padding_mode"].dump() + " (kfac-pytorch always zero-pads; the recording "
                          "would not describe what it computed)");
    return kfac::conv2d_description(l.at("in_channels"), l.at("out_channels"), g, bias);
}

inline kfac::options options_of(const json& k) {
    kfac::options o;
    o.damping = k.at("damping").get<double>();
    o.factor_decay = k.at("factor_decay").get<double>();
    if (k.at("kl_clip").is_null()) o.kl_clip = std::optional<double>{};
    else o.kl_clip = std::optional<double>(k.at("kl_clip").get<double>());
    o.lr = k.at("lr").get<double>();
    o.factor_update_steps = k.at("factor_update_steps").get<std::int64_t>();
    o.inv_update_steps = k.at("inv_update_steps").get<std::int64_t>();
    o.accumulation_steps = k.value("accumulation_steps", std::int64_t{1});
    o.compute_eigenvalue_outer_product = k.value("compute_eigenvalue_outer_product", true);
    o.conv_patches = kfac::conv_patch_mode::reference;  // the recording is kfac-pytorch's
    return o;
}

template <class T>
kfac::tensor_view<T> view_of(xt::xarray<T>& a) {
    return kfac::tensor_view<T>::from_extents(a.data(), a.shape());
}
template <class T>
kfac::tensor_view<const T> const_view_of(const xt::xarray<T>& a) {
    return kfac::tensor_view<const T>::from_extents(a.data(), a.shape());
}

/// Replays every step of the case in precision Scalar with the given compute method.
template <class Scalar, class Method>
replay_report replay_with(const golden_case& c, double rtol) {
    using kfac_type = kfac::KFAC<kfac::backend::cpu_eigen<Scalar>, kfac::comm::serial, Method>;
    const json& meta = c.meta();
    const json& hp = meta.at("kfac");
    replay_report report;
    report.rtol = rtol;
    auto record = [&](const std::string& what, double e) {
        double& m = report.max_error[what];
        m = std::max(m, e);
        report.worst = std::max(report.worst, e);
    };

    const kfac::options opts = options_of(hp);
    kfac_type precond(opts);
    std::vector<json> layers_meta;
    for (const auto& name : meta.at("layer_order")) {
        for (const auto& l : meta.at("layers"))
            if (l.at("name") == name) layers_meta.push_back(l);
    }
    if (layers_meta.size() != meta.at("layers").size())
        report.problems.push_back("layer_order does not list every layer exactly once");
    std::vector<kfac::layer_view<Scalar>> views(layers_meta.size());
    for (std::size_t i = 0; i < layers_meta.size(); ++i) {
        views[i].description = description_of(layers_meta[i]);
        precond.register_layer(layers_meta[i].at("name").get<std::string>(), views[i]);
    }
    const std::int64_t micro = opts.accumulation_steps;
    const std::int64_t steps = meta.at("steps").get<std::int64_t>();
    for (std::int64_t t = 0; t < steps; ++t) {
        const bool factor_update = t % hp.at("factor_update_steps").get<std::int64_t>() == 0;
        const bool inv_update = t % hp.at("inv_update_steps").get<std::int64_t>() == 0;
        if (meta.contains("schedule") && static_cast<std::size_t>(t) < meta["schedule"].size()) {
            const json& s = meta["schedule"][static_cast<std::size_t>(t)];
            if (s.value("factor_update", factor_update) != factor_update ||
                s.value("inv_update", inv_update) != inv_update)
                report.problems.push_back("step " + std::to_string(t) +
                                          ": case.json schedule disagrees with the update intervals");
        }
        std::vector<xt::xarray<Scalar>> a(views.size()), g(views.size()), gw(views.size()), gb(views.size());
        for (std::size_t i = 0; i < views.size(); ++i) {
            const std::string name = layers_meta[i].at("name");
            gw[i] = c.template load<Scalar>(c.file(t, name, "grad_w"));
            views[i].grad_weight = view_of(gw[i]);
            if (views[i].description.bias) {
                gb[i] = c.template load<Scalar>(c.file(t, name, "grad_b"));
                views[i].grad_bias = view_of(gb[i]);
            }
            if (factor_update) {
                a[i] = c.template load<Scalar>(c.file(t, name, "a"));
                g[i] = c.template load<Scalar>(c.file(t, name, "g"));
            }
        }
        // accumulation_steps = m: the step's rows are m equal micro-batches in order; the
        // mean of their statistics is what the reference's hooks averaged.
        for (std::int64_t m = 0; m < (factor_update ? micro : 1); ++m) {
            for (std::size_t i = 0; i < views.size() && factor_update; ++i) {
                auto in = const_view_of(a[i]);
                auto out = const_view_of(g[i]);
                if (micro > 1) {
                    if (in.extent(0) % micro != 0 || out.extent(0) != in.extent(0))
                        throw kfac::error("step " + std::to_string(t) + ": batch of " +
                                          std::to_string(in.extent(0)) + " rows does not split into " +
                                          std::to_string(micro) + " equal micro-batches");
                    const std::int64_t rows = in.extent(0) / micro;
                    in.data += m * (in.size() / micro);
                    out.data += m * (out.size() / micro);
                    in.extents[0] = rows;
                    out.extents[0] = rows;
                }
                views[i].input = in;
                views[i].grad_output = out;
            }
            if (m + 1 < micro && factor_update) precond.accumulate();
        }
        precond.step();
        for (std::size_t i = 0; i < views.size(); ++i) {
            const std::string name = layers_meta[i].at("name");
            const auto& A = precond.a_factor(name);
            const auto& G = precond.g_factor(name);
            record("A", relative_error(A.data(), c.reference(c.file(t, name, "A"))));
            record("G", relative_error(G.data(), c.reference(c.file(t, name, "G"))));
            record("pgrad_w", relative_error(gw[i].data(), c.reference(c.file(t, name, "pgrad_w"))));
            if (views[i].description.bias)
                record("pgrad_b", relative_error(gb[i].data(), c.reference(c.file(t, name, "pgrad_b"))));
        }
        const auto kl_file = c.file(t, "kl_scale");
        if (fs::exists(kl_file)) {
            const double ref = xt::load_npy<double>(kl_file.string())();
            record("kl_scale", std::abs(precond.last_kl_scale() - ref) / std::abs(ref));
        } else if (!hp.at("kl_clip").is_null()) {
            report.problems.push_back("step " + std::to_string(t) + ": kl_clip is set but " +
                                      kl_file.filename().string() + " is missing");
        }
    }
    return report;
}

enum class precision { case_dtype, float64, float32 };

/// Replays a case: compute method from case.json, precision as asked (by default the case's
/// dtype), tolerance `rtol` or, when absent, the case's (float64) or float_replay_rtol when a
/// float64 recording is replayed in float32
/// (float_replay_rtol).
inline replay_report replay(const golden_case& c, precision p = precision::case_dtype,
                            std::optional<double> rtol = std::nullopt) {
    const bool use_float = p == precision::float32 || (p == precision::case_dtype && c.dtype() == "float32");
    const double damping = c.meta().at("kfac").at("damping").get<double>();
    const double tol = rtol ? *rtol
                            : (use_float && c.dtype() == "float64" ? float_replay_rtol(damping)
                                                                   : c.rtol());
    const std::string method = c.meta().at("kfac").at("compute_method");
    if (method == "eigen")
        return use_float ? replay_with<float, kfac::compute::eigendecomposition>(c, tol)
                         : replay_with<double, kfac::compute::eigendecomposition>(c, tol);
    if (method == "inverse")
        return use_float ? replay_with<float, kfac::compute::inverse>(c, tol)
                         : replay_with<double, kfac::compute::inverse>(c, tol);
    throw kfac::error("case.json kfac.compute_method '" + method + "' is neither eigen nor inverse");
}

}  // namespace kfac_replay
