"""Transport security: ZeroMQ CURVE keys and authentication, bind checks, constant-time compare.

    colibri keys generate --dir DIR --name server          server key pair (DIR/server.key{,_secret})
    colibri keys generate --dir DIR --name client-alice    one key pair per client

The server reads its secret certificate (curve_secret_key) and a directory of allowed client
public certificates (curve_allowed_keys, the *.key files). CurveServer is built in the master
before it forks: its constructor only reads and validates files. apply_server() runs in the
router process: it makes the frontend socket a CURVE server and starts the ZAP authenticator
thread there. A client whose public key is not in the directory, a client without CURVE, and a
client with the wrong server key all get nothing (the handshake fails; their requests time out
client-side); each attempt is logged on the "colibri.security" logger at WARNING, rate-limited.

Fail-closed: the socket's ZAP domain is set with ZMQ_ZAP_ENFORCE_DOMAIN, so if the
authenticator is not running every CURVE handshake is refused (libzmq would otherwise let any
client that knows the server public key in).
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import ipaddress
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time

import zmq

log = logging.getLogger("colibri.security")

ZAP_DOMAIN = "colibri"
KEY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CLI_NAME_RE = re.compile(r"^(server|client-[A-Za-z0-9][A-Za-z0-9._-]{0,56})$")

# libzmq's ZMQ_PROTOCOL_ERROR_* values carried by ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL
_PROTOCOL_ERRORS = {
    0x11000001: "CURVE handshake failed cryptographically (the client uses a wrong server public key?)",
    0x11000002: "client did not use CURVE (security mechanism mismatch: plain ZeroMQ client?)",
}


class SecurityError(ValueError):
    """A key file or directory that cannot be used; the message names it."""


# ---------------------------------------------------------------------------- small helpers

def _valid_z85_key(k) -> bool:
    if not isinstance(k, bytes) or len(k) != 40:
        return False
    try:
        from zmq.utils import z85
        return len(z85.decode(k)) == 32
    except Exception:
        return False


def _read_certificate(path: str, what: str):
    """(public, secret|None) of a ZeroMQ certificate, or SecurityError naming the file."""
    import zmq.auth
    if not os.path.exists(path):
        raise SecurityError(f"{what} {path}: file not found")
    if os.path.isdir(path):
        raise SecurityError(f"{what} {path}: is a directory, not a certificate file")
    if not os.path.isfile(path):
        raise SecurityError(f"{what} {path}: not a regular file")
    if os.path.getsize(path) > 64 << 10:
        raise SecurityError(f"{what} {path}: too large for a certificate ({os.path.getsize(path)} bytes)")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise SecurityError(f"{what} {path}: cannot be read ({e.strerror}; running as uid {os.getuid()})") from None
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise SecurityError(f"{what} {path}: not a ZeroMQ CURVE certificate ({e})") from None
    if not _valid_z85_key(public):
        raise SecurityError(f"{what} {path}: malformed public-key (expected 40 Z85 characters)")
    if secret is not None and not _valid_z85_key(secret):
        raise SecurityError(f"{what} {path}: malformed secret-key (expected 40 Z85 characters)")
    return public, secret


def load_secret_key(path: str):
    """(public, secret) Z85 bytes of a secret certificate (*.key_secret); SecurityError naming
    the file when it is missing, unreadable, a public certificate, or inconsistent."""
    if not path:
        raise SecurityError("no CURVE secret key file given")
    public, secret = _read_certificate(path, "CURVE secret key file")
    if secret is None:
        raise SecurityError(f"CURVE secret key file {path}: holds no secret-key; it is a PUBLIC certificate "
                            "(give the *.key_secret file of the pair)")
    if zmq.curve_public(secret) != public:
        raise SecurityError(f"CURVE secret key file {path}: its public-key does not belong to its secret-key")
    return public, secret


def client_curve(server_public_file: str, client_secret_file: str):
    """The `curve=` tuple for Client: (server_public, client_public, client_secret), read from
    the server's public certificate and the client's secret certificate."""
    server_public, _ = _read_certificate(server_public_file, "CURVE server public key file")
    client_public, client_secret = load_secret_key(client_secret_file)
    return server_public, client_public, client_secret


# ---------------------------------------------------------------------------- key generation

def generate_keys(directory, name: str, force: bool = False):
    """Make a CURVE key pair: DIR/NAME.key (public, mode 0644) and DIR/NAME.key_secret (secret,
    mode 0600; never readable by others, not even for an instant). Refuses to overwrite either
    file unless force. Returns (public_path, secret_path)."""
    import zmq.auth
    directory = os.fspath(directory)
    if not KEY_NAME_RE.match(name or ""):
        raise SecurityError(f"key name {name!r}: use letters, digits, '.', '_' and '-' (no '/')")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    if not force:
        for p in (public_path, secret_path):
            if os.path.lexists(p):
                raise SecurityError(f"{p} exists: not overwriting it (use --force to replace the key pair)")
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=directory)     # mode 0700: nothing in it is visible
    try:
        tpub, tsec = zmq.auth.create_certificates(tmp, name)
        os.chmod(tsec, 0o600)
        os.chmod(tpub, 0o644)
        if force:
            os.replace(tsec, secret_path)
            os.replace(tpub, public_path)
        else:
            placed = []
            try:
                for src, dst in ((tsec, secret_path), (tpub, public_path)):
                    try:
                        os.link(src, dst)                   # atomic, and fails if dst exists
                    except FileExistsError:
                        raise SecurityError(f"{dst} exists: not overwriting it (use --force)") from None
                    placed.append(dst)
            except BaseException:
                for p in placed:
                    os.unlink(p)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public_path, secret_path


def cmd_keys_generate(a):
    """`colibri keys generate --dir DIR --name server|client-NAME [--force]`."""
    if not CLI_NAME_RE.match(a.name):
        print(f"colibri: error: --name {a.name!r}: use 'server' or 'client-NAME' (NAME: letters, digits, "
              "'.', '_', '-')", file=sys.stderr)
        sys.exit(2)
    try:
        public_path, secret_path = generate_keys(a.dir, a.name, force=a.force)
        public, _ = _read_certificate(public_path, "public key file")
    except (SecurityError, OSError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"public key  {public_path}")
    print(f"secret key  {secret_path}  (mode 0600: keep it private)")
    print(f"public      {public.decode('ascii')}")
    if a.name == "server":
        print("server: set curve_secret_key to the secret file; give clients the public key")
    else:
        print("client: copy the public .key file into the server's curve_allowed_keys directory "
              "(then HUP the server); the client keeps the secret file")


def add_keys_parser(subparsers) -> argparse.ArgumentParser:
    """`keys` subcommand (with `generate`) on the top-level parser's subparsers."""
    k = subparsers.add_parser("keys", help="ZeroMQ CURVE key pairs for encrypted, authenticated tcp binds")
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    g = ks.add_parser("generate", help="make NAME.key (public) and NAME.key_secret (secret, 0600) in DIR")
    g.add_argument("--dir", required=True, help="directory for the key files (created 0700 if missing)")
    g.add_argument("--name", required=True, help="'server' or 'client-NAME'")
    g.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    g.set_defaults(fn=cmd_keys_generate)
    return k


# ---------------------------------------------------------------------------- bind checks

def check_bind_security(bind: str, curve_enabled: bool) -> list[str]:
    """Warnings about a client bind address (empty list: nothing to say).
    tcp on anything but loopback without CURVE: anyone who reaches the port can use the server
    and read the traffic. ipc in the abstract namespace ('@'): no file permissions at all."""
    out = []
    if bind.startswith("tcp://"):
        host = bind[len("tcp://"):].rpartition(":")[0]
        if ";" in host:                         # tcp://SOURCE;HOST:PORT (connect syntax)
            host = host.split(";", 1)[1]
        host = host.strip("[]")
        if is_loopback(host) or curve_enabled:
            return out
        where = "ALL interfaces" if host in ("*", "0.0.0.0", "::") else f"{host} (not loopback)"
        out.append(f"SECURITY WARNING: {bind} listens on {where} WITHOUT CURVE: anyone who can reach the port "
                   "can send requests, and prompts and answers cross the network in clear text. Set "
                   "curve_secret_key and curve_allowed_keys (`colibri keys generate`), or bind tcp://127.0.0.1 "
                   "or ipc://")
    elif bind.startswith("ipc://"):
        path = bind[len("ipc://"):]
        if path.startswith("@"):
            out.append(f"SECURITY WARNING: {bind} is an abstract-namespace socket: it has no file permissions, "
                       "so ANY local user can connect. Use an ipc:// path in a private directory")
            return out
        parent = os.path.dirname(os.path.abspath(path))
        try:
            st = os.stat(parent)
        except OSError:
            return out
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            out.append(f"SECURITY WARNING: {bind}: its directory {parent} is world-writable without the sticky "
                       "bit: any local user can replace the socket. Use a private directory (mode 0700/0750)")
    return out


def is_loopback(host: str) -> bool:
    if host in ("localhost", "lo", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- CURVE server

class _RateLimited:
    """Log the first of a kind at once, then at most one line per `every` seconds per kind
    with the count of those suppressed. Bounded: a flood of distinct kinds cannot grow memory."""

    def __init__(self, logger, every=60.0, max_kinds=1024):
        self.log, self.every, self.max_kinds = logger, every, max_kinds
        self.seen = {}          # kind -> [last logged at, suppressed since]
        self.lock = threading.Lock()

    def warning(self, kind, msg, *args):
        self.emit(logging.WARNING, kind, msg, *args)

    def emit(self, level, kind, msg, *args):
        now = time.monotonic()
        with self.lock:
            st = self.seen.get(kind)
            if st is not None and now - st[0] < self.every:
                st[1] += 1
                return
            suppressed = st[1] if st else 0
            if len(self.seen) >= self.max_kinds and kind not in self.seen:
                self.seen.clear()
            self.seen[kind] = [now, 0]
        if suppressed:
            msg += " (%d more like it in the last %.0fs)"
            args = (*args, suppressed, self.every)
        self.log.log(level, msg, *args)


def _authenticator_class():
    import zmq.auth
    from zmq.utils import z85

    class ColibriAuthenticator(zmq.auth.Authenticator):
        """pyzmq's ZAP policy (configure_curve, the *.key directory), with every denial logged
        at WARNING on colibri.security (the base class logs them at DEBUG only)."""

        def __init__(self, context, limiter):
            super().__init__(context, log=logging.getLogger("colibri.security.zap"))
            self.limiter = limiter
            self._current = None
            self.denied = 0

        async def handle_zap_message(self, msg):
            self._current = msg
            try:
                await super().handle_zap_message(msg)
            finally:
                self._current = None

        def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
            if status_code != b"200":
                self.denied += 1
                m = self._current or []
                address = m[3].decode("utf-8", "replace") if len(m) > 3 else "?"
                mechanism = m[5].decode("ascii", "replace") if len(m) > 5 else "?"
                key = z85.encode(m[6]).decode("ascii") if mechanism == "CURVE" and len(m) > 6 and \
                    len(m[6]) == 32 else "-"
                self.limiter.warning(("zap", address), "DENIED %s client from %s, public key %s: %s",
                                     mechanism, address, key, status_text.decode("utf-8", "replace"))
            super()._send_zap_reply(request_id, status_code, status_text, user_id)

    return ColibriAuthenticator


class CurveServer:
    """CURVE for the router's client socket.

    secret_key_path: the server's secret certificate (NAME.key_secret).
    allowed_keys_dir: directory of allowed client public certificates (*.key); empty/None
    lets any client that knows the server public key connect (encryption without client
    authentication; a warning is logged).

    The constructor validates the files only (it runs in the master, before fork: no thread,
    no ZeroMQ context). apply_server(ctx, sock) runs in the router process."""

    POLL_MS = 250

    def __init__(self, secret_key_path, allowed_keys_dir=None):
        self.secret_key_path = os.fspath(secret_key_path) if secret_key_path else ""
        self.allowed_keys_dir = os.fspath(allowed_keys_dir) if allowed_keys_dir else ""
        self.warnings = []
        self.public_key, self._secret_key = load_secret_key(self.secret_key_path)
        mode = stat.S_IMODE(os.stat(self.secret_key_path).st_mode)
        if mode & 0o066:
            self._warn(f"CURVE secret key file {self.secret_key_path} is group/world accessible (mode "
                       f"{mode:04o}): chmod 600 it")
        if self.allowed_keys_dir:
            self.allowed = self._load_allowed(strict=True)
            self.allow_any = False
        else:
            self.allowed = {}
            self.allow_any = True
            self._warn("curve_allowed_keys is not set: ANY client that knows the server public key can connect "
                       "(traffic is encrypted, clients are not authenticated)")
        self._auth = None
        self._thread = None
        self._stop = threading.Event()
        self._monitor = None
        self._limiter = _RateLimited(log)

    def _warn(self, msg):
        self.warnings.append(msg)
        log.warning("%s", msg)

    def _load_allowed(self, strict: bool) -> dict:
        """{public key (Z85 bytes): file} from the *.key files. strict (start-up): any problem
        raises SecurityError naming the file or directory. Not strict (reload): a missing
        directory raises, a bad file is skipped with an error logged, an empty directory denies all."""
        d = self.allowed_keys_dir
        if not os.path.isdir(d):
            raise SecurityError(f"CURVE allowed keys directory {d}: "
                                f"{'not a directory' if os.path.exists(d) else 'not found'}")
        if not os.access(d, os.R_OK | os.X_OK):
            raise SecurityError(f"CURVE allowed keys directory {d}: cannot be read (running as uid {os.getuid()})")
        keys = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(d), "*.key"))):
            try:
                public, secret = _read_certificate(path, "CURVE allowed client key")
            except SecurityError as e:
                if strict:
                    raise
                log.error("%s: skipped", e)
                continue
            if secret is not None:
                self._warn(f"CURVE allowed client key {path} holds a SECRET key: only the public certificate "
                           "belongs on the server; move the secret back to its client")
            keys[public] = path
        if not keys:
            msg = (f"CURVE allowed keys directory {d} contains no *.key public certificate, so no client could "
                   f"connect: make one with `colibri keys generate --dir DIR --name client-NAME` and copy its "
                   f".key file here")
            if strict:
                raise SecurityError(msg)
            log.warning("%s: every client is now refused", msg)
        return keys

    # -- in the router process -------------------------------------------------------
    def apply_server(self, ctx, sock):
        """Make `sock` a CURVE server that only lets allowed clients in; call before bind."""
        if self._thread is not None:
            raise RuntimeError("CurveServer.apply_server: already applied")
        import zmq.auth
        auth = _authenticator_class()(ctx, self._limiter)
        auth.start()                                   # binds inproc://zeromq.zap.01 in ctx
        try:
            if self.allow_any:
                auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
            else:
                auth.certs[ZAP_DOMAIN] = {k: True for k in self.allowed}
            sock.curve_server = True
            sock.curve_secretkey = self._secret_key
            sock.curve_publickey = self.public_key
            sock.zap_domain = ZAP_DOMAIN.encode()
            try:
                # with a ZAP domain set, a missing/dead authenticator refuses every handshake
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            except (AttributeError, zmq.ZMQError):
                log.warning("this libzmq has no ZMQ_ZAP_ENFORCE_DOMAIN: CURVE clients would be let in if the "
                            "authenticator stopped")
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        except BaseException:
            auth.stop()
            raise
        self._auth, self._monitor, self._sock = auth, monitor, sock
        self._endpoint = None
        self._stop.clear()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="colibri-zap", daemon=True)
        self._thread.start()
        started.wait(5.0)
        log.info("CURVE on: server public key %s, %s", self.public_key.decode("ascii"),
                 "any client key accepted" if self.allow_any else
                 f"{len(self.allowed)} allowed client keys from {self.allowed_keys_dir}")

    def _run(self, started):
        """The authenticator thread: answers ZAP requests, logs failed handshakes. Exits on
        stop() or when the context terminates (closing its sockets, so ctx.term() completes)."""
        from zmq.utils.monitor import parse_monitor_message
        auth, monitor = self._auth, self._monitor
        loop = asyncio.new_event_loop()
        poller = zmq.Poller()
        poller.register(auth.zap_socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        started.set()
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(self.POLL_MS))
                except zmq.ContextTerminated:
                    break
                if auth.zap_socket in events:
                    try:
                        msg = auth.zap_socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        msg = None
                    if msg is not None:
                        try:
                            loop.run_until_complete(auth.handle_zap_message(msg))
                        except zmq.ContextTerminated:
                            break
                        except Exception:
                            log.exception("ZAP request failed: the client is refused")
                            if len(msg) > 1:
                                try:
                                    auth.zap_socket.send_multipart([b"1.0", msg[1], b"500", b"internal error",
                                                                    b"", b""])
                                except zmq.ZMQError:
                                    pass
                if monitor in events:
                    try:
                        ev = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        continue
                    except zmq.ContextTerminated:
                        break
                    except Exception:
                        continue
                    self._on_monitor_event(ev)
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.critical("the CURVE authenticator thread failed: every CURVE handshake is now refused",
                         exc_info=True)
        finally:
            for s in (monitor, auth.zap_socket):
                try:
                    s.close(linger=0)
                except Exception:
                    pass
            auth.zap_socket = None
            loop.close()

    def _on_monitor_event(self, ev):
        endpoint = ev["endpoint"].decode("utf-8", "replace")
        value = int(ev["value"])
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            what = _PROTOCOL_ERRORS.get(value, f"protocol error 0x{value:08x}")
            self._limiter.warning(("handshake", value), "DENIED connection to %s: %s", endpoint, what)
        else:
            # the peer hung up mid-handshake: a plain ZeroMQ client often sees the mechanism
            # mismatch first and closes, so this is what its attempt looks like from here
            what = os.strerror(value) if 0 < value < 200 else str(value)
            self._limiter.warning(("handshake", value), "DENIED connection to %s: the client hung up during the "
                                  "CURVE handshake (%s): a client without CURVE, or one that gave up", endpoint,
                                  what)

    def reload(self) -> int:
        """Re-read the allowed keys directory (HUP). Returns the number of allowed keys. A missing
        directory raises SecurityError and the current keys stay in force; bad files are skipped
        (logged); an empty directory refuses every client."""
        if self.allow_any:
            return 0
        keys = self._load_allowed(strict=False)
        added, removed = set(keys) - set(self.allowed), set(self.allowed) - set(keys)
        self.allowed = keys
        if self._auth is not None:
            self._auth.certs[ZAP_DOMAIN] = {k: True for k in keys}   # one atomic swap
        log.info("CURVE allowed keys reloaded from %s: %d keys (%d added, %d removed)", self.allowed_keys_dir,
                 len(keys), len(added), len(removed))
        return len(keys)

    def is_allowed(self, user_id) -> bool:
        """Whether the client key behind a message (its ZAP User-Id: the Z85 public key) is
        allowed now. A connection outlives the handshake that let it in: the router asks this
        of every message, so a key removed on HUP stops working on connections already open."""
        if self.allow_any:
            return True
        if isinstance(user_id, str):
            user_id = user_id.encode("ascii", "replace")
        return bool(user_id) and user_id in self.allowed

    @property
    def denied(self) -> int:
        return self._auth.denied if self._auth is not None else 0

    def stop(self, timeout=2.0):
        """Stop the authenticator thread (it closes its sockets). Call after the frontend socket
        is closed and before ctx.term(); ctx.term() alone also ends the thread."""
        t = self._thread
        if t is None:
            return
        self._stop.set()
        t.join(timeout)
        self._thread = None
