// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file model_file.hpp
/// Reads a model's K-FAC layer shapes from the text format of bench/models/*.txt.

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/assignment/placement_costs.hpp>
#include <kfac/kfac.hpp>

namespace kfac_bench {

/// One layer of a model file: its description and the rows one sample adds to each factor's
/// statistics (conv: output positions; linear: rows per sample, e.g. the sequence length).
struct model_layer {
    std::string name;
    kfac::layer_description description;
    std::int64_t height = 1, width = 1;  ///< conv input size
    std::int64_t rows_per_sample = 1;
};

struct model {
    std::string title;
    std::int64_t batch = 1;  ///< the "# batch:" line: default global batch
    std::vector<model_layer> layers;
};

inline model read_model(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw kfac::error("cannot open model file " + path);
    model m;
    std::string line;
    int number = 0;
    while (std::getline(in, line)) {
        ++number;
        if (line.rfind("# batch:", 0) == 0) m.batch = std::stoll(line.substr(8));
        if (m.title.empty() && line.rfind("# ", 0) == 0) m.title = line.substr(2);
        if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
        std::istringstream s(line);
        std::string kind;
        if (!(s >> kind)) continue;
        model_layer l;
        int bias = 0;
        if (kind == "conv2d") {
            std::int64_t c_in, c_out, kh, kw, stride, pad, groups = 1;
            if (!(s >> l.name >> c_in >> c_out >> bias >> kh >> kw >> stride >> pad >> l.height >> l.width))
                throw kfac::error(path + ":" + std::to_string(number) +
                                  ": expected conv2d NAME C_IN C_OUT BIAS K_H K_W STRIDE PADDING H_IN W_IN [GROUPS]");
            if (!(s >> groups)) groups = 1;
            l.description =
                kfac::conv2d_description(c_in, c_out, {{kh, kw}, {stride, stride}, {pad, pad}, {1, 1}, groups}, bias != 0);
            l.rows_per_sample = kfac::conv_output_extent(l.height, kh, stride, pad, 1) *
                                kfac::conv_output_extent(l.width, kw, stride, pad, 1);
        } else if (kind == "linear") {
            std::int64_t in_f, out_f;
            if (!(s >> l.name >> in_f >> out_f >> bias >> l.rows_per_sample))
                throw kfac::error(path + ":" + std::to_string(number) + ": expected linear NAME IN OUT BIAS ROWS_PER_SAMPLE");
            l.description = kfac::linear_description(in_f, out_f, bias != 0);
        } else if (kind == "embedding") {
            std::int64_t vocabulary, width;
            if (!(s >> l.name >> vocabulary >> width >> l.rows_per_sample))
                throw kfac::error(path + ":" + std::to_string(number) +
                                  ": expected embedding NAME VOCABULARY WIDTH ROWS_PER_SAMPLE");
            l.description = kfac::embedding_description(vocabulary, width);
        } else if (kind == "layer_norm") {
            std::int64_t features;
            if (!(s >> l.name >> features >> bias >> l.rows_per_sample))
                throw kfac::error(path + ":" + std::to_string(number) +
                                  ": expected layer_norm NAME FEATURES SHIFT ROWS_PER_SAMPLE");
            l.description = kfac::layer_norm_description(features, bias != 0);
        } else {
            throw kfac::error(path + ":" + std::to_string(number) + ": unknown layer kind '" + kind + "'");
        }
        m.layers.push_back(l);
    }
    if (m.layers.empty()) throw kfac::error("model file " + path + " lists no layers");
    return m;
}

/// The blocks the preconditioner makes of the model's layers, in its order: per block, the
/// layer it belongs to (a grouped convolution of g groups is g blocks).
inline std::vector<const model_layer*> blocks_of(const model& m) {
    std::vector<const model_layer*> blocks;
    for (const auto& l : m.layers)
        for (std::int64_t j = 0; j < std::max<std::int64_t>(1, l.description.groups()); ++j) blocks.push_back(&l);
    return blocks;
}

/// Where the preconditioner runs each block's work at this world size: the placement chain
/// it calls itself (kfac/assignment/placement_costs.hpp), with colocated factors.
template <class Assignment>
kfac::assignment::distribution_plan plan_of(const model& m, int world, kfac::distribution strategy,
                                            double grad_worker_fraction) {
    std::vector<kfac::layer_description> described;
    for (const auto& l : m.layers) described.push_back(l.description);
    return kfac::assignment::plan_distribution<Assignment>(kfac::assignment::placement_costs(described), world, strategy,
                                                           grad_worker_fraction, true);
}

}  // namespace kfac_bench
