"""lit through Bazel: one test target per .mlir file."""

def glob_lit_tests(name = "lit", data = [], exclude = []):
    """Makes an sh_test for every .mlir file under this folder.

    Args:
      name: unused prefix kept for a uniform call site.
      data: extra runtime files (tools, inputs).
      exclude: globs of files that are inputs, not tests.
    """
    for f in native.glob(["**/*.mlir"], exclude = exclude + ["**/Inputs/**"]):
        native.sh_test(
            name = f.replace(".mlir", "").replace("/", "_") + ".test",
            srcs = ["//bazel:lit_runner.sh"],
            args = ["$(location %s)" % f],
            data = [f, "//tests/lit:lit_files"] + data,
            size = "small",
        )
