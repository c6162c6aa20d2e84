// SPDX-License-Identifier: Apache-2.0
/// @file bench_eigensolver.cpp
/// The two second-order kernels of K-FAC on their own, over the factor sizes that occur in
/// practice (64 ... 4608), in float and double:
///   * symmetric eigendecomposition (values + vectors): Eigen's SelfAdjointEigenSolver,
///     LAPACK ?syevd called directly, and the backend's choice (cpu_eigen::symmetric_eigen,
///     which switches from Eigen to syevd above KFAC_EIGEN_SOLVER_MAX_DIM);
///   * damped SPD inverse: the backend's damped_inverse (potrf + potri with LAPACK), the same
///     two LAPACK calls made directly, and Eigen's LLT followed by solve(I);
///   * the approximate refresh of options.eigenbasis_reuse_tolerance (reuse_drift): the
///     Rayleigh quotients and residual of a factor that drifted from the one its basis came
///     from, timed against eigh_backend at the same n, with its error against the exact
///     decomposition of the drifted factor (below);
///   * the machine's GEMM rate at the same n (gemm_reference: C = A·B, 2n³ flops), the ceiling
///     the solvers' rates are read against: syevd's tridiagonal reduction is half matrix–vector
///     work and cannot reach it, its back-transformation and the Cholesky inverse nearly can.
///
/// Inputs are Wishart matrices A = X Xᵀ / n + 1e-3 I, X an n × n standard normal matrix with a
/// fixed seed. Their Marchenko–Pastur spectrum has few clustered eigenvalues, so divide and
/// conquer deflates little: this is the expensive case for syevd (real K-FAC factors, with
/// their large cluster near the damping, are cheaper).
///
/// Every variant takes a const input and produces fresh output, so the copy a solver needs
/// (syevd works in place) is part of the timed call, as it is inside the library.
/// Times are wall-clock (OpenBLAS may run worker threads); run with OPENBLAS_NUM_THREADS=1 or 2.

#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <kfac/kfac.hpp>

namespace {

using index = std::int64_t;
template <class T>
using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

constexpr double damping = 0.003;

/// A = X Xᵀ / n + 1e-3 I in double, built once per n and shared by every benchmark of the
/// process (n = 4608 takes seconds to build).
const matrix<double>& wishart_double(index n) {
    static std::map<index, matrix<double>> cache;
    auto it = cache.find(n);
    if (it != cache.end()) return it->second;
    std::mt19937_64 rng(20240611u + static_cast<std::uint64_t>(n));
    std::normal_distribution<double> normal(0.0, 1.0);
    matrix<double> x(n, n);
    for (index i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
    matrix<double> a = matrix<double>::Zero(n, n);
    a.selfadjointView<Eigen::Lower>().rankUpdate(x, 1.0 / static_cast<double>(n));
    a.triangularView<Eigen::StrictlyUpper>() = a.transpose();
    a.diagonal().array() += 1e-3;
    return cache.emplace(n, std::move(a)).first->second;
}

/// The same matrix in T (rounded from double, so float and double see the same spectrum).
template <class T>
const matrix<T>& wishart(index n) {
    if constexpr (std::is_same_v<T, double>) {
        return wishart_double(n);
    } else {
        static std::map<index, matrix<T>> cache;
        auto it = cache.find(n);
        if (it != cache.end()) return it->second;
        return cache.emplace(n, wishart_double(n).template cast<T>()).first->second;
    }
}

/// Flop model of a symmetric eigendecomposition with vectors by divide and conquer
/// (perf-anchors §2): tridiagonal reduction 4/3 n³ + D&C vectors without deflation
/// at most 4/3 n³ + back-transformation 2 n³ = 14/3 n³. It is an upper bound on syevd's work;
/// the same model is used for Eigen's QR-based solver (which does more, ~9 n³), so that the
/// rates of all solvers compare as inverse times.
double eigen_flops(index n) {
    const double d = static_cast<double>(n);
    return 14.0 / 3.0 * d * d * d;
}

/// Flop model of the Cholesky inverse: potrf n³/3 + potri 2n³/3 = n³ (LAPACK Working Note 41).
double inverse_flops(index n) {
    const double d = static_cast<double>(n);
    return d * d * d;
}

void set_rate(benchmark::State& state, double flops) {
    // Iteration-invariant rate: flops per iteration × iterations / time, in GFLOP/s.
    state.counters["GFLOP/s"] =
        benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- eigendecomposition --------------------------------------------------------------------

/// A factor F₀ (the Wishart matrix) with eigenvectors Q₀ and eigenvalues λ₀, and the factor
/// F₁ it drifted to, in the two ways factors move between inverse updates:
///   F₁ = Q₀ diag(λ₀ ∘ exp(0.2 z)) Q₀ᵀ + δ ‖F₀‖_F E / ‖E‖_F,
/// its eigenvalues rescaled by a random ±20 % (z standard normal, fixed seed; the part a kept
/// basis follows exactly) and a symmetric zero-mean move E of relative size δ in a direction
/// unrelated to Q₀ (the difference of two more Wishart matrices; the part it leaves out, and
/// the residual it measures). The errors compare what the preconditioner would use for F₁
/// with F₁'s own damped inverse, ‖M⁻¹ − (F₁ + γI)⁻¹‖_F / ‖(F₁ + γI)⁻¹‖_F, at a damping of 1 %
/// and of 10 % of the mean eigenvalue (γ = 0.01 or 0.1 tr F₁ / n; eigenvalues clamped at 0):
///   reuse: M = Q₀ diag(qᵢᵀ F₁ qᵢ) Q₀ᵀ + γI, what a kept basis gives;
///   stale: M = Q₀ diag(λ₀) Q₀ᵀ + γI, what skipping the update gives (a longer inv_update_steps).
/// The damped inverse is dominated by the eigenvalues near γ, which this spectrum (Marchenko–
/// Pastur, many eigenvalues near 0) has in plenty: any move of the factor larger than γ there
/// shows, whatever the method, so the 1 % errors are large even for small δ.
struct drifted_factor {
    matrix<double> f1, q0;
    double residual = 0.0;
    double error_reuse[2] = {0.0, 0.0}, error_stale[2] = {0.0, 0.0};  // γ at 1 % and 10 %
};

matrix<double> damped_inverse_from(const matrix<double>& q, vector<double> lambda, double gamma) {
    lambda = (lambda.array().max(0.0) + gamma).inverse().matrix();
    return q * lambda.asDiagonal() * q.transpose();
}

const drifted_factor& drifted(index n, int drift_permille) {
    static std::map<std::pair<index, int>, drifted_factor> cache;
    const auto key = std::make_pair(n, drift_permille);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
    using solver = kfac::backend::cpu_eigen<double>;  // syevd at these sizes (Eigen's: seconds each)
    drifted_factor d;
    vector<double> lambda0, lambda1;
    matrix<double> q1;
    if (!solver::symmetric_eigen(wishart_double(n), d.q0, lambda0))
        throw std::runtime_error("bench_eigensolver: a reference decomposition failed");
    std::mt19937_64 rng(777u + static_cast<std::uint64_t>(n));
    std::normal_distribution<double> normal(0.0, 1.0);
    vector<double> rescaled = lambda0;
    for (index i = 0; i < n; ++i) rescaled(i) *= std::exp(0.2 * normal(rng));
    const matrix<double> e = wishart_double(n + 1).topLeftCorner(n, n) - wishart_double(n + 2).topLeftCorner(n, n);
    d.f1 = d.q0 * rescaled.asDiagonal() * d.q0.transpose();
    d.f1 += (1e-3 * drift_permille * wishart_double(n).norm() / e.norm()) * e;
    if (!solver::symmetric_eigen(d.f1, q1, lambda1))
        throw std::runtime_error("bench_eigensolver: a reference decomposition failed");
    const matrix<double> projected = d.q0.transpose() * d.f1 * d.q0;
    d.residual = (projected - matrix<double>(projected.diagonal().asDiagonal())).norm() / d.f1.norm();
    for (int k = 0; k < 2; ++k) {
        const double gamma = (k == 0 ? 0.01 : 0.1) * d.f1.trace() / static_cast<double>(n);
        const matrix<double> exact = damped_inverse_from(q1, lambda1, gamma);
        d.error_reuse[k] = (damped_inverse_from(d.q0, projected.diagonal(), gamma) - exact).norm() / exact.norm();
        d.error_stale[k] = (damped_inverse_from(d.q0, lambda0, gamma) - exact).norm() / exact.norm();
    }
    return cache.emplace(key, std::move(d)).first->second;
}

/// rayleigh_quotients(F₁, Q₀) in T: the whole cost of a kept basis. Counters: the residual
/// it measured (the tolerance compares against it) and the errors above.
template <class T>
void reuse_drift(benchmark::State& state) {
    const index n = state.range(0);
    const auto& d = drifted(n, static_cast<int>(state.range(1)));
    const matrix<T> f1 = d.f1.template cast<T>(), q0 = d.q0.template cast<T>();
    vector<T> lambda;
    double residual = 0.0;
    for (auto _ : state) {
        residual = kfac::backend::cpu_eigen<T>::rayleigh_quotients(f1, q0, lambda);
        benchmark::DoNotOptimize(lambda.data());
    }
    state.counters["residual"] = residual;
    state.counters["residual_exact"] = d.residual;
    state.counters["error_reuse_1pct"] = d.error_reuse[0];
    state.counters["error_stale_1pct"] = d.error_stale[0];
    state.counters["error_reuse_10pct"] = d.error_reuse[1];
    state.counters["error_stale_10pct"] = d.error_stale[1];
    set_rate(state, 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n));
}

template <class T>
void eigh_eigen_saes(benchmark::State& state) {
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    for (auto _ : state) {
        Eigen::SelfAdjointEigenSolver<matrix<T>> solver(a, Eigen::ComputeEigenvectors);
        if (solver.info() != Eigen::Success) {
            state.SkipWithError("SelfAdjointEigenSolver did not converge");
            break;
        }
        benchmark::DoNotOptimize(solver.eigenvectors().data());
    }
    set_rate(state, eigen_flops(n));
}

template <class T>
void eigh_backend(benchmark::State& state) {
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    matrix<T> q;
    vector<T> lambda;
    for (auto _ : state) {
        if (!kfac::backend::cpu_eigen<T>::symmetric_eigen(a, q, lambda)) {
            state.SkipWithError("cpu_eigen::symmetric_eigen failed");
            break;
        }
        benchmark::DoNotOptimize(q.data());
    }
    set_rate(state, eigen_flops(n));
}

#if KFAC_HAS_LAPACK
using kfac::backend::detail::blas_int;

/// The direct LAPACK benchmarks call the library's routines themselves, so they must not run
/// where the backend would not (generic OpenBLAS kernels crash in potrf/potri and syevd).
bool lapack_skipped(benchmark::State& state) {
    if (!kfac::backend::blas_kernels().generic) return false;
    state.SkipWithError("OpenBLAS runs generic kernels, which crash in LAPACK (see the kfac warning)");
    return true;
}

/// ?syevd through LAPACKE's work interface, workspace allocated once outside the loop: the
/// lower bound for what any wrapper around it can reach.
template <class T>
void eigh_lapack_syevd(benchmark::State& state) {
    using kfac::backend::detail::syevd_work;
    if (lapack_skipped(state)) return;
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    const auto ni = static_cast<blas_int>(n);
    matrix<T> q = a;
    vector<T> w(n);
    T work_query = 0;
    blas_int iwork_query = 0;
    if (syevd_work(ni, q.data(), ni, w.data(), &work_query, -1, &iwork_query, -1) != 0) {
        state.SkipWithError("syevd workspace query failed");
        return;
    }
    // The float query is rounded through float and comes back short for n >= 2895 (the
    // torch.linalg.eigh failure of perf-anchors §4); never go below the documented minimum.
    const index documented_lwork = 1 + 6 * n + 2 * n * n;
    const auto lwork = static_cast<blas_int>(
        std::max<index>(static_cast<index>(std::ceil(static_cast<double>(work_query))), documented_lwork));
    const auto liwork = std::max<blas_int>(iwork_query, static_cast<blas_int>(3 + 5 * n));
    std::vector<T> work(static_cast<std::size_t>(lwork));
    std::vector<blas_int> iwork(static_cast<std::size_t>(liwork));
    for (auto _ : state) {
        q = a;
        if (syevd_work(ni, q.data(), ni, w.data(), work.data(), lwork, iwork.data(), liwork) != 0) {
            state.SkipWithError("syevd failed");
            break;
        }
        benchmark::DoNotOptimize(q.data());
    }
    set_rate(state, eigen_flops(n));
}
#endif

// ---- the GEMM rate --------------------------------------------------------------------------

/// C = A·B of two n × n matrices (BLAS ?gemm with LAPACK builds, Eigen's product without), as
/// GFLOP/s at 2n³: what this machine's BLAS reaches on the kernel every other rate is read
/// against (plot_eigensolver.py draws the solvers' rates as fractions of it).
template <class T>
void gemm_reference(benchmark::State& state) {
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    matrix<T> c(n, n);
    for (auto _ : state) {
#if KFAC_HAS_LAPACK
        const auto ni = static_cast<kfac::backend::detail::blas_int>(n);
        kfac::backend::detail::gemm(CblasNoTrans, CblasNoTrans, ni, ni, ni, T(1), a.data(), ni, a.data(), ni, T(0),
                                    c.data(), ni);
#else
        c.noalias() = a * a;
#endif
        benchmark::DoNotOptimize(c.data());
    }
    const double d = static_cast<double>(n);
    set_rate(state, 2.0 * d * d * d);
}

// ---- damped inverse ------------------------------------------------------------------------

template <class T>
void inv_backend(benchmark::State& state) {
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    matrix<T> inverse;
    for (auto _ : state) {
        if (!kfac::backend::cpu_eigen<T>::damped_inverse(a, static_cast<T>(damping), inverse)) {
            state.SkipWithError("cpu_eigen::damped_inverse failed");
            break;
        }
        benchmark::DoNotOptimize(inverse.data());
    }
    set_rate(state, inverse_flops(n));
}

/// Eigen's Cholesky and a solve against the identity: the header-only fallback's natural
/// choice, which does 7n³/3 flops instead of n³ (the rate is still given under n³).
template <class T>
void inv_eigen_llt(benchmark::State& state) {
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    matrix<T> m;
    matrix<T> inverse;
    for (auto _ : state) {
        m = a;
        m.diagonal().array() += static_cast<T>(damping);
        Eigen::LLT<matrix<T>> llt(m);
        if (llt.info() != Eigen::Success) {
            state.SkipWithError("LLT failed");
            break;
        }
        inverse = llt.solve(matrix<T>::Identity(n, n));
        benchmark::DoNotOptimize(inverse.data());
    }
    set_rate(state, inverse_flops(n));
}

#if KFAC_HAS_LAPACK
/// potrf + potri on the lower triangle and nothing else (the backend also mirrors the result
/// into the upper triangle and checks it is finite).
template <class T>
void inv_lapack_potri(benchmark::State& state) {
    if (lapack_skipped(state)) return;
    const index n = state.range(0);
    const matrix<T>& a = wishart<T>(n);
    const auto ni = static_cast<blas_int>(n);
    matrix<T> m;
    for (auto _ : state) {
        m = a;
        m.diagonal().array() += static_cast<T>(damping);
        if (kfac::backend::detail::cholesky_inverse_lower(ni, m.data(), ni) != 0) {
            state.SkipWithError("potrf/potri failed");
            break;
        }
        benchmark::DoNotOptimize(m.data());
    }
    set_rate(state, inverse_flops(n));
}
#endif

// ---- size sweeps ---------------------------------------------------------------------------
// Small and medium sizes: automatic iteration count, 5 repetitions, median reported.
// n = 2048: one call per repetition, 3 repetitions. n = 4608: a single call (Eigen's solver
// takes ~35 s in float there). Wall-clock time throughout.

void sizes_small(benchmark::internal::Benchmark* b) {
    b->ArgName("n")
        ->ArgsProduct({{64, 128, 256, 577, 1024}})
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

void size_2048(benchmark::internal::Benchmark* b) {
    b->ArgName("n")
        ->Args({2048})
        ->Iterations(1)
        ->Repetitions(3)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

/// n and the drift δ in thousandths: 1 %, 5 %, 10 %, 20 % relative off-diagonal movement
/// (n = 64 for the smoke test).
void sizes_drift(benchmark::internal::Benchmark* b) {
    b->ArgNames({"n", "drift_permille"})
        ->ArgsProduct({{64, 1024, 2048}, {10, 50, 100, 200}})
        ->Repetitions(3)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

void size_4608(benchmark::internal::Benchmark* b) {
    b->ArgName("n")->Args({4608})->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_TEMPLATE(eigh_eigen_saes, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_eigen_saes, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(eigh_eigen_saes, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(eigh_eigen_saes, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_eigen_saes, double)->Apply(size_2048);
// No n = 4608 for Eigen's solver in double: one call takes ~80 s here (perf-anchors §4), longer
// than the whole rest of this sweep, and says nothing new (syevd is ~5x faster there).

BENCHMARK_TEMPLATE(eigh_backend, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_backend, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(eigh_backend, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(eigh_backend, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_backend, double)->Apply(size_2048);
BENCHMARK_TEMPLATE(eigh_backend, double)->Apply(size_4608);

#if KFAC_HAS_LAPACK
BENCHMARK_TEMPLATE(eigh_lapack_syevd, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_lapack_syevd, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(eigh_lapack_syevd, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(eigh_lapack_syevd, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(eigh_lapack_syevd, double)->Apply(size_2048);
BENCHMARK_TEMPLATE(eigh_lapack_syevd, double)->Apply(size_4608);
#endif

BENCHMARK_TEMPLATE(reuse_drift, float)->Apply(sizes_drift);

BENCHMARK_TEMPLATE(gemm_reference, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(gemm_reference, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(gemm_reference, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(gemm_reference, double)->Apply(size_2048);

BENCHMARK_TEMPLATE(inv_backend, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_backend, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_backend, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(inv_backend, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_backend, double)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_backend, double)->Apply(size_4608);

BENCHMARK_TEMPLATE(inv_eigen_llt, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_eigen_llt, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_eigen_llt, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(inv_eigen_llt, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_eigen_llt, double)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_eigen_llt, double)->Apply(size_4608);

#if KFAC_HAS_LAPACK
BENCHMARK_TEMPLATE(inv_lapack_potri, float)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_lapack_potri, float)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_lapack_potri, float)->Apply(size_4608);
BENCHMARK_TEMPLATE(inv_lapack_potri, double)->Apply(sizes_small);
BENCHMARK_TEMPLATE(inv_lapack_potri, double)->Apply(size_2048);
BENCHMARK_TEMPLATE(inv_lapack_potri, double)->Apply(size_4608);
#endif

int main(int argc, char** argv) {
    benchmark::AddCustomContext("KFAC_EIGEN_SOLVER_MAX_DIM", std::to_string(KFAC_EIGEN_SOLVER_MAX_DIM));
    return kfac_bench::run_cpu_benchmarks(argc, argv);
}
