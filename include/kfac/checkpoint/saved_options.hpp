// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file saved_options.hpp
/// The checks of the options a checkpoint records.
/// The options a checkpoint records (metadata `option.<name>`, as engine::configuration() names
/// them and save() writes them), checked by the rules the constructor applies to kfac::options
/// (validate(), kfac/options.hpp). A value no constructor accepts (damping = nan, factor_decay
/// = 7, averaging = "bogus") is no value save() writes: the file is corrupt, whether or not the
/// options are compared on load (load_options::allow_changed_options), since what it records is
/// what its data was computed with.
///
/// The texts: a number in exact decimal, "schedule" for a scheduled hyper-parameter, "none" for
/// no kl_clip, "true" or "false" for a flag, an enumerator's name, a 16-bit format's name for
/// factor_storage. A name this library does not know (an option of a later version) is left
/// alone: the options that shape the numbers are compared by name on load.

#include <charconv>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "kfac/config.hpp"
#include "kfac/options.hpp"
#include "kfac/precision.hpp"

namespace kfac::checkpoint {

namespace saved_option_detail {

/// The text as a double, or nothing when it is not one number ("nan" and "inf" are numbers).
[[nodiscard]] inline std::optional<double> number(std::string_view text) {
    double v = 0.0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
    return v;
}

/// The text as an integer, or nothing.
[[nodiscard]] inline std::optional<std::int64_t> integer(std::string_view text) {
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
    return v;
}

/// "" when `text` is one of `names`, else what it should have been.
[[nodiscard]] inline std::string one_of(std::string_view text, std::initializer_list<const char*> names) {
    std::string list;
    for (const char* n : names) {
        if (text == n) return {};
        list += list.empty() ? std::string("'") + n + "'" : std::string(", '") + n + "'";
    }
    return "it is none of " + list;
}

/// The constructor's check of an option, given an options object with the value set: its
/// message, or "" when validate() accepts it.
[[nodiscard]] inline std::string validated(const std::function<void(options&)>& set) {
    options o;
    set(o);
    try {
        validate(o);
    } catch (const error& e) {
        return e.message();
    }
    return {};
}

/// A number the constructor checks (through `set`), "schedule" when `schedules` allows it.
[[nodiscard]] inline std::string checked_number(std::string_view text, bool schedules,
                                                const std::function<void(options&, double)>& set) {
    if (schedules && text == "schedule") return {};
    const auto v = number(text);
    if (!v) return std::string("it is not a number") + (schedules ? " or 'schedule'" : "");
    return validated([&](options& o) { set(o, *v); });
}

[[nodiscard]] inline std::string checked_interval(std::string_view text, const std::function<void(options&, std::int64_t)>& set) {
    if (text == "schedule") return {};
    const auto v = integer(text);
    if (!v) return "it is not an integer or 'schedule'";
    return validated([&](options& o) { set(o, *v); });
}

}  // namespace saved_option_detail

/// What is wrong with option `name`'s recorded `text` (see the file comment), or "" when the
/// constructor would accept it or the name is not one this library records.
[[nodiscard]] inline std::string saved_option_fault(const std::string& name, const std::string& text) {
    using namespace saved_option_detail;
    const auto flag = [&] { return one_of(text, {"true", "false"}); };
    if (name == "damping") return checked_number(text, true, [](options& o, double v) { o.damping = v; });
    if (name == "factor_decay") return checked_number(text, true, [](options& o, double v) { o.factor_decay = v; });
    if (name == "lr") return checked_number(text, true, [](options& o, double v) { o.lr = v; });
    if (name == "loss_scale") return checked_number(text, true, [](options& o, double v) { o.loss_scale = v; });
    if (name == "kl_clip") {
        if (text == "none") return {};
        return checked_number(text, true, [](options& o, double v) { o.kl_clip = std::optional<double>(v); });
    }
    if (name == "factor_update_steps")
        return checked_interval(text, [](options& o, std::int64_t v) { o.factor_update_steps = v; });
    if (name == "inv_update_steps") return checked_interval(text, [](options& o, std::int64_t v) { o.inv_update_steps = v; });
    if (name == "accumulation_steps") {
        const auto v = integer(text);
        if (!v) return "it is not an integer";
        return validated([&](options& o) { o.accumulation_steps = *v; });
    }
    if (name == "eigenbasis_reuse_tolerance")
        return checked_number(text, false, [](options& o, double v) { o.eigenbasis_reuse_tolerance = v; });
    if (name == "grad_worker_fraction")
        return checked_number(text, false, [](options& o, double v) { o.grad_worker_fraction = v; });
    if (name == "allreduce_bucket_cap_mb")
        return checked_number(text, false, [](options& o, double v) { o.allreduce_bucket_cap_mb = v; });
    if (name == "compute_eigenvalue_outer_product" || name == "relative_damping" || name == "colocate_factors" ||
        name == "symmetry_aware" || name == "fp64_decompositions" || name == "overlap_factor_allreduce" ||
        name == "fp64_retry")
        return flag();
    // The enumerated options: the names configuration() records (detail::option_value_name).
    using detail::option_value_name;
    if (name == "conv_patches")
        return one_of(text, {option_value_name(conv_patch_mode::reference), option_value_name(conv_patch_mode::dilated)});
    if (name == "statistics")
        return one_of(text, {option_value_name(statistic_scale::reference), option_value_name(statistic_scale::per_example)});
    if (name == "averaging")
        return one_of(text,
                      {option_value_name(factor_averaging::reference), option_value_name(factor_averaging::bias_corrected)});
    if (name == "damping_mode")
        return one_of(text, {option_value_name(damping_form::reference), option_value_name(damping_form::factored)});
    if (name == "strategy")
        return one_of(text, {option_value_name(distribution::kaisa), option_value_name(distribution::dp_kfac)});
    if (name == "factor_storage") return one_of(text, {precision_name(precision::bf16), precision_name(precision::fp16)});
    return {};
}

}  // namespace kfac::checkpoint
