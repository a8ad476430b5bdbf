# Sourced by the scripts here that take [--base REV]:
#   base_option NAME USAGE [ARG...]
# sets `base` to REV where ARG... is `--base REV`, to "" where there are
# none, and otherwise prints USAGE (or, for a REV that is no commit here,
# why) and exits 2.
base_option() {
  local name="$1" usage="$2"
  shift 2
  base=""
  [ $# -eq 0 ] && return 0
  [ "$1" = --base ] && [ $# -eq 2 ] || { echo "$usage" >&2; exit 2; }
  base="$2"
  git rev-parse --verify --quiet "$base^{commit}" > /dev/null || {
    echo "$name: --base $base: not a commit of this repository" >&2
    exit 2
  }
}
