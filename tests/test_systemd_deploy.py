"""docs/deployment.md's "Deploy with systemd" steps against the units they install: the same user, venv,
settings file, models and cache directories; the settings file as written serves under the
environment systemd gives the unit; where systemd is PID 1, the unit itself starts, serves,
reloads and stops."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from test_systemd import UNITS, FakeSystemd

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _section():
    text = (ROOT / "docs" / "deployment.md").read_text()
    m = re.search(r"^## Deploy with systemd\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/deployment.md has no '## Deploy with systemd' section"
    return m.group(1)


def _unit(name="colibri.service"):
    """{key: [values]} of a unit file's assignments (comments skipped)."""
    out = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def _commands(section):
    """The shell lines of the section's bash blocks, heredoc bodies included, continuation-joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        lines.extend(ln.strip() for ln in block.splitlines() if ln.strip())
    return lines


def _settings_file(section):
    m = re.search(r"tee (\S+) >/dev/null <<'TOML'\n(.*?)\n\s*TOML\n", section, re.S)
    assert m, "the section writes no settings file"
    return m.group(1), "\n".join(ln.strip() for ln in m.group(2).splitlines())


def test_deployment_steps_make_what_the_unit_needs():
    sec, unit = _section(), _unit()
    cmds = _commands(sec)
    joined = "\n".join(cmds)
    user, group = unit["User"][0], unit["Group"][0]
    assert any(c.startswith("sudo useradd") and c.endswith(f" {user}") and "--system" in c for c in cmds), \
        f"no step creates the unit's user {user}"
    assert user == group and any("--user-group" in c for c in cmds if "useradd" in c), "no step creates its group"
    # the program the unit starts, in the venv a step creates, installed so that ProtectHome cannot hide it
    exe = unit["ExecStart"][0].split()[0]
    venv = exe.rsplit("/bin/", 1)[0]
    assert f"python3 -m venv {venv}" in joined, f"no step creates the venv of {exe}"
    pip = [c for c in cmds if c.startswith(f"sudo {venv}/bin/pip install")]
    assert pip and not any(" -e " in c + " " for c in pip), "the venv's install must not be editable"
    assert unit["ProtectHome"] == ["yes"]
    # the settings file the unit reads is the one a step writes, in a directory a step makes
    config = unit["ExecStart"][0].split("--config", 1)[1].split()[0]
    path, toml = _settings_file(sec)
    assert path == config
    assert f"install -d -m 0755 {os.path.dirname(config)}" in joined
    # its model lies in the read-only models directory, which a step makes and fills
    models = [p.lstrip("-") for p in unit["ReadOnlyPaths"]]
    model = re.search(r'^model = "(.*)"$', toml, re.M).group(1)
    assert os.path.dirname(model) in models, f"model {model} is outside ReadOnlyPaths {models}"
    assert f"install -d -m 0755 {os.path.dirname(model)}" in joined and f" {model}" in joined
    # the kernels go where the unit's CacheDirectory= points the server ($CACHE_DIRECTORY)
    cache = "/var/cache/" + unit["CacheDirectory"][0]
    assert f"sudo -u {user} CACHE_DIRECTORY={cache} {exe} compile --model {model}" in cmds, "no step compiles its model"
    assert f"install -d -o {user} -g {group} -m 0750 {cache}" in joined, "the cache exists before compile"
    state = "/var/lib/" + unit["StateDirectory"][0]
    assert f"install -d -o {user} -g {group} -m 0750 {state}" in joined
    for step in ("systemctl daemon-reload", "systemctl enable --now colibri", "systemctl reload colibri",
                 "journalctl -u colibri"):
        assert any(step in c for c in cmds), step
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


class MainOnly(FakeSystemd):
    """NotifyAccess=main: only the main process's messages count (gunicorn, the gateway under the
    master, sends its own READY=1, which systemd drops); the sender's pid comes with SO_PASSCRED."""

    def __init__(self, path):
        super().__init__(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.main = None

    def collect(self, until, timeout=60.0, extend=False):
        """extend: as systemd does for a start, an EXTEND_TIMEOUT_USEC=N from the main process moves the
        deadline to N us from its arrival (the master sends it while it compiles: a cold compile on a loaded
        machine outlasts TimeoutStartSec)."""
        import struct
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                data = None
            if data is not None:
                pid = next((struct.unpack("iII", d[:12])[0] for level, kind, d in anc
                            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
                if pid == self.main:
                    self.messages.append(data.decode())
                    for line in self.messages[-1].split("\n"):
                        if extend and line.startswith("EXTEND_TIMEOUT_USEC="):
                            deadline = max(deadline, time.monotonic() + int(line.split("=", 1)[1]) / 1e6)
            if until(self.messages):
                return self.messages
        raise TimeoutError(f"sd_notify messages so far: {self.messages}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deployment_settings_file_serves_as_the_unit_runs_it(tmp_path):
    """docs/deployment.md's colibri.toml, its model path and ports moved here, run by the unit's ExecStart with
    the environment the unit gives (RUNTIME_DIRECTORY, STATE_DIRECTORY, NOTIFY_SOCKET, WATCHDOG_USEC):
    READY within TimeoutStartSec, the HTTP API answers under served_model_name, a reload (the unit's
    ExecReload signal) comes back READY, a stop exits 0 within TimeoutStopSec."""
    from colibri_server.bundled import BUNDLED_MODEL
    unit = _unit()
    _, toml = _settings_file(_section())
    model = re.search(r'^model = "(.*)"$', toml, re.M).group(1)
    http = re.search(r'^http = "(.*)"$', toml, re.M).group(1)
    bind = re.search(r'^bind = "(.*)"$', toml, re.M).group(1)
    name = re.search(r'^served_model_name = "(.*)"$', toml, re.M).group(1)
    port, zport = _free_port(), _free_port()
    toml = (toml.replace(model, BUNDLED_MODEL).replace(http, f"127.0.0.1:{port}")
            .replace(bind, f"tcp://127.0.0.1:{zport}"))
    config = tmp_path / "colibri.toml"
    config.write_text(toml + "\n")
    argv = unit["ExecStart"][0].split()
    argv[0] = str(pathlib.Path(sys.executable).parent / "colibri")
    argv[argv.index("--config") + 1] = str(config)
    (tmp_path / "run").mkdir()
    (tmp_path / "state").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLIBRI_")}
    env.update(RUNTIME_DIRECTORY=str(tmp_path / "run"), STATE_DIRECTORY=str(tmp_path / "state"),
               NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="30000000")
    sd = MainOnly(tmp_path / "notify.sock")
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/")
    sd.main = proc.pid
    try:
        start = float(unit["TimeoutStartSec"][0])
        sd.collect(lambda m: "READY=1" in sd.kinds(), timeout=start, extend=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    ids = [m["id"] for m in json.load(r)["data"]]
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        assert ids == [name]
        proc.send_signal(signal.SIGHUP)
        sd.collect(lambda m: sd.kinds().count("READY=1") >= 2, timeout=start, extend=True)
        assert [k for k in sd.kinds() if k != "WATCHDOG=1"] == ["READY=1", "RELOADING=1", "READY=1"]
        assert any("STATUS=serving generation 2" in m for m in sd.messages)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=float(unit["TimeoutStopSec"][0])) == 0
        sd.collect(lambda m: "STOPPING=1" in sd.kinds(), timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _systemd_is_pid1():
    return os.path.isdir("/run/systemd/system")


@pytest.mark.skipif(not _systemd_is_pid1(), reason="systemd is not PID 1 here (no /run/systemd/system): the unit "
                    "cannot be started; a container or VM booted with systemd runs this test")
@pytest.mark.skipif(os.geteuid() != 0, reason="installing a system unit needs root")
def test_unit_starts_serves_reloads_stops_under_systemd(tmp_path):
    """The unit as written (only its program path and settings file moved here), installed as a runtime
    unit: systemctl start returns once READY, the API answers, reload and stop work."""
    from colibri_server.bundled import BUNDLED_MODEL
    user = _unit()["User"][0]
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/colibri", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", user], check=True)
    # ProtectHome/ProtectSystem: the venv and the model must be readable by the service where they are
    name = f"colibri-test-{os.getpid()}"
    port, zport = _free_port(), _free_port()
    etc = pathlib.Path("/run/colibri-test-etc") / name
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "colibri.toml").write_text(f'model = "{BUNDLED_MODEL}"\nbind = "tcp://127.0.0.1:{zport}"\n'
                                      f'http = "127.0.0.1:{port}"\nserved_model_name = "model"\n')
    os.chmod(etc, 0o755)
    os.chmod(etc / "colibri.toml", 0o644)
    text = (UNITS / "colibri.service").read_text()
    text = text.replace("/opt/colibri/.venv/bin/colibri", str(pathlib.Path(sys.executable).parent / "colibri"))
    text = text.replace("/etc/colibri/colibri.toml", str(etc / "colibri.toml"))
    path = pathlib.Path("/run/systemd/system") / f"{name}.service"
    path.write_text(text)

    def ctl(*args, check=True):
        return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=600, check=check)
    try:
        ctl("daemon-reload")
        ctl("start", name)                       # Type=notify: returns once READY=1
        assert ctl("is-active", name).stdout.strip() == "active"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    assert [m["id"] for m in json.load(r)["data"]] == ["model"]
                break
            except OSError:
                assert time.monotonic() < deadline, ctl("status", name, check=False).stdout
                time.sleep(0.5)
        ctl("reload", name)
        assert ctl("is-active", name).stdout.strip() == "active"
        status = ctl("show", "-p", "StatusText", "--value", name).stdout
        assert "serving generation 2" in status, status
        ctl("stop", name)
        assert ctl("show", "-p", "Result", "--value", name).stdout.strip() == "success"
    finally:
        ctl("stop", name, check=False)
        path.unlink()
        ctl("daemon-reload", check=False)
        shutil.rmtree(etc, ignore_errors=True)
