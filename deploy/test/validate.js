#!/usr/bin/env node
// Offline validation of kvd's Kubernetes manifests (deploy/k8s):
//  1. every YAML file parses (all documents);
//  2. every Kubernetes object validates against the Kubernetes OpenAPI schemas shipped in the
//     npm package kubernetes-models (installed from deploy/test/package-lock.json by ./dev);
//  3. every kustomization's resources exist, and when kubectl is installed each variant is built
//     with `kubectl kustomize` and the result validated as well;
//  4. every kvd flag a manifest passes (container args, kvd.conf keys in ConfigMaps) is an option
//     `kvd --help` lists, and every kvctl command a probe runs is in the admin command table;
//  5. policy: no hostIPC, no privileged container, and the sidecar is a native sidecar.
// Usage: validate.js KVD_BINARY [K8S_DIR]
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

const here = path.dirname(fs.realpathSync(__filename));
const modules = path.join(here, 'node_modules');
if (!fs.existsSync(path.join(modules, 'kubernetes-models'))) {
  console.error(`FAIL: ${modules} lacks kubernetes-models; run ./dev test (it runs npm ci in deploy/test)`);
  process.exit(1);
}
module.paths.unshift(modules);
const YAML = require('yaml');

const kvd = process.argv[2];
const k8sDir = process.argv[3] || path.join(here, '..', 'k8s');
let failures = 0;
const fail = (msg) => { failures++; console.error('FAIL: ' + msg); };

// Flags and admin commands from the binary itself (the one option table, the one command table).
const help = execFileSync(kvd, ['--help'], { encoding: 'utf8' });
const flags = new Set(['config']);
for (const m of help.matchAll(/^ {2}--([a-z0-9-]+)=/gm)) flags.add(m[1]);
const doc = execFileSync(kvd, ['--print-admin-doc'], { encoding: 'utf8' });
const commands = new Set();
for (const m of doc.matchAll(/^\| `([a-z ]+)` \|/gm)) commands.add(m[1]);
if (flags.size < 10 || commands.size < 10) fail(`could not read kvd's flags (${flags.size}) or commands (${commands.size})`);

// kubernetes-models is an ES module: load each API group's index once, by file URL.
const { pathToFileURL } = require('url');
const groups = new Map();
async function loadGroup(apiVersion) {
  if (!groups.has(apiVersion)) {
    const file = path.join(modules, 'kubernetes-models', ...apiVersion.split('/'), 'index.js');
    groups.set(apiVersion, fs.existsSync(file) ? await import(pathToFileURL(file).href) : {});
  }
  return groups.get(apiVersion);
}
function modelFor(apiVersion, kind) {
  const g = groups.get(apiVersion);
  return g ? g[kind] : undefined;
}

function checkContainer(where, c, isInit) {
  if (c.securityContext && c.securityContext.privileged) fail(`${where}: container ${c.name} is privileged`);
  const cmd = c.command || [];
  if (cmd.length > 0 && path.basename(cmd[0]) === 'kvd') {
    for (const a of c.args || []) {
      const m = /^--([a-z0-9-]+)=/.exec(a);
      if (!m) fail(`${where}: kvd argument '${a}' is not --name=value`);
      else if (!flags.has(m[1])) fail(`${where}: kvd has no flag --${m[1]}`);
    }
  }
  const probes = [c.livenessProbe, c.readinessProbe, c.startupProbe,
    c.lifecycle && c.lifecycle.preStop, c.lifecycle && c.lifecycle.postStart];
  for (const p of probes) {
    const pc = p && p.exec && p.exec.command;
    if (!pc || path.basename(pc[0]) !== 'kvctl') continue;
    const words = pc.slice(1).filter((w) => !w.startsWith('--'));
    const one = words[0], two = words.slice(0, 2).join(' ');
    if (!commands.has(one) && !commands.has(two)) fail(`${where}: kvctl has no command '${one}'`);
  }
  if (isInit && c.name === 'kvd' && c.restartPolicy !== 'Always') {
    fail(`${where}: the kvd init container must be a native sidecar (restartPolicy: Always)`);
  }
}

function checkObject(where, obj) {
  if (!obj || typeof obj !== 'object') return fail(`${where}: not an object`);
  if (obj.kind === 'Kustomization') return; // not a Kubernetes API object
  const Model = modelFor(obj.apiVersion, obj.kind);
  if (!Model) return fail(`${where}: no schema for ${obj.apiVersion} ${obj.kind}`);
  try {
    new Model(obj).validate();
  } catch (e) {
    fail(`${where}: ${obj.kind} ${obj.metadata && obj.metadata.name} does not validate: ${e.message}`);
  }
  if (obj.kind === 'ConfigMap' && obj.data && obj.data['kvd.conf'] !== undefined) {
    for (const line of obj.data['kvd.conf'].split('\n')) {
      const l = line.replace(/#.*/, '').trim();
      if (l === '') continue;
      const name = l.split('=')[0].trim();
      if (!flags.has(name)) fail(`${where}: kvd.conf sets unknown option '${name}'`);
    }
  }
  const spec = obj.spec && obj.spec.template && obj.spec.template.spec;
  if (spec) {
    if (spec.hostIPC) fail(`${where}: hostIPC is set`);
    for (const c of spec.initContainers || []) checkContainer(where, c, true);
    for (const c of spec.containers || []) checkContainer(where, c, false);
  }
}

function parseAll(where, text) {
  const docs = YAML.parseAllDocuments(text);
  const out = [];
  for (const d of docs) {
    if (d.errors.length > 0) {
      fail(`${where}: YAML: ${d.errors[0].message}`);
      continue;
    }
    const v = d.toJS();
    if (v !== null && v !== undefined) out.push(v);
  }
  return out;
}

function walk(dir) {
  let files = [];
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) files = files.concat(walk(p));
    else if (/\.ya?ml$/.test(e.name)) files.push(p);
  }
  return files.sort();
}

async function main() {
let objects = 0;
const variants = [];
const all = [];
for (const file of walk(k8sDir)) {
  const rel = path.relative(k8sDir, file);
  for (const obj of parseAll(rel, fs.readFileSync(file, 'utf8'))) {
    objects++;
    all.push([rel, obj]);
    if (obj.kind === 'Kustomization') {
      for (const r of obj.resources || []) {
        const p = path.join(path.dirname(file), r);
        if (!fs.existsSync(p)) fail(`${rel}: resource ${r} does not exist`);
      }
      if ((obj.resources || []).some((r) => r.startsWith('../'))) variants.push(path.dirname(file));
    }
  }
}
for (const [rel, obj] of all) {
  if (obj.apiVersion) await loadGroup(obj.apiVersion);
  checkObject(rel, obj);
}
if (variants.length < 2) fail(`expected two kustomize variants, found ${variants.length}`);

let kubectl = null;
try {
  execFileSync('kubectl', ['version', '--client'], { stdio: 'ignore' });
  kubectl = 'kubectl';
} catch (e) {
  console.log('note: kubectl not installed; kustomize builds not checked (files were)');
}
if (kubectl) {
  for (const v of variants) {
    const rel = path.relative(k8sDir, v);
    let out;
    try {
      out = execFileSync(kubectl, ['kustomize', v], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
    } catch (e) {
      fail(`kubectl kustomize ${rel}: ${e.stderr || e.message}`);
      continue;
    }
    for (const obj of parseAll(`kustomize ${rel}`, out)) {
      objects++;
      if (obj.apiVersion) await loadGroup(obj.apiVersion);
      checkObject(`kustomize ${rel}`, obj);
    }
  }
}

console.log(`${objects} objects checked, ${failures} failures (${flags.size} kvd flags, ${commands.size} admin commands)`);
process.exit(failures === 0 ? 0 : 1);
}
main().catch((e) => { console.error('FAIL: ' + (e.stack || e)); process.exit(1); });
