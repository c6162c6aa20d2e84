# SPDX-License-Identifier: Apache-2.0
"""Conan 2 recipe for kfac, a header-only K-FAC preconditioner.

The package is made by kfac's own CMake install (cmake/kfacInstall.cmake), and consumers use
the kfacConfig.cmake it installs: find_package(kfac CONFIG REQUIRED COMPONENTS mpi cuda)
gives kfac::kfac, kfac::mpi and kfac::cuda, each looking for its own dependencies (Eigen3, the
BLAS: scipy-openblas32 through python3 or LAPACKE/OpenBLAS through pkg-config, MPI, the CUDA
toolkit) only when asked for. Conan's
CMakeDeps cannot express those per-component, look-up-when-asked dependencies on system
packages, so package_info() sets cmake_find_mode to "none" (CMakeDeps writes no file for
kfac) and puts the package's share/cmake/kfac in builddirs (CMakeToolchain adds it to
CMAKE_PREFIX_PATH, where find_package finds our config).

Offline by default: with system_deps=True (the default) the recipe requires nothing and the
dependencies come from the system (Debian: libeigen3-dev, liblapacke-dev libopenblas-dev or
the PyPI wheel scipy-openblas32, libmpich-dev, the CUDA toolkit), found by the same
find_package/pkg-config/python3 look-ups as in a plain CMake build (KFAC_BLAS=auto). With system_deps=False, Eigen comes from ConanCenter (eigen/3.4.0) through
CMakeDeps; LAPACKE/OpenBLAS (with_lapack), MPI (with_mpi) and CUDA (with_cuda) still come
from the system, so set with_lapack=False for a graph without system libraries.
"""

import os
import re
import subprocess

from conan import ConanFile
from conan.errors import ConanException
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout
from conan.tools.files import load

required_conan_version = ">=2.0"


class KfacConan(ConanFile):
    name = "kfac"
    description = "Header-only C++20 K-FAC (Kronecker-Factored Approximate Curvature) preconditioner"
    license = "Apache-2.0"
    topics = ("kfac", "second-order-optimization", "deep-learning", "header-only", "mpi")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {
        "with_mpi": [True, False],     # kfac::mpi (comm::mpi); MPI from the system
        "with_cuda": [True, False],    # kfac::cuda (backend::cuda); the CUDA toolkit from the system
        "with_lapack": [True, False],  # CBLAS/LAPACKE fast paths: scipy-openblas32, else Debian's OpenBLAS
        "system_deps": [True, False],  # True: no Conan requirements, Eigen from the system
        "engines": [True, False],      # kfac::engines (+ engines_mpi): the common engines compiled once
    }
    default_options = {
        "with_mpi": False,
        "with_cuda": False,
        "with_lapack": True,
        "system_deps": True,
        "engines": False,
    }
    # The CMake project installs the package; tests, benchmarks and examples are not needed.
    exports_sources = "CMakeLists.txt", "include/*", "cmake/*"
    no_copy_source = True

    def set_version(self):
        if self.version:
            return
        text = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        match = re.search(r"project\(\s*kfac\s+VERSION\s+([0-9][0-9.]*)", text)
        if not match:
            raise ConanException("kfac: no project(kfac VERSION ...) in CMakeLists.txt")
        self.version = match.group(1)

    def layout(self):
        # Not build/: that is where the README's plain CMake build goes.
        cmake_layout(self, build_folder="build-conan")

    def requirements(self):
        if not self.options.system_deps:
            self.requires("eigen/3.4.0", transitive_headers=True)

    def configure(self):
        # With the compiled engines the package holds object code for one compiler and build type.
        if self.options.engines:
            self.package_type = "static-library"

    def validate(self):
        if self.settings.get_safe("compiler.cppstd"):
            check_min_cppstd(self, 20)

    def package_id(self):
        # Header-only: the files do not depend on the compiler or the build type, but the
        # options decide which components kfacConfig.cmake provides and what it looks for.
        if not self.info.options.engines:
            self.info.settings.clear()
        self.info.requires.clear()

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables["KFAC_BUILD_TESTS"] = False
        tc.cache_variables["KFAC_BUILD_BENCHMARKS"] = False
        tc.cache_variables["KFAC_BUILD_EXAMPLES"] = False
        tc.cache_variables["KFAC_INSTALL"] = True
        tc.cache_variables["KFAC_BUILD_ENGINES"] = bool(self.options.engines)
        tc.cache_variables["KFAC_ENABLE_MPI"] = bool(self.options.with_mpi)
        tc.cache_variables["KFAC_ENABLE_CUDA"] = bool(self.options.with_cuda)
        tc.cache_variables["KFAC_ENABLE_LAPACK"] = bool(self.options.with_lapack)
        tc.generate()
        if not self.options.system_deps:
            CMakeDeps(self).generate()

    def build(self):
        # Without the engines, configuring is the whole build: it finds the dependencies and
        # writes the package files; with them, the two libraries are compiled too.
        cmake = CMake(self)
        cmake.configure()
        if self.options.engines:
            cmake.build()

    def package(self):
        CMake(self).install()
        # The CMake project quietly leaves out what it cannot find; a package built with an
        # option on must have what the option promises.
        config = load(self, os.path.join(self.package_folder, "share", "cmake", "kfac", "kfacConfig.cmake"))
        for option, variable, hint in (
            ("with_mpi", "kfac_HAS_MPI", "MPI (Debian: apt install libmpich-dev)"),
            ("with_cuda", "kfac_HAS_CUDA", "the CUDA toolkit (nvcc on PATH or CUDAToolkit_ROOT)"),
            ("with_lapack", "kfac_HAS_LAPACK", "BLAS: neither scipy-openblas32 (python3 -m pip install "
                                                "scipy-openblas32) nor lapacke and openblas through pkg-config "
                                                "(Debian: apt install liblapacke-dev libopenblas-dev)"),
        ):
            if self.options.get_safe(option) and not re.search(rf"set\({variable} ON\)", config):
                raise ConanException(f"kfac: {option}=True but the build found no {hint}; "
                                     f"install it or set -o kfac/*:{option}=False")

    def package_info(self):
        # Consumers use the package's own kfacConfig.cmake (see the module docstring).
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "kfac")
        self.cpp_info.builddirs = [os.path.join("share", "cmake", "kfac")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        # For generators other than CMake's (PkgConfigDeps, MSBuildDeps, ...): the include
        # directory, and the LAPACK define and libraries when the package uses them.
        self.cpp_info.includedirs = ["include"]
        blas = self._blas()
        if blas == "openblas":
            self.cpp_info.defines = ["KFAC_HAS_LAPACK=1"]
            self.cpp_info.system_libs = ["lapacke", "openblas"]
        elif blas == "scipy-openblas32":
            self._declare_scipy_openblas32()

    def _blas(self):
        """The BLAS the package was built with, as its kfacConfig.cmake records it."""
        config = os.path.join(self.package_folder, "share", "cmake", "kfac", "kfacConfig.cmake")
        if not os.path.isfile(config):
            return "eigen"
        match = re.search(r'set\(kfac_BLAS "([a-z0-9-]+)"\)', load(self, config))
        return match.group(1) if match else "eigen"

    def _declare_scipy_openblas32(self):
        """The wheel lives in the consumer's Python, so it is located here, on the consumer's
        machine, the way kfacConfig.cmake does (python3 -c 'import scipy_openblas32')."""
        script = ("import scipy_openblas32 as s; "
                  "print(s.get_include_dir()); print(s.get_lib_dir()); print(s.get_library())")
        try:
            out = subprocess.run(["python3", "-c", script], check=True, capture_output=True, text=True)
            include_dir, lib_dir, library = out.stdout.split()
        except (OSError, subprocess.CalledProcessError, ValueError):
            self.output.warning("kfac was built with scipy-openblas32, but python3 cannot import it here "
                                "(python3 -m pip install scipy-openblas32); non-CMake generators get no BLAS")
            return
        self.cpp_info.defines = ["KFAC_HAS_LAPACK=1", "KFAC_BLAS_SYMBOL_PREFIX=scipy_"]
        self.cpp_info.includedirs.append(include_dir)
        self.cpp_info.libdirs = [lib_dir]
        self.cpp_info.libs = [library]
        self.cpp_info.sharedlinkflags = [f"-Wl,-rpath,{lib_dir}"]
        self.cpp_info.exelinkflags = [f"-Wl,-rpath,{lib_dir}"]
