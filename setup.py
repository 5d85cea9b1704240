"""Build dspec and its compiled module dspec._C with CMake (pybind11's cmake_example pattern).

    pip install .                          # isolated build (fetches cmake/ninja/pybind11)
    pip install -e .                       # editable; dspec/_C*.so lands in the source tree
    pip install --no-build-isolation -e .  # editable, with the build tools of this env

Environment variables:
    DSPEC_SKIP_CUDA_BUILD=1   build without CUDA even when nvcc is found
    DSPEC_CUDA_ARCHS="80;90"  CUDA architectures (CMAKE_CUDA_ARCHITECTURES); default 80;90
    DSPEC_BUILD_TYPE=Release  CMake build type (Debug, RelWithDebInfo, ...)
    DSPEC_BUILD_DIR=build     where CMake's build trees go (default <repo>/build)
    CMAKE_ARGS="..."          extra CMake arguments
    CMAKE_BUILD_PARALLEL_LEVEL / MAX_JOBS   build parallelism (default: all cores)

torch is deliberately not a dependency: install it separately (pinned torch==2.13.0 on
CPU machines); dspec._C never imports it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "off", "no")


def _cuda_archs() -> str:
    raw = os.environ.get("DSPEC_CUDA_ARCHS", "").strip()
    if not raw:
        return "80;90"
    # accept "80;90", "80,90", "8.0 9.0", "9.0a"
    return ";".join(a.replace(".", "") for a in re.split(r"[\s,;]+", raw) if a)


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str = "") -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(Path(sourcedir).resolve())


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        # the directory the module must land in (build_lib/dspec, or the source tree's
        # dspec/ for --inplace and editable installs: setuptools copies it there)
        ext_fullpath = Path.cwd() / self.get_ext_fullpath(ext.name)
        extdir = ext_fullpath.parent.resolve()

        build_type = os.environ.get("DSPEC_BUILD_TYPE") or ("Debug" if self.debug else "Release")
        skip_cuda = _truthy("DSPEC_SKIP_CUDA_BUILD")

        import pybind11  # build requirement

        cmake = shutil.which("cmake")
        try:  # the PyPI cmake wheel, when it is what provides cmake
            import cmake as cmake_pkg  # noqa: PLC0415

            cmake = os.path.join(cmake_pkg.CMAKE_BIN_DIR, "cmake")
        except ImportError:
            pass
        if not cmake:
            raise RuntimeError("dspec: cmake (>= 3.18) is required to build dspec._C")

        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY_{build_type.upper()}={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DDSPEC_VERSION={VERSION}",
            f"-DDSPEC_SKIP_CUDA_BUILD={'ON' if skip_cuda else 'OFF'}",
        ]
        if not skip_cuda:
            cmake_args.append(f"-DCMAKE_CUDA_ARCHITECTURES={_cuda_archs()}")
        if os.environ.get("CMAKE_ARGS"):
            cmake_args += [item for item in os.environ["CMAKE_ARGS"].split(" ") if item]

        generator = os.environ.get("CMAKE_GENERATOR", "")
        ninja = None
        if not generator:
            try:
                import ninja as ninja_pkg  # noqa: PLC0415

                ninja = os.path.join(ninja_pkg.BIN_DIR, "ninja")
            except ImportError:
                ninja = shutil.which("ninja")
            if ninja:
                cmake_args += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM:FILEPATH={ninja}"]

        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        build_args = ["--config", build_type, "-j", jobs]

        build_temp = self._build_dir()
        build_temp.mkdir(parents=True, exist_ok=True)
        self._drop_stale_cache(build_temp, cmake, ninja)

        subprocess.run([cmake, ext.sourcedir, *cmake_args], cwd=build_temp, check=True)
        subprocess.run([cmake, "--build", ".", *build_args], cwd=build_temp, check=True)

    @staticmethod
    def _build_dir() -> Path:
        base = Path(os.environ.get("DSPEC_BUILD_DIR") or ROOT / "build")
        tag = f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}".replace(os.sep, "_")
        return base / f"cmake-{tag}"

    @staticmethod
    def _drop_stale_cache(build_temp: Path, cmake: str, ninja: str | None) -> None:
        """Forget a CMake cache made by another cmake / ninja (e.g. a deleted isolated env)."""
        cache = build_temp / "CMakeCache.txt"
        if not cache.exists():
            return
        text = cache.read_text(errors="replace")
        wanted = {"CMAKE_COMMAND": os.path.realpath(cmake)}
        if ninja:
            wanted["CMAKE_MAKE_PROGRAM"] = os.path.realpath(ninja)
        for key, value in wanted.items():
            m = re.search(rf"^{key}:[A-Z]+=(.*)$", text, re.M)
            if m and os.path.realpath(m.group(1).strip()) != value:
                cache.unlink()
                shutil.rmtree(build_temp / "CMakeFiles", ignore_errors=True)
                return
        m = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", text, re.M)
        if m and (m.group(1).strip() == "Ninja") != bool(ninja):
            cache.unlink()
            shutil.rmtree(build_temp / "CMakeFiles", ignore_errors=True)


setup(
    name="dspec",
    version=VERSION,
    description="Kernel library for speculative decoding with diffusion language models",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dspec", "dspec.*"]),
    # shipped models, model cards and other data under dspec/assets (also in MANIFEST.in)
    package_data={"dspec": ["assets/**/*"]},
    include_package_data=True,
    ext_modules=[CMakeExtension("dspec._C", sourcedir=str(ROOT))],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    # gguf: pure Python, converts the embedded SmolLM2 GGUF; safetensors + tokenizers: dspec.models
    install_requires=["numpy", "tqdm", "gguf>=0.17.1", "safetensors", "tokenizers"],
    extras_require={"test": ["pytest"]},
    zip_safe=False,
)
