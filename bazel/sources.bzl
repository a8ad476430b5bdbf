"""The sources of cc targets, listed for builds outside Bazel's toolchain.

The ThreadSanitizer tests (g++ -fsanitize=thread, tests/unit/run_tsan.sh)
and the fuzzers (clang's libFuzzer, tests/fuzz/run_fuzzer.sh) compile moec's
sources themselves. `cc_sources` takes what to compile from the same
cc_library targets every other build uses, so that there is one description
of which files a library is made of:

    cc_sources(
        name = "executor_tsan_sources",
        srcs = ["ExecutorTest.cpp"],   # files of the test itself
        deps = ["//runtime/exec"],     # libraries, with everything they depend on
    )

writes `executor_tsan_sources.txt`, the repository-relative paths of the C
and C++ sources (.c, .cc, .cpp) of `srcs` and of every cc target reached
through `deps`, one a line, and gives as runfiles those files and every
header beside them, generated ones (tablegen's .inc) included. A runner
reads the list as an `@FILE` argument. Files of other repositories (the
system libraries) are left out, and generated files are not listed: a
library built from a generated archive is stood in for by sources given in
`srcs` (the CUDA backend's device half by DeviceStub.cpp).
"""

_SOURCE_EXTENSIONS = ["c", "cc", "cpp"]

CcSourcesInfo = provider(
    doc = "A cc target's own source and header files, and those of its deps.",
    fields = {"files": "depset of the main repository's source Files"},
)

def _own_files(attr):
    files = []
    for name in ["srcs", "hdrs", "textual_hdrs"]:
        for target in getattr(attr, name, []):
            for f in target.files.to_list():
                if f.owner.workspace_name == "":
                    files.append(f)
    return files

def _collect_impl(target, ctx):
    deps = [d[CcSourcesInfo].files for d in getattr(ctx.rule.attr, "deps", []) if CcSourcesInfo in d]
    return [CcSourcesInfo(files = depset(_own_files(ctx.rule.attr), transitive = deps))]

_collect = aspect(
    implementation = _collect_impl,
    attr_aspects = ["deps"],
)

def _cc_sources_impl(ctx):
    own = [f for f in ctx.files.srcs if f.owner.workspace_name == ""]
    files = depset(own, transitive = [d[CcSourcesInfo].files for d in ctx.attr.deps])
    sources = [
        f.short_path
        for f in files.to_list()
        if f.is_source and f.extension in _SOURCE_EXTENSIONS
    ]
    out = ctx.actions.declare_file(ctx.label.name + ".txt")
    ctx.actions.write(out, "".join([s + "\n" for s in sources]))
    return [DefaultInfo(
        files = depset([out]),
        runfiles = ctx.runfiles(files = [out], transitive_files = files),
    )]

cc_sources = rule(
    implementation = _cc_sources_impl,
    doc = "The C/C++ sources of `srcs` and of the cc targets `deps` reach, listed in NAME.txt.",
    attrs = {
        "srcs": attr.label_list(allow_files = True, doc = "Files of their own: a test's sources, its headers, stand-ins."),
        "deps": attr.label_list(aspects = [_collect], doc = "cc targets whose sources (with their deps') are listed."),
    },
)
