#!/usr/bin/env bash
# Cut a release a team can pin: check that the versions agree, build the sdist and wheel, tag v<version>.
#
#   deploy/release.sh            check, build dist/ and create the annotated tag v<version> (not pushed)
#   deploy/release.sh --dry-run  the same checks and build, no tag (tests/test_release.py runs this on a copy)
#
# Refuses (exit 1) when pyproject.toml, egresslaw/__init__.py and the first `## [X.Y.Z]` of CHANGELOG.md
# disagree, when the git tree has changes or untracked files, or when the tag already exists.
# PYTHON picks the interpreter that builds (default: .venv/bin/python, else python3); it needs `build`.
# Push the tag yourself afterwards: git push origin v<version>.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: deploy/release.sh [--dry-run]" >&2; exit 2 ;;
esac
die() { echo "release: $*" >&2; exit 1; }

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

pyproject=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
package=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' egresslaw/__init__.py | head -n 1)
changelog=$(sed -n 's/^## \[\([0-9][0-9.]*[0-9]\)\].*/\1/p' CHANGELOG.md | head -n 1)
[ -n "$pyproject" ] || die "no version = \"…\" in pyproject.toml"
[ "$pyproject" = "$package" ] || die "pyproject.toml says $pyproject, egresslaw/__init__.py says $package"
[ "$pyproject" = "$changelog" ] || die "pyproject.toml says $pyproject, the first release in CHANGELOG.md is ${changelog:-missing}"
tag="v$pyproject"

[ -z "$(git status --porcelain)" ] || die "the git tree is not clean (commit or stash first):
$(git status --short | head -n 20)"
if git rev-parse -q --verify "refs/tags/$tag" >/dev/null; then
  die "tag $tag already exists (at $(git rev-list -n 1 "$tag" | cut -c1-12)): bump the version first"
fi

rm -rf dist
"$PYTHON" -m build --outdir dist . >&2  # the sdist, then the wheel built from that sdist
sdist="dist/egresslaw-$pyproject.tar.gz"
wheel="dist/egresslaw-$pyproject-py3-none-any.whl"
[ -f "$sdist" ] && [ -f "$wheel" ] || die "the build did not make $sdist and $wheel: $(ls dist)"

if [ "$dry_run" = 1 ]; then
  echo "release: dry run: built $sdist and $wheel; would tag $tag at $(git rev-parse --short HEAD)"
  exit 0
fi
git tag -a "$tag" -m "egresslaw $pyproject"
echo "release: built $sdist and $wheel; tagged $tag at $(git rev-parse --short HEAD) (push it: git push origin $tag)"
