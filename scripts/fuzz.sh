#!/usr/bin/env bash
# Coverage-guided fuzzing of every target of tests/fuzzing/ with cargo-fuzz (libFuzzer; ASan for
# the target whose input reaches unsafe code, FUZZ_SANITIZER=address|none to choose).
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`); CI does not run
# this (it runs the bounded stable harness, tests/fuzz.rs). docs/reliability.md has the results.
#
#   scripts/fuzz.sh                 # every target, 10 minutes each
#   scripts/fuzz.sh 3600 objects    # one target for an hour
#
# New inputs libFuzzer finds go to fuzz/work/<target>/ (ignored by git; the seeds stay in
# fuzz/corpus/<target>/); a failing input is written to fuzz/artifacts/<target>/ and stops that
# target: copy it to fuzz/regressions/<target>/ (replayed by tests/fuzz.rs) once it is fixed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds=${1:-600}
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
    targets=(objects annotations manifests state_file nft_dump sock_diag)
fi
command -v cargo-fuzz >/dev/null || { echo "scripts/fuzz.sh: cargo-fuzz is not installed" >&2; exit 1; }
cargo +nightly --version >/dev/null 2>&1 || { echo "scripts/fuzz.sh: no nightly toolchain" >&2; exit 1; }

status=0
for t in "${targets[@]}"; do
    mkdir -p "work/$t"
    echo "==> $t: ${seconds}s" >&2
    log="work/$t.log"
    # Every target is safe Rust all the way down (the YAML parser included): no sanitizer unless
    # asked for, which makes the runs several times faster.
    sanitizer=${FUZZ_SANITIZER:-none}
    if cargo +nightly fuzz run -O -s "$sanitizer" "$t" "work/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 \
        >"$log" 2>&1; then
        result=ok
    else
        result=FAILED
        status=1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    echo "$t: $result, ${runs:-?} runs in ${seconds}s (sanitizer $sanitizer), $cov, corpus $(ls "work/$t" | wc -l) inputs (log: fuzz/$log)"
    if [[ $result == FAILED ]]; then
        grep -E 'panicked|ERROR|SUMMARY|Test unit written' "$log" | head -5 || true
    fi
done
exit "$status"
