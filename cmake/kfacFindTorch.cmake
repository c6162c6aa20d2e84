# Finds LibTorch for the optional LibTorch adapter's tests and example: Debian's libtorch-dev
# (find_package(Torch)), else the LibTorch inside a PyPI torch wheel, located through python3.
# Included (not a function) so that Torch_FOUND, TORCH_LIBRARIES etc. land in the caller's scope.
find_package(Torch QUIET)
if(NOT Torch_FOUND)
  find_package(Python3 QUIET COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(torch.utils.cmake_prefix_path)"
                    OUTPUT_VARIABLE kfac_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE kfac_torch_python ERROR_QUIET)
    if(kfac_torch_python EQUAL 0 AND kfac_torch_prefix)
      find_package(Torch QUIET PATHS ${kfac_torch_prefix} NO_DEFAULT_PATH)
    endif()
  endif()
endif()
# A CUDA LibTorch's package (a PyPI wheel's) makes the CUDA standard required
# (CMAKE_CUDA_STANDARD_REQUIRED); CMake before 3.26 knows no nvcc flag for C++20, so every CUDA
# target that links kfac (cxx_std_20) would fail to generate. kfac's CUDA targets pass
# -std=c++20 themselves.
if(Torch_FOUND)
  unset(CMAKE_CUDA_STANDARD)
  unset(CMAKE_CUDA_STANDARD_REQUIRED)
endif()
