// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eigen_number_formats.hpp
/// Eigen's 16-bit types as view elements on the CPU: `kfac::layer_view<Eigen::bfloat16>` and
/// `kfac::tensor_view<Eigen::half>` are read as bf16 and fp16 (kfac/precision.hpp).

#include <Eigen/Core>

#include "kfac/precision.hpp"

namespace kfac {

/// Eigen::bfloat16 is bf16.
template <>
struct number_format<Eigen::bfloat16> {
    static constexpr precision format = precision::bf16;  ///< Eigen::bfloat16's format
};
/// Eigen::half is fp16.
template <>
struct number_format<Eigen::half> {
    static constexpr precision format = precision::fp16;  ///< Eigen::half's format
};

}  // namespace kfac
