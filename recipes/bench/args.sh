# recipes/bench/args.sh: the argument checks every benchmark script makes
# before it runs anything. Sourced first (it finds the script by $0), then
# the script's `cd` to the repository root, then the checks (paths are
# checked where the script uses them):
#   . "$(dirname "$0")/args.sh"
#   bench_help "$@"                 -h / --help: the header comment, exit 0
#   bench_at_most N "$@"            more than N arguments: named, exit 2
#   bench_count NAME VALUE [MIN=1]  a whole number >= MIN
#   bench_counts NAME "LIST"        each word of LIST a whole number >= 1
#   bench_configs "LIST"            each word a PyTorch baseline's thread
#                                   configuration, <threads>[:<OMP_WAIT_POLICY>]
#   bench_word NAME VALUE           not an option (a path, a list)
#   bench_fresh NAME PATH           PATH must not exist: an earlier run's
#                                   results are never overwritten
# A refusal prints "SCRIPT: what was wrong" and the usage on stderr, exit 2.

bench_script=$(realpath "$0")
bench_name=$(basename "$0")

# The header comment: line 2 up to the first line that is not a comment.
bench_header() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$bench_script"; }

# The usage lines of the header: "  recipes/bench/x.sh ..." and its continuations.
bench_usage() {
    bench_header | awk '/^  recipes\/bench\// { on = 1; sub(/^  /, "usage: "); print; next }
                        on && /^      / { print; next } { on = 0 }'
}

bench_refuse() {
    echo "$bench_name: $1" >&2
    bench_usage >&2
    exit 2
}

bench_help() {
    case "${1:-}" in
        -h|--help) bench_header; exit 0 ;;
    esac
}

bench_at_most() {
    local n=$1
    shift
    [ $# -le "$n" ] || bench_refuse "takes at most $n arguments, got $# (the first extra: '${*:n+1:1}')"
}

bench_count() {
    local min=${3:-1}
    [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge "$min" ] || bench_refuse "$1 must be a whole number >= $min, got '$2'"
}

bench_counts() {
    local v
    for v in $2; do bench_count "$1" "$v"; done
}

bench_configs() {
    local c
    for c in $1; do
        [[ $c =~ ^[1-9][0-9]*(:[A-Z]+)?$ ]] \
            || bench_refuse "a configuration is <torch threads>[:<OMP_WAIT_POLICY>], got '$c'"
    done
}

bench_word() {
    [[ $2 != -* ]] || bench_refuse "expected $1, got the option '$2'"
}

bench_fresh() {
    bench_word "$1" "$2"
    [ ! -e "$2" ] || bench_refuse "$1 $2 exists (an earlier run's results): give another path or remove it"
}
