#!/usr/bin/env bash
# Checks that backend/src/decorator/forward.rs is what scripts/gen-decorator.py generates from the
# pinned Burn's op traits (formatted by rustfmt), so that no op of a Burn upgrade or of an edit
# to overrides.rs is forwarded by a stale impl. Exits 1 with the difference otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
host=$(rustc -vV | sed -n "s/^host: //p")
manifest=$(cargo metadata --quiet --locked --format-version 1 --filter-platform "$host" | python3 -c '
import json, sys
packages = json.load(sys.stdin)["packages"]
print(next(p["manifest_path"] for p in packages if p["name"] == "burn-backend"))')
ops="$(dirname "$manifest")/src/backend/ops"
generated=$(mktemp)
trap 'rm -f "$generated"' EXIT
python3 scripts/gen-decorator.py "$ops" | rustfmt --edition 2024 >"$generated"
if ! diff -u backend/src/decorator/forward.rs "$generated"; then
    echo "backend/src/decorator/forward.rs is not what scripts/gen-decorator.py generates from" >&2
    echo "$ops (diff above); regenerate it:" >&2
    echo "  python3 scripts/gen-decorator.py $ops | rustfmt --edition 2024 > backend/src/decorator/forward.rs" >&2
    exit 1
fi
echo "backend/src/decorator/forward.rs is what scripts/gen-decorator.py generates"
