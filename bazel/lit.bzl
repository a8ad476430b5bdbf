"""lit through Bazel: one test target per .mlir or .test file."""

def glob_lit_tests(data = [], exclude = []):
    """Makes an sh_test for every .mlir and .test file under this folder.

    Args:
      data: extra runtime files (tools, inputs).
      exclude: globs of files that are inputs, not tests.
    """
    for f in native.glob(["**/*.mlir", "**/*.test"], exclude = exclude + ["**/Inputs/**"]):
        native.sh_test(
            name = f.rsplit(".", 1)[0].replace("/", "_") + "_lit",
            srcs = ["//bazel:lit_runner.sh"],
            args = ["$(location %s)" % f],
            data = [f, "//tests/lit:lit_files"] + data,
            size = "small",
        )
