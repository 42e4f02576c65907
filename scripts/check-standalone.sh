#!/usr/bin/env bash
# Fails when a tracked file reads or points at anything outside the repository: the reference
# material the project was written from lives beside it on developers' machines, and a clone must
# not need it. Facts live in docs/, test data in tests/data/.
set -euo pipefail
cd "$(dirname "$0")/.."
# Paths that leave the repository: ../shared, shared/spec, or a spec cited without docs/.
pattern='(\.\./shared|shared/spec|shared/hooks)'
hits=$(git grep -nE "$pattern" -- ':!scripts/check-standalone.sh' ':!scripts/test.sh' || true)
# Spec documents must be cited by their in-repository path (docs/engine-wire.md, docs/smg-api.md).
bare=$(git grep -nE '(^|[^/A-Za-z-])(engine-wire|smg-api)\.md' -- ':!scripts/check-standalone.sh' ':!docs/' || true)
if [[ -n "$hits$bare" ]]; then
    echo "references outside the repository (use docs/ and tests/data/):"
    [[ -n "$hits" ]] && echo "$hits"
    [[ -n "$bare" ]] && echo "$bare"
    exit 1
fi
echo "ok: no reference leaves the repository"
