#!/usr/bin/env bash
# Run pip with the one warning that drowns CI logs taken out, everything else passed through, pip's exit status kept.
#
#   scripts/pip_quiet.sh PIP ARGS...
#
# A machine whose pip configuration names local indexes (find-links, extra-index-url on file:// folders) gets
# "WARNING: Location 'file:///.../simple/NAME/' is ignored: it is neither a file nor a directory." once per
# package those folders lack: hundreds of lines per install, none of them about this project. Only lines of
# exactly that form are dropped; errors, other warnings and pip's own output reach stderr/stdout unchanged.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/pip_quiet.sh PIP ARGS..." >&2; exit 2; }
{ "$@" 2>&1 1>&3 3>&- | grep -v -E "^WARNING: Location '[^']*' is ignored: " >&2; status=${PIPESTATUS[0]}; } 3>&1
exit "$status"
