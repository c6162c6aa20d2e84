// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda.cuh
/// The CUDA backend: factors, second-order data and gradients in device memory; statistics
/// and preconditioning with cuBLAS, decompositions with cuSOLVER, the element-wise work with
/// Thrust. It meets the backend contract documented in kfac/backend/cpu_eigen.hpp and plugs
/// into the same kfac::KFAC template:
///
/// ```
///   #include <kfac/backend/cuda.cuh>      // compile with nvcc, link kfac::cuda
///   kfac::KFAC<kfac::backend::cuda<float>> precond(opts);
/// ```
///
/// Layer views may point to host or device memory (tensor_view::space): device buffers of
/// the host framework are read and written in place; host buffers are copied once per call.
/// Numerics follow the CPU backend operation for operation (same scalings, the same
/// damping arithmetic); only the summation order inside the library kernels differs.
///
/// Streams: every call goes to the legacy default stream (see cuda_support.cuh), so the
/// library's work is ordered after the framework's work on blocking streams. Results that
/// the host must see (finiteness, solver status, kl_clip's dot product) synchronise; the rest
/// is queued, and transfers() counts both. The preconditioner runs a device backend's layer
/// tasks from one host thread.
///
/// Parts: the statistics of every layer kind (detail/cuda_statistics.cuh), the optional members
/// of unit-wise blocks, diagonal factors, eigenbasis reuse and grouped convolutions
/// (detail/cuda_layer_kinds.cuh), small factors decomposed together
/// (detail/cuda_batched_eigen.cuh), compute::ekfac's scaling (detail/cuda_ekfac_scaling.cuh),
/// over the device matrix and checked helpers of detail/cuda_storage.cuh; this file adds construction, transfers, decompositions,
/// preconditioning and gradients.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "kfac/backend/ekfac_operations.hpp"
#include "kfac/backend/detail/cuda_batched_eigen.cuh"
#include "kfac/backend/detail/cuda_ekfac_scaling.cuh"
#include "kfac/backend/detail/cuda_layer_kinds.cuh"
#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_statistics.cuh"
#include "kfac/backend/detail/cuda_storage.cuh"
#include "kfac/backend/detail/cuda_support.cuh"
#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/config.hpp"
#include "kfac/layers/cuda_number_formats.cuh"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/precision.hpp"
#include "kfac/options.hpp"

namespace kfac::backend {

/// Number of CUDA devices this process sees; 0 without a device or a driver. Never throws.
inline int cuda_device_count() noexcept { return cuda_detail::device_count(); }

/// CUDA backend (cuBLAS, cuSOLVER, Thrust).
/// @tparam Scalar float or double: the precision of factors, decompositions and gradients.
template <class Scalar = float>
struct cuda : cuda_detail::cuda_statistics<Scalar>, cuda_detail::cuda_layer_kinds<Scalar>,
              cuda_detail::cuda_batched_eigen<Scalar> {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::backend::cuda<Scalar>: Scalar must be float or double");

    using scalar_type = Scalar;                          ///< the compute type: float or double
    using index = std::int64_t;                          ///< rows, columns and element counts
    using matrix = cuda_detail::device_matrix<Scalar>;   ///< column-major, dense, in device memory
    using vector = matrix;  ///< n × 1
    using host_matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;  ///< a column-major host copy
    using pinned_buffer = cuda_detail::pinned_buffer<Scalar>;  ///< page-locked host memory for staging collectives
    /// Device scratch kept per layer: uploaded host views, patches, permuted gradients.
    using workspace = cuda_detail::device_workspace<Scalar>;
    using channel_buffer = cuda_detail::device_buffer<Scalar>;  ///< device memory of Scalar values
    /// Counts of synchronisations, device-to-host and host-to-device copies (members
    /// synchronizations, device_to_host, host_to_device); two readings subtract.
    using transfer_counts = cuda_detail::transfer_counts;

    /// Nothing to do: library calls are issued from one host thread.
    struct serial_blas_scope {
        serial_blas_scope() {}   // NOLINT(modernize-use-equals-default): keeps the guard non-trivial
        ~serial_blas_scope() {}  // NOLINT(modernize-use-equals-default)
        serial_blas_scope(const serial_blas_scope&) = delete;
        serial_blas_scope& operator=(const serial_blas_scope&) = delete;
    };

    /// Synchronisations and host↔device copies of every CUDA backend of this process so far;
    /// the difference of two readings is what the calls between them cost
    /// (bench/bench_cuda.cu counts a step with it).
    static transfer_counts transfers() noexcept { return cuda_detail::transfer_ledger::process().read(); }

    /// Whether inverse updates decompose same-size factors of at most 32 rows together
    /// (detail/cuda_batched_eigen.cuh; default on), for every CUDA backend of the process.
    static void batch_small_factors(bool on) noexcept {
        cuda_detail::small_factor_batching().store(on, std::memory_order_relaxed);
    }
    /// Whether small factors are decomposed together (batch_small_factors()).
    static bool batches_small_factors() noexcept {
        return cuda_detail::small_factor_batching().load(std::memory_order_relaxed);
    }

    static constexpr bool device_memory = true;  ///< factors, second-order data and gradients live on the device

    // --- construction and transfer ----------------------------------------------------------

    /// A rows × cols zero matrix.
    static matrix zeros(index rows, index cols) {
        matrix m(rows, cols);
        if (m.size() > 0)
            cuda_detail::check(cudaMemsetAsync(m.data(), 0, calls::bytes(m.size()), cuda_detail::stream()), "cudaMemsetAsync");
        return m;
    }
    /// The n × n matrix with `diagonal` on its diagonal, 0 elsewhere.
    static matrix scaled_identity(index n, Scalar diagonal) {
        matrix m(n, n);
        calls::launch("scaled_identity", [&] { kernels::scaled_identity(calls::policy(), m.data(), n, diagonal); });
        return m;
    }
    static matrix identity(index n) { return scaled_identity(n, Scalar(1)); }  ///< the n × n identity
    /// n ones.
    static vector ones(index n) {
        vector v(n, 1);
        calls::launch("fill", [&] { kernels::fill(calls::policy(), v.data(), n, Scalar(1)); });
        return v;
    }

    /// Whether the device can copy from `p`: device, managed or pinned host memory, not
    /// ordinary host memory (which the driver would read as a device address).
    static bool points_to_device_memory(const void* p) {
        cudaPointerAttributes attributes{};
        if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
            (void)cudaGetLastError();  // clear the sticky-free error the query left
            return false;
        }
        return attributes.type != cudaMemoryTypeUnregistered;
    }

    /// Column-major host copy (synchronises).
    static host_matrix to_host(const matrix& m) {
        host_matrix h(m.rows(), m.cols());
        if (m.size() > 0) cuda_detail::note_blocking_download();
        if (m.size() > 0)
            cuda_detail::check(cudaMemcpy(h.data(), m.data(), calls::bytes(m.size()), cudaMemcpyDeviceToHost), "cudaMemcpy");
        return h;
    }
    /// A device matrix holding the host matrix `h`.
    static matrix from_host(const host_matrix& h) {
        matrix m(h.rows(), h.cols());
        if (m.size() > 0) cuda_detail::note_blocking_upload();
        if (m.size() > 0)
            cuda_detail::check(cudaMemcpy(m.data(), h.data(), calls::bytes(m.size()), cudaMemcpyHostToDevice), "cudaMemcpy");
        return m;
    }
    /// Staging of collectives (kfac/detail/host_staging.hpp); both synchronise.
    static void download(const Scalar* device, Scalar* host, std::size_t count) {
        cuda_detail::note_blocking_download();
        cuda_detail::check(cudaMemcpy(host, device, count * sizeof(Scalar), cudaMemcpyDeviceToHost), "cudaMemcpy(download)");
    }
    /// Copies `count` values from host memory to the device (synchronises).
    static void upload(const Scalar* host, Scalar* device, std::size_t count) {
        cuda_detail::note_blocking_upload();
        cuda_detail::check(cudaMemcpy(device, host, count * sizeof(Scalar), cudaMemcpyHostToDevice), "cudaMemcpy(upload)");
    }

    // --- second-order data ---------------------------------------------------------------

    /// M = Q diag(λ) Qᵀ, λ ascending (cuSOLVER ?syevd, divide and conquer like the CPU's
    /// LAPACK path). devInfo > 0 (no convergence) returns false; < 0 is a bug and throws.
    static bool symmetric_eigen(const matrix& m, matrix& q, vector& lambda) {
        if (cuda_detail::cuda_batched_eigen<Scalar>::take_prefetched(m, q, lambda)) return true;  // decomposed ahead
        const int n = calls::narrow(m.rows());
        q = m;
        lambda.resize(m.rows(), 1);
        auto& scratch = cuda_detail::solver_scratch<Scalar>::of_this_thread();
        const int lwork = cuda_detail::syevd_workspace<Scalar>(n, q.data(), lambda.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        cuda_detail::syevd<Scalar>(n, q.data(), lambda.data(), scratch.work.data(), lwork, scratch.info.data());
        if (!calls::solver_succeeded(scratch.read_info(), "cusolverDn?syevd")) return false;
        return all_finite(q) && all_finite(lambda);
    }

    /// inverse = (M + damping·I)⁻¹ by Cholesky (potrf + potri), falling back to LU when
    /// rounding leaves the matrix not quite SPD, as the CPU backend does.
    static bool damped_inverse(const matrix& m, Scalar damping, matrix& inverse) {
        const int n = calls::narrow(m.rows());
        auto damped = [&](matrix& out) {
            out = m;
            calls::launch("add_to_diagonal", [&] { kernels::add_to_diagonal(calls::policy(), out.data(), out.rows(), damping); });
        };
        damped(inverse);
        auto& scratch = cuda_detail::solver_scratch<Scalar>::of_this_thread();
        int lwork = cuda_detail::potrf_workspace<Scalar>(n, inverse.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        cuda_detail::potrf<Scalar>(n, inverse.data(), scratch.work.data(), lwork, scratch.info.data());
        if (calls::solver_succeeded(scratch.read_info(), "cusolverDn?potrf")) {
            lwork = cuda_detail::potri_workspace<Scalar>(n, inverse.data());
            scratch.work.reserve(static_cast<std::size_t>(lwork));
            cuda_detail::potri<Scalar>(n, inverse.data(), scratch.work.data(), lwork, scratch.info.data());
            if (calls::solver_succeeded(scratch.read_info(), "cusolverDn?potri")) {
                calls::launch("mirror_lower", [&] { kernels::mirror_lower(calls::policy(), inverse.data(), inverse.rows()); });
                return all_finite(inverse);
            }
        }
        matrix lu;
        damped(lu);
        lwork = cuda_detail::getrf_workspace<Scalar>(n, lu.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        scratch.pivots.reserve(static_cast<std::size_t>(n));
        cuda_detail::getrf<Scalar>(n, lu.data(), scratch.work.data(), scratch.pivots.data(), scratch.info.data());
        if (!calls::solver_succeeded(scratch.read_info(), "cusolverDn?getrf")) return false;  // exactly singular
        inverse = identity(m.rows());
        cuda_detail::getrs<Scalar>(n, lu.data(), scratch.pivots.data(), inverse.data(), scratch.info.data());
        if (!calls::solver_succeeded(scratch.read_info(), "cusolverDn?getrs")) return false;
        return all_finite(inverse);
    }

    // --- preconditioning -----------------------------------------------------------------

    /// C = op(A)·op(B).
    static void multiply(const matrix& a, bool trans_a, const matrix& b, bool trans_b, matrix& c) {
        const index m = trans_a ? a.cols() : a.rows();
        const index k = trans_a ? a.rows() : a.cols();
        const index n = trans_b ? b.rows() : b.cols();
        c.resize(m, n);
        cuda_detail::gemm<Scalar>(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, calls::narrow(m),
                                  calls::narrow(n), calls::narrow(k), Scalar(1), a.data(), calls::narrow(std::max<index>(1, a.rows())),
                                  b.data(), calls::narrow(std::max<index>(1, b.rows())), Scalar(0), c.data(),
                                  calls::narrow(std::max<index>(1, m)));
    }

    /// v ← max(v, 0).
    static void clamp_nonnegative(vector& v) {
        calls::launch("clamp_nonnegative", [&] { kernels::clamp_nonnegative(calls::policy(), v.data(), v.size()); });
    }
    /// v ← v + s.
    static void add_constant(vector& v, Scalar s) {
        calls::launch("add_constant", [&] { kernels::add_constant(calls::policy(), v.data(), v.size(), s); });
    }
    /// d(i, j) = 1 / (a_i·g_j + damping).
    static void inverse_eigen_product(const vector& a, const vector& g, Scalar damping, matrix& d) {
        d.resize(a.size(), g.size());
        calls::launch("inverse_eigen_product", [&] {
            kernels::inverse_eigen_product(calls::policy(), a.data(), a.size(), g.data(), g.size(), damping, d.data());
        });
    }
    /// v(i, j) ← v(i, j) / (a_i·g_j + damping).
    static void divide_by_eigen_product(matrix& v, const vector& a, const vector& g, Scalar damping) {
        calls::launch("divide_by_eigen_product", [&] {
            kernels::divide_by_eigen_product(calls::policy(), v.data(), a.data(), a.size(), g.data(), g.size(), damping);
        });
    }
    /// v ← v ∘ d.
    static void multiply_elementwise(matrix& v, const matrix& d) {
        calls::launch("multiply_elementwise", [&] { kernels::multiply_elementwise(calls::policy(), v.data(), d.data(), v.size()); });
    }

    // --- checks and reductions (these synchronise) ----------------------------------------

    static bool all_finite(const matrix& m) { return calls::all_finite(m); }  ///< no NaN, no ±Inf
    /// Whether every element of a device view of the compute type is finite (the overflow vote
    /// of loss scaling, kfac/detail/engine_loss_scale.hpp).
    static bool device_view_finite(const tensor_view<const Scalar>& v) {
        bool ok = false;
        calls::launch("count_non_finite", [&] {
            cuda_detail::note_blocking_download();
            ok = kernels::count_non_finite(calls::sync_policy(), v.data, v.size()) == 0;
        });
        return ok;
    }

    // --- decompositions in double (kfac/backend/fp64_decompositions.hpp) --------------------

    /// symmetric_eigen() in double: M widened exactly, the result rounded once to Scalar.
    static bool symmetric_eigen_fp64(const matrix& m, matrix& q, vector& lambda) {
        if constexpr (std::is_same_v<Scalar, double>) {
            return symmetric_eigen(m, q, lambda);
        } else {
            using wide = cuda<double>;
            typename wide::matrix q64, lambda64;
            if (!wide::symmetric_eigen(converted<double>(m), q64, lambda64)) return false;
            q = converted<Scalar>(q64);
            lambda = converted<Scalar>(lambda64);
            return all_finite(q) && all_finite(lambda);
        }
    }
    /// damped_inverse() in double: M widened exactly, the inverse rounded once to Scalar.
    static bool damped_inverse_fp64(const matrix& m, double damping, matrix& inverse) {
        if constexpr (std::is_same_v<Scalar, double>) {
            return damped_inverse(m, damping, inverse);
        } else {
            using wide = cuda<double>;
            typename wide::matrix inverse64;
            if (!wide::damped_inverse(converted<double>(m), damping, inverse64)) return false;
            inverse = converted<Scalar>(inverse64);
            return all_finite(inverse);
        }
    }
    // --- device views in another format (docs/precision.md) ---------------------------------

    /// A device view of bf16, fp16 or the other of float/double, read into `buffer` as Scalar.
    static tensor_view<const Scalar> widen_device_view(const number_view<const void>& v, channel_buffer& buffer) {
        const auto n = static_cast<std::size_t>(v.size());
        buffer.reserve(n);
        calls::launch("widen_elements", [&] {
            if (v.format == precision::bf16 || v.format == precision::fp16)
                kernels::widen_elements(calls::policy(), static_cast<const std::uint16_t*>(v.data), v.size(), v.format,
                                        buffer.data());
            else if (v.format == precision::fp32)
                kernels::convert(calls::policy(), static_cast<const float*>(v.data), v.size(), buffer.data());
            else
                kernels::convert(calls::policy(), static_cast<const double*>(v.data), v.size(), buffer.data());
        });
        tensor_view<const Scalar> out = v.template as<const Scalar>();
        out.data = buffer.data();
        return out;
    }
    /// `count` values of Scalar (device memory) written into a device view of another format,
    /// each rounded once to nearest.
    static void narrow_device_view(const Scalar* from, const number_view<void>& to) {
        calls::launch("narrow_elements", [&] {
            if (to.format == precision::bf16 || to.format == precision::fp16)
                kernels::narrow_elements(calls::policy(), from, to.size(), to.format, static_cast<std::uint16_t*>(to.data));
            else if (to.format == precision::fp32)
                kernels::convert(calls::policy(), from, to.size(), static_cast<float*>(to.data));
            else
                kernels::convert(calls::policy(), from, to.size(), static_cast<double*>(to.data));
        });
    }

    /// How many of `count` values (device memory) do not round to a finite value of `format`
    /// (the write-back's check of a view narrower than Scalar). Synchronises.
    static std::int64_t count_beyond_format(const Scalar* from, std::int64_t count, precision format) {
        std::int64_t beyond = 0;
        calls::launch("count_beyond_format", [&] {
            cuda_detail::note_blocking_download();
            beyond = kernels::count_beyond_format(calls::sync_policy(), from, count, format);
        });
        return beyond;
    }

    /// A device matrix in another floating-point type.
    template <class To, class From>
    static cuda_detail::device_matrix<To> converted(const cuda_detail::device_matrix<From>& m) {
        cuda_detail::device_matrix<To> out(m.rows(), m.cols());
        calls::launch("convert", [&] { kernels::convert(calls::policy(), m.data(), m.size(), out.data()); });
        return out;
    }
    /// Finiteness of the lower triangle only (the part a statistic sum defines).
    static bool lower_all_finite(const matrix& m) {
        bool ok = false;
        calls::launch("count_non_finite",
               [&] {
            cuda_detail::note_blocking_download();
            ok = kernels::count_non_finite(calls::sync_policy(), m.data(), m.size(), m.rows()) == 0; });
        return ok;
    }
    /// Σ x∘y over all entries, accumulated in double.
    static double frobenius_dot(const matrix& x, const matrix& y) {
        double s = 0.0;
        calls::launch("frobenius_dot", [&] {
            cuda_detail::note_blocking_download();
            s = kernels::frobenius_dot(calls::sync_policy(), x.data(), y.data(), x.size()); });
        return s;
    }

    /// Every layer's gradient checks with one synchronisation (kfac/backend/gradient_checks.hpp):
    /// the pairs cut into chunks of 2¹⁴ elements, one thread per chunk summing in order, then
    /// one per pair summing its chunks in order (so the result does not depend on the launch),
    /// the tables uploaded in one copy and the results read in one.
    static void gradient_checks(const std::vector<const matrix*>& gammas, const std::vector<const matrix*>& ps,
                                std::vector<std::int64_t>& non_finite, std::vector<double>& dots) {
        const auto pairs = static_cast<index>(gammas.size());
        non_finite.assign(gammas.size(), 0);
        dots.assign(gammas.size(), 0.0);
        if (pairs == 0) return;
        constexpr index chunk = index{1} << 14;
        std::vector<const Scalar*> xs(gammas.size()), ys(gammas.size());
        std::vector<index> begin(gammas.size() + 1, 0);
        std::vector<kernels::check_chunk> chunks;
        for (index p = 0; p < pairs; ++p) {
            const auto& gamma = *gammas[static_cast<std::size_t>(p)];
            const auto& pre = *ps[static_cast<std::size_t>(p)];
            if (gamma.size() != pre.size()) throw error("gradient_checks: a gradient and its preconditioned one differ in size");
            xs[static_cast<std::size_t>(p)] = pre.data();
            ys[static_cast<std::size_t>(p)] = gamma.data();
            for (index first = 0; first < gamma.size(); first += chunk)
                chunks.push_back({p, first, std::min(chunk, gamma.size() - first)});
            begin[static_cast<std::size_t>(p) + 1] = static_cast<index>(chunks.size());
        }
        const auto n_chunks = static_cast<index>(chunks.size());
        // One upload: [xs | ys | begin | chunks], every piece 8-byte aligned.
        const std::size_t pointer_bytes = xs.size() * sizeof(const Scalar*), begin_bytes = begin.size() * sizeof(index);
        const std::size_t chunk_bytes = chunks.size() * sizeof(kernels::check_chunk);
        std::vector<unsigned char> table(2 * pointer_bytes + begin_bytes + chunk_bytes);
        std::memcpy(table.data(), xs.data(), pointer_bytes);
        std::memcpy(table.data() + pointer_bytes, ys.data(), pointer_bytes);
        std::memcpy(table.data() + 2 * pointer_bytes, begin.data(), begin_bytes);
        if (chunk_bytes > 0) std::memcpy(table.data() + 2 * pointer_bytes + begin_bytes, chunks.data(), chunk_bytes);
        thread_local cuda_detail::device_buffer<unsigned char> device_table;
        thread_local cuda_detail::device_buffer<double> results;  // chunk dots, chunk counts, pair dots, pair counts
        results.reserve(static_cast<std::size_t>(2 * (n_chunks + pairs)));
        const unsigned char* d_table = calls::upload_table(table, device_table, "cudaMemcpyAsync(gradient check tables)");
        const auto* d_xs = reinterpret_cast<const Scalar* const*>(d_table);
        const auto* d_ys = reinterpret_cast<const Scalar* const*>(d_table + pointer_bytes);
        const auto* d_begin = reinterpret_cast<const index*>(d_table + 2 * pointer_bytes);
        const auto* d_chunks = reinterpret_cast<const kernels::check_chunk*>(d_table + 2 * pointer_bytes + begin_bytes);
        double* chunk_dot = results.data();
        auto* chunk_bad = reinterpret_cast<std::int64_t*>(results.data() + n_chunks);
        double* pair_dot = results.data() + 2 * n_chunks;
        auto* pair_bad = reinterpret_cast<std::int64_t*>(results.data() + 2 * n_chunks + pairs);
        calls::launch("chunk_checks", [&] {
            kernels::chunk_checks(calls::policy(), d_xs, d_ys, d_chunks, n_chunks, chunk_dot, chunk_bad);
        });
        calls::launch("pair_totals", [&] {
            kernels::pair_totals(calls::policy(), d_begin, pairs, chunk_dot, chunk_bad, pair_dot, pair_bad);
        });
        std::vector<double> host(static_cast<std::size_t>(2 * pairs));
        cuda_detail::note_blocking_download();
        cuda_detail::check(cudaMemcpy(host.data(), pair_dot, host.size() * sizeof(double), cudaMemcpyDeviceToHost),
                           "cudaMemcpy(gradient checks)");
        std::copy(host.begin(), host.begin() + pairs, dots.begin());
        std::memcpy(non_finite.data(), host.data() + pairs, static_cast<std::size_t>(pairs) * sizeof(std::int64_t));
    }

    // --- gradients -----------------------------------------------------------------------

    /// gamma ← Γᵀ (A_dim × G_dim): weight row j, then bias j, as column j. Two strided copies
    /// from host or device views.
    static void load_gradient(matrix& gamma, tensor_view<const Scalar> w, tensor_view<const Scalar> b) {
        const index rows = w.extent(0), cols = w.size() / rows, a_dim = cols + (b.empty() ? 0 : 1);
        gamma.resize(a_dim, rows);
        if (w.space == memory_space::host) cuda_detail::note_upload();
        if (!b.empty() && b.space == memory_space::host) cuda_detail::note_upload();
        cuda_detail::check(cudaMemcpy2DAsync(gamma.data(), calls::bytes(a_dim), w.data, calls::bytes(cols), calls::bytes(cols),
                                             static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                           "cudaMemcpy2DAsync(weight gradient)");
        if (!b.empty())
            cuda_detail::check(cudaMemcpy2DAsync(gamma.data() + cols, calls::bytes(a_dim), b.data, calls::bytes(1), calls::bytes(1),
                                                 static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                               "cudaMemcpy2DAsync(bias gradient)");
    }

    /// weight and bias ← scale·Pᵀ's columns; returns once host views hold the result.
    static void store_gradient(const matrix& pt, Scalar scale, tensor_view<Scalar> w, tensor_view<Scalar> b) {
        const index rows = w.extent(0), cols = w.size() / rows, a_dim = pt.rows();
        const Scalar* src = pt.data();
        thread_local cuda_detail::device_buffer<Scalar> scaled;
        if (scale != Scalar(1)) {
            scaled.reserve(static_cast<std::size_t>(pt.size()));
            calls::launch("scaled_copy", [&] { kernels::scaled_copy(calls::policy(), pt.data(), pt.size(), scale, scaled.data()); });
            src = scaled.data();
        }
        cuda_detail::check(cudaMemcpy2DAsync(w.data, calls::bytes(cols), src, calls::bytes(a_dim), calls::bytes(cols),
                                             static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                           "cudaMemcpy2DAsync(weight gradient)");
        if (!b.empty())
            cuda_detail::check(cudaMemcpy2DAsync(b.data, calls::bytes(1), src + cols, calls::bytes(a_dim), calls::bytes(1),
                                                 static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                               "cudaMemcpy2DAsync(bias gradient)");
        if (w.space == memory_space::host) cuda_detail::note_download();
        if (!b.empty() && b.space == memory_space::host) cuda_detail::note_download();
        if (w.space == memory_space::host || (!b.empty() && b.space == memory_space::host)) {
            cuda_detail::note_synchronization();
            cuda_detail::check(cudaStreamSynchronize(cuda_detail::stream()), "cudaStreamSynchronize");
        }
    }

private:
    using calls = cuda_detail::device_calls<Scalar>;
};

/// compute::ekfac's operations on the CUDA backend (detail/cuda_ekfac_scaling.cuh).
template <class Scalar>
struct ekfac_operations<cuda<Scalar>> : cuda_detail::cuda_ekfac_operations<Scalar> {};

}  // namespace kfac::backend
