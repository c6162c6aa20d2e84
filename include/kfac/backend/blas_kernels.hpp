// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file blas_kernels.hpp
/// Which kernel set OpenBLAS runs, measured against what the CPU supports.
///
/// OpenBLAS built with DYNAMIC_ARCH picks its kernels at start-up from the CPU's model. A
/// release that does not know the model (Debian 12's 0.3.21 on Intel family 6 model 207, an
/// AVX-512 part) silently falls back to its oldest set, "Prescott"; OPENBLAS_CORETYPE=Prescott
/// forces the same anywhere. Two things follow:
///   * every BLAS call runs 2.5–3× slower than the CPU allows;
///   * LAPACK routines crash inside those kernels. Single-threaded, Debian's OpenBLAS with
///     Prescott kernels segfaults in spotrf + spotri for 458 of the 474 odd n in [255, 1201],
///     and in ssyevd at n = 693; over n = 255, 279, …, 1191, spotrf + spotri crashed 40/40 times
///     with Prescott, 39/40 with Core2, 40/40 with Barcelona, and 0/40 with Nehalem,
///     Sandybridge, Haswell or Zen. scipy-openblas32 0.3.34 runs "Katmai" for Prescott and
///     crashes the same way. The ssyevd crash is ssymv_L_PRESCOTT (called by ssytrd) reading
///     past the end of the matrix, so it faults only where the next page is unmapped; results
///     that come back are no proof the kernels are safe.
///
/// blas_kernels() finds these facts once per process. The CPU backend (cpu_eigen.hpp) then
/// sends its LAPACK-level calls (Cholesky inverse, syevd) to Eigen while the kernels are
/// `generic`, and a program is told, once, through kfac/diagnostics.hpp when they are
/// `outdated`. The rules themselves are pure functions of (kernel set name, CPU level), so they
/// can be tested without the CPU or the library they describe.

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "kfac/backend/detail/blas_lapack.hpp"
#include "kfac/config.hpp"
#include "kfac/diagnostics.hpp"

namespace kfac::backend {

/// x86 vector instruction-set levels, oldest first. `unknown`: not x86, or not known.
enum class isa_level {
    unknown,  ///< not x86, or a level this code does not know
    sse,      ///< SSE/SSE2 only (OpenBLAS's Prescott kernels)
    sse4_2,   ///< up to SSE4.2 (Nehalem)
    avx,      ///< AVX (Sandy Bridge)
    avx2,     ///< AVX2 and FMA (Haswell, Zen)
    avx512f,  ///< AVX-512 Foundation (Skylake-X, Zen 4)
};

/// "SSE", "SSE4.2", "AVX", "AVX2", "AVX-512F"; "unknown".
inline const char* isa_name(isa_level level) {
    switch (level) {
        case isa_level::sse: return "SSE";
        case isa_level::sse4_2: return "SSE4.2";
        case isa_level::avx: return "AVX";
        case isa_level::avx2: return "AVX2";
        case isa_level::avx512f: return "AVX-512F";
        case isa_level::unknown: break;
    }
    return "unknown";
}

namespace detail {

struct kernel_set {
    std::string_view name;  ///< openblas_get_corename() in lower case
    isa_level isa;          ///< the newest vector extension its kernels use
};

/// OpenBLAS's x86 kernel sets (driver/others/dynamic.c). Names of other architectures are not
/// listed: nothing here is known to be wrong with them.
inline constexpr kernel_set x86_kernel_sets[] = {
    {"katmai", isa_level::sse},        {"coppermine", isa_level::sse},   {"northwood", isa_level::sse},
    {"prescott", isa_level::sse},      {"banias", isa_level::sse},       {"atom", isa_level::sse},
    {"core2", isa_level::sse},         {"penryn", isa_level::sse},       {"dunnington", isa_level::sse},
    {"athlon", isa_level::sse},        {"opteron", isa_level::sse},      {"opteron_sse3", isa_level::sse},
    {"barcelona", isa_level::sse},     {"bobcat", isa_level::sse},       {"nano", isa_level::sse},
    {"nehalem", isa_level::sse4_2},    {"sandybridge", isa_level::avx},  {"bulldozer", isa_level::avx},
    {"piledriver", isa_level::avx},    {"steamroller", isa_level::avx},  {"excavator", isa_level::avx},
    {"haswell", isa_level::avx2},      {"zen", isa_level::avx2},         {"skylakex", isa_level::avx512f},
    {"cooperlake", isa_level::avx512f}, {"sapphirerapids", isa_level::avx512f},
};

inline std::string lower_case(std::string_view text) {
    std::string out(text);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

}  // namespace detail

/// The level an OpenBLAS kernel set is written for, from its name (any case: builds without
/// DYNAMIC_ARCH report "HASWELL"); `unknown` for names of other architectures.
inline isa_level kernel_set_isa(std::string_view core_name) {
    const std::string name = detail::lower_case(core_name);
    for (const auto& set : detail::x86_kernel_sets)
        if (set.name == name) return set.isa;
    return isa_level::unknown;
}

/// The newest level this CPU (and its OS) supports; `unknown` off x86 or without the GCC/Clang
/// builtins. AVX2 counts only with FMA, which every AVX2 kernel set of OpenBLAS also uses.
inline isa_level cpu_isa_level() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();  // a no-op after start-up; needed if called from a static initialiser
    if (__builtin_cpu_supports("avx512f")) return isa_level::avx512f;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return isa_level::avx2;
    if (__builtin_cpu_supports("avx")) return isa_level::avx;
    if (__builtin_cpu_supports("sse4.2")) return isa_level::sse4_2;
    return isa_level::sse;
#else
    return isa_level::unknown;
#endif
}

/// True when the CPU backend must keep LAPACK-level calls away from these kernels: the
/// SSE-era sets on any CPU (Prescott, Core2 and Barcelona crash in potrf/potri, Katmai does in
/// scipy-openblas32), and every pre-AVX2 set on a CPU with AVX2. No OpenBLAS that knows such a
/// CPU picks a pre-AVX2 set, so there it is a fallback or a forced choice; Nehalem and
/// Sandybridge did not crash in the sweep above, but Eigen's solvers there cost less than a
/// crash would. gemm and syrk stay on BLAS: sweeps of sgemm/ssyrk/strsm/strmm with Prescott
/// kernels did not crash.
inline bool is_generic_kernel_set(std::string_view core_name, isa_level cpu) {
    const isa_level kernels = kernel_set_isa(core_name);
    if (kernels == isa_level::unknown) return false;
    return kernels == isa_level::sse || (cpu >= isa_level::avx2 && kernels < isa_level::avx2);
}

/// True when the kernels are older than the CPU supports, counting up to AVX2 only. AVX2
/// kernels (Haswell, Zen) on an AVX-512 CPU are not reported: they are correct, within about
/// 1.5× of the AVX-512 sets where a core has two 512-bit FMA units and level with them where it
/// splits 512-bit work in two (AMD Zen 4, which Debian's 0.3.21 runs with Zen kernels), and a
/// warning on every Zen 4 machine would be noise. The 2.5–3× loss is below AVX2.
inline bool is_outdated_kernel_set(std::string_view core_name, isa_level cpu) {
    const isa_level kernels = kernel_set_isa(core_name);
    if (kernels == isa_level::unknown || cpu == isa_level::unknown) return false;
    return kernels < std::min(cpu, isa_level::avx2);
}

/// The facts about this process's BLAS, for programs that want to show or check them.
struct blas_kernels_info {
    /// The library: which build kfac was configured with, OpenBLAS's build line and the file
    /// it was loaded from, e.g. "scipy-openblas32: OpenBLAS 0.3.34 DYNAMIC_ARCH NO_AFFINITY
    /// Haswell MAX_THREADS=64 (.../libscipy_openblas.so)"; "none (Eigen only)" without BLAS.
    std::string library;
    /// The kernel set OpenBLAS runs (openblas_get_corename): "Haswell", "Prescott", ...; empty
    /// without BLAS.
    std::string core_name;
    /// The newest vector extension of the CPU (cpu_isa_level()).
    isa_level cpu_isa = isa_level::unknown;
    /// OPENBLAS_CORETYPE as it was when the facts were gathered; empty when unset.
    std::string coretype_override;
    /// is_generic_kernel_set(): LAPACK-level calls of the CPU backend go through Eigen.
    bool generic = false;
    /// is_outdated_kernel_set(): the kernels are older than the CPU supports (the warning).
    bool outdated = false;
};

/// The facts for a given library, kernel set, CPU and OPENBLAS_CORETYPE: no system query.
inline blas_kernels_info describe_blas_kernels(std::string library, std::string core_name,
                                               isa_level cpu, std::string coretype_override = {}) {
    blas_kernels_info info;
    info.generic = is_generic_kernel_set(core_name, cpu);
    info.outdated = is_outdated_kernel_set(core_name, cpu);
    info.library = std::move(library);
    info.core_name = std::move(core_name);
    info.cpu_isa = cpu;
    info.coretype_override = std::move(coretype_override);
    return info;
}

/// The warning for `info`, one line starting with "kfac: warning:", or "" when the kernels
/// are not outdated. It names the library, the kernel set, the CPU's level and the fix.
inline std::string blas_kernels_warning(const blas_kernels_info& info) {
    if (!info.outdated) return {};
    const std::string best = info.cpu_isa >= isa_level::avx512f ? "SkylakeX" : "Haswell";
    std::string line = "kfac: warning: OpenBLAS runs its " + info.core_name + " kernels (" +
                       isa_name(kernel_set_isa(info.core_name)) + ") on a CPU with " +
                       isa_name(info.cpu_isa) + ", so BLAS calls run several times slower than they could";
    if (info.generic)
        line += ", and kfac computes Cholesky inverses and eigendecompositions with Eigen instead of "
                "LAPACK, whose routines crash with these kernels";
    line += ". BLAS: " + info.library + ".";
    if (!info.coretype_override.empty())
        line += " OPENBLAS_CORETYPE=" + info.coretype_override + " is set in the environment: unset it, or set "
                "OPENBLAS_CORETYPE=" + best + " before the program starts.";
    else
        line += " Fix: python3 -m pip install scipy-openblas32 and reconfigure kfac with "
                "-DKFAC_BLAS=scipy-openblas32, or set OPENBLAS_CORETYPE=" + best +
                " before the program starts.";
    return line;
}

/// Says `info`'s warning, if it has one, through the diagnostic channel the first time it is
/// called with `once`, however many threads call it.
inline void report_blas_kernels(const blas_kernels_info& info, std::once_flag& once) {
    if (!info.outdated) return;
    std::call_once(once, [&] { emit_diagnostic(blas_kernels_warning(info)); });
}

namespace detail {

/// Which build of OpenBLAS kfac was configured with, from its symbol prefix: "" for an
/// unprefixed one (Debian's), "scipy-openblas32" for the PyPI wheel.
inline std::string blas_build_name() {
    const std::string_view prefix = KFAC_BLAS_SYMBOL_PREFIX_STRING;
    if (prefix.empty()) return {};
    if (prefix == "scipy_") return "scipy-openblas32";
    // Appended, not `"..." + std::string(prefix)`: GCC 12 at -O3 warns falsely about that
    // form (-Wrestrict, bug 105329).
    std::string name = "OpenBLAS with symbol prefix ";
    name += prefix;
    return name;
}

/// This process's facts: asks OpenBLAS, the CPU and the environment.
inline blas_kernels_info detect_blas_kernels() {
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    std::string override_text = coretype ? coretype : "";
#if KFAC_HAS_LAPACK
    const std::string build = blas_build_name();
    std::string library = (build.empty() ? "" : build + ": ") + blas_config();
    if (const std::string path = blas_library_path(); !path.empty()) library += " (" + path + ")";
    return describe_blas_kernels(std::move(library), blas_core_name(), cpu_isa_level(), std::move(override_text));
#else
    return describe_blas_kernels("none (Eigen only)", "", cpu_isa_level(), std::move(override_text));
#endif
}

}  // namespace detail

/// This process's facts, gathered on the first call (thread-safe); that call also says the
/// warning, if any, through kfac/diagnostics.hpp. The CPU backend calls it on its first BLAS
/// use, so install a diagnostic handler before the first step(), or call this at start-up to
/// have the warning said then.
inline const blas_kernels_info& blas_kernels() {
    static const blas_kernels_info info = [] {
        blas_kernels_info found = detail::detect_blas_kernels();
        static std::once_flag said;
        report_blas_kernels(found, said);
        return found;
    }();
    return info;
}

}  // namespace kfac::backend
