// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file digits_training.hpp
/// What the digits examples share besides the data and the model: the hyper-parameters (with
/// the values tuned on this problem), their command-line options, and K-FAC's options.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

#include "cli.hpp"
#include "digits_dataset.hpp"
#include "eigen_mlp.hpp"

namespace kfac_examples {

/// Hyper-parameters of a digits run. The defaults are the best of a small grid tried on this
/// data for each optimizer separately (examples/digits/README.md says how).
struct digits_settings {
    std::filesystem::path data;  ///< empty: digits::default_digits_path()
    std::uint32_t seed = 1;      ///< split, initial weights and batch order
    int epochs = 20;
    int batch = 32;
    std::vector<int> widths{digits::pixels, 128, 64, digits::classes};

    // Plain SGD with momentum.
    float lr = 0.2f;
    float momentum = 0.8f;

    // SGD with momentum on K-FAC preconditioned gradients.
    float kfac_lr = 0.03f;
    float kfac_momentum = 0.5f;
    double damping = 0.03;
    double kl_clip = 0.003;  ///< 0: no clipping
    double factor_decay = 0.95;
    int factor_update_steps = 1;
    int inv_update_steps = 10;
    int threads = 1;  ///< kfac's layer-level threads; 1 keeps the comparison on one core
};

inline constexpr const char* digits_settings_usage =
    "  --data PATH            digits.csv.gz (default: python3-sklearn's copy)\n"
    "  --seed N               data split, initial weights and batch order (default 1)\n"
    "  --epochs N             passes over the 1,438 training images (default 20)\n"
    "  --batch N              minibatch size (default 32)\n"
    "  --hidden A,B,...       hidden widths of the MLP (default 128,64)\n"
    "  --lr X, --momentum X   plain SGD's learning rate and momentum (default 0.2, 0.8)\n"
    "  --kfac-lr X            learning rate with K-FAC (default 0.03)\n"
    "  --kfac-momentum X      momentum with K-FAC (default 0.5)\n"
    "  --damping X            K-FAC damping (default 0.03)\n"
    "  --kl-clip X            K-FAC kl_clip, 0 for none (default 0.003)\n"
    "  --factor-decay X       running-average decay of the factors (default 0.95)\n"
    "  --factor-update-steps N, --inv-update-steps N   (default 1, 10)\n"
    "  --threads N            kfac's threads, 0 for all cores (default 1)\n";

/// Reads the options listed in digits_settings_usage.
inline digits_settings read_digits_settings(cli& args) {
    digits_settings s;
    if (auto d = args.text("data")) s.data = *d;
    s.seed = static_cast<std::uint32_t>(args.integer("seed", s.seed));
    s.epochs = static_cast<int>(args.integer("epochs", s.epochs));
    s.batch = static_cast<int>(args.integer("batch", s.batch));
    if (auto h = args.text("hidden")) {
        s.widths = {digits::pixels};
        std::size_t pos = 0;
        while (pos <= h->size()) {
            const std::size_t comma = std::min(h->find(',', pos), h->size());
            const std::string item = h->substr(pos, comma - pos);
            char* end = nullptr;
            const long w = std::strtol(item.c_str(), &end, 10);
            if (item.empty() || *end != '\0' || w <= 0 || w > 100000)
                throw cli_error("--hidden takes positive widths separated by commas, not '" + *h + "'");
            s.widths.push_back(static_cast<int>(w));
            pos = comma + 1;
        }
        s.widths.push_back(digits::classes);
    }
    s.lr = static_cast<float>(args.number("lr", s.lr));
    s.momentum = static_cast<float>(args.number("momentum", s.momentum));
    s.kfac_lr = static_cast<float>(args.number("kfac-lr", s.kfac_lr));
    s.kfac_momentum = static_cast<float>(args.number("kfac-momentum", s.kfac_momentum));
    s.damping = args.number("damping", s.damping);
    s.kl_clip = args.number("kl-clip", s.kl_clip);
    s.factor_decay = args.number("factor-decay", s.factor_decay);
    s.factor_update_steps = static_cast<int>(args.integer("factor-update-steps", s.factor_update_steps));
    s.inv_update_steps = static_cast<int>(args.integer("inv-update-steps", s.inv_update_steps));
    s.threads = static_cast<int>(args.integer("threads", s.threads));
    if (s.epochs < 1) throw cli_error("--epochs must be at least 1");
    if (s.batch < 1) throw cli_error("--batch must be at least 1");
    if (s.kl_clip < 0.0) throw cli_error("--kl-clip must be >= 0 (0: no clipping)");
    return s;
}

/// K-FAC's options for these settings (kfac validates them and names what is wrong).
inline kfac::options digits_kfac_options(const digits_settings& s) {
    kfac::options o;
    o.lr = s.kfac_lr;  // kl_clip's η must be the optimizer's learning rate
    o.damping = s.damping;
    if (s.kl_clip > 0.0) o.kl_clip = s.kl_clip;
    else o.kl_clip = std::optional<double>{};
    o.factor_decay = s.factor_decay;
    o.factor_update_steps = std::int64_t{s.factor_update_steps};
    o.inv_update_steps = std::int64_t{s.inv_update_steps};
    o.threads = s.threads;
    return o;
}

/// Registers every Linear layer of `model` as fc1, fc2, ...
template <class Preconditioner>
void register_mlp(Preconditioner& precond, mlp& model) {
    for (std::size_t i = 0; i < model.layers.size(); ++i)
        precond.register_layer("fc" + std::to_string(i + 1), model.layers[i].view);
}

/// 0, 1, ..., n − 1.
inline std::vector<std::size_t> iota_order(std::size_t n) {
    std::vector<std::size_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = i;
    return v;
}

}  // namespace kfac_examples
