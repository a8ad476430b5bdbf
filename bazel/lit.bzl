"""lit through Bazel: one test target per .mlir or .test file."""

def glob_lit_tests(data = [], exclude = [], medium = []):
    """Makes an sh_test for every .mlir and .test file under this folder.

    Args:
      data: extra runtime files (tools, inputs).
      exclude: globs of files that are inputs, not tests.
      medium: files that run layers for longer than a small test's minute
        on a loaded 2-core machine (a medium test has five).
    """
    files = native.glob(["**/*.mlir", "**/*.test"], exclude = exclude + ["**/Inputs/**"])
    for m in medium:
        if m not in files:
            fail("glob_lit_tests: medium names %s, which is no lit test here" % m)
    for f in files:
        native.sh_test(
            name = f.rsplit(".", 1)[0].replace("/", "_") + "_lit",
            srcs = ["//bazel:lit_runner.sh"],
            args = ["$(location %s)" % f],
            data = [f, "//tests/lit:lit_files"] + data,
            size = "medium" if f in medium else "small",
        )
