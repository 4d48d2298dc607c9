#!/usr/bin/env bash
# Runs deploy/test/validate.js on deploy/k8s, then its self-test (the same checks must catch
# known breaks of those manifests: a kvd sidecar without a GPU, a worker on another GPU, ...);
# skips (passes with a message) only without node.
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
    echo "SKIP: node is not installed; Kubernetes manifests not validated (./dev installs nodejs)"
    exit 0
fi
# kustomize does not follow the runfiles' symlinks: validate a dereferenced copy.
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/k8s.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp -rL deploy/k8s "$tmp/k8s"
node deploy/test/validate.js "$1" "$tmp/k8s"
node deploy/test/validate.js --self-test "$1" "$tmp/k8s"
