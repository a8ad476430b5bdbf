#!/usr/bin/env bash
# Runs the CPU kernel tests once for every oneDNN ISA this CPU has, capping
# oneDNN at it (DNNL_MAX_CPU_ISA): AVX2, AVX-512 (no bf16 dot products),
# avx512_bf16 and AMX. Every kernel path the runtime picks at run time is
# then checked against the plain loops on this machine. Where the CPU has
# AVX-512, the tests also run with MOEC_GEMM=moec (moec's tile for fp32 too)
# and MOEC_GEMM=onednn (oneDNN for bf16 too; runtime/cpu/Gmm.h); where it
# has AMX, also with MOEC_AMX=off (bf16 on the AVX-512 micro-kernel).
#
#   run_isa.sh CPU_KERNELS_TEST
set -euo pipefail
test_binary="$1"
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
isas=()
has avx2 fma && isas+=("AVX2:avx2")
has avx512f avx512bw avx512vl avx512dq && isas+=("AVX512_CORE:avx512_core")
has avx512f avx512bw avx512vl avx512dq avx512_bf16 && isas+=("AVX512_CORE_BF16:avx512_core_bf16")
has avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_bf16 amx_tile &&
  isas+=("AVX512_CORE_AMX:avx512_core_amx")
if [[ ${#isas[@]} -eq 0 ]]; then
  echo "this CPU has none of AVX2, AVX-512, avx512_bf16, AMX: nothing to force"
  exit 1
fi
failed=0
for entry in "${isas[@]}"; do
  cap="${entry%%:*}"
  name="${entry#*:}"
  echo "== DNNL_MAX_CPU_ISA=$cap (expect $name)"
  if DNNL_MAX_CPU_ISA="$cap" MOEC_EXPECT_ISA="$name" "$test_binary" "[cpu]"; then
    echo "ok: $name"
  else
    echo "FAILED: $name"
    failed=$((failed + 1))
  fi
done
if has avx512f avx512bw avx512vl; then
  for gemm in moec onednn; do
    echo "== MOEC_GEMM=$gemm"
    if MOEC_GEMM="$gemm" "$test_binary" "[gmm]"; then
      echo "ok: MOEC_GEMM=$gemm"
    else
      echo "FAILED: MOEC_GEMM=$gemm"
      failed=$((failed + 1))
    fi
  done
fi
# Where bf16 runs on AMX tiles, the GEMM tests also on the AVX-512 micro-kernel.
if has amx_bf16 amx_tile avx512_bf16; then
  echo "== MOEC_AMX=off"
  if MOEC_AMX=off "$test_binary" "[gmm]"; then
    echo "ok: MOEC_AMX=off"
  else
    echo "FAILED: MOEC_AMX=off"
    failed=$((failed + 1))
  fi
fi
# A value a setting does not know warns and runs as auto:
#   warns_as_auto VARIABLE "the warning"
warns_as_auto() {
  local out="${TEST_TMPDIR:-/tmp}/moec_bogus.$$"
  if env "$1=bogus" "$test_binary" "[gmm]" 2> "$out" && grep -q "$2" "$out"; then
    echo "ok: $1=bogus warns and runs as auto"
  else
    echo "FAILED: $1=bogus"
    failed=$((failed + 1))
  fi
  rm -f "$out"
}
warns_as_auto MOEC_GEMM "MOEC_GEMM='bogus' is none of 'auto', 'moec', 'onednn'; using 'auto'"
# (MOEC_AMX is read at the first bf16 product of moec's tile: where the CPU
# has avx512_bf16.)
if has avx512f avx512bw avx512vl avx512_bf16; then
  warns_as_auto MOEC_AMX "MOEC_AMX='bogus' is neither 'auto' nor 'off'; using 'auto'"
fi
# (MOEC_DOT_FORM and MOEC_SWAPPED_FORM where that product runs on the
# AVX-512 micro-kernel.)
if has avx512f avx512bw avx512vl avx512_bf16 && ! has amx_bf16; then
  warns_as_auto MOEC_DOT_FORM "MOEC_DOT_FORM='bogus' is neither 'auto', 'on' nor 'off'; using 'auto'"
  warns_as_auto MOEC_SWAPPED_FORM "MOEC_SWAPPED_FORM='bogus' is neither 'auto' nor 'off'; using 'auto'"
fi
echo "kernel ISAs: ${#isas[@]} run, $failed failed"
[[ $failed -eq 0 ]]
