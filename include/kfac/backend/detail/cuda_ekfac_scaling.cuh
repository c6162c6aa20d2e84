// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_ekfac_scaling.cuh
/// compute::ekfac's operations on the CUDA backend (kfac/backend/ekfac_operations.hpp): the
/// captured rows kept in device memory to the step's estimate, the estimate by
/// device_ekfac_scaling.cuh over cuBLAS (strided-batched GEMMs), and the element-wise work on
/// the scaling by Thrust. kfac/backend/cuda.cuh names these the operations of backend::cuda.

#include <cstdint>
#include <vector>

#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_storage.cuh"
#include "kfac/backend/detail/cuda_support.cuh"
#include "kfac/backend/detail/device_ekfac_scaling.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::cuda_detail {

template <class Scalar>
struct cuda_ekfac_operations {
    static constexpr bool supported = true;
    using index = std::int64_t;
    using matrix = device_matrix<Scalar>;
    using vector = matrix;
    using rows_copy = device_buffer<Scalar>;
    using scratch = device_ekfac::scratch<device_buffer<Scalar>>;
    using calls = device_calls<Scalar>;

    /// The GEMMs and execution policy device_ekfac::accumulate_scaling() runs on.
    struct library {
        static auto policy() { return calls::policy(); }
        static cublasOperation_t op(bool transpose) { return transpose ? CUBLAS_OP_T : CUBLAS_OP_N; }
        static void gemm(bool ta, bool tb, index m, index n, index k, Scalar alpha, const Scalar* a, index lda,
                         const Scalar* b, index ldb, Scalar beta, Scalar* c, index ldc) {
            cuda_detail::gemm<Scalar>(op(ta), op(tb), calls::narrow(m), calls::narrow(n), calls::narrow(k), alpha, a,
                                      calls::narrow(lda), b, calls::narrow(ldb), beta, c, calls::narrow(ldc));
        }
        static void gemm_strided_batched(bool ta, bool tb, index m, index n, index k, Scalar alpha, const Scalar* a,
                                         index lda, index stride_a, const Scalar* b, index ldb, index stride_b,
                                         Scalar beta, Scalar* c, index ldc, index stride_c, index batch) {
            cuda_detail::gemm_strided_batched<Scalar>(op(ta), op(tb), calls::narrow(m), calls::narrow(n), calls::narrow(k),
                                                      alpha, a, calls::narrow(lda), stride_a, b, calls::narrow(ldb),
                                                      stride_b, beta, c, calls::narrow(ldc), stride_c,
                                                      calls::narrow(batch));
        }
    };

    /// A device copy of the view's elements (host or device memory), queued on the stream: a
    /// pageable host source is staged before the call returns, so the caller may reuse it.
    static tensor_view<const Scalar> keep(const tensor_view<const Scalar>& v, rows_copy& into) {
        tensor_view<const Scalar> kept = v;
        kept.space = memory_space::device;
        if (v.size() == 0) return kept;
        into.reserve(static_cast<std::size_t>(v.size()));
        if (v.space == memory_space::host) note_upload();
        check(cudaMemcpyAsync(into.data(), v.data, calls::bytes(v.size()), cudaMemcpyDefault, stream()),
              "cudaMemcpyAsync(EKFAC rows)");
        kept.data = into.data();
        return kept;
    }

    static void accumulate(matrix& s_t, const layer_description& d, const std::vector<tensor_view<const Scalar>>& a,
                           const std::vector<tensor_view<const Scalar>>& g, const matrix& q_a, const matrix& q_g,
                           Scalar beta, scratch& ws) {
        if (beta == Scalar(0)) s_t.resize(d.a_dim(), d.g_dim());
        calls::launch("EKFAC scaling", [&] {
            device_ekfac::accumulate_scaling<library>(s_t.data(), s_t.rows(), s_t.cols(), d, a, g, q_a.data(), q_a.rows(),
                                                      q_a.cols(), q_g.data(), q_g.rows(), q_g.cols(), beta, ws);
        });
    }
    static void outer_product(const vector& a, const vector& g, matrix& out) {
        out.resize(a.size(), g.size());
        calls::launch("outer_product", [&] {
            kernels::outer_product(calls::policy(), a.data(), a.size(), g.data(), g.size(), out.data());
        });
    }
    static void divide_by_damped(matrix& v_t, const matrix& s_t, Scalar damping) {
        calls::launch("divide_by_damped_scaling", [&] {
            kernels::divide_by_damped_scaling(calls::policy(), v_t.data(), s_t.data(), v_t.size(), damping);
        });
    }
    static void scale(matrix& m, Scalar s) {
        calls::launch("scale", [&] { kernels::scale(calls::policy(), m.data(), m.size(), s); });
    }
    static void divide(matrix& m, Scalar s) {
        calls::launch("divide", [&] { kernels::divide(calls::policy(), m.data(), m.size(), s); });
    }
    static void add_scaled(matrix& sum, Scalar s, const matrix& m) {
        calls::launch("axpby", [&] { kernels::axpby(calls::policy(), sum.data(), m.data(), sum.size(), Scalar(1), s); });
    }
    static void blend(matrix& s_t, const matrix& e, Scalar xi) {
        calls::launch("axpby", [&] {
            kernels::axpby(calls::policy(), s_t.data(), e.data(), s_t.size(), xi, Scalar(1) - xi);
        });
    }
};

}  // namespace kfac::backend::cuda_detail
