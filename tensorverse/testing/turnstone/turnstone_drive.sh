#!/usr/bin/env bash
# (Tensorverse: a copy of the team's shared/tools/turnstone_drive.sh, for tensorverse/testing/turnstone/agent.py.)
# turnstone_drive.sh — run ONE non-interactive turnstone (PyPI `turnstone` 1.9.0) agent session
# against an OpenAI-compatible endpoint, inside a fresh temporary directory, then exit.
#
#   usage:  turnstone_drive.sh BASE_URL MODEL "PROMPT"
#           turnstone_drive.sh --setup            # create the venv (see SETUP)
#   e.g.    turnstone_drive.sh http://127.0.0.1:8000/v1 Qwen/Qwen3-0.6B "Read notes.txt and summarise it."
#
# SETUP (once per machine; nothing system-wide):
#   turnstone 1.9.0 requires Python >= 3.13 (pip on 3.11 refuses it: "Requires-Python >=3.13").
#   pyenv on these machines has 3.13.0, so:
#     ${PYENV_ROOT:-$HOME/.pyenv}/versions/3.13.0/bin/python3 -m venv ${TMPDIR:-/tmp}/ts-venv
#     ${TMPDIR:-/tmp}/ts-venv/bin/pip install turnstone==1.9.0        # ~40 s, ~350 MB, 60 packages, from PyPI
#   (`turnstone_drive.sh --setup` does exactly that.)  Override the venv path with TS_VENV.
#
# HOW IT WORKS (all verified against the turnstone_fake_server.py beside this script):
#   * turnstone has no one-shot flag; its CLI is a readline REPL that reads stdin with input().
#     Piping ONE line (the prompt) works: the line becomes the user message, the agent loop runs
#     (model -> tool calls -> model ...) until the model answers without a tool call, then the
#     next input() hits EOF and turnstone prints "Goodbye." and exits 0.  No TTY needed.
#   * It talks Chat Completions only: POST {BASE_URL}/chat/completions, always stream=true with
#     stream_options.include_usage, tools in OpenAI function format, no tool_choice, token limit
#     sent as max_completion_tokens.  GET {BASE_URL}/models only when MODEL is empty (auto-detect).
#   * Besides the agent turns it sends one side request per session: a title generator
#     (stream, no tools, max_completion_tokens 8192).  The LLM approval judge (more requests,
#     with its own read_file/list_directory tools) is disabled here (--no-judge) unless TS_JUDGE=1.
#
# SAFETY LAYERS (the model's tool calls are untrusted):
#   1. Approval gate: bash, write_file, edit_file, web_fetch, web_search, watch, task_agent,
#      open_preview, skills load/create... need approval.  This script seeds a tool policy
#      "* -> deny" in turnstone's database, so every approval-gated call is refused with
#      "Blocked by tool policy (...)" — even one the model invents without it being offered.
#      TS_ALLOW=write_file,edit_file (say) adds "allow" policies for the listed names.
#   2. Tool visibility: a persona "driver" whose hard allowlist (TS_TOOLS, default
#      read_file,search,diff_file) is the only tool list sent to the model.  NOT a security
#      boundary on its own: a model that names an unoffered built-in (e.g. bash) still gets it
#      prepared and, if approved, run — layer 1 is what stops it.  TS_TOOLS=all = turnstone's
#      interactive set, 15 tools here (bash, write_file, web_fetch, ... — still denied by layer 1).
#   3. stdin holds only the prompt line, so an approval prompt that is somehow reached reads EOF
#      and is refused ("Denied by user").  Never pipe more lines: a later line would be read as
#      the answer to an approval prompt ("y"/"a" = approve) or as another user message.
#   Not approval-gated, so they run (read in the source; read_file verified): read_file, search,
#   diff_file, bash_output, kill_shell, notify, recall, skills list/find (memory is off in the
#   persona).  read_file/search have NO
#   path restriction: the model can read any file this user can read (it stays in the model's
#   context and in the transcript).  For hostile models run this as an unprivileged user.
#
# ENVIRONMENT (all optional):
#   TS_VENV=${TMPDIR:-/tmp}/ts-venv       venv holding turnstone
#   TS_TOOLS=read_file,search,diff_file   tools offered to the model, or "all"
#   TS_ALLOW=                  approval-gated tools to allow (comma list); default none
#   TS_MAX_TOKENS=1024         per-request completion limit (turnstone's default is 32768, which a
#                              small vLLM max_model_len rejects with HTTP 400)
#   TS_CONTEXT_WINDOW=32768    context window turnstone assumes; 0 with MODEL="" = read max_model_len
#                              from GET /models (read in the source, not tried)
#   TS_TEMPERATURE=            sampling temperature (omitted from the request when empty)
#   TS_REASONING_EFFORT=       none|minimal|low|medium|high|xhigh|max (omitted when empty)
#   TS_CONFIG=                 a turnstone config.toml to use (else an empty one); e.g. for
#                              [models.X.capabilities.server_compat.extra_body] chat_template_kwargs
#   TS_TIMEOUT=600             wall-clock limit in seconds (timeout(1)); the agent loop itself has
#                              no cap on tool rounds
#   TS_JUDGE=0                 1 = keep turnstone's LLM approval judge on (advisory, extra requests)
#   TS_WORKDIR=                run here instead of a fresh mktemp -d (created if missing)
#   TS_CLEANUP=0               1 = delete the run directory at the end
#   TS_QUIET=0                 1 = don't echo turnstone's stdout live
#   TS_EXTRA_ARGS=             extra turnstone CLI arguments (word-split)
#   OPENAI_API_KEY             sent as "Authorization: Bearer ..." (default "dummy")
#
# OUTPUT: run dir layout  RUN/work (the agent's cwd; put input files here via TS_WORKDIR),
#   RUN/home (HOME), RUN/turnstone.db, RUN/config.toml, RUN/stdout.txt, RUN/stderr.txt,
#   RUN/transcript.json (every stored message of the session).  The last line printed is the
#   model's final answer.
# EXIT STATUS: turnstone's own status when non-zero (1 = startup failure, e.g. model
#   auto-detect failed; 124 = TS_TIMEOUT hit).  turnstone exits 0 even when the backend failed
#   mid-turn (it retries 3 times, prints the error, then reads EOF), so on 0 this script checks
#   the stored session: 0 = the session ended with a non-empty assistant answer, 3 = it did not
#   (backend error, empty answer...).  2 = usage/setup error.
set -u

TS_VENV=${TS_VENV:-${TMPDIR:-/tmp}/ts-venv}

if [ "${1:-}" = "--setup" ]; then
    # A pyenv shim named python3.13 exists but fails unless 3.13 is the active pyenv version,
    # so each candidate must actually run and be >= 3.13.
    PY313=
    for c in ${TS_PYTHON:-} ${PYENV_ROOT:-$HOME/.pyenv}/versions/3.13*/bin/python3 python3.13 python3; do
        if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 13))' 2>/dev/null; then
            PY313=$c; break
        fi
    done
    [ -z "$PY313" ] && { echo "turnstone_drive: no Python >= 3.13 found (set TS_PYTHON)" >&2; exit 2; }
    "$PY313" -m venv "$TS_VENV" && "$TS_VENV/bin/pip" install -q turnstone==1.9.0 || exit 2
    "$TS_VENV/bin/python" -c 'import importlib.metadata as m; print("turnstone", m.version("turnstone"), "ready")'
    exit 0
fi

if [ $# -ne 3 ]; then
    sed -n '2,8p' "$0" >&2
    exit 2
fi
BASE_URL=$1 MODEL=$2 PROMPT=$3

if [ ! -x "$TS_VENV/bin/turnstone" ]; then
    echo "turnstone_drive: $TS_VENV/bin/turnstone missing; run: $0 --setup" >&2
    exit 2
fi

# One line only (see SAFETY 3); a leading "/" would be taken as a REPL command.
PROMPT=$(printf '%s' "$PROMPT" | tr '\r\n' '  ' | sed 's/^[[:space:]]*//')
case "$PROMPT" in
    "") echo "turnstone_drive: empty prompt" >&2; exit 2 ;;
    /*) PROMPT="Task: $PROMPT" ;;
esac

if [ -n "${TS_WORKDIR:-}" ]; then
    RUN=$(mkdir -p "$TS_WORKDIR" && cd "$TS_WORKDIR" && pwd)
else
    RUN=$(mktemp -d -t turnstone-run.XXXXXX)
fi
mkdir -p "$RUN/work" "$RUN/home"
rm -f "$RUN"/turnstone.db "$RUN"/turnstone.db-*   # a reused TS_WORKDIR starts a fresh session
if [ -n "${TS_CONFIG:-}" ]; then cp "$TS_CONFIG" "$RUN/config.toml"; else : > "$RUN/config.toml"; fi
chmod 600 "$RUN/config.toml"

export HOME="$RUN/home" TURNSTONE_CONFIG="$RUN/config.toml" TURNSTONE_DB_PATH="$RUN/turnstone.db"
export TURNSTONE_DB_BACKEND=sqlite OPENAI_API_KEY=${OPENAI_API_KEY:-dummy} NO_COLOR=1
PY="$TS_VENV/bin/python"

# Seed the database: deny-all (+ allow) tool policies and the restricted persona.
if ! "$PY" - "$TURNSTONE_DB_PATH" "${TS_TOOLS:-read_file,search,diff_file}" "${TS_ALLOW:-}" \
        > "$RUN/seed.log" 2>&1 <<'EOF'
import sys
from turnstone.core.storage import init_storage
from turnstone.prompts import load_persona_prompt
db, tools, allow = sys.argv[1], sys.argv[2], sys.argv[3]
st = init_storage("sqlite", path=db)
st.create_tool_policy("driver-deny-all", "driver: deny approval-gated tools", "*", "deny", 0)
for i, name in enumerate(n.strip() for n in allow.split(",") if n.strip()):
    st.create_tool_policy(f"driver-allow-{i}", f"driver: allow {name}", name, "allow", 100)
st.create_persona({
    "persona_id": "driver-persona", "name": "driver", "display_name": "driver",
    "description": "turnstone_drive.sh persona",
    "base_prompt": load_persona_prompt("engineer.md"),   # turnstone's default interactive prompt
    "tool_allowlist": None if tools == "all" else [t.strip() for t in tools.split(",") if t.strip()],
    "mcp_enabled": False, "memory_enabled": False,
    "applies_to_kinds": ["interactive"], "is_default": False, "enabled": True})
print("seeded", db)
EOF
then
    echo "turnstone_drive: seeding the database failed:" >&2; cat "$RUN/seed.log" >&2; exit 2
fi

ARGS=(--base-url "$BASE_URL" --persona driver --tool-search off --retention-days 0
      --max-tokens "${TS_MAX_TOKENS:-1024}" --context-window "${TS_CONTEXT_WINDOW:-32768}")
[ -n "$MODEL" ] && ARGS+=(--model "$MODEL")
[ "${TS_JUDGE:-0}" = 1 ] || ARGS+=(--no-judge)
[ -n "${TS_TEMPERATURE:-}" ] && ARGS+=(--temperature "$TS_TEMPERATURE")
[ -n "${TS_REASONING_EFFORT:-}" ] && ARGS+=(--reasoning-effort "$TS_REASONING_EFFORT")
# shellcheck disable=SC2206
[ -n "${TS_EXTRA_ARGS:-}" ] && ARGS+=(${TS_EXTRA_ARGS})

echo "turnstone_drive: run dir $RUN (tools offered: ${TS_TOOLS:-read_file,search,diff_file}; allowed gated: ${TS_ALLOW:-none})" >&2
cd "$RUN/work" || exit 2
if [ "${TS_QUIET:-0}" = 1 ]; then
    printf '%s\n' "$PROMPT" | timeout "${TS_TIMEOUT:-600}" "$TS_VENV/bin/turnstone" "${ARGS[@]}" \
        > "$RUN/stdout.txt" 2> "$RUN/stderr.txt"
    RC=$?
else
    printf '%s\n' "$PROMPT" | timeout "${TS_TIMEOUT:-600}" "$TS_VENV/bin/turnstone" "${ARGS[@]}" \
        2> "$RUN/stderr.txt" | tee "$RUN/stdout.txt"
    RC=${PIPESTATUS[1]}
fi

# Dump the stored session; decide success from it.
"$PY" - "$TURNSTONE_DB_PATH" "$RUN/transcript.json" > "$RUN/final.txt" 2>> "$RUN/stderr.txt" <<'EOF'
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
ws = db.execute("select ws_id, state from workstreams where kind='interactive' "
                "order by created desc limit 1").fetchone()
rows = [] if ws is None else db.execute(
    "select role, content, tool_name, tool_call_id, tool_calls, is_error from conversations "
    "where ws_id=? order by id", (ws[0],)).fetchall()
msgs = [{"role": r, "content": c, "tool_name": tn, "tool_call_id": tci,
         "tool_calls": json.loads(tc) if tc else None, "is_error": bool(e)}
        for r, c, tn, tci, tc, e in rows]
json.dump({"ws_id": ws and ws[0], "state": ws and ws[1], "messages": msgs},
          open(sys.argv[2], "w"), indent=1)
last = msgs[-1] if msgs else None
ok = (ws is not None and ws[1] != "error" and last is not None and last["role"] == "assistant"
      and not last["tool_calls"] and (last["content"] or "").strip() != "")
print("OK" if ok else "NOANSWER")
print((last or {}).get("content") or "" if ok else "")
EOF
VERDICT=$(head -1 "$RUN/final.txt" 2>/dev/null)
echo "turnstone_drive: turnstone exit $RC; session: ${VERDICT:-unknown}; transcript $RUN/transcript.json" >&2
if [ "$VERDICT" = OK ]; then
    echo "== final answer =="
    tail -n +2 "$RUN/final.txt"
fi
[ "${TS_CLEANUP:-0}" = 1 ] && rm -rf "$RUN"
if [ "$RC" -ne 0 ]; then exit "$RC"; fi
[ "$VERDICT" = OK ] && exit 0
exit 3
