#!/usr/bin/env node
// Offline validation of kvd's Kubernetes manifests (deploy/k8s):
//  1. every YAML file parses (all documents);
//  2. every Kubernetes object validates against the Kubernetes OpenAPI schemas shipped in the
//     npm package kubernetes-models (installed from deploy/test/package-lock.json by ./dev), and
//     has no field those schemas lack (what `kubectl apply --validate=strict` rejects; the
//     schema validators alone let unknown fields through). An apiVersion/kind the package has no
//     schema for is a failure: nothing is skipped;
//  3. every kustomization's resources exist, and when kubectl is installed each variant is built
//     with `kubectl kustomize` and the result validated as well;
//  4. every kvd flag a manifest passes (container args, kvd.conf keys in ConfigMaps) is an option
//     `kvd --help` lists, and every kvctl command a probe runs is in the admin command table;
//  5. policy: no hostIPC, no privileged container, and the sidecar is a native sidecar;
//  6. Dynamic Resource Allocation: every pod resourceClaims entry names one claim or template
//     that the same variant defines, every container claim names a pod claim (and an existing
//     request), every v1 device request sets exactly one of `exactly` / `firstAvailable`;
//  7. GPU ownership: a kvd with a GPU backend gets a GPU in its own container (it calls
//     cuMemCreate there), and the containers it shares memory with see that same GPU: the same
//     DRA claim, or (device plugin) kvd's nvidia.com/gpu seen by the worker through
//     NVIDIA_VISIBLE_DEVICES=all on nodes with exactly that many GPUs (nvidia.com/gpu.count).
//     Two containers requesting nvidia.com/gpu get two different GPUs: that fails.
// Usage: validate.js KVD_BINARY [K8S_DIR]
//        validate.js --self-test KVD_BINARY [K8S_DIR]
//          breaks the manifests in memory in known ways (the kvd sidecar without a GPU, a worker
//          on another GPU, a v1beta1-shaped request under resource.k8s.io/v1, ...) and fails
//          unless the checks catch every one of them and pass the unbroken manifests.
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

const argv = process.argv.slice(2);
const selfTest = argv[0] === '--self-test';
if (selfTest) argv.shift();
const kvd = argv[0];
const k8sDir = argv[1] || path.join(here, '..', 'k8s');
if (!kvd) {
  console.error('usage: validate.js [--self-test] KVD_BINARY [K8S_DIR]');
  process.exit(2);
}
let failures = [];
const fail = (msg) => { failures.push(msg); };

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

// Strict fields. The schema validators accept any field they do not know; the API server (with
// kubectl's default --validate=strict) rejects it. The package's type declarations (.d.ts) list
// every field of every type, and each file imports the files of the types its fields have:
// enough to walk an object and name each field that is not there. Types the walk cannot follow
// (primitives, inline object types, types with no declared fields such as RawExtension) are not
// checked below that point, so this check can miss a field but never invents one.
const typeCache = new Map();
function fieldsOf(file) {
  if (typeCache.has(file)) return typeCache.get(file);
  let fields = null;
  if (fs.existsSync(file)) {
    const text = fs.readFileSync(file, 'utf8');
    const imports = new Map();
    for (const m of text.matchAll(/^import \{ ([^}]+) \} from "([^"]+)";$/gm)) {
      const spec = m[2].replace(/\.js$/, '');
      const target = spec.startsWith('.') ? path.resolve(path.dirname(file), spec + '.d.ts')
        : path.join(modules, spec + '.d.ts');
      for (const name of m[1].split(',')) imports.set(name.trim(), target);
    }
    const lines = text.split('\n');
    const start = lines.findIndex((l) => /^export interface \w+/.test(l));
    if (start >= 0) {
      fields = new Map();
      for (let i = start + 1; i < lines.length && lines[i] !== '}'; i++) {
        const m = /^ {4}"([^"]+)"\??: (.*?);?$/.exec(lines[i]);
        if (!m) continue;
        let type = m[2];
        let map = false, array = false;
        if (type === '{') { // a map: the next line is "[key: string]: T;"
          const v = /^\s+\[key: string\]: (.+);$/.exec(lines[i + 1] || '');
          type = v ? v[1] : '';
          map = true;
        }
        const a = /^Array<(\w+)>$/.exec(type);
        if (a) { type = a[1]; array = true; }
        fields.set(m[1], { file: imports.get(type), map, array });
      }
    }
  }
  typeCache.set(file, fields);
  return fields;
}
function strictFields(where, value, fields, at) {
  if (!fields || fields.size === 0 || value === null || typeof value !== 'object' || Array.isArray(value)) return;
  for (const [key, v] of Object.entries(value)) {
    const f = fields.get(key);
    const name = at ? `${at}.${key}` : key;
    if (!f) {
      fail(`${where}: unknown field "${name}" (the API server rejects it)`);
      continue;
    }
    if (!f.file || v === null || typeof v !== 'object') continue;
    const sub = fieldsOf(f.file);
    if (f.array && Array.isArray(v)) v.forEach((x, i) => strictFields(where, x, sub, `${name}[${i}]`));
    else if (f.map) for (const [k, x] of Object.entries(v)) strictFields(where, x, sub, `${name}.${k}`);
    else strictFields(where, v, sub, name);
  }
}

function isKvd(c) {
  const cmd = c.command || [];
  return cmd.length > 0 && path.basename(cmd[0]) === 'kvd';
}
function kvdArg(c, name) {
  let v;
  for (const a of c.args || []) if (a.startsWith(`--${name}=`)) v = a.slice(name.length + 3);
  return v;
}

function checkContainer(where, c, isInit) {
  if (c.securityContext && c.securityContext.privileged) fail(`${where}: container ${c.name} is privileged`);
  if (isKvd(c)) {
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

// The pod spec of a workload (or of a Pod), or undefined.
function podSpecOf(obj) {
  const s = obj.spec;
  if (!s) return undefined;
  if (obj.kind === 'Pod') return s;
  if (obj.kind === 'CronJob') return s.jobTemplate && s.jobTemplate.spec && s.jobTemplate.spec.template && s.jobTemplate.spec.template.spec;
  return s.template && s.template.spec;
}
function containersOf(spec) {
  return [...(spec.initContainers || []), ...(spec.containers || [])];
}

// The device requests of a ResourceClaim or ResourceClaimTemplate.
function deviceRequests(obj) {
  const spec = obj.kind === 'ResourceClaimTemplate' ? obj.spec && obj.spec.spec : obj.spec;
  return (spec && spec.devices && spec.devices.requests) || [];
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
  const dts = path.join(modules, 'kubernetes-models', ...obj.apiVersion.split('/'), `${obj.kind}.d.ts`);
  const fields = fieldsOf(dts);
  if (!fields || fields.size === 0) fail(`${where}: no field list for ${obj.apiVersion} ${obj.kind} (${dts})`);
  else strictFields(`${where}: ${obj.kind} ${obj.metadata && obj.metadata.name}`, obj, fields, '');
  if (obj.kind === 'ConfigMap' && obj.data && obj.data['kvd.conf'] !== undefined) {
    for (const line of obj.data['kvd.conf'].split('\n')) {
      const l = line.replace(/#.*/, '').trim();
      if (l === '') continue;
      const name = l.split('=')[0].trim();
      if (!flags.has(name)) fail(`${where}: kvd.conf sets unknown option '${name}'`);
    }
  }
  if (obj.apiVersion === 'resource.k8s.io/v1' && (obj.kind === 'ResourceClaim' || obj.kind === 'ResourceClaimTemplate')) {
    for (const r of deviceRequests(obj)) {
      if ((r.exactly === undefined) === (r.firstAvailable === undefined)) {
        fail(`${where}: ${obj.kind} ${obj.metadata && obj.metadata.name}: device request '${r.name}' must set exactly one of exactly / firstAvailable (resource.k8s.io/v1)`);
      }
    }
  }
  const spec = podSpecOf(obj);
  if (spec) {
    if (spec.hostIPC) fail(`${where}: hostIPC is set`);
    for (const c of spec.initContainers || []) checkContainer(where, c, true);
    for (const c of spec.containers || []) checkContainer(where, c, false);
  }
}

// DRA references inside one variant (the objects of one directory, or of one kustomize build).
function checkClaims(where, spec, defined) {
  const podClaims = new Map();
  for (const pc of spec.resourceClaims || []) {
    if (podClaims.has(pc.name)) fail(`${where}: spec.resourceClaims names '${pc.name}' twice`);
    podClaims.set(pc.name, pc);
    const byName = pc.resourceClaimName !== undefined, byTemplate = pc.resourceClaimTemplateName !== undefined;
    if (byName === byTemplate) {
      fail(`${where}: pod claim '${pc.name}' must set exactly one of resourceClaimName / resourceClaimTemplateName`);
      continue;
    }
    const kind = byName ? 'ResourceClaim' : 'ResourceClaimTemplate';
    const target = byName ? pc.resourceClaimName : pc.resourceClaimTemplateName;
    if (!defined.get(kind).has(target)) fail(`${where}: pod claim '${pc.name}' names ${kind} '${target}', which this variant does not define`);
  }
  const used = new Set();
  for (const c of containersOf(spec)) {
    const seen = new Set();
    for (const cc of (c.resources && c.resources.claims) || []) {
      if (seen.has(cc.name)) fail(`${where}: container ${c.name} lists claim '${cc.name}' twice`);
      seen.add(cc.name);
      used.add(cc.name);
      const pc = podClaims.get(cc.name);
      if (!pc) {
        fail(`${where}: container ${c.name} uses claim '${cc.name}', which is not in spec.resourceClaims`);
        continue;
      }
      if (cc.request === undefined) continue;
      const kind = pc.resourceClaimName !== undefined ? 'ResourceClaim' : 'ResourceClaimTemplate';
      const obj = defined.get(kind).get(pc.resourceClaimName || pc.resourceClaimTemplateName);
      if (obj && !deviceRequests(obj).some((r) => r.name === cc.request)) {
        fail(`${where}: container ${c.name} asks for request '${cc.request}' of claim '${cc.name}', which has no such request`);
      }
    }
  }
  for (const name of podClaims.keys()) {
    if (!used.has(name)) fail(`${where}: pod claim '${name}' is used by no container`);
  }
}

const GPU_BACKENDS = new Set(['cuda-vmm', 'cuda-ipc']);
// How a container gets GPUs: DRA claims, device-plugin GPUs, the NVIDIA runtime's variable.
function gpuOf(c) {
  const r = c.resources || {};
  const n = (m) => Number((m || {})['nvidia.com/gpu'] || 0);
  const env = (c.env || []).find((e) => e.name === 'NVIDIA_VISIBLE_DEVICES');
  const visible = env && env.value && !['void', 'none'].includes(env.value) ? env.value : null;
  return { claims: (r.claims || []).map((x) => x.name), plugin: Math.max(n(r.limits), n(r.requests)), visible };
}
function hostPaths(spec, c) {
  const vols = new Map((spec.volumes || []).map((v) => [v.name, v]));
  return (c.volumeMounts || []).map((m) => vols.get(m.name)).filter((v) => v && v.hostPath).map((v) => v.hostPath.path);
}

// kvd in a pod: returns the host paths of a kvd that runs alone in its pod and sees the node's
// GPUs through NVIDIA_VISIBLE_DEVICES (the DaemonSet pattern), for checkShared.
function checkGpu(where, spec) {
  const shared = [];
  const all = containersOf(spec);
  const count = (spec.nodeSelector || {})['nvidia.com/gpu.count'];
  for (const k of all.filter(isKvd)) {
    const backend = kvdArg(k, 'backend');
    if (!GPU_BACKENDS.has(backend)) continue;
    const g = gpuOf(k);
    if (g.claims.length === 0 && g.plugin === 0 && !g.visible) {
      fail(`${where}: kvd (--backend=${backend}) gets no GPU: its container lists no DRA claim (resources.claims), requests no nvidia.com/gpu and sets no NVIDIA_VISIBLE_DEVICES, but kvd calls cuMemCreate in its own container`);
      continue;
    }
    const vols = new Map((spec.volumes || []).map((v) => [v.name, v]));
    const kvdVols = new Set((k.volumeMounts || []).map((m) => m.name).filter((n) => vols.has(n) && !vols.get(n).configMap));
    // Init containers that run to completion before kvd starts never use its memory (native
    // sidecars, restartPolicy Always, run beside it and do).
    const beside = [...(spec.initContainers || []).filter((c) => c.restartPolicy === 'Always'), ...(spec.containers || [])];
    const peers = beside.filter((c) => c !== k && (c.volumeMounts || []).some((m) => kvdVols.has(m.name)));
    for (const p of peers) {
      const pg = gpuOf(p);
      if (g.claims.length > 0) {
        if (pg.plugin > 0) fail(`${where}: container ${p.name} requests nvidia.com/gpu, but kvd's GPU is the DRA claim ${g.claims.join(', ')}: a device-plugin GPU is another device`);
        if (!pg.claims.some((n) => g.claims.includes(n))) fail(`${where}: container ${p.name} does not list kvd's claim (${g.claims.join(', ')}) in resources.claims, so it does not see the GPU kvd's memory is on`);
      } else if (g.plugin > 0) {
        if (pg.plugin > 0) fail(`${where}: kvd and container ${p.name} both request nvidia.com/gpu: the device plugin gives them different GPUs (share one DRA claim instead)`);
        else if (pg.claims.length > 0) fail(`${where}: container ${p.name} uses a DRA claim, but kvd's GPU comes from the device plugin (nvidia.com/gpu): not the same device`);
        else if (pg.visible !== 'all') fail(`${where}: kvd owns the pod's GPU (nvidia.com/gpu: ${g.plugin}) but container ${p.name} sees no GPU: give it NVIDIA_VISIBLE_DEVICES=all (docs/K8S_GPU.md)`);
        else if (count !== String(g.plugin)) fail(`${where}: container ${p.name} sees the node's GPUs (NVIDIA_VISIBLE_DEVICES=all), so the pod must select nodes with exactly the ${g.plugin} GPU(s) kvd requests (nodeSelector nvidia.com/gpu.count: "${g.plugin}")`);
      } else {
        if (pg.plugin === 0 && pg.claims.length === 0 && !pg.visible) fail(`${where}: container ${p.name} shares kvd's socket but gets no GPU`);
        if (count !== '1') fail(`${where}: kvd sees the node's GPUs through NVIDIA_VISIBLE_DEVICES and uses one (--device); container ${p.name} is certain to have that one only on single-GPU nodes (nodeSelector nvidia.com/gpu.count: "1")`);
      }
    }
    if (peers.length === 0 && g.claims.length === 0 && g.plugin === 0) {
      if (count !== '1') fail(`${where}: kvd sees the node's GPUs through NVIDIA_VISIBLE_DEVICES and serves one of them (--device); the workers get theirs from the device plugin, and only on single-GPU nodes is that kvd's: add nodeSelector nvidia.com/gpu.count: "1"`);
      shared.push(...hostPaths(spec, k));
    }
  }
  return shared;
}

// Workloads of the variant that share a host-path socket directory with such a kvd (and use a
// GPU) must run on the same single-GPU nodes.
function checkShared(where, spec, kvdPaths) {
  if (kvdPaths.size === 0 || containersOf(spec).some(isKvd)) return;
  const count = (spec.nodeSelector || {})['nvidia.com/gpu.count'];
  for (const c of containersOf(spec)) {
    const g = gpuOf(c);
    if (g.plugin === 0 && g.claims.length === 0 && !g.visible) continue;
    if (!hostPaths(spec, c).some((p) => kvdPaths.has(p))) continue;
    if (count !== '1') fail(`${where}: container ${c.name} uses the node's kvd (host path ${[...kvdPaths].join(', ')}), whose GPU is certainly the one the device plugin gives ${c.name} only on single-GPU nodes: add nodeSelector nvidia.com/gpu.count: "1"`);
  }
}

// Every check on the objects of one variant: [[where, obj], ...].
function checkVariant(objs) {
  const defined = new Map([['ResourceClaim', new Map()], ['ResourceClaimTemplate', new Map()]]);
  for (const [, obj] of objs) {
    if (obj && defined.has(obj.kind) && obj.metadata) defined.get(obj.kind).set(obj.metadata.name, obj);
  }
  const kvdPaths = new Set();
  for (const [where, obj] of objs) {
    checkObject(where, obj);
    const spec = obj && obj.kind !== 'Kustomization' ? podSpecOf(obj) : undefined;
    if (!spec) continue;
    checkClaims(where, spec, defined);
    for (const p of checkGpu(where, spec)) kvdPaths.add(p);
  }
  for (const [where, obj] of objs) {
    const spec = obj && obj.kind !== 'Kustomization' ? podSpecOf(obj) : undefined;
    if (spec) checkShared(where, spec, kvdPaths);
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

// Breaks for --self-test: each changes the objects of one directory and names a failure the
// checks must then report. apply returns false when the manifests no longer have what it breaks
// (the self-test then fails: update the break with the manifests).
const find = (objs, kind) => objs.map(([, o]) => o).find((o) => o && o.kind === kind);
const pod = (objs) => podSpecOf(find(objs, 'Deployment') || find(objs, 'DaemonSet'));
const kvdOf = (objs) => objs.map(([, o]) => o && o.kind !== 'Kustomization' && podSpecOf(o))
  .filter(Boolean).flatMap(containersOf).find(isKvd);
const workerOf = (objs) => (pod(objs).containers || []).find((c) => c.name === 'worker');
const BREAKS = [
  { dir: 'sidecar', name: 'the kvd sidecar requests no GPU (the original manifest\'s bug)',
    expect: /kvd \(--backend=cuda-vmm\) gets no GPU/,
    apply: (o) => { const k = kvdOf(o); if (!k.resources.claims) return false; delete k.resources.claims; return true; } },
  { dir: 'sidecar', name: 'the worker requests nvidia.com/gpu instead of kvd\'s claim',
    expect: /does not list kvd's claim/,
    apply: (o) => { const w = workerOf(o); if (!w.resources.claims) return false; delete w.resources.claims; w.resources.limits['nvidia.com/gpu'] = 1; return true; } },
  { dir: 'sidecar', name: 'a resource.k8s.io/v1beta1-shaped request under resource.k8s.io/v1',
    expect: /unknown field "spec\.spec\.devices\.requests\[0\]\.deviceClassName"/,
    apply: (o) => { const r = deviceRequests(find(o, 'ResourceClaimTemplate'))[0]; if (!r || !r.exactly) return false; Object.assign(r, r.exactly); delete r.exactly; return true; } },
  { dir: 'sidecar', name: 'a device request without exactly / firstAvailable',
    expect: /must set exactly one of exactly \/ firstAvailable/,
    apply: (o) => { const r = deviceRequests(find(o, 'ResourceClaimTemplate'))[0]; if (!r || !r.exactly) return false; delete r.exactly; return true; } },
  { dir: 'sidecar', name: 'the pod names a ResourceClaimTemplate the variant lacks',
    expect: /names ResourceClaimTemplate 'kvd-gpu-typo', which this variant does not define/,
    apply: (o) => { const pc = (pod(o).resourceClaims || [])[0]; if (!pc) return false; pc.resourceClaimTemplateName = 'kvd-gpu-typo'; return true; } },
  { dir: 'sidecar', name: 'a container names a claim the pod lacks',
    expect: /uses claim 'gpu0', which is not in spec\.resourceClaims/,
    apply: (o) => { const w = workerOf(o); if (!w.resources.claims) return false; w.resources.claims[0].name = 'gpu0'; return true; } },
  { dir: 'sidecar', name: 'a misspelt field (resoures)',
    expect: /unknown field "spec\.template\.spec\.containers\[0\]\.resoures"/,
    apply: (o) => { const w = workerOf(o); w.resoures = w.resources; delete w.resources; return true; } },
  { dir: 'sidecar', name: 'a wrong type (count: "one")',
    expect: /ResourceClaimTemplate kvd-gpu does not validate/,
    apply: (o) => { const r = deviceRequests(find(o, 'ResourceClaimTemplate'))[0]; if (!r || !r.exactly) return false; r.exactly.count = 'one'; return true; } },
  { dir: 'sidecar', name: 'a DRA API version the schemas do not have (resource.k8s.io/v1beta3)',
    expect: /no schema for resource\.k8s\.io\/v1beta3 ResourceClaimTemplate/,
    apply: (o) => { find(o, 'ResourceClaimTemplate').apiVersion = 'resource.k8s.io/v1beta3'; return true; } },
  { dir: 'sidecar', name: 'a kvd flag that does not exist',
    expect: /kvd has no flag --gpu/,
    apply: (o) => { kvdOf(o).args.push('--gpu=0'); return true; } },
  { dir: 'sidecar-device-plugin', name: 'kvd and the worker both request nvidia.com/gpu',
    expect: /both request nvidia\.com\/gpu: the device plugin gives them different GPUs/,
    apply: (o) => { const w = workerOf(o); if (!kvdOf(o).resources.limits['nvidia.com/gpu']) return false; w.resources.limits['nvidia.com/gpu'] = 1; return true; } },
  { dir: 'sidecar-device-plugin', name: 'the worker without NVIDIA_VISIBLE_DEVICES',
    expect: /container worker sees no GPU: give it NVIDIA_VISIBLE_DEVICES=all/,
    apply: (o) => { const w = workerOf(o); const n = (w.env || []).length; w.env = (w.env || []).filter((e) => e.name !== 'NVIDIA_VISIBLE_DEVICES'); return w.env.length < n; } },
  { dir: 'sidecar-device-plugin', name: 'no single-GPU node selector',
    expect: /nodeSelector nvidia\.com\/gpu\.count: "1"/,
    apply: (o) => { const s = pod(o); if (!s.nodeSelector) return false; delete s.nodeSelector; return true; } },
  { dir: 'daemonset', name: 'the kvd DaemonSet on multi-GPU nodes',
    expect: /kvd sees the node's GPUs through NVIDIA_VISIBLE_DEVICES and serves one of them/,
    apply: (o) => { const s = podSpecOf(find(o, 'DaemonSet')); if (!s.nodeSelector['nvidia.com/gpu.count']) return false; delete s.nodeSelector['nvidia.com/gpu.count']; return true; } },
  { dir: 'daemonset', name: 'the DaemonSet\'s workers on multi-GPU nodes',
    expect: /uses the node's kvd \(host path \/run\/kvd\)/,
    apply: (o) => { const s = podSpecOf(find(o, 'Deployment')); if (!s.nodeSelector) return false; delete s.nodeSelector; return true; } },
  { dir: 'daemonset', name: 'the kvd DaemonSet without NVIDIA_VISIBLE_DEVICES',
    expect: /kvd \(--backend=cuda-vmm\) gets no GPU/,
    apply: (o) => { const k = kvdOf(o); const n = k.env.length; k.env = k.env.filter((e) => e.name !== 'NVIDIA_VISIBLE_DEVICES'); return k.env.length < n; } },
];

async function runSelfTest(byDir) {
  let bad = 0;
  failures = [];
  for (const objs of byDir.values()) checkVariant(objs);
  if (failures.length > 0) {
    for (const f of failures) console.error('FAIL: ' + f);
    console.error('FAIL: self-test: the unbroken manifests do not pass');
    return 1;
  }
  for (const b of BREAKS) {
    const objs = byDir.get(b.dir);
    if (!objs) { console.error(`FAIL: self-test: no directory ${b.dir}`); bad++; continue; }
    const copy = JSON.parse(JSON.stringify(objs));
    failures = [];
    let applied;
    try { applied = b.apply(copy); } catch (e) { applied = false; }
    if (!applied) { console.error(`FAIL: self-test: cannot break ${b.dir}: ${b.name} (the manifests changed?)`); bad++; continue; }
    for (const [, obj] of copy) if (obj && obj.apiVersion) await loadGroup(obj.apiVersion);
    checkVariant(copy);
    if (failures.some((f) => b.expect.test(f))) console.log(`ok: ${b.dir}: ${b.name}: caught`);
    else {
      console.error(`FAIL: self-test: ${b.dir}: ${b.name}: not caught (wanted ${b.expect}); got: ${failures.join(' | ') || 'no failure'}`);
      bad++;
    }
  }
  console.log(`self-test: ${BREAKS.length - bad} of ${BREAKS.length} breaks caught`);
  return bad === 0 ? 0 : 1;
}

async function main() {
  let objects = 0;
  const variants = [];
  const byDir = new Map();
  for (const file of walk(k8sDir)) {
    const rel = path.relative(k8sDir, file);
    const dir = path.dirname(rel);
    if (!byDir.has(dir)) byDir.set(dir, []);
    for (const obj of parseAll(rel, fs.readFileSync(file, 'utf8'))) {
      objects++;
      byDir.get(dir).push([rel, obj]);
      if (obj.apiVersion) await loadGroup(obj.apiVersion);
      if (obj.kind === 'Kustomization') {
        for (const r of obj.resources || []) {
          const p = path.join(path.dirname(file), r);
          if (!fs.existsSync(p)) fail(`${rel}: resource ${r} does not exist`);
        }
        if ((obj.resources || []).some((r) => r.startsWith('../'))) variants.push(path.dirname(file));
      }
    }
  }
  if (selfTest) {
    const early = failures;
    if (early.length > 0) {
      for (const f of early) console.error('FAIL: ' + f);
      process.exit(1);
    }
    process.exit(await runSelfTest(byDir));
  }
  for (const objs of byDir.values()) checkVariant(objs);
  if (variants.length < 3) fail(`expected three kustomize variants (sidecar, sidecar-device-plugin, daemonset), found ${variants.length}`);

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
      const built = [];
      for (const obj of parseAll(`kustomize ${rel}`, out)) {
        objects++;
        if (obj.apiVersion) await loadGroup(obj.apiVersion);
        built.push([`kustomize ${rel}`, obj]);
      }
      checkVariant(built);
    }
  }

  for (const f of failures) console.error('FAIL: ' + f);
  console.log(`${objects} objects checked, ${failures.length} failures (${flags.size} kvd flags, ${commands.size} admin commands)`);
  process.exit(failures.length === 0 ? 0 : 1);
}
main().catch((e) => { console.error('FAIL: ' + (e.stack || e)); process.exit(1); });
