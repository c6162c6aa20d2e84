// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file mixed_precision.hpp
/// The examples' mixed precision (--precision): LibTorch's autocast around a forward pass.
/// bf16: CPU or CUDA autocast in bfloat16; fp16: CUDA autocast in half (with a loss scaler,
/// kfac::torch::grad_scaler, held by the caller); fp32: nothing.

#include <string>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

namespace mixed_precision {

// LibTorch 2.4 names the device in its autocast switches and deprecates the per-device ones
// of 1.13 (Debian's), which have no replacement there.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline void set_autocast(bool cuda, bool enabled, at::ScalarType type = at::kFloat) {
    const auto device = cuda ? at::kCUDA : at::kCPU;
    if (enabled) at::autocast::set_autocast_dtype(device, type);
    at::autocast::set_autocast_enabled(device, enabled);
}
#else
inline void set_autocast(bool cuda, bool enabled, at::ScalarType type = at::kFloat) {
    if (cuda) {
        if (enabled) at::autocast::set_autocast_gpu_dtype(type);
        at::autocast::set_enabled(enabled);
    } else {
        if (enabled) at::autocast::set_autocast_cpu_dtype(type);
        at::autocast::set_cpu_enabled(enabled);
    }
}
#endif

/// Autocast on for its lifetime (LibTorch 1.13's C++ switches, which have no scope guard).
class autocast_scope {
public:
    autocast_scope(const std::string& precision, const std::string& device) {
        if (precision == "fp32") return;
        const auto type = precision == "bf16" ? at::kBFloat16 : at::kHalf;
        cuda_ = device == "cuda";
        set_autocast(cuda_, true, type);
        on_ = true;
    }
    ~autocast_scope() {
        if (!on_) return;
        set_autocast(cuda_, false);
        at::autocast::clear_cache();  // the casts of the weights made for this pass
    }
    autocast_scope(const autocast_scope&) = delete;
    autocast_scope& operator=(const autocast_scope&) = delete;

private:
    bool on_ = false, cuda_ = false;
};

}  // namespace mixed_precision
