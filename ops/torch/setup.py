"""The moec_torch package: the MoE-FFN layer as a PyTorch module, with the
libraries it runs on (the op library moec_torch.so and the compiler library
libmoec.so) and the layer graphs, so that an installed package needs no
build tree at run time. Build the libraries first, then install offline:

    bazel build //ops/torch:moec_torch.so //compiler/api:libmoec.so
    /usr/bin/python3 -m pip install --no-index --no-build-isolation ops/torch

MOEC_TORCH_LIB, MOEC_LIB and MOEC_GRAPHS name the libraries and the graph
folder to package instead of the checkout's.

The build is out of tree: build/ and moec_torch.egg-info go to a scratch
folder, removed when setup.py ends, so an install leaves the source tree as
it was (--build-base and --egg-base still choose other folders).
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

try:
    from setuptools.command.build import build
except ImportError:  # setuptools < 62.4
    from distutils.command.build import build

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _source(env, default):
    path = Path(os.environ.get(env) or default)
    if not path.exists():
        raise SystemExit(f"moec_torch: {path} does not exist; build it first "
                         "(bazel build //ops/torch:moec_torch.so //compiler/api:libmoec.so) "
                         f"or set {env}")
    return path


_scratch = []


def _scratch_folder():
    """This run's folder for build/ and the egg-info, removed at exit."""
    if not _scratch:
        _scratch.append(tempfile.mkdtemp(prefix="moec_torch-build-"))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]


class OutOfTreeBuild(build):
    """build, with build/ in the scratch folder (bdist_wheel's folder follows)."""

    def initialize_options(self):
        super().initialize_options()
        self.build_base = os.path.join(_scratch_folder(), "build")


class OutOfTreeEggInfo(egg_info):
    """egg_info, with moec_torch.egg-info in the scratch folder."""

    def initialize_options(self):
        super().initialize_options()
        self.egg_base = _scratch_folder()


class BuildWithLibraries(build_py):
    """Copies the libraries into moec_torch/lib and the graphs into
    moec_torch/graphs of the built package."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "moec_torch"
        lib = package / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        for env, default in (("MOEC_TORCH_LIB", REPO / "bazel-bin/ops/torch/moec_torch.so"),
                             ("MOEC_LIB", REPO / "bazel-bin/compiler/api/libmoec.so")):
            source = _source(env, default)
            target = lib / source.name
            shutil.copyfile(source, target)
            target.chmod(0o755)
        graphs = _source("MOEC_GRAPHS", REPO / "graphs")
        (package / "graphs").mkdir(exist_ok=True)
        for graph in sorted(graphs.glob("*.json")):
            shutil.copyfile(graph, package / "graphs" / graph.name)


setup(
    name="moec_torch",
    version="0.2.0",  # base/Version.h's MOEC_VERSION_STRING (test_moe_ffn checks they agree)
    description="moec's fused MoE-FFN layer (forward and backward) as a PyTorch module",
    packages=["moec_torch", "moec_torch.hf", "moec_torch.hf_models"],
    python_requires=">=3.9",
    cmdclass={"build": OutOfTreeBuild, "build_py": BuildWithLibraries,
              "egg_info": OutOfTreeEggInfo},
    zip_safe=False,
)
