# SPDX-License-Identifier: Apache-2.0
"""Builds and runs a tiny K-FAC step against the kfac package, through its kfacConfig.cmake."""

import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout


class KfacTestPackageConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    test_type = "explicit"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        tc.user_presets_path = False  # write nothing into the source tree
        kfac = self.dependencies[self.tested_reference_str.split("/")[0]]
        components = [name for name, option in (("mpi", "with_mpi"), ("cuda", "with_cuda"))
                      if kfac.options.get_safe(option)]
        tc.cache_variables["KFAC_TEST_COMPONENTS"] = ";".join(components)
        # The program checks that the package is found, compiles, links and steps once: its
        # compile time is template instantiation, and optimisation would only add to it.
        if (self.settings.get_safe("compiler") in ("gcc", "clang", "apple-clang")
                and self.settings.get_safe("build_type") == "Release"):
            tc.cache_variables["CMAKE_CXX_FLAGS_RELEASE"] = "-O0 -DNDEBUG"
        tc.generate()
        # Writes the config files of kfac's Conan requirements (eigen with system_deps=False);
        # none for kfac itself, whose own kfacConfig.cmake is used.
        CMakeDeps(self).generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
