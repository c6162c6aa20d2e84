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
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xnpy.hpp>

#include <kfac/kfac.hpp>
#if KFAC_REPLAY_WITH_MPI
#include <kfac/comm/mpi.hpp>
#endif
#if KFAC_REPLAY_WITH_PROCESS_GROUP
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <kfac/comm/process_group_gloo.hpp>
#endif

#include "staged_backend.hpp"

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
    std::string precision;  ///< "float32" or "float64": what the replay computed in
    std::string strategy;   ///< the preconditioner's strategy_name()
    std::int64_t first_step = 0, end_step = 0;  ///< the steps replayed: [first_step, end_step)
    [[nodiscard]] bool passed() const { return problems.empty() && worst <= rtol; }
};

/// max|x − r| / max|r| (golden/README.md §7); absolute when r is all zero.
template <class X, class R>
double relative_error(const X& x, const R& r, std::size_t n) {
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
        num = std::max(num, std::abs(static_cast<double>(x[i]) - static_cast<double>(r[i])));
        den = std::max(den, std::abs(static_cast<double>(r[i])));
    }
    return den > 0.0 ? num / den : num;
}
template <class X>
double relative_error(const X& x, const xt::xarray<double>& r) {
    return relative_error(x, r.data(), r.size());
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

    /// s{t}_{layer}_{what}.npy
    [[nodiscard]] fs::path file(std::int64_t step, const std::string& layer, const std::string& what) const {
        return file(step, layer + "_" + what);
    }
    /// s{t}_{what}.npy. Built by appending: GCC 12 at -O3 warns falsely (-Wrestrict, bug
    /// 105329) on `"s" + std::to_string(...)`.
    [[nodiscard]] fs::path file(std::int64_t step, const std::string& what) const {
        std::string name(1, 's');
        name += std::to_string(step);
        name += '_';
        name += what;
        name += ".npy";
        return folder_ / name;
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

/// The case folders under `root`: `root` itself when it holds a case.json, else every
/// sub-folder that does, sorted by name.
inline std::vector<fs::path> discover_cases(const fs::path& root) {
    std::vector<fs::path> out;
    if (fs::exists(root / "case.json")) return {root};
    if (!fs::is_directory(root)) return out;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory() && fs::exists(e.path() / "case.json")) out.push_back(e.path());
    std::sort(out.begin(), out.end());
    return out;
}

/// The case folders under several roots, in order; a case whose folder name an earlier root
/// already supplied is the same recording and is skipped. Missing roots are skipped too.
template <class Roots>
std::vector<fs::path> discover_cases_in(const Roots& roots) {
    std::vector<fs::path> out;
    std::vector<std::string> names;
    for (const auto& root : roots)
        for (auto& folder : discover_cases(fs::path(root))) {
            const std::string name = folder.filename().string();
            if (std::find(names.begin(), names.end(), name) != names.end()) continue;
            names.push_back(name);
            out.push_back(std::move(folder));
        }
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

/// How the replay distributes the work (meaningful with several ranks).
struct distributed_setup {
    kfac::distribution strategy = kfac::distribution::kaisa;
    double grad_worker_fraction = kfac::comm_opt;
    bool colocate = true;
    std::string assignment = "compute";  ///< compute | memory | round_robin
    /// Checkpoints: replay steps 0..save_after-1, then save to save_file and stop; or load
    /// resume_from into a fresh preconditioner and replay from its step to the end.
    std::optional<std::int64_t> save_after;
    fs::path save_file;
    std::optional<fs::path> resume_from;
};

/// Rank r's contiguous block of n rows: the first n % W ranks get one row more.
inline std::pair<std::int64_t, std::int64_t> row_block(std::int64_t n, int world, int rank) {
    const std::int64_t base = n / world, extra = n % world;
    const std::int64_t begin = rank * base + std::min<std::int64_t>(rank, extra);
    return {begin, base + (rank < extra ? 1 : 0)};
}

/// Points a view at rows [begin, begin + count) of a C-order array along dimension 0.
template <class T>
kfac::tensor_view<const T> rows_of(const xt::xarray<T>& a, std::int64_t begin, std::int64_t count) {
    auto v = const_view_of(a);
    const std::int64_t per_row = v.extent(0) ? v.size() / v.extent(0) : 0;
    v.data += begin * per_row;
    v.extents[0] = count;
    return v;
}

/// One step's arrays of every layer.
template <class Scalar>
struct step_arrays {
    std::vector<xt::xarray<Scalar>> a, g, gw, gb;
};

/// A one-process communicator of the replay's own policy, for DP-KFAC's reference shards: the
/// shards are then the same instantiation of the preconditioner as the replayed one.
template <class Comm>
Comm single_process_comm() {
    return Comm{};
}
#if KFAC_REPLAY_WITH_MPI
template <>
inline kfac::comm::mpi single_process_comm<kfac::comm::mpi>() {
    return kfac::comm::mpi(MPI_COMM_SELF);
}
#endif
#if KFAC_REPLAY_WITH_PROCESS_GROUP
template <>
inline kfac::comm::process_group single_process_comm<kfac::comm::process_group>() {
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options);
    return kfac::comm::process_group(pg, store, kfac::comm::gloo_groups(options));
}
#endif

/// Replays every step of the case. With several ranks (Comm = comm::mpi) each rank gets its
/// contiguous block of each step's rows while the gradients are the full-batch ones, as
/// data-parallel training delivers them. KAISA must reproduce the recording on every rank;
/// DP-KFAC is compared with single-process preconditioners fed each owner's shard.
template <template <class> class BackendOf, class Scalar, class Method, class Assignment, class Comm>
replay_report replay_with(const golden_case& c, double rtol, const distributed_setup& setup, Comm comm) {
    using backend = BackendOf<Scalar>;
    using kfac_type = kfac::KFAC<backend, Comm, Method, Assignment>;
    using shard_type = kfac_type;
    // Factors in host memory: the matrix itself for host backends, a copy for device ones.
    auto host = [](const auto& m) -> decltype(auto) { return backend::to_host(m); };
    const json& meta = c.meta();
    const json& hp = meta.at("kfac");
    replay_report report;
    report.rtol = rtol;
    report.precision = std::is_same_v<Scalar, float> ? "float32" : "float64";
    auto record = [&](const std::string& what, double e) {
        double& m = report.max_error[what];
        m = std::max(m, e);
        report.worst = std::max(report.worst, e);
    };
    const int world = comm.size(), rank = comm.rank();
    const bool dp = setup.strategy == kfac::distribution::dp_kfac;

    kfac::options opts = options_of(hp);
    opts.strategy = setup.strategy;
    opts.grad_worker_fraction = setup.grad_worker_fraction;
    opts.colocate_factors = setup.colocate;
    const std::int64_t micro = opts.accumulation_steps;
    if (micro > 1 && world > 1)
        throw kfac::error("replaying accumulation_steps > 1 on several ranks is not supported");
    kfac_type precond(opts, std::move(comm));
    report.strategy = precond.strategy_name();

    std::vector<json> layers_meta;
    for (const auto& name : meta.at("layer_order"))
        for (const auto& l : meta.at("layers"))
            if (l.at("name") == name) layers_meta.push_back(l);
    if (layers_meta.size() != meta.at("layers").size())
        report.problems.push_back("layer_order does not list every layer exactly once");
    const std::size_t n_layers = layers_meta.size();
    std::vector<kfac::layer_view<Scalar>> views(n_layers);
    for (std::size_t i = 0; i < n_layers; ++i) {
        views[i].description = description_of(layers_meta[i]);
        precond.register_layer(layers_meta[i].at("name").get<std::string>(), views[i]);
    }
    // DP-KFAC's reference: one single-process preconditioner per shard, without kl_clip
    // (ν mixes layers of different owners and is recomputed below).
    std::vector<std::unique_ptr<shard_type>> shards;
    std::vector<std::vector<kfac::layer_view<Scalar>>> shard_views;
    if (dp) {
        kfac::options shard_opts = options_of(hp);
        shard_opts.kl_clip = std::optional<double>{};
        shard_views.assign(static_cast<std::size_t>(world), views);
        for (int s = 0; s < world; ++s) {
            shards.push_back(std::make_unique<shard_type>(shard_opts, single_process_comm<Comm>()));
            for (std::size_t i = 0; i < n_layers; ++i)
                shards.back()->register_layer(layers_meta[i].at("name").get<std::string>(), shard_views[static_cast<std::size_t>(s)][i]);
        }
    }

    const std::int64_t steps = meta.at("steps").get<std::int64_t>();
    std::int64_t first = 0, last = steps;
    if (setup.resume_from) {
        // Every shard reference starts from the file too: the owners' factors in it are what
        // the resumed owners continue from.
        precond.load(*setup.resume_from);
        for (auto& shard : shards) shard->load(*setup.resume_from, {.allow_changed_options = true});
        first = precond.steps();
        if (first > steps)
            throw kfac::error(setup.resume_from->string() + " was saved after step " + std::to_string(first) +
                              " but the case has only " + std::to_string(steps) + " steps");
    }
    if (setup.save_after) {
        if (*setup.save_after < 0 || *setup.save_after > steps)
            throw kfac::error("--save-after " + std::to_string(*setup.save_after) + ": the case has " +
                              std::to_string(steps) + " steps");
        last = *setup.save_after;
    }
    report.first_step = first;
    report.end_step = last;
    for (std::int64_t t = first; t < last; ++t) {
        const bool factor_update = t % hp.at("factor_update_steps").get<std::int64_t>() == 0;
        const bool inv_update = t % hp.at("inv_update_steps").get<std::int64_t>() == 0;
        if (meta.contains("schedule") && static_cast<std::size_t>(t) < meta["schedule"].size()) {
            const json& s = meta["schedule"][static_cast<std::size_t>(t)];
            if (s.value("factor_update", factor_update) != factor_update ||
                s.value("inv_update", inv_update) != inv_update)
                report.problems.push_back("step " + std::to_string(t) +
                                          ": case.json schedule disagrees with the update intervals");
        }
        step_arrays<Scalar> x;
        x.a.resize(n_layers), x.g.resize(n_layers), x.gw.resize(n_layers), x.gb.resize(n_layers);
        for (std::size_t i = 0; i < n_layers; ++i) {
            const std::string name = layers_meta[i].at("name");
            x.gw[i] = c.template load<Scalar>(c.file(t, name, "grad_w"));
            if (views[i].description.bias) x.gb[i] = c.template load<Scalar>(c.file(t, name, "grad_b"));
            if (factor_update) {
                x.a[i] = c.template load<Scalar>(c.file(t, name, "a"));
                x.g[i] = c.template load<Scalar>(c.file(t, name, "g"));
            }
        }
        const step_arrays<Scalar> raw = x;  // Γ before preconditioning
        auto bind_gradients = [&](std::vector<kfac::layer_view<Scalar>>& vs, step_arrays<Scalar>& arrays) {
            for (std::size_t i = 0; i < n_layers; ++i) {
                vs[i].grad_weight = view_of(arrays.gw[i]);
                vs[i].grad_bias = vs[i].description.bias ? view_of(arrays.gb[i]) : kfac::tensor_view<Scalar>{};
            }
        };
        auto bind_rows = [&](std::vector<kfac::layer_view<Scalar>>& vs, int r, int parts) {
            for (std::size_t i = 0; i < n_layers && factor_update; ++i) {
                const auto [begin, count] = row_block(x.a[i].shape()[0], parts, r);
                vs[i].input = rows_of(x.a[i], begin, count);
                vs[i].grad_output = rows_of(x.g[i], begin, count);
            }
        };
        bind_gradients(views, x);
        // accumulation_steps = m: the step's rows are m equal micro-batches in order; the
        // mean of their statistics is what the reference's hooks averaged.
        for (std::int64_t m = 0; m < (factor_update ? micro : 1); ++m) {
            if (micro > 1) {
                for (std::size_t i = 0; i < n_layers && factor_update; ++i)
                    if (x.a[i].shape()[0] % static_cast<std::size_t>(micro) != 0)
                        throw kfac::error("step " + std::to_string(t) + ": the batch does not split into " +
                                          std::to_string(micro) + " equal micro-batches");
                bind_rows(views, static_cast<int>(m), static_cast<int>(micro));
                if (m + 1 < micro) precond.accumulate();
            } else {
                bind_rows(views, rank, world);
            }
        }
        precond.step();

        if (!dp) {
            for (std::size_t i = 0; i < n_layers; ++i) {
                const std::string name = layers_meta[i].at("name");
                record("A", relative_error(host(precond.a_factor(name)).data(), c.reference(c.file(t, name, "A"))));
                record("G", relative_error(host(precond.g_factor(name)).data(), c.reference(c.file(t, name, "G"))));
                record("pgrad_w", relative_error(x.gw[i].data(), c.reference(c.file(t, name, "pgrad_w"))));
                if (views[i].description.bias)
                    record("pgrad_b", relative_error(x.gb[i].data(), c.reference(c.file(t, name, "pgrad_b"))));
            }
            const auto kl_file = c.file(t, "kl_scale");
            if (fs::exists(kl_file)) {
                const double ref = xt::load_npy<double>(kl_file.string())();
                record("kl_scale", std::abs(precond.last_kl_scale() - ref) / std::abs(ref));
            } else if (!hp.at("kl_clip").is_null()) {
                report.problems.push_back("step " + std::to_string(t) + ": kl_clip is set but " +
                                          kl_file.filename().string() + " is missing");
            }
            continue;
        }
        // DP-KFAC: expected P of layer L = the owner's shard preconditioner's, then one ν.
        std::vector<step_arrays<Scalar>> shard_out(static_cast<std::size_t>(world), raw);
        for (int s = 0; s < world; ++s) {
            auto& sv = shard_views[static_cast<std::size_t>(s)];
            bind_gradients(sv, shard_out[static_cast<std::size_t>(s)]);
            bind_rows(sv, s, world);
            shards[static_cast<std::size_t>(s)]->step();
        }
        double vg = 0.0;
        std::vector<const step_arrays<Scalar>*> expected(n_layers);
        for (std::size_t i = 0; i < n_layers; ++i) {
            const std::string name = layers_meta[i].at("name");
            const int owner = precond.workers(name).a;
            expected[i] = &shard_out[static_cast<std::size_t>(owner)];
            for (std::size_t e = 0; e < raw.gw[i].size(); ++e)
                vg += static_cast<double>(expected[i]->gw[i].data()[e]) * static_cast<double>(raw.gw[i].data()[e]);
            for (std::size_t e = 0; e < raw.gb[i].size() && views[i].description.bias; ++e)
                vg += static_cast<double>(expected[i]->gb[i].data()[e]) * static_cast<double>(raw.gb[i].data()[e]);
            if (owner == rank) {
                const auto& sh = *shards[static_cast<std::size_t>(owner)];
                const auto& a_ref = host(sh.a_factor(name));
                const auto& g_ref = host(sh.g_factor(name));
                record("A", relative_error(host(precond.a_factor(name)).data(), a_ref.data(), static_cast<std::size_t>(a_ref.size())));
                record("G", relative_error(host(precond.g_factor(name)).data(), g_ref.data(), static_cast<std::size_t>(g_ref.size())));
            }
        }
        double nu = 1.0;
        if (!hp.at("kl_clip").is_null()) {
            const double lr = hp.at("lr").get<double>();
            vg *= lr * lr;
            if (vg != 0.0) nu = std::min(1.0, std::sqrt(hp.at("kl_clip").get<double>() / std::abs(vg)));
            record("kl_scale", std::abs(precond.last_kl_scale() - nu) / nu);
        }
        for (std::size_t i = 0; i < n_layers; ++i) {
            xt::xarray<double> w = xt::xarray<double>(expected[i]->gw[i]) * nu;
            record("pgrad_w", relative_error(x.gw[i].data(), w));
            if (views[i].description.bias) {
                xt::xarray<double> b = xt::xarray<double>(expected[i]->gb[i]) * nu;
                record("pgrad_b", relative_error(x.gb[i].data(), b));
            }
        }
    }
    if (setup.save_after) precond.save(setup.save_file);
    return report;
}

enum class precision { case_dtype, float64, float32 };

/// Whether replays run on a backend in float too: the staged backend (staged_backend.hpp), which
/// tests where data travels rather than the arithmetic, replays in double only, so that its
/// preconditioners are compiled for one scalar type.
template <template <class> class BackendOf>
inline constexpr bool replays_in_float = true;
template <>
inline constexpr bool replays_in_float<staged_backend> = false;
/// Over comm::process_group the replays run in double only (every case once over Gloo is
/// enough; the float replay instances would add their compile for nothing).
template <class Comm>
inline constexpr bool comm_replays_in_float = true;
#if KFAC_REPLAY_WITH_PROCESS_GROUP
template <>
inline constexpr bool comm_replays_in_float<kfac::comm::process_group> = false;
#endif
/// A backend over a communicator replaying in double only, beyond the two rules above: the CUDA
/// backend over MPI (kfac_replay_cuda specialises it), whose float replays run in one process
/// over comm::serial.
template <template <class> class BackendOf, class Comm>
inline constexpr bool pair_replays_in_float = true;
template <template <class> class BackendOf, class Comm>
inline constexpr bool replays_float = replays_in_float<BackendOf> && comm_replays_in_float<Comm> &&
                                      pair_replays_in_float<BackendOf, Comm>;

/// Replays a case: compute method from case.json, precision as asked (by default the case's
/// dtype), tolerance `rtol` or, when absent, the case's, or float_replay_rtol when a
/// float64 recording is replayed in float32.
template <class Comm = kfac::comm::serial, template <class> class BackendOf = kfac::backend::cpu_eigen,
          class MakeComm = Comm (*)()>
replay_report replay(const golden_case& c, precision p = precision::case_dtype,
                     std::optional<double> rtol = std::nullopt, const distributed_setup& setup = {},
                     MakeComm make_comm = [] { return Comm{}; }) {
    const bool use_float = p == precision::float32 || (p == precision::case_dtype && c.dtype() == "float32");
    const double damping = c.meta().at("kfac").at("damping").get<double>();
    const double tol = rtol ? *rtol
                            : (use_float && c.dtype() == "float64" ? float_replay_rtol(damping) : c.rtol());
    const std::string method = c.meta().at("kfac").at("compute_method");
    auto with_assignment = [&](auto scalar_tag, auto method_tag) -> replay_report {
        using S = decltype(scalar_tag);
        using M = decltype(method_tag);
        if (setup.assignment == "compute")
            return replay_with<BackendOf, S, M, kfac::assignment::compute_balanced>(c, tol, setup, make_comm());
        if (setup.assignment == "memory")
            return replay_with<BackendOf, S, M, kfac::assignment::memory_balanced>(c, tol, setup, make_comm());
        if (setup.assignment == "round_robin")
            return replay_with<BackendOf, S, M, kfac::assignment::round_robin>(c, tol, setup, make_comm());
        throw kfac::error("unknown assignment '" + setup.assignment + "' (compute, memory or round_robin)");
    };
    auto with_method = [&](auto scalar_tag) -> replay_report {
        if (method == "eigen") return with_assignment(scalar_tag, kfac::compute::eigendecomposition{});
        if (method == "inverse") return with_assignment(scalar_tag, kfac::compute::inverse{});
        throw kfac::error("case.json kfac.compute_method '" + method + "' is neither eigen nor inverse");
    };
    if constexpr (!replays_float<BackendOf, Comm>) {
        if (use_float)
            throw kfac::error(std::string(!replays_in_float<BackendOf>  ? "the staged backend"
                                          : !comm_replays_in_float<Comm> ? "kfac_replay_process_group"
                                                                         : "this backend over several ranks") +
                              " replays in double only: pass --double (a float32 case is replayed in double with the "
                              "case's tolerance)");
        return with_method(double{});
    } else {
        return use_float ? with_method(float{}) : with_method(double{});
    }
}

// Each replay_with instantiation (a preconditioner per method and assignment) is compiled once,
// in the translation units tests/CMakeLists.txt generates (one per communicator, backend and
// scalar type, kfac_replay_instances_*), and only declared here: the replay tool and the Catch2
// suite share them, and the build runs them in parallel.
#define KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(X, BACKEND, SCALAR, COMM)                         \
    X(BACKEND, SCALAR, kfac::compute::eigendecomposition, kfac::assignment::compute_balanced, COMM) \
    X(BACKEND, SCALAR, kfac::compute::eigendecomposition, kfac::assignment::memory_balanced, COMM)  \
    X(BACKEND, SCALAR, kfac::compute::eigendecomposition, kfac::assignment::round_robin, COMM)      \
    X(BACKEND, SCALAR, kfac::compute::inverse, kfac::assignment::compute_balanced, COMM)            \
    X(BACKEND, SCALAR, kfac::compute::inverse, kfac::assignment::memory_balanced, COMM)             \
    X(BACKEND, SCALAR, kfac::compute::inverse, kfac::assignment::round_robin, COMM)
#define KFAC_REPLAY_DECLARE(BACKEND, SCALAR, METHOD, ASSIGNMENT, COMM)                             \
    extern template replay_report replay_with<BACKEND, SCALAR, METHOD, ASSIGNMENT, COMM>(          \
        const golden_case&, double, const distributed_setup&, COMM);
#define KFAC_REPLAY_DEFINE(BACKEND, SCALAR, METHOD, ASSIGNMENT, COMM)                              \
    template replay_report replay_with<BACKEND, SCALAR, METHOD, ASSIGNMENT, COMM>(const golden_case&, double, \
                                                                                  const distributed_setup&, COMM);
#ifndef KFAC_REPLAY_INSTANTIATE_HERE
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, kfac::backend::cpu_eigen, float, kfac::comm::serial)
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, kfac::backend::cpu_eigen, double, kfac::comm::serial)
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, staged_backend, double, kfac::comm::serial)
#if KFAC_REPLAY_WITH_MPI
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, kfac::backend::cpu_eigen, float, kfac::comm::mpi)
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, kfac::backend::cpu_eigen, double, kfac::comm::mpi)
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, staged_backend, double, kfac::comm::mpi)
#endif
#if KFAC_REPLAY_WITH_PROCESS_GROUP
KFAC_REPLAY_FOR_EACH_METHOD_AND_ASSIGNMENT(KFAC_REPLAY_DECLARE, kfac::backend::cpu_eigen, double, kfac::comm::process_group)
#endif
#endif

}  // namespace kfac_replay
