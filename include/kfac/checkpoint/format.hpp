// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file format.hpp
/// What a checkpoint of the preconditioner holds, in a safetensors container
/// (kfac/checkpoint/safetensors.hpp), and the checks its header and metadata pass before
/// anything is loaded from it (the tensors' values: kfac/checkpoint/value_checks.hpp). The
/// preconditioner's save() and load() move the data; this header names it.
///
/// Tensors (C order, the scalar type of the preconditioner that wrote them, F32 or F64):
///   `<layer>.A`, `<layer>.G`            running factors (symmetric); BF16 or F16 when kept in
///        options.factor_storage, an F16 one scaled by 2^k with metadata `fp16_exponent.<tensor>`
///        = k (k ≠ 0)
///   `<layer>.<method tensor>`           second-order data in force, unless saved without it:
///        eigendecomposition: A.eigenvectors, A.eigenvalues, G.eigenvectors, G.eigenvalues and,
///        with compute_eigenvalue_outer_product, eigenvalue_product_inverse (A_dim × G_dim);
///        inverse: A.inverse, G.inverse (damped inverses)
/// Metadata (strings): see the key names below; `option.<name>` holds an option's value in
/// exact decimal, or `schedule` for a scheduled one (schedules are code: the host supplies
/// them again), `layer.<name>` the layer's signature. The `checksum` entry digests everything
/// else: every other metadata entry, the tensors' names, dtypes and shapes, and the data.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kfac/checkpoint/files.hpp"
#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/factor_storage.hpp"
#include "kfac/detail/number_conversion.hpp"
#include "kfac/precision.hpp"

namespace kfac::checkpoint {

///@{
/// Name in the `format` metadata entry, and the version this library writes and reads. A file
/// of a newer version is refused; older versions stay readable. Version 1 checksummed the
/// data alone, so a flipped bit in the metadata (the step count, a counter, the damping) went
/// unseen; version 2 checksums the whole archive and says so in `checksum_scope`.
inline constexpr const char* format_name = "kfac.preconditioner";
inline constexpr int format_version = 2;
///@}

/// The value of `checksum_scope` in files of version 2: what the checksum digests.
inline constexpr const char* checksum_scope_all = "metadata+data";

/// What save() writes.
struct save_options {
    /// Second-order data in force (eigendecompositions or inverses). Without it the file holds
    /// only the factors (about half the size for the inverse method, a third for the
    /// eigendecomposition) and load() recomputes the data from the saved factors with the
    /// recorded damping; the steps until the next inverse update then differ from the
    /// uninterrupted run (the factors moved since the data was computed), by as much as
    /// kfac-pytorch's resume does.
    bool second_order = true;
};

/// What load() accepts.
struct load_options {
    /// By default the options that shape the numbers (damping, factor_decay, lr, kl_clip, the
    /// intervals, accumulation_steps, conv_patches, compute_eigenvalue_outer_product, the curvature
    /// modes statistics, averaging, damping_mode and relative_damping) must be
    /// the file's; true resumes with changed ones. Distribution options (strategy,
    /// grad_worker_fraction, colocate_factors, world size) may always differ.
    bool allow_changed_options = false;
    /// Ignore the file's second-order data and recompute it from the factors (as a file saved
    /// without it does); also the way to load a file of the other compute method.
    bool recompute_second_order = false;
};

/// Metadata keys.
namespace key {
inline constexpr const char* format = "format";            ///< format_name
inline constexpr const char* version = "format_version";   ///< format_version
inline constexpr const char* library = "library_version";  ///< the version of the kfac that wrote it
inline constexpr const char* step = "step";                ///< completed step() calls
inline constexpr const char* checksum = "checksum";        ///< digest64 in hex (expected_checksum())
inline constexpr const char* checksum_scope = "checksum_scope";  ///< from format version 2
inline constexpr const char* scalar = "scalar";          ///< "float" or "double": the tensors' type
inline constexpr const char* method = "compute_method";  ///< the compute method's name
inline constexpr const char* second_order = "second_order";  ///< "included", "omitted" or "none yet"
inline constexpr const char* damping = "second_order_damping";  ///< γ of the last inverse update
inline constexpr const char* layers = "layers";              ///< how many
inline constexpr const char* world_size = "saved_world_size";  ///< of the run that saved (information only)
inline constexpr const char* strategy = "saved_strategy";       ///< its distribution (information only)
inline const std::string layer_prefix = "layer.";  ///< + a layer's name: its signature (layer_signature())
inline const std::string damping_prefix = "damping.";  ///< reserved: no file holds per-layer damping
inline const std::string option_prefix = "option.";  ///< + an option's name: its value (saved_options.hpp)
inline const std::string health_prefix = "health.";  ///< + a counter's name: its count (kfac/health.hpp)
/// Prefix of a layer's W. `statistics_weight.<layer>`: W of the layer's running factors (kfac/detail/layer_record.hpp),
/// in exact decimal; absent in files written before it was recorded (W unknown).
inline const std::string statistics_weight_prefix = "statistics_weight.";
}  // namespace key

/// This library's version, "major.minor.patch", as checkpoints record it.
[[nodiscard]] inline std::string library_version() {
    return std::to_string(KFAC_VERSION_MAJOR) + "." + std::to_string(KFAC_VERSION_MINOR) + "." +
           std::to_string(KFAC_VERSION_PATCH);
}

/// Options whose change makes a resumed run differ from the uninterrupted one.
[[nodiscard]] inline bool shapes_the_numbers(const std::string& option) {
    static const char* const names[] = {"damping", "factor_decay", "lr", "kl_clip", "factor_update_steps",
                                        "inv_update_steps", "accumulation_steps", "conv_patches",
                                        "compute_eigenvalue_outer_product", "eigenbasis_reuse_tolerance",
                                        "statistics", "averaging", "damping_mode", "relative_damping",
                                        "fp64_decompositions"};
    for (const char* n : names)
        if (option == n) return true;
    return false;
}

/// What a file written before an option existed implicitly saved it as: the value that
/// reproduces that library's behaviour (empty: the option is as old as the format).
[[nodiscard]] inline std::string value_before_option_existed(const std::string& option) {
    if (option == "eigenbasis_reuse_tolerance") return "0";  // exact decompositions
    // The curvature modes: kfac-pytorch's statistics, averaging and damping.
    if (option == "statistics" || option == "averaging" || option == "damping_mode") return "reference";
    if (option == "relative_damping" || option == "fp64_decompositions") return "false";
    return {};
}

/// The container-level facts of a checkpoint, checked: ours, not newer than this library,
/// intact (checksum), with a valid step count, second-order state and damping.
struct header {
    int version = 0;        ///< the format version
    std::int64_t step = 0;  ///< completed step() calls
    double damping = 0.0;  ///< γ of the second-order data (0 before the first step)
    ///@{
    /// The metadata entries key::scalar, key::method, key::second_order and key::library.
    std::string scalar, method, second_order, library;
    ///@}
};

/// Whether `a` is checksummed whole (format version 2 on). A file that carries the scope
/// entry, or claims any version but 1, is verified that way whatever else its metadata says,
/// so no single flipped bit makes a version-2 file be verified the old way.
[[nodiscard]] inline bool checksums_metadata(const archive& a) {
    if (a.metadata.count(key::checksum_scope) != 0) return true;
    const auto version = a.metadata.find(key::version);
    return version == a.metadata.end() || version->second != "1";
}

/// The checksum `a` must record, in the scope it declares.
[[nodiscard]] inline std::string expected_checksum(const archive& a) {
    return hex64(checksums_metadata(a) ? archive_checksum(a, key::checksum) : data_checksum(a.tensors));
}

/// Records the checksum of `a` (after every other metadata entry is set: it digests them).
inline void seal(archive& a) { a.metadata[key::checksum] = expected_checksum(a); }

/// A metadata entry's text. @throws kfac::error naming the source and the key.
[[nodiscard]] inline const std::string& metadata_text(const archive& a, const std::string& k, const std::string& source) {
    const auto it = a.metadata.find(k);
    if (it == a.metadata.end())
        throw error("checkpoint " + source + ": the metadata entry '" + k + "' is missing; it is not a complete " +
                    format_name + " checkpoint (was it written by kfac's save()?)");
    return it->second;
}

/// A metadata entry that must be a non-negative integer.
[[nodiscard]] inline std::int64_t metadata_count(const archive& a, const std::string& k, const std::string& source) {
    const std::string& text = metadata_text(a, k, source);
    std::size_t used = 0;
    long long v = -1;
    try {
        v = std::stoll(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || text.empty() || v < 0)
        throw error("checkpoint " + source + ": metadata '" + k + "' = '" + text +
                    "' is not a non-negative integer (the file is corrupt)");
    return static_cast<std::int64_t>(v);
}

/// A metadata entry that must be a number (exact decimal, as save() writes it).
[[nodiscard]] inline double metadata_number(const archive& a, const std::string& k, const std::string& source) {
    const std::string& text = metadata_text(a, k, source);
    std::size_t used = 0;
    double v = 0.0;
    try {
        v = std::stod(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used != text.size() || text.empty())
        throw error("checkpoint " + source + ": metadata '" + k + "' = '" + text + "' is not a number (the file is corrupt)");
    return v;
}

/// The damping the file's second-order data was computed with: finite and > 0, as
/// options.damping must be; 0 before the first step (no data yet, nothing was computed).
[[nodiscard]] inline double metadata_damping(const archive& a, const std::string& source, std::int64_t step) {
    const double v = metadata_number(a, key::damping, source);
    const bool valid = std::isfinite(v) && (step == 0 ? v >= 0.0 : v > 0.0);
    if (!valid)
        throw error("checkpoint " + source + ": metadata '" + key::damping + "' = '" + metadata_text(a, key::damping, source) +
                    "' is invalid: the damping of second-order data must be finite and > 0, as options.damping must be" +
                    (step == 0 ? " (or 0 before the first step)" : "") + "; the file is corrupt (use an earlier checkpoint)");
    return v;
}

/// @throws kfac::error naming `source`, what was expected and found, and the fix.
[[nodiscard]] inline header check_header(const archive& a, const std::string& source) {
    auto meta = [&](const char* k) -> const std::string& { return metadata_text(a, k, source); };
    if (meta(key::format) != format_name)
        throw error("checkpoint " + source + ": its format is '" + meta(key::format) + "', not " + format_name);
    auto integer = [&](const char* k) { return metadata_count(a, k, source); };
    header h;
    h.library = meta(key::library);
    const auto version = integer(key::version);
    if (version > format_version)
        throw error("checkpoint " + source + ": format version " + std::to_string(version) + " (written by kfac " +
                    h.library + ") is newer than the version " + std::to_string(format_version) + " this kfac (" +
                    library_version() + ") reads; load it with kfac " + h.library + " or later");
    h.version = static_cast<int>(version);
    const std::string recorded = meta(key::checksum);
    const bool whole = checksums_metadata(a);
    const std::string actual = expected_checksum(a);
    if (recorded != actual)
        throw error("checkpoint " + source + ": the checksum of its " + (whole ? "metadata, header and data" : "data") +
                    " is " + actual + ", the file records " + recorded +
                    "; the file was corrupted after it was written (copy it again, or use an earlier checkpoint)");
    // Vouched for by the checksum from here on (version 2), or as trusted as version 1 was.
    if (whole && meta(key::checksum_scope) != checksum_scope_all)
        throw error("checkpoint " + source + ": metadata '" + key::checksum_scope + "' = '" + meta(key::checksum_scope) +
                    "', but this kfac (" + library_version() + ") knows only '" + checksum_scope_all +
                    "'; the file was not written by kfac's save()");
    h.step = integer(key::step);
    if (h.step == std::numeric_limits<std::int64_t>::max())
        throw error("checkpoint " + source + ": metadata '" + key::step + "' = '" + std::to_string(h.step) +
                    "' is a count step() cannot advance (the largest a std::int64_t holds); the file is corrupt (use "
                    "an earlier checkpoint)");
    h.scalar = meta(key::scalar);
    if (h.scalar != "float" && h.scalar != "double")
        throw error("checkpoint " + source + ": metadata '" + key::scalar + "' = '" + h.scalar +
                    "' is neither float nor double, the scalar types save() records; the file is corrupt (use an "
                    "earlier checkpoint)");
    h.method = meta(key::method);
    h.second_order = meta(key::second_order);
    if (h.second_order != "included" && h.second_order != "omitted" && h.second_order != "none yet")
        throw error("checkpoint " + source + ": metadata '" + key::second_order + "' = '" + h.second_order +
                    "' is none of included, omitted, none yet (the file is corrupt)");
    if ((h.step == 0) != (h.second_order == "none yet"))
        throw error("checkpoint " + source + ": metadata '" + key::step + "' = '" + std::to_string(h.step) + "' and '" +
                    key::second_order + "' = '" + h.second_order + "' disagree (save() writes 'none yet' exactly at "
                    "step 0); the file is corrupt (use an earlier checkpoint)");
    h.damping = metadata_damping(a, source, h.step);
    return h;
}

/// The shape a tensor of `rows` × `cols` has in a checkpoint.
[[nodiscard]] inline std::vector<std::int64_t> stored_shape(std::int64_t rows, std::int64_t cols, int tensor_rank) {
    return tensor_rank == 1 ? std::vector<std::int64_t>{rows * cols} : std::vector<std::int64_t>{rows, cols};
}

/// A host matrix (column-major, Eigen-like: rows(), cols(), operator()(i, j)) as a C-order
/// tensor of shape {rows, cols}, or {rows} for a vector (tensor_rank 1).
template <class Scalar, class HostMatrix>
[[nodiscard]] tensor to_tensor(std::string name, const HostMatrix& m, int tensor_rank) {
    const auto rows = static_cast<std::int64_t>(m.rows()), cols = static_cast<std::int64_t>(m.cols());
    std::vector<Scalar> values(static_cast<std::size_t>(rows * cols));
    for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) values[static_cast<std::size_t>(i * cols + j)] = m(i, j);
    return tensor::from(std::move(name), values.data(), stored_shape(rows, cols, tensor_rank));
}

/// A float or double tensor of a stored factor's values (options.factor_storage) in the 16-bit
/// format that holds them exactly: `format` (F16 at the power-of-two scale of
/// kfac/detail/factor_storage.hpp, recorded in tensor::exponent), else BF16 (a factor fp16
/// storage kept in bf16), else unchanged. Values that came from factor storage are always held
/// by one of the two, so the file records the stored factors bit for bit.
[[nodiscard]] inline tensor to_packed_tensor(const tensor& t, precision format) {
    const std::vector<double> values = t.values<double>();
    const auto n = static_cast<std::int64_t>(values.size());
    for (const precision f : {format, precision::bf16}) {
        const detail::packed_factor p = detail::pack_values(values, n, 1, f);
        if (detail::packed_values(p) != values) continue;
        tensor out{t.name, f == precision::bf16 ? dtype::bf16 : dtype::f16, t.shape, {}};
        out.exponent = p.exponent;
        out.bytes.resize(p.bits.size() * sizeof(std::uint16_t));
        if (!out.bytes.empty()) std::memcpy(out.bytes.data(), p.bits.data(), out.bytes.size());
        return out;
    }
    return t;
}

/// A C-order tensor into a column-major host matrix of `rows` × `cols` (float ↔ double
/// converts: widening is exact, narrowing rounds to nearest).
template <class Scalar, class HostMatrix>
void from_tensor(const tensor& t, HostMatrix& m) {
    const auto values = t.values<Scalar>();
    const auto rows = static_cast<std::int64_t>(m.rows()), cols = static_cast<std::int64_t>(m.cols());
    for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) m(i, j) = values[static_cast<std::size_t>(i * cols + j)];
}

}  // namespace kfac::checkpoint
