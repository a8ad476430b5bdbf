# lit configuration of moec's FileCheck tests. Run through Bazel
# (bazel test //tests/lit/...), which puts the tools in the runfiles tree.
import os

import lit.formats

config.name = "moec"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.excludes = ["Inputs"]
config.test_source_root = os.path.dirname(os.path.abspath(__file__))

root = os.environ.get("MOEC_SRC_ROOT", os.getcwd())
tools = lit_config.params.get("moec_tools_dir", os.path.join(root, "tools"))
config.environment["PATH"] = os.pathsep.join(
    [tools, "/usr/lib/llvm-16/bin", os.environ.get("PATH", "")])
config.substitutions.append(("%configs", os.path.join(root, "examples", "configs")))
config.substitutions.append(("%graphs", os.path.join(root, "graphs")))
