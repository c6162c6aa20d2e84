// SPDX-License-Identifier: Apache-2.0
// The GPU test program (kfac_cuda_tests): the backend's cases (cuda_backend_test.cu) and every
// layer kind's (cuda_layer_kinds_test.cu) in one nvcc translation unit. nvcc runs three front
// ends over a file (cudafe++, cicc, the host compiler), and the two files share nearly all of
// what those instantiate (both backends, the engines' declarations, Catch2): apart they took
// 78.2 s and 28.8 s of CPU, together 82.4 s. CTest runs each file's cases as its own test
// (Catch2's -# tags them by file: [#cuda_backend_test], [#cuda_layer_kinds_test]). Without a
// CUDA device the program prints why and exits 77, which CTest reports as skipped.

#include "cuda/cuda_backend_test.cu"
#include "cuda/cuda_layer_kinds_test.cu"

int main(int argc, char** argv) { return kfac_test::run_gpu_tests(argc, argv); }
