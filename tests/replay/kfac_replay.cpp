// SPDX-License-Identifier: Apache-2.0
// kfac_replay: replays a golden case folder through the public API and compares every
// dumped quantity (see ../shared/golden/README.md).
//
//   kfac_replay [CASE_DIR...] [--float | --double] [--rtol R]
//               [--strategy kaisa|dp-kfac] [--grad-worker-fraction comm_opt|hybrid_opt|mem_opt|F]
//               [--assignment compute|memory|round_robin] [--colocate on|off]
//               [--backend cpu|cuda|staged] [--save-after K FILE | --resume FILE]
//               [--then DISTRIBUTION_OPTIONS]...
//
// --then starts another configuration of the same case in the same process: the options after
// it (--strategy, --grad-worker-fraction, --assignment, --colocate) start from their defaults,
// the case, precision, tolerance and backend are the first configuration's. The MPI tests run
// every configuration of a case at one world size in one mpiexec (process start-up and
// MPI_Init were 0.11 s of a 0.18 s run); each configuration prints its own lines, and the run
// ends with `configurations=<n> failed=<m>`.
//
// --save-after K FILE replays and verifies steps 0..K-1, saves the preconditioner (a
// checkpoint, kfac/checkpoint/format.hpp) and stops; --resume FILE loads one into a fresh
// preconditioner and replays and verifies from its step to the end of the case. Under mpiexec
// the two may run at different world sizes and strategies.
//
// CASE_DIR is one case folder or a folder of case folders (several may be given); without one,
// every case discovered in the repository's tests/data/golden and in ../shared/golden (when
// present) is replayed.
//
// --backend: cpu (cpu_eigen, the default); cuda (backend::cuda, in the kfac_replay_cuda
// build, which exits 77 when no CUDA device is present); staged (a CPU backend that declares
// its data device-resident, so every collective goes through the host staging of device
// backends: the MPI tests use it to check that path without a GPU; in double only, --double).
//
// Under `mpiexec -n W` (when built with MPI) each rank takes its contiguous block of every
// step's rows; errors are maximised over ranks. Prints, per case, the largest error per
// quantity and a line
//   max_rel_err=<value> rtol=<value> world=<W> strategy=<name> PASS|FAIL
// and, when several cases or configurations ran, `cases=<n> failed=<m>` after each configuration.
// Exit status: 0 when every case passed, 1 on FAIL, 2 on a usage or input error.

#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "golden_case.hpp"
#include "golden_dirs.hpp"

#ifndef KFAC_REPLAY_WITH_CUDA
#define KFAC_REPLAY_WITH_CUDA 0
#endif
// Distributed over MPI ranks or, in kfac_replay_process_group, over processes of
// tests/mpi/launch.sh and a Gloo process group (tests/mpi/test_world.hpp).
#ifndef KFAC_REPLAY_WITH_PROCESS_GROUP
#define KFAC_REPLAY_WITH_PROCESS_GROUP 0
#endif
#define KFAC_REPLAY_DISTRIBUTED (KFAC_REPLAY_WITH_MPI || KFAC_REPLAY_WITH_PROCESS_GROUP)
#if KFAC_REPLAY_DISTRIBUTED
#define KFAC_TEST_PROCESS_GROUP KFAC_REPLAY_WITH_PROCESS_GROUP
#include "mpi/test_world.hpp"
#endif
#if KFAC_REPLAY_WITH_CUDA
#include <kfac/backend/cuda.cuh>
#endif
#include "staged_backend.hpp"

#if KFAC_REPLAY_WITH_CUDA && KFAC_REPLAY_DISTRIBUTED
// Over several ranks the CUDA backend replays in double only (the np2 tests); its float replays
// run in one process, over comm::serial.
template <>
inline constexpr bool kfac_replay::pair_replays_in_float<kfac::backend::cuda, kfac_test::comm_under_test> = false;
#endif

/// Exit status that CTest reads as "skipped" (SKIP_RETURN_CODE).
constexpr int exit_skipped = 77;

namespace {

const char* usage =
    "usage: kfac_replay [CASE_DIR | FOLDER_OF_CASES]... [--float | --double] [--rtol R]\n"
    "         [--strategy kaisa|dp-kfac] [--grad-worker-fraction comm_opt|hybrid_opt|mem_opt|F]\n"
    "         [--assignment compute|memory|round_robin] [--colocate on|off]\n"
    "         [--backend cpu|cuda|staged] [--save-after K FILE | --resume FILE]\n"
    "         [--then DISTRIBUTION_OPTIONS]...\n"
    "  --save-after K FILE  replay and verify steps 0..K-1, save the preconditioner to FILE, stop\n"
    "  --resume FILE        load FILE into a fresh preconditioner, replay and verify from its step\n"
    "  --then               another configuration (--strategy, --grad-worker-fraction, --assignment,\n"
    "                       --colocate, from their defaults) of the same case, in this process\n";

double parse_fraction(const std::string& s) {
    if (s == "comm_opt") return kfac::comm_opt;
    if (s == "hybrid_opt") return kfac::hybrid_opt;
    if (s == "mem_opt") return kfac::mem_opt;
    return std::stod(s);
}

struct run_context {
    int rank = 0;
    int world = 1;
};

int replay_case(const kfac_replay::fs::path& folder, kfac_replay::precision p, std::optional<double> rtol,
                const kfac_replay::distributed_setup& setup, const std::string& backend, run_context& ctx);

int run(int argc, char** argv, run_context& ctx) {
    std::vector<std::string> folders;
    auto p = kfac_replay::precision::case_dtype;
    std::optional<double> rtol;
    std::vector<kfac_replay::distributed_setup> setups(1);
    std::string backend = KFAC_REPLAY_WITH_CUDA ? "cuda" : "cpu";
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw kfac::error("option " + arg + " needs a value");
            return argv[++i];
        };
        kfac_replay::distributed_setup& setup = setups.back();
        // The case and how it is replayed are the first configuration's.
        const bool first = setups.size() == 1;
        auto common = [&] {
            if (!first) throw kfac::error(arg + " belongs before the first --then\n" + usage);
        };
        if (arg == "--then") setups.emplace_back();
        else if (arg == "--float") {
            common();
            p = kfac_replay::precision::float32;
        } else if (arg == "--double") {
            common();
            p = kfac_replay::precision::float64;
        } else if (arg == "--rtol") {
            common();
            rtol = std::stod(value());
        } else if (arg == "--strategy") {
            const std::string v = value();
            if (v == "kaisa") setup.strategy = kfac::distribution::kaisa;
            else if (v == "dp-kfac" || v == "dp_kfac") setup.strategy = kfac::distribution::dp_kfac;
            else throw kfac::error("--strategy must be kaisa or dp-kfac, not '" + v + "'");
        } else if (arg == "--grad-worker-fraction") setup.grad_worker_fraction = parse_fraction(value());
        else if (arg == "--assignment") setup.assignment = value();
        else if (arg == "--backend") {
            common();
            backend = value();
        } else if (arg == "--colocate") {
            const std::string v = value();
            if (v != "on" && v != "off") throw kfac::error("--colocate must be on or off");
            setup.colocate = v == "on";
        } else if (arg == "--save-after") {
            common();
            const std::string k = value();
            std::size_t used = 0;
            try {
                setup.save_after = std::stoll(k, &used);
            } catch (const std::exception&) {
                used = 0;
            }
            if (used != k.size() || k.empty()) throw kfac::error("--save-after needs a step count, not '" + k + "'");
            setup.save_file = value();
        } else if (arg == "--resume") {
            common();
            setup.resume_from = kfac_replay::fs::path(value());
        } else if (arg == "-h" || arg == "--help") {
            if (ctx.rank == 0) std::cout << usage;
            return 0;
        } else if (!arg.empty() && arg[0] != '-' && first) folders.push_back(arg);
        else throw kfac::error("unknown argument '" + arg + "'\n" + usage);
    }
    const kfac_replay::distributed_setup& first = setups.front();
    if ((first.save_after || first.resume_from) && setups.size() > 1)
        throw kfac::error("--save-after and --resume replay one configuration; drop --then");
    std::vector<kfac_replay::fs::path> cases;
    if (folders.empty()) cases = kfac_replay::discover_cases_in(kfac_replay::golden_dirs);
    for (const auto& folder : folders) {
        const auto found = kfac_replay::discover_cases(folder);
        if (found.empty()) throw kfac::error("no case.json in '" + folder + "' or its sub-folders\n" + usage);
        cases.insert(cases.end(), found.begin(), found.end());
    }
    if (cases.empty()) throw kfac::error(std::string("no golden case found in the default folders\n") + usage);
    if ((first.save_after || first.resume_from) && cases.size() != 1)
        throw kfac::error("--save-after and --resume take one case folder; " + std::to_string(cases.size()) +
                          " cases were given");
    int failed = 0;
    for (const auto& setup : setups) {
        int failed_cases = 0;
        for (const auto& case_folder : cases) {
            const int status = replay_case(case_folder, p, rtol, setup, backend, ctx);
            if (status == exit_skipped) return status;  // no device: nothing can run
            if (status != 0) ++failed_cases;
        }
        if ((cases.size() > 1 || setups.size() > 1) && ctx.rank == 0)
            std::printf("cases=%zu failed=%d\n", cases.size(), failed_cases);
        if (failed_cases != 0) ++failed;
    }
    if (setups.size() > 1 && ctx.rank == 0) std::printf("configurations=%zu failed=%d\n", setups.size(), failed);
    return failed == 0 ? 0 : 1;
}

int replay_case(const kfac_replay::fs::path& folder, kfac_replay::precision p, std::optional<double> rtol,
                const kfac_replay::distributed_setup& setup, const std::string& backend, run_context& ctx) {
    const kfac_replay::golden_case c(folder);
#if KFAC_REPLAY_DISTRIBUTED
    using comm_type = kfac_test::comm_under_test;
    auto make_comm = [] { return kfac_test::make_comm(); };
#else
    using comm_type = kfac::comm::serial;
    auto make_comm = [] { return kfac::comm::serial{}; };
#endif
    kfac_replay::replay_report r;
    if (backend == "cpu") {
        r = kfac_replay::replay<comm_type, kfac::backend::cpu_eigen>(c, p, rtol, setup, make_comm);
    } else if (backend == "staged") {
#if KFAC_REPLAY_WITH_PROCESS_GROUP
        throw kfac::error("--backend staged: kfac_replay_process_group replays the cpu backend only; the staging "
                          "is checked with MPI (kfac_replay)");
#else
        r = kfac_replay::replay<comm_type, kfac_replay::staged_backend>(c, p, rtol, setup, make_comm);
#endif
    } else if (backend == "cuda") {
#if KFAC_REPLAY_WITH_CUDA
        if (kfac::backend::cuda_device_count() == 0) {
            if (ctx.rank == 0)
                std::cout << "SKIPPED: no CUDA device is present (cudaGetDeviceCount reports none); the CUDA "
                             "backend's golden replay needs a GPU\n";
            return exit_skipped;
        }
        // One process replays over comm::serial (the preconditioners kfac_engines_cuda compiles
        // once, in both precisions); several ranks over the transport, in double only.
        if (ctx.world == 1)
            r = kfac_replay::replay<kfac::comm::serial, kfac::backend::cuda>(c, p, rtol, setup,
                                                                             [] { return kfac::comm::serial{}; });
        else
            r = kfac_replay::replay<comm_type, kfac::backend::cuda>(c, p, rtol, setup, make_comm);
#else
        throw kfac::error("--backend cuda: this kfac_replay was built without CUDA; use kfac_replay_cuda");
#endif
    } else {
        throw kfac::error("--backend must be cpu, cuda or staged, not '" + backend + "'");
    }
#if KFAC_REPLAY_DISTRIBUTED
    // Maximise every quantity and the problem count over ranks.
    const std::vector<std::string> quantities = {"A", "G", "pgrad_w", "pgrad_b", "kl_scale"};
    for (const auto& q : quantities) {
        const double all = kfac_test::world_largest(r.max_error.count(q) ? r.max_error[q] : -1.0);
        if (all >= 0.0) r.max_error[q] = all;
        r.worst = std::max(r.worst, all);
    }
    const auto problems = static_cast<std::int64_t>(r.problems.size());
    std::int64_t all_problems = problems;
    kfac_test::world_sum(&all_problems, 1);
    if (all_problems > problems) r.problems.push_back("problems on other ranks");
#endif
    if (ctx.rank != 0) return r.passed() ? 0 : 1;
    std::cout << "case " << c.name() << " (" << c.dtype() << " recording, replayed in "
              << r.precision << ", method "
              << c.meta().at("kfac").at("compute_method").get<std::string>() << ", assignment "
              << setup.assignment << ", colocate " << (setup.colocate ? "on" : "off") << ", backend " << backend
              << ")\n";
    for (const auto& [what, e] : r.max_error) std::printf("  %-9s max_rel_err=%.3e\n", what.c_str(), e);
    for (const auto& problem : r.problems) std::cout << "  problem: " << problem << "\n";
    if (backend == "staged") std::cout << "staged_bytes=" << kfac_replay::staged_bytes().load() << "\n";
    if (setup.resume_from) std::cout << "resumed from " << setup.resume_from->string() << " at step " << r.first_step << "\n";
    if (setup.save_after) std::cout << "saved " << setup.save_file.string() << " after step " << r.end_step << "\n";
    std::printf("max_rel_err=%.3e rtol=%.1e world=%d strategy=%s %s\n", r.worst, r.rtol, ctx.world,
                r.strategy.c_str(), r.passed() ? "PASS" : "FAIL");
    std::fflush(stdout);
    return r.passed() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    run_context ctx;
#if KFAC_REPLAY_DISTRIBUTED
    kfac_test::init_world(argc, argv);
    ctx.rank = kfac_test::world_rank();
    ctx.world = kfac_test::world_size();
#endif
    int status = 0;
    try {
        status = run(argc, argv, ctx);
    } catch (const std::exception& e) {
        // Errors the library raises are raised on every rank alike, so every rank gets here.
        if (ctx.rank == 0) {
            std::cerr << "kfac_replay: " << e.what() << "\n";
            std::printf("max_rel_err=nan rtol=nan world=%d strategy=none FAIL\n", ctx.world);
        }
        status = 2;
    }
#if KFAC_REPLAY_DISTRIBUTED
    status = static_cast<int>(kfac_test::world_max(std::int64_t{status}));
    kfac_test::finalize_world();
#endif
    return status;
}
