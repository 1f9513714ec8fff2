#!/usr/bin/env bash
# Background jobs on a GPU box that outlive the terminal (or ssh connection) that started them:
#
#   tools/gpu_jobs.sh start WORK NAME [--after A,B] [--nice] [--limit SECONDS] -- CMD ARG ...
#   tools/gpu_jobs.sh wait WORK SECONDS [NAME ...]   until the named jobs (default: all) have ended, at most SECONDS
#   tools/gpu_jobs.sh table WORK                     one line per job: state, exit code, start, wall time, last line
#   tools/gpu_jobs.sh collect WORK OUT [FILE ...]    OUT/jobs.txt (the table and each log's tail) + OUT/jobs.tar.gz
#   tools/gpu_jobs.sh stop WORK NAME                 end a job and everything it started (its process group)
#
# Why: a real-size lowering runs for 10-15 minutes, longer than a remote command or a connection may be allowed
# to last. Each job runs in a process group of its own (setsid), so only its end, its --limit or `stop` ends it.
# One command starts every job, in dependency order (--after waits until those jobs have ended, whatever their
# exit code), and later commands only wait and report. Nothing here needs a GPU; it is checked on the CPU
# (tests/test_gpu_jobs.py).
#
# WORK/jobs/NAME holds: cmd (what runs), pid (its process group), log (stdout + stderr), started, ended (epoch seconds), rc (exit code;
# 124 when --limit cut it). --nice runs the job at the lowest CPU priority, for a build beside a timed job.
# collect's FILEs (absolute, or relative to WORK) are added to the tarball; only reports, logs, JSON and text
# travel, never artifacts.
set -uo pipefail
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
verb="$1"; WORK="$2"; shift 2
JOBS="$WORK/jobs"

job_state() {  # NAME -> waiting | running | exit N
  local d="$JOBS/$1"
  if [ -f "$d/rc" ]; then echo "exit $(cat "$d/rc")"
  elif [ -f "$d/started" ]; then echo "running"
  else echo "waiting"; fi
}

case "$verb" in
  start)
    [ $# -ge 3 ] || usage
    name="$1"; shift
    after=""; nice_level=0; limit=0
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case "$1" in
        --after) after="$2"; shift 2 ;;
        --nice) nice_level=19; shift ;;
        --limit) limit="$2"; shift 2 ;;
        *) echo "gpu_jobs: unknown option $1 (options come before --)" >&2; exit 2 ;;
      esac
    done
    [ "${1:-}" = "--" ] && [ $# -ge 2 ] || { echo "gpu_jobs: start needs -- CMD" >&2; exit 2; }
    shift
    d="$JOBS/$name"
    if [ -d "$d" ]; then echo "gpu_jobs: job $name already exists in $WORK" >&2; exit 2; fi
    mkdir -p "$d"
    printf '%q ' "$@" > "$d/cmd"
    # The job's own shell: wait for its dependencies, then run with the priority and limit asked for.
    # shellcheck disable=SC2016
    setsid nohup bash -c '
      d="$1"; after="$2"; nice_level="$3"; limit="$4"; shift 4
      echo $$ > "$d/pid"
      for dep in ${after//,/ }; do
        while [ ! -f "$(dirname "$d")/$dep/rc" ]; do sleep 2; done
      done
      date +%s > "$d/started"
      if [ "$limit" -gt 0 ]; then nice -n "$nice_level" timeout "$limit" "$@"
      else nice -n "$nice_level" "$@"; fi
      rc=$?
      date +%s > "$d/ended"; echo "$rc" > "$d/rc"
    ' gpu-job "$d" "$after" "$nice_level" "$limit" "$@" > "$d/log" 2>&1 < /dev/null &
    echo "gpu_jobs: started $name${after:+ (after $after)}: $(cat "$d/cmd")"
    ;;
  table)
    printf '%-18s %-9s %6s %s\n' job state wall_s "last line of its log"
    for d in "$JOBS"/*/; do
      [ -d "$d" ] || continue
      name="$(basename "$d")"; state="$(job_state "$name")"; wall=""
      if [ -f "$d/started" ]; then
        end="$(cat "$d/ended" 2>/dev/null || date +%s)"; wall=$(( end - $(cat "$d/started") ))
      fi
      last="$(tail -n 1 "$d/log" 2>/dev/null | tr -d '\r' | cut -c1-100)"
      printf '%-18s %-9s %6s %s\n' "$name" "$state" "$wall" "$last"
    done
    ;;
  wait)
    [ $# -ge 1 ] || usage
    seconds="$1"; shift
    names=("$@")
    if [ ${#names[@]} -eq 0 ]; then
      for d in "$JOBS"/*/; do [ -d "$d" ] && names+=("$(basename "$d")"); done
    fi
    deadline=$(( $(date +%s) + seconds ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
      pending=0
      for n in "${names[@]}"; do [ -f "$JOBS/$n/rc" ] || pending=1; done
      [ "$pending" = 0 ] && break
      sleep 5
    done
    "$0" table "$WORK"
    for n in "${names[@]}"; do [ -f "$JOBS/$n/rc" ] || exit 1; done
    ;;
  collect)
    [ $# -ge 1 ] || usage
    OUT="$1"; shift
    mkdir -p "$OUT"
    {
      "$0" table "$WORK"
      for d in "$JOBS"/*/; do
        [ -d "$d" ] || continue
        echo; echo "== $(basename "$d") ($(job_state "$(basename "$d")")): $(cat "$d/cmd")"
        tail -n 40 "$d/log"
      done
    } > "$OUT/jobs.txt"
    extra=()
    for f in "$@"; do [ -e "$f" ] || [ -e "$WORK/$f" ] && extra+=("$f"); done
    (cd "$WORK" && { find jobs -type f; for f in "${extra[@]}"; do
        find "$f" -type f \( -name '*.log' -o -name '*.md' -o -name '*.json' -o -name '*.txt' \) 2>/dev/null; done; } \
       | tar czf "$OUT/jobs.tar.gz" -T -)
    cat "$OUT/jobs.txt"
    ;;
  stop)
    [ $# -ge 1 ] || usage
    pid="$(cat "$JOBS/$1/pid" 2>/dev/null)" || { echo "gpu_jobs: no job $1 in $WORK" >&2; exit 2; }
    kill -TERM -- "-$pid" 2>/dev/null
    # The job's own shell went with its group, so the stop records the ending (143: ended by SIGTERM).
    if [ ! -f "$JOBS/$1/rc" ]; then date +%s > "$JOBS/$1/ended"; echo 143 > "$JOBS/$1/rc"; fi
    echo "gpu_jobs: stopped $1"
    ;;
  *) usage ;;
esac
