// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file options.hpp
/// Run-time hyper-parameters of the preconditioner. Each numeric one is a value or a
/// schedule: a function of the step number k (the count of completed step() calls),
/// evaluated when it is read, exactly as kfac-pytorch evaluates its callables.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kfac/config.hpp"
#include "kfac/precision.hpp"

namespace kfac {

/// A hyper-parameter given as a constant or as a function of the step number.
/// @tparam T the value type (double, std::int64_t, or std::optional<double> for kl_clip).
template <class T>
class hyperparameter {
public:
    /// A schedule: the value as a function of the step number k (0 at the first step()).
    using schedule_type = std::function<T(std::int64_t)>;

    hyperparameter() = default;

    /// A constant: `value` at every step. Implicit, so that `opts.damping = 0.003;` reads as
    /// written.
    template <class U>
        requires std::convertible_to<U, T> && (!std::is_invocable_v<U, std::int64_t>)
    hyperparameter(U value) : value_(T(std::move(value))) {}  // NOLINT: implicit by design

    /// A schedule: `schedule(k)`, converted to T, at step k. Implicit, so that a lambda can be
    /// assigned.
    template <class F>
        requires std::is_invocable_v<F, std::int64_t> &&
                 std::convertible_to<std::invoke_result_t<F, std::int64_t>, T>
    hyperparameter(F schedule)  // NOLINT: implicit by design
        : value_(schedule_type([f = std::move(schedule)](std::int64_t k) { return T(f(k)); })) {}

    /// The value at step k.
    [[nodiscard]] T operator()(std::int64_t k) const {
        if (const T* v = std::get_if<T>(&value_)) return *v;
        return std::get<schedule_type>(value_)(k);
    }

    /// Whether it was given as a schedule rather than a constant.
    [[nodiscard]] bool is_schedule() const noexcept { return value_.index() == 1; }

private:
    std::variant<T, schedule_type> value_{T{}};
};

/// How a dilated convolution's input patches are extracted for the A factor.
enum class conv_patch_mode {
    /// kfac-pytorch's behaviour: dilation is ignored, patches are contiguous k_h × k_w
    /// windows (golden/README.md §4.2). The default, so results match the reference.
    reference,
    /// The patches the convolution really multiplies with its kernel (dilation honoured),
    /// so A and G are built over the same spatial positions. Correct; differs from the
    /// reference only for layers with dilation ≠ 1.
    dilated,
};

/// How second-order work and state are distributed when the CommPolicy has several ranks.
enum class distribution {
    /// KAISA (Pauloski et al., SC'20/'21): factors are averaged over all ranks; each layer's
    /// second-order data is computed on its assigned rank(s) and shared within a column of
    /// the grid set by grad_worker_fraction; preconditioned gradients travel along rows.
    kaisa,
    /// DP-KFAC (Zhang et al., IEEE TCC 2022): each layer has one owner that builds the
    /// layer's factors from its *own* local batch only (no factor communication), computes
    /// the second-order data, preconditions the averaged gradient and broadcasts the result.
    /// The preconditioner therefore depends on which data shard the owner saw.
    dp_kfac,
};

/// How a pass's batch statistics are scaled (docs/curvature-modes.md).
enum class statistic_scale {
    /// kfac-pytorch's: A and G are means over the statistic's rows of the activations' and of
    /// the output gradients' outer products, a convolution's patches and output gradients
    /// each divided by its S positions first (A and G carry 1/(N·S³)). The default.
    reference,
    /// Factors of the Fisher of the per-example loss, for a host loss that is the mean over
    /// the N examples of the batch (each view's dimension 0): Martens & Grosse 2015 for dense
    /// layers (A = E[a aᵀ], G = E[Ds Dsᵀ], Ds = N·g the example's own loss gradient), Grosse &
    /// Martens 2016 (KFC) for layers shared over S positions (A summed over an example's
    /// positions, G averaged over them): A = (1/N) Σ_n Σ_s a aᵀ, G = (1/(N·S)) Σ_n Σ_s Ds Dsᵀ.
    /// Independent of the batch size and of S³. kfac/detail/statistic_scale.hpp.
    per_example,
};

/// How the running factors average the statistics of the factor updates.
enum class factor_averaging {
    /// kfac-pytorch's: F ← ξF + (1 − ξ)F̂ from F = I, so the identity keeps the weight
    /// Π ξ of the decays applied so far. The default.
    reference,
    /// kfac-jax's weighted moving average: F = R/W with R ← ξR + (1 − ξ)F̂ and W ← ξW + (1 − ξ)
    /// from R = 0, W = 0. No identity residue: the first update makes F = F̂, and every later F
    /// is an average of statistics whose weights sum to 1.
    bias_corrected,
};

/// How the damping γ enters the preconditioner.
enum class damping_form {
    /// kfac-pytorch's: eigen method 1/(λ_A λ_G + γ); inverse method (A + γI)⁻¹ ⊗ (G + γI)⁻¹.
    /// The default.
    reference,
    /// Factored Tikhonov damping (Martens & Grosse 2015, §6.3), both methods: A + π√γ·I and
    /// G + (√γ/π)·I with π = √((tr A / dim A) / (tr G / dim G)), so that the damped product
    /// is (λ_A + π√γ)(λ_G + √γ/π). A block with one estimated factor (unit-wise) takes γ whole.
    factored,
};

/// What the preconditioner reports when it meets NaN or ±Inf (see preconditioner::health), or
/// a value it would otherwise lose: `gradient` also when the preconditioned gradient is finite
/// but beyond its view's format; `factor_storage` when fp16 factor storage would have flushed a
/// variance of a factor, which is then kept in bf16 (docs/precision.md).
enum class non_finite_source {
    factor_statistics,  ///< a layer's batch statistic (not folded into its running factors)
    decomposition,      ///< an eigendecomposition or inverse (retried in double, else the last kept)
    gradient,           ///< a preconditioned gradient, non-finite or beyond its view's format
    factor_storage,     ///< fp16 storage would have flushed a variance (stored in bf16 instead)
};

/// Run-time options. Defaults are kfac-pytorch's (KFACPreconditioner) defaults.
struct options {
    /// Tikhonov damping γ (> 0). Eigen method: added to the product of eigenvalues;
    /// inverse method: added to each factor.
    hyperparameter<double> damping{0.001};
    /// Running-average decay ξ in [0, 1): F ← ξ F + (1 − ξ) F̂. Factors start at I.
    hyperparameter<double> factor_decay{0.95};
    /// KL clip κ (> 0), or std::nullopt for no clipping.
    hyperparameter<std::optional<double>> kl_clip{std::optional<double>(0.001)};
    /// Learning rate η (≥ 0); used only by kl_clip (ν = min(1, sqrt(κ / (η² Σ P·Γ)))).
    hyperparameter<double> lr{0.1};
    /// Factors are updated on steps k with k % factor_update_steps == 0 (> 0).
    hyperparameter<std::int64_t> factor_update_steps{std::int64_t{1}};
    /// Second-order data is recomputed on steps k with k % inv_update_steps == 0 (> 0).
    /// Need not be a multiple of factor_update_steps.
    hyperparameter<std::int64_t> inv_update_steps{std::int64_t{1}};
    /// Forward/backward passes per step(): accumulate() after each of the first
    /// accumulation_steps − 1 passes, then step(). The batch statistic is their mean.
    std::int64_t accumulation_steps = 1;
    /// Eigen method: precompute D = 1/(λ_G λ_Aᵀ + γ) on inverse-update steps (with that
    /// step's γ) instead of dividing at every step.
    bool compute_eigenvalue_outer_product = true;
    /// Eigen method, opt-in approximation (0, the default, is off: every inverse update
    /// decomposes exactly, as kfac-pytorch does). With τ in (0, 1), an inverse update keeps a
    /// dense factor F's eigenvectors Q from its previous decomposition while they still
    /// diagonalise F to within τ,
    ///   ‖F Q − Q Λ‖_F ≤ τ ‖F‖_F,  Λ = diag(Qᵀ F Q) (the Rayleigh quotients),
    /// and takes Λ (clamped at 0) as F's eigenvalues: one matrix product instead of an
    /// eigendecomposition (about a fifth of its time at n ≥ 1024 on a CPU). The factor the
    /// step preconditions with is then Q Λ Qᵀ, which differs from F by the off-diagonal part of
    /// Qᵀ F Q: at most τ ‖F‖_F in Frobenius norm. Otherwise F is decomposed exactly and its new
    /// eigenvectors are the next reference. The decision depends only on F and Q, which a
    /// checkpoint holds, so a resume takes the same decisions. Typical τ: 0.01 to 0.1
    /// (docs/performance.md, "Approximate eigenbasis refresh"). Backends without it refuse τ > 0.
    double eigenbasis_reuse_tolerance = 0.0;
    /// ECMAScript regular expressions; a layer is not registered when one of them is found
    /// (std::regex_search, case-sensitive) in its name or its kind ("linear", "Linear",
    /// "conv2d", "Conv2d", "conv1d", "Conv1d").
    std::vector<std::string> skip_layers{};
    /// ECMAScript regular expressions; a layer whose name one of them is found in is
    /// registered with weight_sharing::reduce (kfac/layers/layer_description.hpp) whatever its
    /// adapter's description says: the per-layer choice for adapters that describe layers
    /// themselves (kfac::torch). Every other layer keeps its description's (expand by default).
    std::vector<std::string> reduce_layers{};
    /// Patch extraction for dilated convolutions.
    conv_patch_mode conv_patches = conv_patch_mode::reference;

    // Curvature modes (docs/curvature-modes.md): each opt-in; the defaults are kfac-pytorch's.
    /// The scale of the batch statistics: the reference's, or the per-example Fisher's.
    statistic_scale statistics = statistic_scale::reference;
    /// The running average: the reference's (from the identity) or bias-corrected.
    factor_averaging averaging = factor_averaging::reference;
    /// How γ is applied: the reference's or factored (π) Tikhonov damping.
    damping_form damping_mode = damping_form::reference;
    /// γ relative to each layer's curvature: the damping applied is γ·m_A·m_G, m the mean
    /// eigenvalue (trace / dimension) of each running factor at the inverse update (m_G = 1 for
    /// a unit-wise block), so that one γ is the same fraction of every layer's mean curvature
    /// in every model. A layer whose m_A·m_G is not positive takes γ itself. With the eigen
    /// method, relative or factored damping needs compute_eigenvalue_outer_product (the
    /// per-layer damping is fixed at the inverse update).
    bool relative_damping = false;
    /// Threads for layer-level task parallelism; 0: KFAC_NUM_THREADS, OPENBLAS_NUM_THREADS or
    /// OMP_NUM_THREADS from the environment, else all cores (1 per rank with several ranks).
    int threads = 0;

    // Distribution; without effect in a single process.
    /// How second-order work and state are distributed over the ranks: KAISA or DP-KFAC.
    distribution strategy = distribution::kaisa;
    /// KAISA's gradient-worker fraction f in [0, 1]: kfac::comm_opt (1), kfac::hybrid_opt
    /// (0.5), kfac::mem_opt (0, meaning 1/W), or any f with W·f a divisor of W.
    double grad_worker_fraction = 1.0;
    /// Compute a layer's A and G second-order data on the same rank. Required by MEM_OPT and
    /// by compute_eigenvalue_outer_product with the eigendecomposition method.
    bool colocate_factors = true;
    /// Cap of one factor-allreduce bucket in MiB (2²⁰ bytes); 0 sends each factor alone.
    double allreduce_bucket_cap_mb = 25.0;
    /// Send only the lower triangle, n(n+1)/2 values, of each symmetric factor.
    bool symmetry_aware = false;
    /// Overlap the broadcasts of second-order data with preconditioning: a rank preconditions
    /// the layers whose second-order data it already holds while the broadcasts travel, and
    /// waits for them only before the layers that receive. The same collectives in the same
    /// order and the same arithmetic either way (the results are bitwise equal); false waits
    /// for every broadcast first, the schedule before it existed. Ranks may differ in it.
    bool overlap_communication = true;
    /// Overlap the factor allreduce with the work around it (KAISA with several ranks): each
    /// bucket starts as soon as its layers' statistics are computed, while the later layers'
    /// are (a policy with start_allreduce, kfac::comm::mpi; the others start it after the
    /// last), and the buckets complete one by one, each layer averaged, and on an
    /// inverse-update step decomposed, as soon as its statistics have landed, while the later
    /// buckets travel. One more collective per factor update (the rows' sums, first), so every
    /// rank must set it alike (it is part of the configuration agreement). The same buckets and
    /// arithmetic as without it: the same numbers while a layer's rows summed over the ranks
    /// stay below 2²⁴ in float (2⁵³ in double) and BLAS runs one thread per rank (the default
    /// with several ranks; docs/distribution.md, "Overlap"). A device backend that stages its collectives
    /// through the host completes the allreduce whole, as without it.
    bool overlap_factor_allreduce = false;

    // Mixed precision (docs/precision.md).
    /// The loss scale s of mixed-precision training (> 0, finite): the host back-propagates
    /// s·L, so its output gradients are s times the true ones, and the G statistics (a
    /// normalisation layer's statistic) are divided by s², as kfac-pytorch divides the output
    /// gradients by its GradScaler's scale. A schedule is read at every accumulate() and step():
    /// `[&](std::int64_t) { return scaler.scale(); }` follows a dynamic scaler. With a loss scale
    /// (a schedule, or a constant other than 1), a step whose gradients or statistics hold an
    /// inf or a NaN on any rank (the scale was too large, and the scaler will skip the step) is
    /// skipped whole: step() returns step_result::skipped, and nothing changes but
    /// health().skipped_steps (docs/precision.md). Call the scaler's unscale before step():
    /// the weight gradients must be the true ones.
    hyperparameter<double> loss_scale{1.0};
    /// Decompose (eigendecomposition or damped inverse) every dense factor in double, and
    /// round the result to the backend's type: kronfluence's default, for a float backend whose
    /// factors are ill-conditioned. Costs a double decomposition per factor
    /// (docs/precision.md); a double backend already does this.
    bool fp64_decompositions = false;
    /// A float backend's decomposition that fails or returns non-finite values is retried once
    /// in double (Distributed Shampoo's rule), counted in health().fp64_retries; only if the retry
    /// fails too is the previous decomposition kept (docs/troubleshooting.md, "Non-finite values"). It changes
    /// nothing for a decomposition that succeeds.
    bool fp64_retry = true;
    /// Storage of the running factors between steps: precision::bf16 or precision::fp16 (half
    /// the bytes of float), or unset for the backend's type. Each stored factor is rounded once
    /// (fp16 at a power-of-two scale that fits its range) and widened exactly for each use;
    /// checkpoints record it in that dtype (docs/precision.md).
    std::optional<precision> factor_storage{};
};

/// Whether options.loss_scale is in use (a schedule, or a constant other than 1).
[[nodiscard]] inline bool loss_scaling(const options& o) { return o.loss_scale.is_schedule() || o.loss_scale(0) != 1.0; }

namespace detail {

/// A number as a person reads it in a message: 6 significant digits, 1e-50 stays 1e-50
/// (std::to_string would print 0.000000).
inline std::string number_text(double v) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.6g", v);
    return buffer;
}

/// How a message names an option's value: "options.lr = 0.1" for a constant,
/// "options.lr evaluated to 0.1 at step 3" for a schedule.
inline std::string option_text(const char* name, const std::string& value, std::optional<std::int64_t> step) {
    std::string s = std::string("options.") + name;
    if (!step) return s + " = " + value;
    return s + " evaluated to " + value + " at step " + std::to_string(*step);
}

/// The names of the enumerated options' values, as configurations and checkpoints record them
/// (kfac/checkpoint/saved_options.hpp checks a file's against them).
inline const char* option_value_name(conv_patch_mode m) {
    return m == conv_patch_mode::dilated ? "dilated" : "reference";
}
inline const char* option_value_name(distribution d) { return d == distribution::dp_kfac ? "dp_kfac" : "kaisa"; }
inline const char* option_value_name(statistic_scale s) {
    return s == statistic_scale::per_example ? "per_example" : "reference";
}
inline const char* option_value_name(factor_averaging a) {
    return a == factor_averaging::bias_corrected ? "bias_corrected" : "reference";
}
inline const char* option_value_name(damping_form f) { return f == damping_form::factored ? "factored" : "reference"; }

inline void require(bool ok, const std::string& message) {
    if (!ok) throw error(message);
}

// The checks of each hyper-parameter, shared by validate() (constants, at construction) and
// the step plan (schedules, when read). `step` is the step a schedule was read at.

inline void check_damping(double d, std::optional<std::int64_t> step = std::nullopt) {
    require(std::isfinite(d) && d > 0.0, option_text("damping", number_text(d), step) +
                                             " is invalid: damping must be finite and > 0 (try 0.001)");
}

/// The preconditioner divides by the damping in the factors' precision (1/(λ_G·λ_A + γ) for
/// a zero eigenvalue, (F + γI)⁻¹ for a singular factor), so 1/γ must be finite there: a γ
/// that underflows (1e-50 in float) would turn every gradient into 0 or Inf.
/// Symmetrically, 1/γ must be a normal number there: a γ above 1/(smallest normal)
/// (8.5e37 in float; FLT_MAX, or a double beyond it that rounds to Inf) would turn every
/// preconditioned gradient into 0.
template <class Scalar>
void check_damping_representable(double d, std::optional<std::int64_t> step = std::nullopt) {
    const auto s = static_cast<Scalar>(d);
    const char* type = sizeof(Scalar) == sizeof(float) ? "float" : "double";
    if (std::isfinite(s) && s > Scalar(0) && std::isfinite(Scalar(1) / s) &&
        Scalar(1) / s >= std::numeric_limits<Scalar>::min())
        return;
    if (!(s > Scalar(0)) || !std::isfinite(Scalar(1) / s))
        throw error(option_text("damping", number_text(d), step) + " is too small for " + type +
                    ": the preconditioner divides by the damping, so 1/damping must be finite in " + type +
                    " (damping >= " + number_text(1.0 / static_cast<double>(std::numeric_limits<Scalar>::max())) +
                    "); use a larger damping (typical values are 1e-4 to 1e-1)");
    throw error(option_text("damping", number_text(d), step) + " is too large for " + type +
                ": the preconditioner divides by the damping, so 1/damping must be a normal " + type +
                " (damping <= " + number_text(1.0 / static_cast<double>(std::numeric_limits<Scalar>::min())) +
                "), or every preconditioned gradient would be 0; use a smaller damping (typical values are 1e-4 "
                "to 1e-1)");
}

inline void check_factor_decay(double d, std::optional<std::int64_t> step = std::nullopt) {
    require(d >= 0.0 && d < 1.0, option_text("factor_decay", number_text(d), step) +
                                     " is invalid: it must lie in [0, 1) (try 0.95)");
}

inline void check_kl_clip(const std::optional<double>& c, std::optional<std::int64_t> step = std::nullopt) {
    require(!c || (std::isfinite(*c) && *c > 0.0),
            option_text("kl_clip", c ? number_text(*c) : std::string("nullopt"), step) +
                " is invalid: it must be finite and > 0, or std::nullopt for no clipping");
}

inline void check_lr(double lr, std::optional<std::int64_t> step = std::nullopt) {
    require(std::isfinite(lr) && lr >= 0.0,
            option_text("lr", number_text(lr), step) + " is invalid: it must be finite and >= 0");
}

inline void check_loss_scale(double s, std::optional<std::int64_t> step = std::nullopt) {
    require(std::isfinite(s) && s > 0.0,
            option_text("loss_scale", number_text(s), step) + " is invalid: it must be finite and > 0 (1: no loss scaling)");
}

/// The G statistics are divided by s² in the compute type (kfac/detail/statistic_scale.hpp), so
/// s² and 1/s² must both be normal numbers there: a scale whose square underflows (1e-30 in
/// float) would overflow every statistic and skip every factor update, one whose square
/// overflows (2^64 in float) would turn them into 0. For float that is 2^-63 <= s <= 2^63, for
/// double 2^-511 <= s <= 2^511. The constructor checks a constant, step() a schedule's values.
template <class Scalar>
void check_loss_scale_representable(double s, std::optional<std::int64_t> step = std::nullopt) {
    const double square = s * s;
    const auto smallest = static_cast<double>(std::numeric_limits<Scalar>::min());
    const auto largest = static_cast<double>(std::numeric_limits<Scalar>::max());
    if (square >= smallest && square <= largest && 1.0 / square >= smallest && 1.0 / square <= largest) return;
    const double low = std::sqrt(std::max(smallest, 1.0 / largest)), high = std::sqrt(std::min(largest, 1.0 / smallest));
    const char* type = sizeof(Scalar) == sizeof(float) ? "float" : "double";
    throw error(option_text("loss_scale", number_text(s), step) + " is out of the compute type's range: s² and 1/s² " +
                "must be normal numbers of " + type + " (" + number_text(low) + " <= s <= " + number_text(high) +
                "), since the G statistics are divided by s²; " +
                (s < 1.0 ? "a scale this small means the loss underflows, so set a floor on the scaler's scale"
                         : "a scaler's scale this large means its steps keep succeeding without overflow, so cap "
                           "its growth"));
}

inline void check_interval(const char* name, std::int64_t v, std::optional<std::int64_t> step = std::nullopt) {
    require(v > 0, option_text(name, std::to_string(v), step) + " is invalid: it must be a positive number of steps");
}

}  // namespace detail

/// Checks the constant options (schedules are checked at each step when read).
/// @throws kfac::error naming the option, the value and the valid range.
inline void validate(const options& o) {
    using detail::require;
    constexpr std::int64_t k0 = 0;
    if (!o.damping.is_schedule()) detail::check_damping(o.damping(k0));
    if (!o.factor_decay.is_schedule()) detail::check_factor_decay(o.factor_decay(k0));
    if (!o.kl_clip.is_schedule()) detail::check_kl_clip(o.kl_clip(k0));
    if (!o.lr.is_schedule()) detail::check_lr(o.lr(k0));
    if (!o.factor_update_steps.is_schedule()) detail::check_interval("factor_update_steps", o.factor_update_steps(k0));
    if (!o.inv_update_steps.is_schedule()) detail::check_interval("inv_update_steps", o.inv_update_steps(k0));
    if (!o.loss_scale.is_schedule()) detail::check_loss_scale(o.loss_scale(k0));
    require(o.accumulation_steps > 0, "options.accumulation_steps = " +
                                          std::to_string(o.accumulation_steps) +
                                          " is invalid: it must be >= 1");
    require(o.eigenbasis_reuse_tolerance >= 0.0 && o.eigenbasis_reuse_tolerance < 1.0,
            "options.eigenbasis_reuse_tolerance = " + detail::number_text(o.eigenbasis_reuse_tolerance) +
                " is invalid: it must lie in [0, 1) (0: decompose exactly at every inverse update; try 0.05)");
    // The same bound as KFAC_NUM_THREADS: a pool far beyond the cores only costs thread starts.
    require(o.threads >= 0 && o.threads <= 4096, "options.threads = " + std::to_string(o.threads) +
                                                     " is invalid: it must lie in [0, 4096] (0: from the environment)");
    require(o.strategy == distribution::kaisa || o.strategy == distribution::dp_kfac,
            "options.strategy = " + std::to_string(static_cast<long long>(o.strategy)) +
                " is not a kfac::distribution value: use distribution::kaisa or distribution::dp_kfac");
    require(o.conv_patches == conv_patch_mode::reference || o.conv_patches == conv_patch_mode::dilated,
            "options.conv_patches = " + std::to_string(static_cast<long long>(o.conv_patches)) +
                " is not a kfac::conv_patch_mode value: use conv_patch_mode::reference or conv_patch_mode::dilated");
    require(o.statistics == statistic_scale::reference || o.statistics == statistic_scale::per_example,
            "options.statistics = " + std::to_string(static_cast<long long>(o.statistics)) +
                " is not a kfac::statistic_scale value: use statistic_scale::reference or statistic_scale::per_example");
    require(o.averaging == factor_averaging::reference || o.averaging == factor_averaging::bias_corrected,
            "options.averaging = " + std::to_string(static_cast<long long>(o.averaging)) +
                " is not a kfac::factor_averaging value: use factor_averaging::reference or "
                "factor_averaging::bias_corrected");
    require(o.damping_mode == damping_form::reference || o.damping_mode == damping_form::factored,
            "options.damping_mode = " + std::to_string(static_cast<long long>(o.damping_mode)) +
                " is not a kfac::damping_form value: use damping_form::reference or damping_form::factored");
    // A cap beyond 2⁴⁰ MiB would overflow the byte count; no real bucket comes near it.
    require(std::isfinite(o.allreduce_bucket_cap_mb) && o.allreduce_bucket_cap_mb >= 0.0 &&
                o.allreduce_bucket_cap_mb <= 1099511627776.0,
            "options.allreduce_bucket_cap_mb = " + detail::number_text(o.allreduce_bucket_cap_mb) +
                " is invalid: it must be finite and lie in [0, 1099511627776] (2^40 MiB, beyond which the byte "
                "count overflows; 0: no bucketing; 25 is the default)");
    require(o.grad_worker_fraction >= 0.0 && o.grad_worker_fraction <= 1.0,
            "options.grad_worker_fraction = " + std::to_string(o.grad_worker_fraction) +
                " is invalid: it must lie in [0, 1] (kfac::comm_opt, kfac::hybrid_opt, kfac::mem_opt)");
}

}  // namespace kfac
