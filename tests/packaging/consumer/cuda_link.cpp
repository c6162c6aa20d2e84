// SPDX-License-Identifier: Apache-2.0
// Links the installed kfac::cuda from a host (g++) translation unit: its CCCL include
// directory and the cudart/cuBLAS/cuSOLVER libraries must resolve. Needs no GPU to build; it
// is never run by the tests.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <thrust/version.h>

#include <cstdio>

#include <kfac/kfac.hpp>

int main() {
    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    int cublas_version = 0;
    cublasGetProperty(MAJOR_VERSION, &cublas_version);
    int cusolver_version = 0;
    cusolverGetProperty(MAJOR_VERSION, &cusolver_version);
    std::printf("thrust %d, cuBLAS %d, cuSOLVER %d, %d device(s) (%s)\n", THRUST_VERSION,
                cublas_version, cusolver_version, devices, cudaGetErrorString(status));
    return 0;
}
