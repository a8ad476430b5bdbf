"""mlir-tblgen through Bazel: one genrule per generated file, one library of them."""

_TBLGEN = "@llvm//:mlir_tblgen"

def gentbl_cc_library(name, td_file, tbl_outs, td_srcs = [], deps = []):
    """Runs mlir-tblgen on `td_file` once per (flags, output) pair.

    Args:
      name: name of the cc_library that carries the generated .inc files;
        name + "_files" is a filegroup of them.
      td_file: the top-level .td file.
      tbl_outs: list of (flags, out) pairs, e.g. (["-gen-op-decls"], "Ops.h.inc").
      td_srcs: other .td files `td_file` includes.
      deps: cc deps of the generated code's users.
    """
    outs = []
    for flags, out in tbl_outs:
        rule_name = "%s_%s" % (name, out.replace("/", "_").replace(".", "_"))
        native.genrule(
            name = rule_name,
            srcs = [td_file] + td_srcs + ["@llvm//:mlir_td"],
            outs = [out],
            tools = [_TBLGEN],
            cmd = ("$(location %s) %s -I /usr/lib/llvm-16/include -I $$(dirname $(location %s)) " +
                   "-I . $(location %s) -o $@") % (_TBLGEN, " ".join(flags), td_file, td_file),
        )
        outs.append(out)
    native.cc_library(
        name = name,
        textual_hdrs = outs,
        deps = deps,
    )

    # The generated files themselves, for builds outside Bazel (fuzz targets).
    native.filegroup(name = name + "_files", srcs = outs)

def td_library(name, srcs):
    native.filegroup(name = name, srcs = srcs)
