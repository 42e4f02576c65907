#!/usr/bin/env bash
# Fails when a tracked file reads or points at anything outside the repository: the reference
# material the project was written from lives beside it on developers' machines, and a clone must
# not need it. Facts live in docs/, test data in tests/data/.
set -euo pipefail
cd "$(dirname "$0")/.."
# Paths that leave the repository (the sibling reference folder, its spec and hooks), or a spec
# cited without docs/. The folder name is spelled in pieces so that this script does not match
# itself.
ref=shar; ref="${ref}ed"
pattern="(\\.\\./$ref|$ref/spec|$ref/hooks)"
hits=$(git grep -nE "$pattern" || true)
# Spec documents must be cited by their in-repository path (docs/engine-wire.md, docs/smg-api.md).
bare=$(git grep -nE '(^|[^/A-Za-z-])(engine-wire|smg-api)\.md' -- ':!docs/' || true)
# Our own tracker's issue numbers mean nothing to a reader of the repository: a comment or a
# page gives the reason instead. (Upstream projects' issues, cited as owner/repo#N or with a link,
# are references a reader can follow, and are not matched.) Spelled in pieces, as above.
iss=ssue; iss="[Ii]$iss"
ours=$(git grep -nE "(^|[^/#A-Za-z])$iss(s)? [0-9]+([^0-9A-Za-z-]|$)" -- ':!docs/engine-wire.md' ':!docs/smg-api.md' || true)
if [[ -n "$hits$bare$ours" ]]; then
    echo "references outside the repository (use docs/ and tests/data/):"
    [[ -n "$hits" ]] && echo "$hits"
    [[ -n "$bare" ]] && echo "$bare"
    [[ -n "$ours" ]] && echo "$ours"
    exit 1
fi
echo "ok: no reference leaves the repository"
