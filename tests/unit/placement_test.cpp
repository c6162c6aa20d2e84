// SPDX-License-Identifier: Apache-2.0
// One placement model (issue 26, item 4): kfac_schedule_study's plan of every block (bench/
// model_file.hpp's plan_of, the chain placement_costs → plan_distribution) is the placement
// the preconditioner reports in layers(), for each model file of the study and a model with a
// grouped and a depthwise convolution, at several world sizes, for every strategy and
// assignment. Before the chain was shared, the study saw one block per grouped convolution.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

#include "model_file.hpp"

namespace {

/// comm::serial that reports `world` ranks: layers() plans for the world size it is told and
/// makes no collective (the constructor's agreement is one rank's own).
struct sized_world : kfac::comm::serial {
    int world = 1;
    [[nodiscard]] int size() const { return world; }
};

/// cpu_eigen<float> whose registration allocates nothing: layers() reads the descriptions only,
/// and the study's models hold factors of up to 4608 x 4608 entries (BERT-large's running
/// factors and statistics alone would take 8 GB).
struct descriptions_only : kfac::backend::cpu_eigen<float> {
    static matrix identity(std::int64_t) { return {}; }
    static matrix ones(std::int64_t) { return {}; }
    static matrix zeros(std::int64_t, std::int64_t) { return {}; }
};

struct strategy_case {
    kfac::distribution kind;
    double fraction;
};

std::vector<strategy_case> strategies_for(int world) {
    std::vector<strategy_case> out{{kfac::distribution::dp_kfac, 1.0},
                                   {kfac::distribution::kaisa, 1.0},                                 // COMM_OPT
                                   {kfac::distribution::kaisa, kfac::mem_opt}};
    if (world % 2 == 0 && world > 2) out.push_back({kfac::distribution::kaisa, 0.5});                // HYBRID_OPT
    return out;
}

template <class Assignment>
void check_model_placement(const kfac_bench::model& m, const std::string& model_name) {
    std::vector<kfac::layer_view<float>> views(m.layers.size());
    for (std::size_t i = 0; i < m.layers.size(); ++i) views[i].description = m.layers[i].description;
    const auto blocks = kfac_bench::blocks_of(m);
    for (int world : {1, 2, 3, 4, 8}) {
        for (const auto& s : strategies_for(world)) {
            INFO(model_name << ", " << Assignment::name << ", world " << world << ", "
                            << (s.kind == kfac::distribution::dp_kfac ? "dp_kfac" : "kaisa") << " fraction "
                            << s.fraction);
            kfac::options o;
            o.strategy = s.kind;
            o.grad_worker_fraction = s.fraction;
            sized_world comm;
            comm.world = world;
            kfac::KFAC<descriptions_only, sized_world, kfac::compute::eigendecomposition, Assignment>
                precond(o, comm);
            for (std::size_t i = 0; i < views.size(); ++i) precond.register_layer(m.layers[i].name, views[i]);
            const auto reported = precond.layers();
            const auto planned = kfac_bench::plan_of<Assignment>(m, world, s.kind, s.fraction);
            REQUIRE(reported.size() == blocks.size());
            REQUIRE(planned.layers.size() == blocks.size());
            for (std::size_t i = 0; i < blocks.size(); ++i) {
                INFO("block " << reported[i].name);
                CHECK(reported[i].a_worker == planned.layers[i].a_worker);
                CHECK(reported[i].g_worker == planned.layers[i].g_worker);
                CHECK(reported[i].factor_holders == planned.layers[i].factor_holders);
                CHECK(reported[i].grad_workers == planned.layers[i].grad_workers);
            }
            if (world == 8 && s.kind == kfac::distribution::kaisa && s.fraction == 1.0) {
                // Not a comparison of two trivial plans: the blocks are spread over the ranks.
                std::set<int> owners;
                for (const auto& l : reported) owners.insert(l.a_worker);
                CHECK(owners.size() == std::min<std::size_t>(8, blocks.size()));
            }
        }
    }
}

void check_all_assignments(const kfac_bench::model& m, const std::string& name) {
    check_model_placement<kfac::assignment::compute_balanced>(m, name);
    check_model_placement<kfac::assignment::memory_balanced>(m, name);
    check_model_placement<kfac::assignment::round_robin>(m, name);
}

}  // namespace

TEST_CASE("the study's plan of each model file is the preconditioner's placement", "[assignment][placement]") {
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(KFAC_BENCH_MODELS_DIR))
        if (entry.path().extension() == ".txt") files.push_back(entry.path());
    REQUIRE(files.size() >= 4);  // bert_large_encoder, mlp_w2, resnet32_cifar10, resnet50_imagenet
    for (const auto& file : files) check_all_assignments(kfac_bench::read_model(file.string()), file.filename().string());
}

TEST_CASE("a grouped convolution is g blocks in the study's plan and in the preconditioner", "[assignment][placement]") {
    const auto path = std::filesystem::temp_directory_path() / "kfac_placement_test_grouped.txt";
    {
        std::ofstream out(path);
        out << "conv2d stem 3 32 0 3 3 2 1 32 32\n"
               "conv2d grouped 32 64 1 3 3 1 1 16 16 4\n"    // 4 groups of 8 → 16 channels
               "conv2d depthwise 64 64 0 3 3 1 1 16 16 64\n"  // depthwise: 64 blocks of 1 → 1
               "linear head 64 10 1 1\n";
    }
    const auto m = kfac_bench::read_model(path.string());
    std::filesystem::remove(path);
    CHECK(kfac_bench::blocks_of(m).size() == 1 + 4 + 64 + 1);
    check_all_assignments(m, "grouped");
}
