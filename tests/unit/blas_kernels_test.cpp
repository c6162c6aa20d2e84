// SPDX-License-Identifier: Apache-2.0
// OpenBLAS's kernel set against the CPU (kfac/backend/blas_kernels.hpp): the rules, the
// warning said once through kfac/diagnostics.hpp, and the LAPACK-level work that crashed with
// generic kernels (issue 9): float Cholesky inverses at n = 577 and 1025, an eigendecomposition
// at n = 693, and a two-layer preconditioner with A dimension 577 on two threads.
//
// Built twice: into kfac_tests with the configured BLAS, and by tests/blas into a binary that
// links Debian's OpenBLAS and runs under OPENBLAS_CORETYPE=Prescott, so that on any x86 CPU the
// crashing kernels are the ones loaded (there KFAC_TEST_BLAS_KERNELS_ONLY is 1: this file is the
// binary's only one, and its first case the process's first use of the BLAS).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <Eigen/Eigenvalues>

#include "unit/test_util.hpp"

#ifndef KFAC_TEST_BLAS_KERNELS_ONLY
#define KFAC_TEST_BLAS_KERNELS_ONLY 0
#endif

using namespace kfac_test;
using kfac::backend::isa_level;

namespace {

/// Collects diagnostic lines while alive, then puts the previous handler back.
struct captured_diagnostics {
    std::vector<std::string> lines;
    kfac::diagnostic_handler previous;
    // The channel calls its handler under its own lock, so pushing needs no other.
    captured_diagnostics()
        : previous(kfac::set_diagnostic_handler([this](const std::string& line) { lines.push_back(line); })) {}
    ~captured_diagnostics() { kfac::set_diagnostic_handler(previous); }
    captured_diagnostics(const captured_diagnostics&) = delete;
    captured_diagnostics& operator=(const captured_diagnostics&) = delete;
};

/// `calls` threads race to report `info` with one flag.
void report_from_threads(const kfac::backend::blas_kernels_info& info, std::once_flag& once, int calls) {
    std::vector<std::thread> threads;
    for (int t = 0; t < calls; ++t)
        threads.emplace_back([&] { kfac::backend::report_blas_kernels(info, once); });
    for (auto& t : threads) t.join();
}

/// True when this process was started with OPENBLAS_CORETYPE=Prescott on x86, where OpenBLAS
/// then loads its Prescott kernels (scipy-openblas32: Katmai), which the backend must treat as
/// generic.
bool forced_prescott() {
#if defined(__x86_64__) || defined(__i386__)
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    std::string value = coretype ? coretype : "";
    std::transform(value.begin(), value.end(), value.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return KFAC_HAS_LAPACK && value == "prescott";
#else
    return false;
#endif
}

/// X Xᵀ / m for an n × m standard normal X with m = 2n, in double. Its spectrum lies near the
/// Marchenko–Pastur interval for ratio ½, [(1 − √½)², (1 + √½)²] ≈ [0.086, 2.9], so its
/// condition number is about 34 at every n.
mat<double> wishart(Eigen::Index n, std::uint32_t seed) {
    const Eigen::Index m = 2 * n;
    const auto values = random_vector<double>(static_cast<std::size_t>(n * m), seed);
    const Eigen::Map<const mat<double>> x(values.data(), n, m);
    mat<double> a = x * x.transpose() / static_cast<double>(m);
    return (a + a.transpose()) / 2.0;
}

/// κ₂ of an SPD matrix, from its eigenvalues in double.
double condition_number(const mat<double>& a) {
    const Eigen::SelfAdjointEigenSolver<mat<double>> solver(a, Eigen::EigenvaluesOnly);
    return solver.eigenvalues().maxCoeff() / solver.eigenvalues().minCoeff();
}

double spectral_norm(const mat<double>& a) {
    const Eigen::SelfAdjointEigenSolver<mat<double>> solver(a, Eigen::EigenvaluesOnly);
    return solver.eigenvalues().cwiseAbs().maxCoeff();
}

/// The same layer with its buffers in double: the double run sees exactly the float inputs.
owned_layer<double> as_double(const owned_layer<float>& l) {
    owned_layer<double> d;
    d.view.description = l.view.description;
    d.input.assign(l.input.begin(), l.input.end());
    d.grad_output.assign(l.grad_output.begin(), l.grad_output.end());
    d.grad_weight.assign(l.grad_weight.begin(), l.grad_weight.end());
    d.grad_bias.assign(l.grad_bias.begin(), l.grad_bias.end());
    d.input_shape = l.input_shape;
    d.output_shape = l.output_shape;
    d.bind();
    return d;
}

/// Every weight and bias gradient of the layers, in one vector of doubles.
template <class T>
Eigen::VectorXd gradients(const std::vector<owned_layer<T>>& layers) {
    std::vector<double> all;
    for (const auto& l : layers) {
        all.insert(all.end(), l.grad_weight.begin(), l.grad_weight.end());
        all.insert(all.end(), l.grad_bias.begin(), l.grad_bias.end());
    }
    return Eigen::Map<const Eigen::VectorXd>(all.data(), static_cast<Eigen::Index>(all.size()));
}

/// Runs `steps` steps of the inverse method at two task threads over `layers`, each step
/// starting from the layers' original gradients (as a training loop hands in new ones).
template <class T>
std::vector<owned_layer<T>> preconditioned(std::vector<owned_layer<T>> layers, int steps,
                                           std::vector<mat<double>>* factors = nullptr) {
    for (auto& l : layers) l.bind();  // the copies' views must point at the copies
    kfac::options o;
    o.threads = 2;
    kfac::KFAC<kfac::backend::cpu_eigen<T>, kfac::comm::serial, kfac::compute::inverse,
               kfac::assignment::compute_balanced>
        p(o);
    const auto original = layers;
    for (std::size_t i = 0; i < layers.size(); ++i) p.register_layer("fc" + std::to_string(i), layers[i].view);
    for (int s = 0; s < steps; ++s) {
        for (std::size_t i = 0; i < layers.size(); ++i) {
            layers[i].grad_weight = original[i].grad_weight;
            layers[i].grad_bias = original[i].grad_bias;  // same size: the buffers stay put
        }
        p.step();
    }
    if (factors)
        for (std::size_t i = 0; i < layers.size(); ++i) {
            factors->push_back(p.a_factor("fc" + std::to_string(i)).template cast<double>());
            factors->push_back(p.g_factor("fc" + std::to_string(i)).template cast<double>());
        }
    return layers;
}

}  // namespace

// First in the file: in the Prescott binary this is the process's first use of the BLAS.
TEST_CASE("this process's BLAS facts agree with the rules, and the warning is said once",
          "[blas_kernels][diagnostics]") {
#if !KFAC_TEST_BLAS_KERNELS_ONLY
    // Other files' cases may have used the BLAS in this process already, so the first question
    // (and its warning, if any, on std::cerr) comes before capturing: only repeated asking is
    // tested here.
    static_cast<void>(kfac::backend::blas_kernels());
#endif
    captured_diagnostics captured;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([] { static_cast<void>(kfac::backend::blas_kernels()); });
    for (auto& t : threads) t.join();
    const auto& info = kfac::backend::blas_kernels();
    const std::size_t said = KFAC_TEST_BLAS_KERNELS_ONLY && info.outdated ? 1 : 0;
    CHECK(captured.lines.size() == said);
    if (captured.lines.size() == 1) CHECK(captured.lines[0] == kfac::backend::blas_kernels_warning(info));

    CHECK(info.cpu_isa == kfac::backend::cpu_isa_level());
    CHECK(info.generic == kfac::backend::is_generic_kernel_set(info.core_name, info.cpu_isa));
    CHECK(info.outdated == kfac::backend::is_outdated_kernel_set(info.core_name, info.cpu_isa));
    INFO("BLAS: " << info.library << "; kernels " << info.core_name << "; CPU "
                  << kfac::backend::isa_name(info.cpu_isa));
#if KFAC_HAS_LAPACK
    CHECK_FALSE(info.core_name.empty());
    CHECK_THAT(info.library, Catch::Contains("OpenBLAS"));
#else
    CHECK(info.core_name.empty());
    CHECK_FALSE(info.generic);
#endif
    if (forced_prescott()) {
        // The regression binary must really run the generic kernels, or it proves nothing.
        CHECK(kfac::backend::kernel_set_isa(info.core_name) == isa_level::sse);
        CHECK(info.generic);
        CHECK(info.coretype_override == std::getenv("OPENBLAS_CORETYPE"));
    }
}

TEST_CASE("kernel sets are placed by the vector extension they use", "[blas_kernels]") {
    using kfac::backend::kernel_set_isa;
    CHECK(kernel_set_isa("Prescott") == isa_level::sse);
    CHECK(kernel_set_isa("Katmai") == isa_level::sse);
    CHECK(kernel_set_isa("Core2") == isa_level::sse);
    CHECK(kernel_set_isa("Nehalem") == isa_level::sse4_2);
    CHECK(kernel_set_isa("Sandybridge") == isa_level::avx);
    CHECK(kernel_set_isa("Haswell") == isa_level::avx2);
    CHECK(kernel_set_isa("HASWELL") == isa_level::avx2);  // builds without DYNAMIC_ARCH
    CHECK(kernel_set_isa("Zen") == isa_level::avx2);
    CHECK(kernel_set_isa("SkylakeX") == isa_level::avx512f);
    CHECK(kernel_set_isa("NEOVERSEN1") == isa_level::unknown);
    CHECK(kernel_set_isa("") == isa_level::unknown);
}

TEST_CASE("generic and outdated kernel sets", "[blas_kernels]") {
    using kfac::backend::is_generic_kernel_set;
    using kfac::backend::is_outdated_kernel_set;
    // The case of issue 9: Prescott on AVX-512 or AVX2 CPUs, and scipy-openblas32's Katmai.
    for (const auto cpu : {isa_level::avx2, isa_level::avx512f})
        for (const char* core : {"Prescott", "Katmai", "Core2", "Nehalem", "Sandybridge"}) {
            INFO(core << " on " << kfac::backend::isa_name(cpu));
            CHECK(is_generic_kernel_set(core, cpu));
            CHECK(is_outdated_kernel_set(core, cpu));
        }
    // The sets OpenBLAS picks for such CPUs.
    for (const char* core : {"Haswell", "Zen", "SkylakeX", "SapphireRapids"}) {
        CHECK_FALSE(is_generic_kernel_set(core, isa_level::avx512f));
        CHECK_FALSE(is_outdated_kernel_set(core, isa_level::avx512f));
    }
    CHECK_FALSE(is_generic_kernel_set("Haswell", isa_level::avx2));
    CHECK_FALSE(is_outdated_kernel_set("Zen", isa_level::avx2));
    // An SSE-era set is generic on any CPU, but only outdated where the CPU has more.
    CHECK(is_generic_kernel_set("Prescott", isa_level::sse));
    CHECK_FALSE(is_outdated_kernel_set("Core2", isa_level::sse));
    CHECK(is_generic_kernel_set("Prescott", isa_level::unknown));
    CHECK_FALSE(is_outdated_kernel_set("Prescott", isa_level::unknown));
    // Older but post-SSE sets on older CPUs: not generic; outdated below the CPU's level.
    CHECK_FALSE(is_generic_kernel_set("Nehalem", isa_level::avx));
    CHECK(is_outdated_kernel_set("Nehalem", isa_level::avx));
    CHECK_FALSE(is_outdated_kernel_set("Sandybridge", isa_level::avx));
    // Kernel sets of other architectures are not judged.
    CHECK_FALSE(is_generic_kernel_set("ARMV8", isa_level::unknown));
    CHECK_FALSE(is_outdated_kernel_set("POWER9", isa_level::unknown));
}

TEST_CASE("the warning is said exactly once, with the facts and the fix", "[blas_kernels][diagnostics]") {
    using kfac::backend::describe_blas_kernels;
    captured_diagnostics captured;

    SECTION("generic kernels on an AVX2 CPU") {
        const auto info = describe_blas_kernels("OpenBLAS: OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott (/lib/libopenblas.so.0)",
                                                "Prescott", isa_level::avx2);
        REQUIRE(info.generic);
        REQUIRE(info.outdated);
        std::once_flag once;
        report_from_threads(info, once, 8);
        kfac::backend::report_blas_kernels(info, once);
        REQUIRE(captured.lines.size() == 1);
        const std::string& line = captured.lines[0];
        CHECK_THAT(line, Catch::StartsWith("kfac: warning:"));
        CHECK(line.find('\n') == std::string::npos);
        CHECK_THAT(line, Catch::Contains("Prescott kernels (SSE)") && Catch::Contains("CPU with AVX2") &&
                             Catch::Contains("OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott (/lib/libopenblas.so.0)") &&
                             Catch::Contains("with Eigen instead of LAPACK") &&
                             Catch::Contains("pip install scipy-openblas32") &&
                             Catch::Contains("-DKFAC_BLAS=scipy-openblas32") &&
                             Catch::Contains("OPENBLAS_CORETYPE=Haswell"));
    }
    SECTION("forced through OPENBLAS_CORETYPE on an AVX-512 CPU") {
        const auto info = describe_blas_kernels("scipy-openblas32: OpenBLAS 0.3.34", "Katmai", isa_level::avx512f, "Prescott");
        std::once_flag once;
        kfac::backend::report_blas_kernels(info, once);
        REQUIRE(captured.lines.size() == 1);
        CHECK_THAT(captured.lines[0], Catch::Contains("CPU with AVX-512F") &&
                                          Catch::Contains("OPENBLAS_CORETYPE=Prescott is set") &&
                                          Catch::Contains("OPENBLAS_CORETYPE=SkylakeX"));
    }
    SECTION("nothing to say about fitting kernels") {
        for (const auto& [core, cpu] : {std::pair{"Haswell", isa_level::avx2}, std::pair{"Zen", isa_level::avx2},
                                        std::pair{"Haswell", isa_level::avx512f},
                                        std::pair{"SkylakeX", isa_level::avx512f},
                                        std::pair{"Core2", isa_level::sse}, std::pair{"ARMV8", isa_level::unknown}}) {
            const auto info = describe_blas_kernels("OpenBLAS", core, cpu);
            std::once_flag once;
            report_from_threads(info, once, 4);
            CHECK(kfac::backend::blas_kernels_warning(info).empty());
        }
        CHECK(captured.lines.empty());
    }
}

TEST_CASE("the diagnostic channel can be redirected and silenced", "[diagnostics]") {
    std::vector<std::string> seen;
    auto previous = kfac::set_diagnostic_handler([&](const std::string& line) { seen.push_back(line); });
    kfac::emit_diagnostic("kfac: warning: one");
    const auto mine = kfac::set_diagnostic_handler(nullptr);
    kfac::emit_diagnostic("kfac: warning: silenced");
    kfac::set_diagnostic_handler(previous);
    CHECK(seen == std::vector<std::string>{"kfac: warning: one"});
    CHECK(static_cast<bool>(mine));
}

TEMPLATE_TEST_CASE("damped inverses at the sizes that crashed, on one BLAS thread", "[blas_kernels][inverse]",
                   float, double) {
    using T = TestType;
    using backend = kfac::backend::cpu_eigen<T>;
    const Eigen::Index n = GENERATE(577, 1025);
    INFO("n = " << n);
    const T damping = T(1e-3);
    const mat<T> m = wishart(n, 11).cast<T>();
    // The reference inverts exactly the matrix the backend sees, in double with Eigen's LLT.
    mat<double> damped = m.template cast<double>();
    damped.diagonal().array() += static_cast<double>(damping);
    const mat<double> reference = damped.llt().solve(mat<double>::Identity(n, n));
    mat<T> inverse;
    {
        const typename backend::serial_blas_scope one_thread;  // as the preconditioner's tasks run it
        REQUIRE(backend::damped_inverse(m, damping, inverse));
    }
    REQUIRE(inverse.allFinite());
    // A Cholesky-based inverse has a normwise relative error of at most c·n·u·κ₂ to first order
    // (Higham, Accuracy and Stability of Numerical Algorithms, §14.2), c a small constant; with
    // c = 1 (and twice that in double, where the reference itself errs as much) this is the
    // tolerance. κ ≈ 34 here, so it is 1e-3 (float) at n = 577: far above the rounding
    // actually seen, far below the O(1) error of a wrong inverse.
    const double kappa = condition_number(damped);
    const double tolerance = (std::is_same_v<T, double> ? 2.0 : 1.0) * kappa * static_cast<double>(n) * eps<T>();
    CHECK(rel_err(inverse.template cast<double>().reshaped(), reference.reshaped()) < tolerance);
    if (kfac::backend::blas_kernels().generic) {
        // LAPACK was not called: the result is Eigen's LLT, bit for bit.
        mat<T> shifted = m;
        shifted.diagonal().array() += damping;
        CHECK(inverse == shifted.llt().solve(mat<T>::Identity(n, n)));
    }
}

TEST_CASE("eigendecomposition at n = 693 (ssyevd crashed there), on one BLAS thread", "[blas_kernels][eigen]") {
    using backend = kfac::backend::cpu_eigen<float>;
    const Eigen::Index n = 693;
    const mat<float> m = wishart(n, 12).cast<float>();
    const mat<double> a = m.cast<double>();
    mat<float> q;
    Eigen::VectorXf lambda;
    {
        const backend::serial_blas_scope one_thread;
        REQUIRE(backend::symmetric_eigen(m, q, lambda));
    }
    const Eigen::SelfAdjointEigenSolver<mat<double>> reference(a, Eigen::EigenvaluesOnly);
    // A backward-stable solver returns the exact eigenpairs of A + E with ‖E‖₂ ≤ c·n·u·‖A‖₂:
    // by Weyl each eigenvalue moves by at most ‖E‖₂, the residual AV − VΛ is of that size, and
    // V is orthonormal to c·n·u (the properties Eigen's own tests check, signs of eigenvectors
    // being arbitrary). c depends on the algorithm: LAPACK's syevd stays near 0.003 here,
    // Eigen's tridiagonal QR in float (the path with generic kernels) reaches 1.1; c = 4.
    const double c = 4.0;
    const double norm = spectral_norm(a);
    const double tolerance = c * static_cast<double>(n) * eps<float>() * norm;
    const mat<double> v = q.cast<double>();
    const Eigen::VectorXd l = lambda.cast<double>();
    CHECK((l - reference.eigenvalues()).cwiseAbs().maxCoeff() < tolerance);
    CHECK((a * v - v * l.asDiagonal()).cwiseAbs().maxCoeff() < tolerance);
    CHECK((v.transpose() * v - mat<double>::Identity(n, n)).cwiseAbs().maxCoeff() <
          c * static_cast<double>(n) * eps<float>());
    if (kfac::backend::blas_kernels().generic) {
        // syevd was not called: the result is Eigen's solver, bit for bit. (Whether syevd
        // crashes depends on the page after the matrix: ssymv_L_PRESCOTT reads past its end.)
        const Eigen::SelfAdjointEigenSolver<mat<float>> eigen(m, Eigen::ComputeEigenvectors);
        CHECK(lambda == eigen.eigenvalues());
        CHECK(q == eigen.eigenvectors());
    }
}

TEST_CASE("inverse method, two Linear(576) layers with bias, two threads, float against double",
          "[blas_kernels][preconditioner]") {
    const std::int64_t rows = 256, in = 576, out = 64;
    const int steps = 3;
    std::vector<owned_layer<float>> layers;
    for (std::uint32_t seed : {21u, 31u}) layers.push_back(random_linear<float>(rows, in, out, true, seed));
    std::vector<owned_layer<double>> layers_double;
    for (const auto& l : layers) layers_double.push_back(as_double(l));

    std::vector<mat<double>> factors;
    const auto single = preconditioned(layers, steps);
    const auto reference = preconditioned(layers_double, steps, &factors);
    const Eigen::VectorXd got = gradients(single), want = gradients(reference);
    REQUIRE(got.allFinite());
    REQUIRE(want.allFinite());
    CHECK(got != gradients(layers));  // it did precondition

    // Float rounds the factor statistics (sums of `rows` products per element: relative error
    // ≤ rows·u), each damped inverse (≤ n·u·κ, as above, and the statistics' error is amplified
    // by κ too) and the two n-term products of G⁻¹ Γ A⁻¹; first order, the errors add:
    // u·Σ_F κ_F·(n_F + rows) + u·(n_A + n_G). The factors here are near the identity (decay
    // 0.95 from I), so κ_F is close to 1 and the tolerance about 1e-4.
    double budget = static_cast<double>(in + 1 + out);
    for (const auto& f : factors) {
        mat<double> damped = f;
        damped.diagonal().array() += 1e-3;
        budget += condition_number(damped) * static_cast<double>(f.rows() + rows);
    }
    CHECK(rel_err(got, want) < budget * eps<float>());
}
