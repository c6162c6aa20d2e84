// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_number_formats.cuh
/// CUDA's 16-bit types as view elements: `kfac::layer_view<__nv_bfloat16>` and
/// `kfac::tensor_view<__half>` over device memory are read as bf16 and fp16 by
/// kfac::backend::cuda, which converts them on the device (docs/precision.md).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kfac/precision.hpp"

namespace kfac {

/// __nv_bfloat16 is bf16.
template <>
struct number_format<__nv_bfloat16> {
    static constexpr precision format = precision::bf16;  ///< __nv_bfloat16's format
};
/// __half is fp16.
template <>
struct number_format<__half> {
    static constexpr precision format = precision::fp16;  ///< __half's format
};

}  // namespace kfac
