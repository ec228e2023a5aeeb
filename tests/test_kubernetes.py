"""deploy/kubernetes (issue 21 item 6): every manifest valid against the Kubernetes schemas
(kubernetes-validate, offline and strict: an unknown field or a wrong type fails), and
consistent with colibri itself: each container's `colibri ...` command parsed by colibri's own
parser and settings (a flag that does not exist fails), the worker hosts' --join on the head
Service's backend port, the readiness probe on the gateway's /health, the grace period above
graceful_timeout, every Secret and volume a command names mounted, and the CURVE key halves
paired: the keys README.md generates, laid out as each container's mounts, loaded by colibri's
own CURVE code (the router admits the gateway on its client port and the worker hosts on its
backend, and neither on the other). No network, no kubectl."""
from __future__ import annotations

import contextlib
import functools
import io
import os
import pathlib
import re
import shutil

import kubernetes_validate
import pytest
import yaml

from colibri_server.cli import build_parser
from colibri_server.http.app import HEALTH_TIMEOUT
from colibri_server.http.config import ENV_VARS as HTTP_ENV_VARS
from colibri_server.http.config import curve_from_files
from colibri_server.settings import SettingsError, load_settings
from colibri_server.settings.schema import SETTINGS
from colibri_server.wire.security import CLI_NAME_RE, CurveServer, client_curve

DIR = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# the newest schemas kubernetes-validate ships (1.37.0 has 1.25 .. 1.37), and an older release
# still common in clusters: the manifests use nothing newer than it
K8S_VERSIONS = ("1.37", "1.30")
NAME = "colibri"
HEAD_SERVICE = "colibri-head"
MODEL_CLAIM = "colibri-models"
# the Secret of the public keys the router's client port admits, and the gateway's key in it
CLIENT_KEYS = "colibri-client-keys"
GATEWAY_PUBLIC = "gateway.key"
# whose secret key each container may hold (NAME.key_secret): its own only
OWN_KEY = {"router": "head", "http": "gateway", "serve": "worker"}


# ---------------------------------------------------------------------------- loading

# read once per run (the tests only read what these return)
@functools.cache
def _docs(path: pathlib.Path) -> list[dict]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d is not None]


def _manifest_files() -> list[pathlib.Path]:
    return sorted(p for p in DIR.glob("*.yaml") if p.name != "kustomization.yaml")


def _kustomization() -> dict:
    return yaml.safe_load((DIR / "kustomization.yaml").read_text())


def _applied() -> list[dict]:
    """The objects `kubectl apply -k` creates: the kustomization's resources."""
    return [d for f in _kustomization()["resources"] for d in _docs(DIR / f)]


def _one(kind: str, component: str) -> dict:
    found = [d for d in _applied() if d["kind"] == kind
             and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {kind} of component {component}, found {len(found)}"
    return found[0]


def _service() -> dict:
    found = [d for d in _applied() if d["kind"] == "Service" and d["metadata"]["name"] == HEAD_SERVICE]
    assert len(found) == 1, f"expected the Service {HEAD_SERVICE}"
    return found[0]


def _pod(component: str) -> dict:
    return _one("Deployment", component)["spec"]["template"]["spec"]


def _containers() -> list[tuple[str, dict, dict]]:
    """(id, pod spec, container) of every container of every workload."""
    out = []
    for d in _applied():
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            pod = d["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                out.append((f"{d['metadata']['name']}/{c['name']}", pod, c))
    return out


def _argv(c: dict) -> list[str]:
    return list(c.get("command", [])) + list(c.get("args", []))


def _container(component: str, subcommand: str) -> dict:
    found = [c for c in _pod(component)["containers"] if _argv(c)[1:2] == [subcommand]]
    assert len(found) == 1, f"expected one `colibri {subcommand}` container in the {component} pod"
    return found[0]


def _flag(argv: list[str], name: str) -> str:
    """The value after `name` (or of `name=value`) in argv; fails when absent."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    pytest.fail(f"{name} is missing from {argv}")


def _host_port(addr: str) -> tuple[str, int]:
    """(host, port) of tcp://HOST:PORT or HOST:PORT."""
    addr = addr.removeprefix("tcp://")
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _container_port(c: dict, port) -> int:
    """A probe's or a Service's port (number, or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert named, f"container {c['name']} has no port named {port!r}"
    return named[0]


def _service_link_env(pod: dict) -> dict:
    """The variables the kubelet puts in every container for every Service of the namespace
    (docker links style) unless the pod sets enableServiceLinks: false."""
    if pod.get("enableServiceLinks", True) is False:
        return {}
    env = {}
    for s in (d for d in _applied() if d["kind"] == "Service"):
        pre = s["metadata"]["name"].upper().replace("-", "_")
        ip = "10.96.0.10"
        ports = s["spec"]["ports"]
        env[f"{pre}_SERVICE_HOST"] = ip
        env[f"{pre}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{pre}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
        for p in ports:
            proto = p.get("protocol", "TCP")
            if "name" in p:
                env[f"{pre}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
            base = f"{pre}_PORT_{p['port']}_{proto}"
            env.update({base: f"{proto.lower()}://{ip}:{p['port']}", f"{base}_PROTO": proto.lower(),
                        f"{base}_PORT": str(p["port"]), f"{base}_ADDR": ip})
    return env


def _parse(argv: list[str]):
    """colibri's own parser on a container's command: SystemExit (unknown flag or subcommand,
    bad value) becomes a failure with argparse's message."""
    assert argv and argv[0] == "colibri", f"not a colibri command: {argv}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv[1:])
    except SystemExit:
        pass
    pytest.fail(f"colibri's parser refuses {' '.join(argv)}:\n{err.getvalue()}")


def _settings(pod: dict, c: dict):
    """Effective settings of a `colibri serve|router` container: its command line, its literal
    COLIBRI_* environment and the service-link variables the kubelet would add."""
    env = {**_service_link_env(pod), **{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}}
    try:
        return load_settings(_parse(_argv(c)), config_path=None, env=env)
    except SettingsError as e:
        problem = str(e)
    pytest.fail(f"{' '.join(_argv(c))}: colibri would not start:\n{problem}")


# ---------------------------------------------------------------------------- the schemas

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_valid_against_the_kubernetes_schemas(version):
    files = _manifest_files()
    assert files
    n, errors = 0, []
    for f in files:
        for d in _docs(f):
            # strict: additionalProperties false everywhere, so a misspelt field fails too
            try:
                got = kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{f.name}: {d['kind']}/{d['metadata']['name']}: {path}: {e.message}")
                continue
            assert got == version, f"validated against {got}, not {version}"
            n += 1
    assert not errors, "\n".join(errors)
    assert n >= 5


def test_kustomization_lists_every_manifest():
    k = _kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= {"apiVersion", "kind", "resources", "images", "namespace", "labels"}, set(k)
    listed = k["resources"]
    assert len(set(listed)) == len(listed)
    for f in listed:
        assert (DIR / f).is_file(), f"kustomization.yaml lists {f}, which does not exist"
    # examples are left out on purpose (the model volume is the user's); nothing else
    unlisted = {p.name for p in _manifest_files()} - set(listed)
    assert all(".example." in n for n in unlisted), f"not in kustomization.yaml: {sorted(unlisted)}"
    images = {c["image"].rsplit(":", 1)[0] for _, _, c in _containers()}
    assert images == {"colibri-server"}
    assert [i["name"] for i in k.get("images", [])] == ["colibri-server"]


def test_labels_and_selectors():
    for d in _applied():
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == NAME, d["metadata"]["name"]
        assert labels["app.kubernetes.io/component"] in ("head", "worker"), d["metadata"]["name"]
        if d["kind"] == "Deployment":
            tpl = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= tpl.items()
            assert tpl["app.kubernetes.io/component"] == labels["app.kubernetes.io/component"]
    head_tpl = _one("Deployment", "head")["spec"]["template"]["metadata"]["labels"]
    worker_tpl = _one("Deployment", "worker")["spec"]["template"]["metadata"]["labels"]
    sel = _service()["spec"]["selector"]
    assert sel.items() <= head_tpl.items() and not sel.items() <= worker_tpl.items()
    assert _one("PodDisruptionBudget", "worker")["spec"]["selector"]["matchLabels"].items() <= worker_tpl.items()
    assert _one("Deployment", "head")["spec"]["replicas"] == 1


# ---------------------------------------------------------------------------- colibri's CLI

@pytest.mark.parametrize("cid", [cid for cid, _, _ in _containers()])
def test_commands_parse_with_colibris_parser(cid):
    """`colibri router` and the serve flags --backend-bind, --worker-allowed-keys, --join,
    --join-server-key, --join-secret-key must exist; serve and router commands must also pass
    colibri's settings checks, in the environment the pod gives them."""
    [(pod, c)] = [(pod, c) for i, pod, c in _containers() if i == cid]
    argv = _argv(c)
    ns = _parse(argv)
    if ns.cmd in ("serve", "router"):
        _settings(pod, c)
    elif ns.cmd == "http":
        extra = {e["name"] for e in c.get("env", []) if e["name"].startswith("COLIBRI_")} - HTTP_ENV_VARS
        assert not extra, f"the gateway reads no {sorted(extra)}"


def test_service_links_off():
    """Kubernetes puts COLIBRI_HEAD_SERVICE_HOST, COLIBRI_HEAD_PORT, ... in every pod for the
    colibri-head Service; colibri takes unknown COLIBRI_* variables for mistyped settings and
    does not start. Shown on colibri's own settings loader, then required of every pod."""
    fake = {"enableServiceLinks": True}
    with pytest.raises(SettingsError, match="COLIBRI_HEAD_SERVICE_HOST"):
        load_settings({}, config_path=None, env=_service_link_env(fake))
    for cid, pod, _ in _containers():
        assert pod.get("enableServiceLinks") is False, cid


def test_grace_period_covers_graceful_timeout():
    default = SETTINGS["graceful_timeout"].default
    for cid, pod, c in _containers():
        argv = _argv(c)
        graceful = float(_flag(argv, "--graceful-timeout")) if "--graceful-timeout" in argv else default
        # gunicorn in `colibri http` waits 30 s as well (http/serve.py)
        graceful = max(graceful, 30.0)
        assert pod["terminationGracePeriodSeconds"] >= graceful + 5, cid


def test_resources_set_and_worker_sizes_fit_the_limits():
    for cid, _, c in _containers():
        r = c["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(r[kind]), f"{cid}: {kind}"
    pod = _pod("worker")
    [c] = pod["containers"]
    r = c["resources"]
    assert r["requests"] == r["limits"], "worker hosts: Guaranteed QoS (requests = limits)"
    s = _settings(pod, c)
    cpus = int(r["limits"]["cpu"])
    assert s.workers * s.threads_per_worker == cpus, "--workers x --threads-per-worker = the CPU limit"
    # the default KV pool is sized from the node's memory, not the pod's limit
    assert s.kv_cache_memory > 0 and "--kv-cache-memory" in _argv(c)
    assert _quantity(r["limits"]["memory"]) > s.workers * s.kv_cache_memory


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m, q
    return int(m.group(1)) * units.get(m.group(2), 1)


# ---------------------------------------------------------------------------- wiring

def test_worker_join_names_the_head_service_backend_port():
    worker = _container("worker", "serve")
    host, port = _host_port(_flag(_argv(worker), "--join"))
    svc = _service()
    assert host in (HEAD_SERVICE, f"{HEAD_SERVICE}.svc", f"{HEAD_SERVICE}.svc.cluster.local") or \
        host.startswith(f"{HEAD_SERVICE}.")
    [sp] = [p for p in svc["spec"]["ports"] if p["port"] == port]
    assert sp["name"] == "backend"
    router = _container("head", "router")
    target = _container_port(router, sp.get("targetPort", sp["port"]))
    assert _host_port(_flag(_argv(router), "--backend-bind")) == ("0.0.0.0", target)
    # the head is ready only with a worker, and workers join through this Service
    assert svc["spec"].get("publishNotReadyAddresses") is True
    # a surge rollout would wait for ever: the workers stay on the old head
    assert _one("Deployment", "head")["spec"]["strategy"]["type"] == "Recreate"


def test_gateway_port_probes_and_router_address():
    http = _container("head", "http")
    router = _container("head", "router")
    argv = _argv(http)
    host, port = _host_port(_flag(argv, "--bind"))
    assert host == "0.0.0.0"
    assert port in [p["containerPort"] for p in http["ports"]]
    ready = http["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and _container_port(http, ready["port"]) == port
    # /health waits HEALTH_TIMEOUT for the router before it answers 503
    assert http["readinessProbe"]["timeoutSeconds"] > HEALTH_TIMEOUT
    live = http["livenessProbe"]
    assert live["periodSeconds"] > http["readinessProbe"]["periodSeconds"]
    # /health is 503 while no worker host has joined: restarting the head would not help
    assert live["httpGet"]["path"] != "/health" and _container_port(http, live["httpGet"]["port"]) == port
    [sp] = [p for p in _service()["spec"]["ports"] if p["name"] == "http"]
    assert _container_port(http, sp["targetPort"]) == port
    # the gateway talks to the router beside it over loopback, on the router's client bind
    connect, bind = _host_port(_flag(argv, "--connect")), _host_port(_flag(_argv(router), "--bind"))
    assert connect[0] == "127.0.0.1" and bind[0] in ("0.0.0.0", "127.0.0.1") and connect[1] == bind[1]
    # with keys from files (COLIBRI_HTTP_CURVE_SERVERKEY would make a fresh key pair, which the
    # router's --curve-allowed-keys refuses)
    assert not [e for e in http.get("env", []) if e["name"].startswith("COLIBRI_HTTP_CURVE")]


def test_router_client_port_on_the_service_admits_by_key():
    """ZeroMQ clients of the cluster reach the router's client bind through the Service's zmq
    port; a bind off loopback admits clients by key (curve_allowed_keys), not anyone with the
    head's public key."""
    router = _container("head", "router")
    host, port = _host_port(_flag(_argv(router), "--bind"))
    assert host == "0.0.0.0"
    [sp] = [p for p in _service()["spec"]["ports"] if p["name"] == "zmq"]
    assert sp["port"] == port and _container_port(router, sp["targetPort"]) == port
    s = _settings(_pod("head"), router)
    assert s.bind == f"tcp://0.0.0.0:{port}"
    assert s.curve_secret_key and s.curve_allowed_keys and s.worker_allowed_keys
    assert s.curve_allowed_keys != s.worker_allowed_keys, "clients and worker hosts: two sets of keys"
    # every port the Service exposes is one of the head's containers'
    head = _pod("head")
    for sp in _service()["spec"]["ports"]:
        owners = [c for c in head["containers"] if any(
            p["containerPort"] == sp["port"] and p.get("name") == sp["targetPort"] for p in c.get("ports", []))]
        assert len(owners) == 1, sp


# ---------------------------------------------------------------------------- volumes, Secrets, keys

@functools.cache
def _readme_text() -> str:
    return (DIR / "README.md").read_text().replace("\\\n", " ")


def _readme_secret_commands() -> list[tuple[str, dict[str, str | None]]]:
    """(Secret, {key: the file it is read from, None for a literal}) of each of README.md's
    `kubectl create secret generic` commands, in order (one Secret may be made again, e.g.
    with more keys)."""
    out = []
    for line in _readme_text().splitlines():
        m = re.search(r"kubectl create secret generic ([a-z0-9-]+)(.*)", line)
        if m:
            keys = {k: None for k in re.findall(r"--from-literal=([A-Za-z0-9._-]+)=", m.group(2))}
            keys.update(re.findall(r"--from-file=([A-Za-z0-9._-]+)=(\S+)", m.group(2)))
            out.append((m.group(1), keys))
    return out


def _readme_secrets() -> dict[str, set[str]]:
    """{Secret: its keys} as README.md's `kubectl create secret generic` commands make them: the
    keys every command of that Secret gives it (a key only one of them has may be missing)."""
    out = {}
    for name, keys in _readme_secret_commands():
        out[name] = out[name] & set(keys) if name in out else set(keys)
    return out


def _readme_secret_files() -> dict[tuple[str, str], str]:
    """{(Secret, key): the file README.md reads it from}; one file per key whatever the command."""
    out = {}
    for name, keys in _readme_secret_commands():
        for k, f in keys.items():
            if f is not None:
                assert out.setdefault((name, k), f) == f, f"README.md: {name} {k} from {out[(name, k)]} and {f}"
    return out


def _resolve(pod: dict, c: dict, path: str):
    """What a file path of a container is, and its mount: ('pvc', claim, rel, mount),
    ('secret', name, key, mount) for one file of a Secret, ('secret-dir', name, keys, mount) for
    a Secret's directory (the items' keys, or README.md's keys of a whole Secret mounted),
    ('emptyDir', volume, rel, mount). Fails when no volume holds it."""
    mounts = [m for m in c.get("volumeMounts", []) if path == m["mountPath"] or
              path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{c['name']}: {path} is on no mounted volume"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    [vol] = [v for v in pod["volumes"] if v["name"] == m["name"]]
    rel = path[len(m["mountPath"]):].lstrip("/")
    if "persistentVolumeClaim" in vol:
        return "pvc", vol["persistentVolumeClaim"]["claimName"], rel, m
    if "secret" in vol:
        sec = vol["secret"]
        items = {i["path"]: i["key"] for i in sec.get("items", [])}
        if not rel:
            keys = set(items.values()) if items else _readme_secrets().get(sec["secretName"], set())
            return "secret-dir", sec["secretName"], keys, m
        if items:
            assert rel in items, f"{c['name']}: {path}: Secret {sec['secretName']} mounts only {sorted(items)}"
            return "secret", sec["secretName"], items[rel], m
        return "secret", sec["secretName"], rel, m
    return next(iter(k for k in vol if k != "name")), vol["name"], rel, m


def test_every_volume_and_secret_is_mounted_and_created():
    secrets = _readme_secrets()
    for cid, pod, c in _containers():
        names = [v["name"] for v in pod["volumes"]]
        assert len(set(names)) == len(names), cid
        for m in c.get("volumeMounts", []):
            assert m["name"] in names, f"{cid}: mounts the undeclared volume {m['name']}"
        # every absolute path the command names lies on a mounted volume, and a Secret's file
        # or directory is one README.md makes
        for a in _argv(c)[1:]:
            if a.startswith("/"):
                kind, name, key, _ = _resolve(pod, c, a)
                if kind == "secret":
                    assert key in secrets.get(name, ()), f"{cid}: {a}: README.md's {name} has no key {key}"
                if kind == "secret-dir":
                    assert name in secrets and key, f"{cid}: {a}: README.md makes no {name} with keys"
        for e in c.get("env", []):
            if "value" in e and e["name"].endswith("_DIR") and e["value"].startswith("/"):
                assert _resolve(pod, c, e["value"])[0] == "emptyDir", f"{cid}: {e['name']} not writable"
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets.get(ref["name"], ()), f"{cid}: {ref} is not made in README.md"
    for component in ("head", "worker"):
        pod = _pod(component)
        mounted = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        for v in pod["volumes"]:
            assert v["name"] in mounted, f"{component}: volume {v['name']} is mounted by no container"
            if "secret" in v:
                name = v["secret"]["secretName"]
                assert name in secrets, f"Secret {name} is not made in README.md"
                for i in v["secret"].get("items", []):
                    assert i["key"] in secrets[name], f"README.md's {name} has no key {i['key']}"
                if not v["secret"].get("items"):
                    # a whole Secret only when it holds public keys only, in every README version
                    every = {k for n, keys in _readme_secret_commands() if n == name for k in keys}
                    assert every and all(k.endswith(".key") for k in every), \
                        f"{v['name']}: the whole Secret {name} is mounted, but it holds {sorted(every)}"
                    assert v["secret"].get("defaultMode", 0o644) & 0o222 == 0, v["name"]
                assert not v["secret"].get("optional"), v["name"]
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"] == {"claimName": MODEL_CLAIM, "readOnly": True}


def test_model_read_only_from_the_claim():
    for component, sub in (("head", "router"), ("worker", "serve")):
        pod, c = _pod(component), _container(component, sub)
        kind, claim, rel, mount = _resolve(pod, c, _flag(_argv(c), "--model"))
        assert (kind, claim, rel) == ("pvc", MODEL_CLAIM, "model.colibri")
        assert mount["readOnly"] is True


def _secret_keys_held(pod: dict, c: dict) -> set[str]:
    """The Secret keys a container's mounts give it."""
    held = set()
    for m in c.get("volumeMounts", []):
        [v] = [v for v in pod["volumes"] if v["name"] == m["name"]]
        if "secret" in v:
            held |= _resolve(pod, c, m["mountPath"])[2]
    return held


def test_curve_key_halves_pair_up():
    """The gateway and the worker hosts hold the head's public key, the router its secret half;
    the router admits the gateway's public key on its client bind (the colibri-client-keys
    directory) and the worker hosts' on its backend; each key pair's halves come from one
    `colibri keys generate` pair in README.md. A container holds no secret key but its own."""
    head, worker = _pod("head"), _pod("worker")
    router, serve, http = _container("head", "router"), _container("worker", "serve"), _container("head", "http")
    r, w, h = _argv(router), _argv(serve), _argv(http)
    assert _resolve(head, router, _flag(r, "--curve-secret-key"))[:3] == ("secret", "colibri-head-keys", "head.key_secret")
    assert _resolve(worker, serve, _flag(w, "--join-server-key"))[:3] == ("secret", "colibri-head-keys", "head.key")
    assert _resolve(worker, serve, _flag(w, "--join-secret-key"))[:3] == ("secret", "colibri-worker-keys", "worker.key_secret")
    assert _resolve(head, router, _flag(r, "--worker-allowed-keys"))[:3] == ("secret-dir", "colibri-worker-keys", {"worker.key"})
    assert _resolve(head, http, _flag(h, "--curve-server-key"))[:3] == ("secret", "colibri-head-keys", "head.key")
    assert _resolve(head, http, _flag(h, "--curve-secret-key"))[:3] == ("secret", "colibri-gateway-keys", "gateway.key_secret")
    kind, name, allowed, _ = _resolve(head, router, _flag(r, "--curve-allowed-keys"))
    assert (kind, name) == ("secret-dir", CLIENT_KEYS) and GATEWAY_PUBLIC in allowed, \
        f"the router's --curve-allowed-keys ({name}: {sorted(allowed)}) must hold {GATEWAY_PUBLIC}"
    # colibri reads the *.key files of an allowed-keys directory: only public keys, by that name
    assert allowed and all(k.endswith(".key") for k in allowed), sorted(allowed)
    assert not allowed & _resolve(head, router, _flag(r, "--worker-allowed-keys"))[2]
    # public and secret halves from one generated pair: NAME.key beside NAME.key_secret
    files = _readme_secret_files()
    pairs = [(("colibri-head-keys", "head.key"), ("colibri-head-keys", "head.key_secret")),
             (("colibri-worker-keys", "worker.key"), ("colibri-worker-keys", "worker.key_secret")),
             ((CLIENT_KEYS, GATEWAY_PUBLIC), ("colibri-gateway-keys", "gateway.key_secret"))]
    for public, secret in pairs:
        assert files[public] + "_secret" == files[secret], f"{public} is not {secret}'s public half"
    for cid, pod, c in _containers():
        own = OWN_KEY[_argv(c)[1]]
        for k in _secret_keys_held(pod, c):
            assert not k.endswith("_secret") or k.startswith(own + "."), f"{cid} holds {k}"
    for pod in (head, worker):
        for v in pod["volumes"]:
            if "secret" in v and v["secret"]["secretName"] != CLIENT_KEYS:
                keys = {i["key"] for i in v["secret"].get("items", [])}
                assert keys, f"{v['name']}: mount chosen keys (items), not a whole Secret"


def _materialize(root: pathlib.Path, pod: dict, c: dict, cid: str) -> dict[str, str]:
    """Lay a container's Secret mounts out under root from the files README.md generated (in the
    current directory): {a path in the container: the file or directory standing for it}."""
    files = _readme_secret_files()
    out = {}
    for m in c.get("volumeMounts", []):
        [v] = [v for v in pod["volumes"] if v["name"] == m["name"]]
        if "secret" not in v:
            continue
        name = v["secret"]["secretName"]
        items = v["secret"].get("items") or [{"key": k, "path": k} for k in _readme_secrets()[name]]
        d = root / cid.replace("/", "_") / m["mountPath"].lstrip("/")
        d.mkdir(parents=True)
        out[m["mountPath"]] = str(d)
        for i in items:
            shutil.copy(files[(name, i["key"])], d / i["path"])
            out[f"{m['mountPath'].rstrip('/')}/{i['path']}"] = str(d / i["path"])
    return out


def test_curve_keys_work_with_colibris_loaders(tmp_path, monkeypatch):
    """README.md's `colibri keys generate` and `kubectl create secret` commands run for real
    (the generation through colibri's command, the Secrets as copies laid out like each
    container's mounts), then each container's key files loaded as colibri loads them: the
    router's two CURVE servers (client bind, backend), the gateway's and a worker host's client
    keys. The router admits the gateway on the client bind only, a worker host on the backend only."""
    monkeypatch.chdir(tmp_path)
    for line in _readme_text().splitlines():
        if line.startswith("colibri keys generate"):
            a = _parse(line.split())
            with contextlib.redirect_stdout(io.StringIO()):
                a.fn(a)
    head, worker = _pod("head"), _pod("worker")
    router, serve, http = _container("head", "router"), _container("worker", "serve"), _container("head", "http")
    at = {}
    for cid, pod, c in (("router", head, router), ("http", head, http), ("serve", worker, serve)):
        at[cid] = _materialize(tmp_path / "pods", pod, c, cid)

    s = _settings(head, router)
    clients = CurveServer(at["router"][s.curve_secret_key], at["router"][s.curve_allowed_keys])
    workers = CurveServer(at["router"][s.curve_secret_key], at["router"][s.worker_allowed_keys])
    # no secret key among the allowed public keys, none group-readable here (0440 in the pod)
    assert not clients.warnings and not workers.warnings, clients.warnings + workers.warnings

    ns = _parse(_argv(http))
    server_public, gateway_public, _ = curve_from_files(at["http"][ns.curve_server_key],
                                                        at["http"][ns.curve_secret_key])
    assert server_public == clients.public_key, "the gateway's --curve-server-key is not the router's key"
    assert clients.is_allowed(gateway_public), "the router's --curve-allowed-keys refuses the gateway"
    assert not workers.is_allowed(gateway_public)

    w = _settings(worker, serve)
    server_public, worker_public, _ = client_curve(at["serve"][w.join_server_key], at["serve"][w.join_secret_key])
    assert server_public == workers.public_key, "the worker hosts' --join-server-key is not the head's key"
    assert workers.is_allowed(worker_public), "the router's --worker-allowed-keys refuses the worker hosts"
    assert not clients.is_allowed(worker_public)
    # nothing but public keys in the allowed directories
    for d in (clients.allowed_keys_dir, workers.allowed_keys_dir):
        assert not [f for f in os.listdir(d) if not f.endswith(".key")], d


def test_readme_key_commands():
    """`colibri keys generate` as README.md gives it parses, and makes the files its
    `kubectl create secret` commands read."""
    text = _readme_text()
    made = set()
    for line in text.splitlines():
        if line.startswith("colibri keys generate"):
            a = _parse(line.split())
            # the command refuses any other name
            assert CLI_NAME_RE.match(a.name), f"README.md: --name {a.name}: 'server' or 'client-NAME'"
            made |= {f"{a.dir}/{a.name}.key", f"{a.dir}/{a.name}.key_secret"}
    read = set(_readme_secret_files().values())
    assert read and read <= made, sorted(read - made)
    assert "kubectl apply -k deploy/kubernetes" in text
