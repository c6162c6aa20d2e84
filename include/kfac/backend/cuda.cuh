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
/// is queued. The preconditioner runs a device backend's layer tasks from one host thread.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_support.cuh"
#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/config.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

/// Most elements of one chunk of conv patches (positions × A_dim) on the device: 2²⁶ is
/// 256 MiB in float. Larger inputs are processed in chunks, each one SYRK.
#ifndef KFAC_CUDA_PATCH_CHUNK_ELEMENTS
#define KFAC_CUDA_PATCH_CHUNK_ELEMENTS (std::int64_t{1} << 26)
#endif

namespace kfac::backend {

namespace cuda_detail {

/// A column-major rows × cols matrix in device memory (a vector is n × 1). Copies are
/// device-to-device; resize() keeps nothing, like Eigen's.
template <class T>
class device_matrix {
public:
    using index = std::int64_t;

    device_matrix() = default;
    device_matrix(index rows, index cols) { resize(rows, cols); }
    device_matrix(const device_matrix& o) { *this = o; }
    device_matrix(device_matrix&&) noexcept = default;
    device_matrix& operator=(device_matrix&&) noexcept = default;
    device_matrix& operator=(const device_matrix& o) {
        if (this == &o) return *this;
        resize(o.rows_, o.cols_);
        if (size() > 0)
            check(cudaMemcpyAsync(data(), o.data(), static_cast<std::size_t>(size()) * sizeof(T),
                                  cudaMemcpyDeviceToDevice, stream()),
                  "cudaMemcpyAsync");
        return *this;
    }
    ~device_matrix() = default;

    void resize(index rows, index cols) {
        if (rows * cols != size()) buffer_ = device_buffer<T>(static_cast<std::size_t>(rows * cols));
        rows_ = rows;
        cols_ = cols;
    }
    void resize(index n) { resize(n, 1); }

    [[nodiscard]] T* data() noexcept { return buffer_.data(); }
    [[nodiscard]] const T* data() const noexcept { return buffer_.data(); }
    [[nodiscard]] index rows() const noexcept { return rows_; }
    [[nodiscard]] index cols() const noexcept { return cols_; }
    [[nodiscard]] index size() const noexcept { return rows_ * cols_; }

private:
    device_buffer<T> buffer_;
    index rows_ = 0, cols_ = 0;
};

/// Scratch of the solver calls of one thread, kept between calls.
template <class T>
struct solver_scratch {
    device_buffer<T> work;
    device_buffer<int> info{1};
    device_buffer<int> pivots;

    static solver_scratch& of_this_thread() {
        thread_local solver_scratch s;
        return s;
    }
    /// The status the last solver call left in `info` (synchronises).
    int read_info() {
        int h = 0;
        check(cudaMemcpy(&h, info.data(), sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy(devInfo)");
        return h;
    }
};

}  // namespace cuda_detail

/// Number of CUDA devices this process sees; 0 without a device or a driver. Never throws.
inline int cuda_device_count() noexcept { return cuda_detail::device_count(); }

/// CUDA backend (cuBLAS, cuSOLVER, Thrust).
/// @tparam Scalar float or double: the precision of factors, decompositions and gradients.
template <class Scalar = float>
struct cuda {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "kfac::backend::cuda<Scalar>: Scalar must be float or double");

    using scalar_type = Scalar;
    using index = std::int64_t;
    using matrix = cuda_detail::device_matrix<Scalar>;
    using vector = matrix;  ///< n × 1
    using host_matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using pinned_buffer = cuda_detail::pinned_buffer<Scalar>;

    static constexpr bool device_memory = true;

    /// Nothing to do: library calls are issued from one host thread.
    struct serial_blas_scope {
        serial_blas_scope() {}   // NOLINT(modernize-use-equals-default): keeps the guard non-trivial
        ~serial_blas_scope() {}  // NOLINT(modernize-use-equals-default)
        serial_blas_scope(const serial_blas_scope&) = delete;
        serial_blas_scope& operator=(const serial_blas_scope&) = delete;
    };

    /// Device scratch kept per layer: uploaded host views, patches, permuted gradients.
    struct workspace {
        cuda_detail::device_buffer<Scalar> input, patches;
    };

    // --- construction and transfer ----------------------------------------------------------

    static matrix zeros(index rows, index cols) {
        matrix m(rows, cols);
        if (m.size() > 0)
            cuda_detail::check(cudaMemsetAsync(m.data(), 0, bytes(m.size()), cuda_detail::stream()), "cudaMemsetAsync");
        return m;
    }
    static matrix scaled_identity(index n, Scalar diagonal) {
        matrix m(n, n);
        launch("scaled_identity", [&] { kernels::scaled_identity(policy(), m.data(), n, diagonal); });
        return m;
    }
    static matrix identity(index n) { return scaled_identity(n, Scalar(1)); }
    static vector ones(index n) {
        vector v(n, 1);
        launch("fill", [&] { kernels::fill(policy(), v.data(), n, Scalar(1)); });
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
        if (m.size() > 0)
            cuda_detail::check(cudaMemcpy(h.data(), m.data(), bytes(m.size()), cudaMemcpyDeviceToHost), "cudaMemcpy");
        return h;
    }
    /// A device matrix holding the host matrix `h`.
    static matrix from_host(const host_matrix& h) {
        matrix m(h.rows(), h.cols());
        if (m.size() > 0)
            cuda_detail::check(cudaMemcpy(m.data(), h.data(), bytes(m.size()), cudaMemcpyHostToDevice), "cudaMemcpy");
        return m;
    }
    /// Staging of collectives (kfac/detail/host_staging.hpp); both synchronise.
    static void download(const Scalar* device, Scalar* host, std::size_t count) {
        cuda_detail::check(cudaMemcpy(host, device, count * sizeof(Scalar), cudaMemcpyDeviceToHost), "cudaMemcpy(download)");
    }
    static void upload(const Scalar* host, Scalar* device, std::size_t count) {
        cuda_detail::check(cudaMemcpy(device, host, count * sizeof(Scalar), cudaMemcpyHostToDevice), "cudaMemcpy(upload)");
    }

    // --- factor statistics ---------------------------------------------------------------

    /// Why this backend cannot precondition a layer (empty when it can); the preconditioner
    /// asks at registration. Conv1d runs as the Conv2d it equals; weight sharing `reduce`
    /// and normalisation layers have no device kernels yet.
    static std::string unsupported_layer(const layer_description& d) {
        if (is_normalization(d.kind))  // before `reduce`, a BatchNorm's default
            return std::string("a ") + kind_name(d.kind) + "'s unit-wise blocks are computed by the CPU backend only "
                   "(kfac::backend::cuda has no kernels for them yet); use kfac::backend::cpu_eigen, or exclude "
                   "the layer with options.skip_layers";
        if (d.sharing == weight_sharing::reduce)
            return "weight sharing 'reduce' is computed by the CPU backend only (kfac::backend::cuda has no "
                   "kernel for it yet); use weight_sharing::expand on the GPU or kfac::backend::cpu_eigen";
        return {};
    }

    /// sum = beta·sum + X̃ᵀX̃ / (N·S³) (lower triangle; S = 1 for Linear), golden §4.1–4.2.
    /// The bias's ones column is part of the SYRK operand, so one call gives the whole
    /// factor including the bias row and corner.
    static void accumulate_a_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> a,
                                       conv_patch_mode mode, Scalar beta, workspace& ws) {
        const index cols = d.weight_columns(), n_a = d.a_dim();
        if (d.kind == layer_kind::linear) {
            const index rows = a.size() / cols;
            const Scalar alpha = Scalar(1) / static_cast<Scalar>(rows);
            const Scalar* x = nullptr;
            if (!d.bias) {
                x = on_device(a, ws.input);
            } else {  // [X | 1] as an (in + 1) × rows column-major operand
                ws.input.reserve(static_cast<std::size_t>(n_a * rows));
                cuda_detail::check(cudaMemcpy2DAsync(ws.input.data(), bytes(n_a), a.data, bytes(cols), bytes(cols),
                                                     static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                                   "cudaMemcpy2DAsync(activations)");
                launch("fill_row", [&] { kernels::fill_row(policy(), ws.input.data(), n_a, cols, rows, Scalar(1)); });
                x = ws.input.data();
            }
            cuda_detail::gram<Scalar>(CUBLAS_OP_N, narrow(n_a), narrow(rows), alpha, x, narrow(n_a), beta, sum.data(),
                                      narrow(sum.rows()));
            return;
        }
        const index n = a.extent(0), channels = a.extent(1), height = a.extent(2), width = a.extent(3);
        const Scalar* input = on_device(a, ws.input);
        const patch_grid grid = make_patch_grid(d.conv, height, width, mode);
        const Scalar s = static_cast<Scalar>(grid.positions());
        const Scalar alpha = Scalar(1) / (static_cast<Scalar>(n) * s * s * s);  // golden §4.2
        const index total_rows = n * grid.rows;
        const index chunk_rows =
            std::max<index>(1, std::min<index>(total_rows, KFAC_CUDA_PATCH_CHUNK_ELEMENTS / std::max<index>(1, grid.cols * n_a)));
        const index ld = chunk_rows * grid.cols;
        ws.patches.reserve(static_cast<std::size_t>(ld * n_a));
        for (index first = 0; first < total_rows; first += chunk_rows) {
            const index count = std::min(chunk_rows, total_rows - first);
            launch("extract_patches", [&] {
                kernels::extract_patches(policy(), input, channels, height, width, d.conv, grid, first, count, d.bias,
                                         ws.patches.data(), ld);
            });
            cuda_detail::gram<Scalar>(CUBLAS_OP_T, narrow(n_a), narrow(count * grid.cols), alpha, ws.patches.data(),
                                      narrow(ld), first == 0 ? beta : Scalar(1), sum.data(), narrow(sum.rows()));
        }
    }

    /// sum = beta·sum + YᵀY / (N·S³) (golden §4.1, §4.2 step 5).
    static void accumulate_g_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> g,
                                       Scalar beta, workspace& ws) {
        const index out = d.out;
        if (d.kind == layer_kind::linear) {
            const index rows = g.size() / out;
            cuda_detail::gram<Scalar>(CUBLAS_OP_N, narrow(out), narrow(rows), Scalar(1) / static_cast<Scalar>(rows),
                                      on_device(g, ws.input), narrow(out), beta, sum.data(), narrow(sum.rows()));
            return;
        }
        const index n = g.extent(0), spatial = g.extent(2) * g.extent(3);
        const Scalar s = static_cast<Scalar>(spatial);
        const Scalar alpha = Scalar(1) / (static_cast<Scalar>(n) * s * s * s);
        const Scalar* y = on_device(g, ws.input);
        ws.patches.reserve(static_cast<std::size_t>(n * spatial * out));
        launch("channels_last", [&] { kernels::channels_last(policy(), y, n, out, spatial, ws.patches.data()); });
        cuda_detail::gram<Scalar>(CUBLAS_OP_T, narrow(out), narrow(n * spatial), alpha, ws.patches.data(),
                                  narrow(n * spatial), beta, sum.data(), narrow(sum.rows()));
    }

    /// F ← decay·F + weight·sym(sum), reading sum's lower triangle only.
    static void running_average(matrix& f, matrix& sum, Scalar decay, Scalar weight) {
        launch("running_average",
               [&] { kernels::running_average(policy(), f.data(), sum.data(), f.rows(), decay, weight); });
    }

    /// M ← s·M after mirroring its lower triangle into the upper one.
    static void scale_symmetric(matrix& m, Scalar s) {
        launch("mirror_lower", [&] { kernels::mirror_lower(policy(), m.data(), m.rows()); });
        launch("scale", [&] { kernels::scale(policy(), m.data(), m.size(), s); });
    }

    // --- second-order data ---------------------------------------------------------------

    /// M = Q diag(λ) Qᵀ, λ ascending (cuSOLVER ?syevd, divide and conquer like the CPU's
    /// LAPACK path). devInfo > 0 (no convergence) returns false; < 0 is a bug and throws.
    static bool symmetric_eigen(const matrix& m, matrix& q, vector& lambda) {
        const int n = narrow(m.rows());
        q = m;
        lambda.resize(m.rows(), 1);
        auto& scratch = cuda_detail::solver_scratch<Scalar>::of_this_thread();
        const int lwork = cuda_detail::syevd_workspace<Scalar>(n, q.data(), lambda.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        cuda_detail::syevd<Scalar>(n, q.data(), lambda.data(), scratch.work.data(), lwork, scratch.info.data());
        if (!solver_succeeded(scratch.read_info(), "cusolverDn?syevd")) return false;
        return all_finite(q) && all_finite(lambda);
    }

    /// inverse = (M + damping·I)⁻¹ by Cholesky (potrf + potri), falling back to LU when
    /// rounding leaves the matrix not quite SPD, as the CPU backend does.
    static bool damped_inverse(const matrix& m, Scalar damping, matrix& inverse) {
        const int n = narrow(m.rows());
        auto damped = [&](matrix& out) {
            out = m;
            launch("add_to_diagonal", [&] { kernels::add_to_diagonal(policy(), out.data(), out.rows(), damping); });
        };
        damped(inverse);
        auto& scratch = cuda_detail::solver_scratch<Scalar>::of_this_thread();
        int lwork = cuda_detail::potrf_workspace<Scalar>(n, inverse.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        cuda_detail::potrf<Scalar>(n, inverse.data(), scratch.work.data(), lwork, scratch.info.data());
        if (solver_succeeded(scratch.read_info(), "cusolverDn?potrf")) {
            lwork = cuda_detail::potri_workspace<Scalar>(n, inverse.data());
            scratch.work.reserve(static_cast<std::size_t>(lwork));
            cuda_detail::potri<Scalar>(n, inverse.data(), scratch.work.data(), lwork, scratch.info.data());
            if (solver_succeeded(scratch.read_info(), "cusolverDn?potri")) {
                launch("mirror_lower", [&] { kernels::mirror_lower(policy(), inverse.data(), inverse.rows()); });
                return all_finite(inverse);
            }
        }
        matrix lu;
        damped(lu);
        lwork = cuda_detail::getrf_workspace<Scalar>(n, lu.data());
        scratch.work.reserve(static_cast<std::size_t>(lwork));
        scratch.pivots.reserve(static_cast<std::size_t>(n));
        cuda_detail::getrf<Scalar>(n, lu.data(), scratch.work.data(), scratch.pivots.data(), scratch.info.data());
        if (!solver_succeeded(scratch.read_info(), "cusolverDn?getrf")) return false;  // exactly singular
        inverse = identity(m.rows());
        cuda_detail::getrs<Scalar>(n, lu.data(), scratch.pivots.data(), inverse.data(), scratch.info.data());
        if (!solver_succeeded(scratch.read_info(), "cusolverDn?getrs")) return false;
        return all_finite(inverse);
    }

    // --- preconditioning -----------------------------------------------------------------

    /// C = op(A)·op(B).
    static void multiply(const matrix& a, bool trans_a, const matrix& b, bool trans_b, matrix& c) {
        const index m = trans_a ? a.cols() : a.rows();
        const index k = trans_a ? a.rows() : a.cols();
        const index n = trans_b ? b.rows() : b.cols();
        c.resize(m, n);
        cuda_detail::gemm<Scalar>(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, narrow(m),
                                  narrow(n), narrow(k), Scalar(1), a.data(), narrow(std::max<index>(1, a.rows())),
                                  b.data(), narrow(std::max<index>(1, b.rows())), Scalar(0), c.data(),
                                  narrow(std::max<index>(1, m)));
    }

    static void clamp_nonnegative(vector& v) {
        launch("clamp_nonnegative", [&] { kernels::clamp_nonnegative(policy(), v.data(), v.size()); });
    }
    static void add_constant(vector& v, Scalar s) {
        launch("add_constant", [&] { kernels::add_constant(policy(), v.data(), v.size(), s); });
    }
    static void inverse_eigen_product(const vector& a, const vector& g, Scalar damping, matrix& d) {
        d.resize(a.size(), g.size());
        launch("inverse_eigen_product", [&] {
            kernels::inverse_eigen_product(policy(), a.data(), a.size(), g.data(), g.size(), damping, d.data());
        });
    }
    static void divide_by_eigen_product(matrix& v, const vector& a, const vector& g, Scalar damping) {
        launch("divide_by_eigen_product", [&] {
            kernels::divide_by_eigen_product(policy(), v.data(), a.data(), a.size(), g.data(), g.size(), damping);
        });
    }
    static void multiply_elementwise(matrix& v, const matrix& d) {
        launch("multiply_elementwise", [&] { kernels::multiply_elementwise(policy(), v.data(), d.data(), v.size()); });
    }

    // --- checks and reductions (these synchronise) ----------------------------------------

    static bool all_finite(const matrix& m) {
        bool ok = false;
        launch("count_non_finite", [&] { ok = kernels::count_non_finite(sync_policy(), m.data(), m.size()) == 0; });
        return ok;
    }
    static bool lower_all_finite(const matrix& m) {
        bool ok = false;
        launch("count_non_finite",
               [&] { ok = kernels::count_non_finite(sync_policy(), m.data(), m.size(), m.rows()) == 0; });
        return ok;
    }
    static double frobenius_dot(const matrix& x, const matrix& y) {
        double s = 0.0;
        launch("frobenius_dot", [&] { s = kernels::frobenius_dot(sync_policy(), x.data(), y.data(), x.size()); });
        return s;
    }

    // --- gradients -----------------------------------------------------------------------

    /// gamma ← Γᵀ (A_dim × G_dim): weight row j, then bias j, as column j. Two strided copies
    /// from host or device views.
    static void load_gradient(matrix& gamma, tensor_view<const Scalar> w, tensor_view<const Scalar> b) {
        const index rows = w.extent(0), cols = w.size() / rows, a_dim = cols + (b.empty() ? 0 : 1);
        gamma.resize(a_dim, rows);
        cuda_detail::check(cudaMemcpy2DAsync(gamma.data(), bytes(a_dim), w.data, bytes(cols), bytes(cols),
                                             static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                           "cudaMemcpy2DAsync(weight gradient)");
        if (!b.empty())
            cuda_detail::check(cudaMemcpy2DAsync(gamma.data() + cols, bytes(a_dim), b.data, bytes(1), bytes(1),
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
            launch("scaled_copy", [&] { kernels::scaled_copy(policy(), pt.data(), pt.size(), scale, scaled.data()); });
            src = scaled.data();
        }
        cuda_detail::check(cudaMemcpy2DAsync(w.data, bytes(cols), src, bytes(a_dim), bytes(cols),
                                             static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                           "cudaMemcpy2DAsync(weight gradient)");
        if (!b.empty())
            cuda_detail::check(cudaMemcpy2DAsync(b.data, bytes(1), src + cols, bytes(a_dim), bytes(1),
                                                 static_cast<std::size_t>(rows), cudaMemcpyDefault, cuda_detail::stream()),
                               "cudaMemcpy2DAsync(bias gradient)");
        if (w.space == memory_space::host || (!b.empty() && b.space == memory_space::host))
            cuda_detail::check(cudaStreamSynchronize(cuda_detail::stream()), "cudaStreamSynchronize");
    }

private:
    static std::size_t bytes(index count) { return static_cast<std::size_t>(count) * sizeof(Scalar); }

    /// cuBLAS and cuSOLVER take int dimensions.
    static int narrow(index v) {
        if (v > static_cast<index>(std::numeric_limits<int>::max())) {
            std::string what = std::to_string(v);  // appended: GCC 12 -Wrestrict bug 105329
            what += " exceeds the 32-bit dimensions cuBLAS and cuSOLVER take";
            throw error(what);
        }
        return static_cast<int>(v);
    }

    static auto policy() { return thrust::cuda::par_nosync.on(cuda_detail::stream()); }
    static auto sync_policy() { return thrust::cuda::par.on(cuda_detail::stream()); }

    /// Thrust reports failures as thrust::system_error; the library's callers expect kfac::error.
    template <class F>
    static void launch(const char* what, F&& f) {
        try {
            f();
        } catch (const thrust::system_error& e) {
            throw error(std::string("Thrust kernel ") + what + " failed: " + e.what());
        }
    }

    /// A device pointer to the view's elements: the view's own when it is in device memory,
    /// else a copy in `buffer`.
    static const Scalar* on_device(tensor_view<const Scalar> v, cuda_detail::device_buffer<Scalar>& buffer) {
        if (v.space == memory_space::device) return v.data;
        buffer.reserve(static_cast<std::size_t>(v.size()));
        cuda_detail::check(cudaMemcpyAsync(buffer.data(), v.data, bytes(v.size()), cudaMemcpyHostToDevice,
                                           cuda_detail::stream()),
                           "cudaMemcpyAsync(host view)");
        return buffer.data();
    }

    /// devInfo: 0 success, > 0 a numerical failure (the caller keeps its previous data),
    /// < 0 an invalid argument, which is a bug and throws.
    static bool solver_succeeded(int info, const char* call) {
        if (info < 0)
            cuda_detail::fail(call, "devInfo", info, "invalid argument (parameter -devInfo)");
        return info == 0;
    }
};

}  // namespace kfac::backend
