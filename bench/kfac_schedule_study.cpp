// SPDX-License-Identifier: Apache-2.0
/// @file kfac_schedule_study.cpp
/// How K-FAC's work and traffic spread over 1 … 4096 workers, per distribution strategy and
/// assignment, using the library's own grid and assignment code and a cost model calibrated
/// on this machine.
///
///   kfac_schedule_study --model bench/models/resnet50_imagenet.txt [--model ...]
///       --calibration eig.json        bench_eigensolver --benchmark_format=json output
///       [--method eigen|inverse] [--batch B] [--cores C] [--max-world 4096]
///       [--json out.json] [--csv out.csv] [--measured mpi.jsonl ...]
///
/// Per model, world size W (powers of two, and W = 3), strategy (comm_opt, hybrid_opt,
/// mem_opt, dp_kfac) and assignment (compute, memory, round_robin) it reports: the
/// second-order work of the busiest rank (its makespan under the cost model) and the load
/// imbalance (max / mean), per-rank memory of factors and second-order data (worst rank), the
/// payload bytes a rank sends or receives on a factor-update, inverse-update and plain step,
/// and the predicted update and non-update step times.
///
/// Cost model (float32): a factor's decomposition (or inverse) takes the time measured by
/// bench_eigensolver for its size, interpolated log-log between the measured sizes and
/// extrapolated as n³; factor statistics run at a SYRK rate and preconditioning at a GEMM
/// rate, both measured here at start-up; a collective costs α + bytes/β. Ranks that share a
/// machine share its cores: per-rank compute time is scaled by (ranks on the machine)/cores.
/// The study places one rank per core on machines of --cores cores (a lone rank uses all its
/// machine's cores through task parallelism); --measured compares the prediction with
/// bench_kfac_mpi output, measured with every rank on this machine.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include <kfac/kfac.hpp>

#include "model_file.hpp"

namespace {

using json = nlohmann::json;
using kfac_bench::model;

/// Time of one decomposition (or inverse) of an n × n factor, from measured points.
class size_curve {
public:
    void add(double n, double seconds) { points_[n] = seconds; }
    [[nodiscard]] bool empty() const { return points_.empty(); }
    [[nodiscard]] double operator()(double n) const {
        if (points_.empty()) throw kfac::error("no calibration points");
        auto hi = points_.lower_bound(n);
        if (hi == points_.end()) {  // beyond the largest size: n³
            const auto& [n1, t1] = *points_.rbegin();
            return t1 * std::pow(n / n1, 3.0);
        }
        if (hi->first == n || hi == points_.begin()) {
            if (hi->first == n) return hi->second;
            return hi->second * std::pow(n / hi->first, 3.0);  // below the smallest: n³ too
        }
        auto lo = std::prev(hi);
        const double x = (std::log(n) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
        return std::exp(std::log(lo->second) + x * (std::log(hi->second) - std::log(lo->second)));
    }

private:
    std::map<double, double> points_;
};

struct cost_model {
    size_curve eig, inv;
    double syrk_flops = 50e9;  ///< real flops/s of a statistic (rows · n²)
    double gemm_flops = 90e9;  ///< flops/s of preconditioning GEMMs
    double alpha = 5e-6;       ///< seconds per collective message
    double beta = 5e9;         ///< bytes per second
    int cores = 1;
    /// Measured at a world size on one machine (bench_kfac_mpi's calibration line): the
    /// compute slowdown when every rank works at once, relative to one rank, and α, β.
    struct at_world {
        double slowdown = 0, alpha = 0, beta = 0, beta_broadcast = 0;
        double step_overhead = 0;  ///< seconds: a K-FAC step of one tiny layer
    };
    std::map<int, at_world> measured;
};

void calibrate_from_benchmark(cost_model& c, const std::string& path) {
    std::ifstream in(path);
    if (!in) throw kfac::error("cannot open calibration file " + path);
    const json j = json::parse(in);
    const std::regex name(R"(^(eigh|inv)_backend<float>/n:(\d+)/)");
    for (const auto& b : j.at("benchmarks")) {
        if (b.value("run_type", "") == "aggregate" && b.value("aggregate_name", "") != "median") continue;
        std::smatch m;
        const std::string n = b.at("name");
        if (!std::regex_search(n, m, name)) continue;
        const double unit = b.value("time_unit", "ns") == "ms" ? 1e-3 : b.value("time_unit", "ns") == "us" ? 1e-6 : 1e-9;
        const double t = b.at("real_time").get<double>() * unit;
        (m[1] == "eigh" ? c.eig : c.inv).add(std::stod(m[2]), t);
    }
    if (c.eig.empty() || c.inv.empty())
        throw kfac::error(path + " has no eigh_backend<float>/inv_backend<float> results; run bench_eigensolver "
                                 "--benchmark_format=json");
}

/// SYRK and GEMM rates of this machine on one thread, measured with the backend's calls.
void calibrate_rates(cost_model& c) {
    using backend = kfac::backend::cpu_eigen<float>;
    const typename backend::serial_blas_scope one_thread;
    auto seconds = [](auto&& f) {
        f();
        const auto t0 = std::chrono::steady_clock::now();
        f();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const std::int64_t n = 288, rows = 8192;
    std::vector<float> x(static_cast<std::size_t>(n * rows), 0.5f);
    backend::matrix sum(n, n);
    c.syrk_flops = double(rows) * n * n / seconds([&] { backend::gram_of_cols(sum.data(), n, x.data(), n, rows, rows, 1.0f, 0.0f); });
    backend::matrix a = backend::matrix::Random(512, 512), b = backend::matrix::Random(512, 512), out;
    c.gemm_flops = 2.0 * 512 * 512 * 512 / seconds([&] { backend::multiply(a, false, b, false, out); });
}

struct strategy {
    std::string name;
    kfac::distribution kind;
    double fraction;
};

struct row {
    std::string model, strategy, assignment;
    int world = 1;
    double makespan = 0, mean_work = 0, imbalance = 1;
    double factor_bytes_per_rank = 0, second_order_bytes_per_rank = 0;
    double sent_factor_step = 0, sent_inverse_step = 0, sent_plain_step = 0;
    double predicted_update = 0, predicted_non_update = 0;
};

template <class Assignment>
row evaluate(const model& m, const std::string& model_name, const strategy& s, int world, const cost_model& c,
             bool eigen, std::int64_t global_batch, int ranks_per_node, int lone_rank_threads = 0) {
    row r{model_name, s.name, Assignment::name, world};
    // Who holds, computes and receives what: the preconditioner's own plan, per block.
    const auto blocks = kfac_bench::blocks_of(m);
    const std::size_t L = blocks.size();
    const auto plan = kfac_bench::plan_of<Assignment>(m, world, s.kind, s.fraction);
    const int grad_workers = plan.grad_workers_per_layer;
    const double bytes = 4.0;  // float32
    // The ranks on one machine share its cores: a lone rank uses them all (task parallelism),
    // more ranks than cores time-share them; where the machine was measured at this world
    // size, the measured slowdown and α, β replace the idealised ones.
    double slowdown = static_cast<double>(std::min(world, ranks_per_node)) / c.cores;
    if (world == 1 && lone_rank_threads > 0)  // a lone rank's tasks use this many of the cores
        slowdown = 1.0 / std::min(lone_rank_threads, c.cores);
    double alpha = c.alpha, beta = c.beta, beta_bcast = c.beta;
    if (const auto it = c.measured.find(world); it != c.measured.end() && ranks_per_node >= world && world > 1) {
        slowdown = it->second.slowdown;
        alpha = it->second.alpha;
        beta = it->second.beta;
        beta_bcast = it->second.beta_broadcast > 0 ? it->second.beta_broadcast : beta;
    }
    const double local_batch = std::max(1.0, static_cast<double>(global_batch) / world);
    std::vector<double> work(static_cast<std::size_t>(world), 0.0);
    std::vector<double> second_bytes(static_cast<std::size_t>(world), 0.0), factor_bytes(static_cast<std::size_t>(world), 0.0);
    std::vector<double> stats_time(static_cast<std::size_t>(world), 0.0), precond_time(static_cast<std::size_t>(world), 0.0);
    std::vector<double> inv_bcast(static_cast<std::size_t>(world), 0.0);
    double total_factor_values = 0, grad_values = 0;
    for (std::size_t i = 0; i < L; ++i) {
        const auto& layer = *blocks[i];
        const double a = static_cast<double>(layer.description.a_dim()), g = static_cast<double>(layer.description.g_dim());
        const double rows = local_batch * static_cast<double>(layer.rows_per_sample);
        const double t_stats = rows * (a * a + g * g) / c.syrk_flops;
        const double t_precond = (eigen ? 4.0 : 2.0) * a * g * (a + g) / c.gemm_flops;
        const double second_values = eigen ? a * a + g * g + a * g : a * a + g * g;
        total_factor_values += a * a + g * g;
        grad_values += a * g;
        const int owner_a = plan.layers[i].a_worker, owner_g = plan.layers[i].g_worker;
        work[static_cast<std::size_t>(owner_a)] += eigen ? c.eig(a) : c.inv(a);
        work[static_cast<std::size_t>(owner_g)] += eigen ? c.eig(g) : c.inv(g);
        for (int rank = 0; rank < world; ++rank) {
            const auto k = static_cast<std::size_t>(rank);
            const auto role = plan.role(i, rank);
            if (role.holds_factors) {
                stats_time[k] += t_stats;
                factor_bytes[k] += 2.0 * (a * a + g * g) * bytes;  // running factor + batch statistic
            }
            if (role.grad_worker) {
                precond_time[k] += t_precond;
                second_bytes[k] += second_values * bytes;
                if (role.share_second_order) inv_bcast[k] += second_values * bytes;
            }
        }
    }
    const double mean = std::accumulate(work.begin(), work.end(), 0.0) / world;
    r.makespan = *std::max_element(work.begin(), work.end()) * slowdown;
    r.mean_work = mean * slowdown;
    r.imbalance = mean > 0 ? *std::max_element(work.begin(), work.end()) / mean : 1.0;
    r.factor_bytes_per_rank = *std::max_element(factor_bytes.begin(), factor_bytes.end());
    r.second_order_bytes_per_rank = *std::max_element(second_bytes.begin(), second_bytes.end());
    const bool kaisa = s.kind == kfac::distribution::kaisa;
    const bool bcast_grads = plan.broadcast_gradients();
    r.sent_factor_step = kaisa && world > 1 ? (total_factor_values + static_cast<double>(L)) * bytes : 0.0;
    r.sent_inverse_step = *std::max_element(inv_bcast.begin(), inv_bcast.end());
    r.sent_plain_step = bcast_grads ? grad_values * bytes : 0.0;
    // Step time of the slowest rank: its compute (scaled by the shared cores) + collectives.
    // α per message (it grows with W through the collective's tree depth where not measured).
    const double depth = c.measured.count(world) ? 1.0 : std::ceil(std::log2(std::max(1, world)));
    const double t_allreduce = world > 1 && kaisa ? alpha * depth + r.sent_factor_step / beta : 0.0;
    const double t_inv_bcast = grad_workers > 1 ? 2.0 * static_cast<double>(L) * alpha * depth + r.sent_inverse_step / beta_bcast : 0.0;
    const double t_grad_bcast = bcast_grads ? static_cast<double>(L) * alpha * depth + r.sent_plain_step / beta_bcast : 0.0;
    double update = 0, plain = 0;
    for (int rank = 0; rank < world; ++rank) {
        const auto k = static_cast<std::size_t>(rank);
        update = std::max(update, (stats_time[k] + work[k] + precond_time[k]) * slowdown);
        plain = std::max(plain, precond_time[k] * slowdown);
    }
    // Per-step fixed cost (checks, agreement, ranks meeting again), where it was measured.
    const auto fixed = c.measured.find(world);
    const double overhead = fixed != c.measured.end() && ranks_per_node >= world ? fixed->second.step_overhead : 0.0;
    r.predicted_update = update + t_allreduce + t_inv_bcast + t_grad_bcast + overhead;
    r.predicted_non_update = plain + t_grad_bcast + overhead;
    return r;
}

json to_json(const row& r) {
    return {{"model", r.model}, {"strategy", r.strategy}, {"assignment", r.assignment}, {"world", r.world},
            {"second_order_makespan_s", r.makespan}, {"second_order_mean_s", r.mean_work},
            {"load_imbalance", r.imbalance}, {"factor_bytes_per_rank", r.factor_bytes_per_rank},
            {"second_order_bytes_per_rank", r.second_order_bytes_per_rank},
            {"bytes_factor_update_step", r.sent_factor_step}, {"bytes_inverse_update_step", r.sent_inverse_step},
            {"bytes_plain_step", r.sent_plain_step}, {"predicted_update_s", r.predicted_update},
            {"predicted_non_update_s", r.predicted_non_update}};
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> model_paths, measured_paths;
    std::string calibration, json_out, csv_out, method = "eigen";
    std::int64_t batch = 0;
    int max_world = 4096;
    cost_model c;
    c.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    try {
        for (int i = 1; i < argc; ++i) {
            const std::string arg = argv[i];
            auto value = [&]() -> std::string {
                if (i + 1 >= argc) throw kfac::error(arg + " needs a value");
                return argv[++i];
            };
            if (arg == "--model") model_paths.push_back(value());
            else if (arg == "--calibration") calibration = value();
            else if (arg == "--method") method = value();
            else if (arg == "--batch") batch = std::stoll(value());
            else if (arg == "--cores") c.cores = std::stoi(value());
            else if (arg == "--max-world") max_world = std::stoi(value());
            else if (arg == "--json") json_out = value();
            else if (arg == "--csv") csv_out = value();
            else if (arg == "--measured") measured_paths.push_back(value());
            else throw kfac::error("unknown argument " + arg);
        }
        if (model_paths.empty() || calibration.empty())
            throw kfac::error("usage: kfac_schedule_study --model FILE... --calibration eig.json [--method eigen|inverse] "
                              "[--batch B] [--cores C] [--max-world W] [--json F] [--csv F] [--measured F...]");
        calibrate_from_benchmark(c, calibration);
        calibrate_rates(c);
        std::fprintf(stderr, "calibration: syrk %.1f GFLOP/s, gemm %.1f GFLOP/s (1 thread), eig(576) %.2f ms, "
                             "eig(2048) %.1f ms, %d cores\n",
                     c.syrk_flops / 1e9, c.gemm_flops / 1e9, c.eig(576) * 1e3, c.eig(2048) * 1e3, c.cores);
        const bool eigen = method == "eigen";
        const std::vector<strategy> strategies = {{"comm_opt", kfac::distribution::kaisa, kfac::comm_opt},
                                                  {"hybrid_opt", kfac::distribution::kaisa, kfac::hybrid_opt},
                                                  {"mem_opt", kfac::distribution::kaisa, kfac::mem_opt},
                                                  {"dp_kfac", kfac::distribution::dp_kfac, 1.0}};
        std::vector<int> worlds = {1, 2, 3};
        for (int w = 4; w <= max_world; w *= 2) worlds.push_back(w);
        std::vector<row> rows;
        const auto t0 = std::chrono::steady_clock::now();
        std::map<std::string, model> models;
        for (const auto& path : model_paths) {
            const auto m = kfac_bench::read_model(path);
            const std::string name = path.substr(path.find_last_of('/') + 1);
            models[name] = m;
            const std::int64_t b = batch ? batch : m.batch;
            for (int w : worlds)
                for (const auto& s : strategies) {
                    if (s.kind == kfac::distribution::kaisa &&
                        (!kfac::assignment::kaisa_grid::valid(w, s.fraction) ||
                         kfac::assignment::kaisa_grid(w, s.fraction).strategy_name() != s.name))
                        continue;
                    rows.push_back(evaluate<kfac::assignment::compute_balanced>(m, name, s, w, c, eigen, b, c.cores));
                    rows.push_back(evaluate<kfac::assignment::memory_balanced>(m, name, s, w, c, eigen, b, c.cores));
                    rows.push_back(evaluate<kfac::assignment::round_robin>(m, name, s, w, c, eigen, b, c.cores));
                }
        }
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "%zu configurations in %.2f s\n", rows.size(), elapsed);

        json all = json::array();
        for (const auto& r : rows) all.push_back(to_json(r));
        if (!json_out.empty()) std::ofstream(json_out) << all.dump(1) << "\n";
        if (!csv_out.empty()) {
            std::ofstream out(csv_out);
            bool header = true;
            for (const auto& j : all) {
                if (header) {
                    const char* sep = "";
                    for (const auto& [k, v] : j.items()) out << sep << k, sep = ",";
                    out << "\n";
                    header = false;
                }
                const char* sep = "";
                for (const auto& [k, v] : j.items()) out << sep << (v.is_string() ? v.get<std::string>() : v.dump()), sep = ",";
                out << "\n";
            }
        }
        // Summary: compute-balanced assignment, a few world sizes.
        std::printf("%-26s %-10s %6s %12s %9s %12s %12s %12s %12s\n", "model", "strategy", "W", "makespan_ms",
                    "imbalance", "factors_MB", "2nd_order_MB", "bytes_upd_MB", "bytes_plain_MB");
        for (const auto& r : rows) {
            if (r.assignment != std::string("compute")) continue;
            if (r.world != 1 && r.world != 4 && r.world != 64 && r.world != 1024 && r.world != 4096) continue;
            std::printf("%-26s %-10s %6d %12.2f %9.2f %12.1f %12.1f %12.2f %12.2f\n", r.model.c_str(), r.strategy.c_str(),
                        r.world, r.makespan * 1e3, r.imbalance, r.factor_bytes_per_rank / 1e6,
                        r.second_order_bytes_per_rank / 1e6, r.sent_factor_step / 1e6, r.sent_plain_step / 1e6);
        }
        // Validation against measured step times. Runs on a shared machine vary by up to 1.5×
        // from one run to the next, so every quantity measured several times (calibration
        // lines per world size, step times per configuration) enters as its median.
        auto median = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            const std::size_t n = v.size();
            return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
        };
        std::map<int, std::vector<double>> kernel_runs, gemm_runs, message_runs, allreduce_runs, broadcast_runs, empty_runs;
        struct configuration {
            std::string model, strategy;
            int world = 1, threads = 0;
            std::int64_t global_batch = 0;
            std::vector<double> update_ms, non_update_ms;
        };
        std::map<std::string, configuration> measured;
        for (const auto& path : measured_paths) {
            std::ifstream in(path);
            if (!in) throw kfac::error("cannot open measured file " + path);
            std::string line;
            while (std::getline(in, line)) {
                if (line.empty() || line[0] != '{') continue;
                const json mj = json::parse(line);
                if (mj.contains("calibration")) {
                    const int w = mj.at("world");
                    kernel_runs[w].push_back(mj.at("kernel_ms"));
                    if (mj.contains("gemm_ms")) gemm_runs[w].push_back(mj.at("gemm_ms"));
                    message_runs[w].push_back(mj.at("message_s"));
                    allreduce_runs[w].push_back(mj.at("allreduce_bytes_per_s"));
                    if (mj.contains("broadcast_bytes_per_s")) broadcast_runs[w].push_back(mj.at("broadcast_bytes_per_s"));
                    if (mj.contains("empty_step_ms")) empty_runs[w].push_back(mj.at("empty_step_ms"));
                    continue;
                }
                if (mj.at("method") != method) continue;
                std::string key = mj.at("model").get<std::string>();
                key += ' ';
                key += mj.at("strategy").get<std::string>();
                key += ' ';
                key += std::to_string(mj.at("world").get<int>());
                auto& m = measured[key];
                m.model = mj.at("model");
                m.strategy = mj.at("strategy");
                m.world = mj.at("world");
                m.threads = mj.value("threads", 0);
                m.global_batch = mj.at("global_batch");
                m.update_ms.push_back(mj.at("update_ms"));
                m.non_update_ms.push_back(mj.at("non_update_ms"));
            }
        }
        // The rates of one rank alone, measured in the same runs as the steps, replace the
        // start-up ones: the kernels of bench_kfac_mpi's calibration (SYRK 288 × 8192 rows,
        // GEMM 576² × 64, a preconditioning shape).
        if (kernel_runs.count(1)) c.syrk_flops = 8192.0 * 288.0 * 288.0 / (median(kernel_runs[1]) * 1e-3);
        if (gemm_runs.count(1)) c.gemm_flops = 2.0 * 576.0 * 576.0 * 64.0 / (median(gemm_runs[1]) * 1e-3);
        if (kernel_runs.count(1))
            std::printf("rates from the measured runs: syrk %.1f GFLOP/s, gemm %.1f GFLOP/s\n", c.syrk_flops / 1e9,
                        c.gemm_flops / 1e9);
        if (kernel_runs.count(1))
            for (const auto& [w, runs] : kernel_runs) {
                auto& m = c.measured[w];
                m.slowdown = median(runs) / median(kernel_runs[1]);
                m.alpha = median(message_runs[w]);
                m.beta = median(allreduce_runs[w]);
                if (broadcast_runs.count(w)) m.beta_broadcast = median(broadcast_runs[w]);
                if (empty_runs.count(w)) m.step_overhead = median(empty_runs[w]) * 1e-3;
                std::printf("machine at W=%d (%zu run(s)): compute slowdown %.2f, %.3g s per message, %.3g GB/s allreduce, "
                            "%.3g GB/s broadcast, %.2f ms per-step fixed cost\n",
                            w, runs.size(), m.slowdown, m.alpha, m.beta / 1e9, m.beta_broadcast / 1e9,
                            m.step_overhead * 1e3);
            }
        int outside = 0, compared = 0;
        for (const auto& [key, mc] : measured) {
            const auto it = models.find(mc.model);
            if (it == models.end()) continue;
            const auto s = std::find_if(strategies.begin(), strategies.end(), [&](const strategy& x) { return x.name == mc.strategy; });
            if (s == strategies.end()) continue;
            // Measured with every rank on this machine.
            const auto r = evaluate<kfac::assignment::compute_balanced>(it->second, it->first, *s, mc.world, c, eigen,
                                                                        mc.global_batch, mc.world, mc.threads);
            for (const auto& [what, predicted, runs] :
                 {std::tuple<std::string, double, const std::vector<double>*>{"update_ms", r.predicted_update, &mc.update_ms},
                  std::tuple<std::string, double, const std::vector<double>*>{"non_update_ms", r.predicted_non_update,
                                                                              &mc.non_update_ms}}) {
                const double measured_ms = median(*runs);
                const auto [lo, hi] = std::minmax_element(runs->begin(), runs->end());
                const double ratio = predicted * 1e3 / measured_ms;
                const bool ok = ratio >= 0.7 && ratio <= 1.3;
                outside += !ok;
                ++compared;
                std::printf("validation %-22s W=%d %-10s %-14s measured %9.2f ms (%zu run(s), %.2f-%.2f) predicted %9.2f ms "
                            "ratio %.2f %s\n",
                            mc.model.c_str(), mc.world, mc.strategy.c_str(), what.c_str(), measured_ms, runs->size(), *lo, *hi,
                            predicted * 1e3, ratio, ok ? "within 30%" : "OUTSIDE 30%");
            }
        }
        if (compared) std::printf("validation: %d of %d predictions within ±30%%\n", compared - outside, compared);
        return outside ? 3 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kfac_schedule_study: %s\n", e.what());
        return 2;
    }
}
