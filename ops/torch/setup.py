"""The moec_torch package: the MoE-FFN layer as a PyTorch module, with the
libraries it runs on (the op library moec_torch.so and the compiler library
libmoec.so) and the layer graphs, so that an installed package needs no
build tree at run time. Build the libraries first, then install offline:

    bazel build //ops/torch:moec_torch.so //compiler/api:libmoec.so
    /usr/bin/python3 -m pip install --no-index --no-build-isolation ops/torch

MOEC_TORCH_LIB, MOEC_LIB and MOEC_GRAPHS name the libraries and the graph
folder to package instead of the checkout's.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _source(env, default):
    path = Path(os.environ.get(env) or default)
    if not path.exists():
        raise SystemExit(f"moec_torch: {path} does not exist; build it first "
                         "(bazel build //ops/torch:moec_torch.so //compiler/api:libmoec.so) "
                         f"or set {env}")
    return path


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
    version="0.1.0",
    description="moec's fused MoE-FFN layer (forward and backward) as a PyTorch module",
    packages=["moec_torch"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildWithLibraries},
    zip_safe=False,
)
