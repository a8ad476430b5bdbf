"""The shell scripts of a folder, for //scripts:help_test."""

def shell_scripts(exclude = []):
    """A filegroup `scripts` of the folder's *.sh files: //scripts:help_test
    runs each with --help and -h, which must print its usage and do nothing
    else.

    Args:
      exclude: files that are sourced, not run.
    """
    native.filegroup(
        name = "scripts",
        srcs = native.glob(["*.sh"], exclude = exclude),
        visibility = ["//scripts:__pkg__"],
    )
