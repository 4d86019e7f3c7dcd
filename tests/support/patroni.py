"""A real 3-node Patroni + etcd cluster on loopback, started and stopped by the tests.

Patroni comes from PyPI (PATRONI_VERSION, a release with the leader-key fix of Patroni's
PR 2689) in a venv of its own (PATRONI_VENV, built by :func:`ensure_tools` or
``make .venv-patroni/.installed-stamp``: its pins must not meet the main venv's); etcd
from Debian's ``etcd-server``; Postgres 15 from Debian. Patroni runs as an unprivileged
account (ACCOUNT, created when we are root) through ``setpriv``, in a tmp dir that
account owns; every port comes from :func:`tests.support.services.free_port`.

The members start in parallel; :meth:`PatroniCluster.start` returns once one of them
holds the leader key, every member is healthy and the synchronous standby is named.
:meth:`PatroniCluster.stop` ends every process it started by pid (Patroni, the
postmasters and their children, etcd), resuming paused ones first, also on failure.

``python -m tests.support.patroni --install`` builds what is missing;
``python -m tests.support.patroni --measure`` starts a cluster, prints its start time
and memory, and stops it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pwd
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from tests.support.relay import Relay
from tests.support.services import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
PATRONI_VERSION = "4.1.5"
PATRONI_VENV = Path(os.environ.get("PGLOCK_PATRONI_VENV", ROOT / ".venv-patroni"))
PATRONI_STAMP = PATRONI_VENV / ".installed-stamp"
PG_BINDIR = Path("/usr/lib/postgresql/15/bin")
ETCD = "/usr/bin/etcd"
ACCOUNT = "pglock-patroni"

#: The dynamic configuration the failover tests run with: ttl 20 s is the least
#: Patroni 4.1.5 accepts; synchronous replication so that a deposed primary
#: acknowledges no commit.
DCS_CONFIG: dict[str, Any] = {
    "ttl": 20,
    "loop_wait": 2,
    "retry_timeout": 4,
    "maximum_lag_on_failover": 1048576,
    "synchronous_mode": True,
    "synchronous_mode_strict": True,
    "postgresql": {
        "use_pg_rewind": True,
        "use_slots": True,
        "remove_data_directory_on_rewind_failure": True,
        "remove_data_directory_on_diverged_timelines": True,
        "parameters": {
            "wal_level": "replica",
            "hot_standby": "on",
            "wal_log_hints": "on",
            "max_wal_senders": 10,
            "max_replication_slots": 10,
            "max_connections": 100,
            "wal_keep_size": "128MB",
        },
    },
}


class ClusterUnavailable(RuntimeError):
    """This machine lacks something the cluster needs (and cannot install it)."""


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def ensure_tools() -> None:
    """Install what is missing when we may: etcd (apt, as root), Patroni's venv, the account.

    Raises ClusterUnavailable naming what is still missing.
    """
    root = os.geteuid() == 0
    if not Path(ETCD).exists() and root and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "etcd-server"], check=False, env=env)
    if not PATRONI_STAMP.exists():
        # The system's Python: the account Patroni runs as must reach the interpreter
        # (a pyenv one under /root is out of its reach).
        python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
        has_venv = subprocess.run([python, "-c", "import ensurepip"], check=False).returncode == 0
        if not has_venv and root and shutil.which("apt-get"):
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "python3-venv"], check=False, env=env
            )
        subprocess.run([python, "-m", "venv", "--clear", str(PATRONI_VENV)], check=True)
        pip = [str(PATRONI_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"patroni[etcd3,psycopg3]=={PATRONI_VERSION}"], check=True)
        PATRONI_STAMP.touch()
    if root:
        try:
            pwd.getpwnam(ACCOUNT)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 ACCOUNT],
                check=True,
            )  # fmt: skip
    missing = [
        what
        for what, path in (
            ("etcd (Debian's etcd-server)", Path(ETCD)),
            (f"Patroni {PATRONI_VERSION} ({PATRONI_VENV})", PATRONI_VENV / "bin" / "patroni"),
            ("Postgres 15 (Debian's postgresql-15)", PG_BINDIR / "postgres"),
        )
        if not path.exists()
    ]
    if missing:
        raise ClusterUnavailable("cannot start a Patroni cluster, missing: " + ", ".join(missing))


def make_tls(where: Path) -> dict[str, Path]:
    """A private CA and two certificates it signs, made with openssl in ``where``: one for
    the members' REST APIs (127.0.0.1 and localhost; for their calls to each other too),
    one for the client. The files by the names the pglock settings give them
    (``patroni_cafile``, ...) and Patroni's own (``server_certfile``, ...)."""
    where.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=where)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=pglock test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, usage, names in (
        ("server", "serverAuth,clientAuth", "IP:127.0.0.1,DNS:localhost"),
        ("client", "clientAuth", "DNS:pglock-client"),
    ):
        (where / f"{name}.ext").write_text(
            f"subjectAltName={names}\nextendedKeyUsage={usage}\n"
            "keyUsage=critical,digitalSignature\n"
            "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
        )
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=pglock test {name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt",
                "-extfile", f"{name}.ext")  # fmt: skip
    return {
        "patroni_cafile": where / "ca.crt",
        "patroni_certfile": where / "client.crt",
        "patroni_keyfile": where / "client.key",
        "server_certfile": where / "server.crt",
        "server_keyfile": where / "server.key",
    }


def get_json(
    url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None
) -> tuple[int, Any]:
    """GET ``url``: (HTTP status, parsed body or None); (0, None) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


def post_json(
    url: str,
    payload: dict[str, Any],
    timeout: float = 30.0,
    context: ssl.SSLContext | None = None,
) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class Member:
    """One Patroni member: its Postgres port, REST API port, data dir and process."""

    name: str
    pg_port: int
    api_port: int
    base: Path
    process: subprocess.Popen[bytes] | None = None
    #: The tests' TLS context for an HTTPS REST API (PatroniCluster(tls=True)).
    context: ssl.SSLContext | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.base / "patroni.log"

    @property
    def api_url(self) -> str:
        scheme = "https" if self.context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.api_port}"

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.pg_port} user=postgres dbname=postgres"

    @property
    def patroni_pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (from postmaster.pid), None when there is none."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def status(self, path: str = "/patroni", timeout: float = 2.0) -> tuple[int, Any]:
        return get_json(self.api_url + path, timeout, self.context)

    def is_leader(self, timeout: float = 2.0) -> bool:
        return self.status("/leader", timeout)[0] == 200


class PatroniCluster:
    """A Patroni cluster of ``size`` members and one etcd, all on 127.0.0.1."""

    def __init__(
        self,
        size: int = 3,
        dcs: dict[str, Any] | None = None,
        *,
        etcd_relays: bool = False,
        tls: bool = False,
    ) -> None:
        """``dcs`` changes DCS_CONFIG's keys; with ``etcd_relays`` each member reaches
        etcd through a relay of its own (cut_from_etcd); with ``tls`` the REST APIs are
        HTTPS with a private CA and ``verify_client: required`` (make_tls; the client's
        files in :attr:`tls_files`)."""
        self.size = size
        self.dcs = {**DCS_CONFIG, **(dcs or {})}
        self.etcd_relays = etcd_relays
        #: member name -> the relay it reaches etcd through (with etcd_relays).
        self.relays: dict[str, Relay] = {}
        self.scope = f"pglock-{uuid.uuid4().hex[:8]}"
        self.base = Path(tempfile.mkdtemp(prefix="pglock-patroni-"))
        self.account = pwd.getpwnam(ACCOUNT) if os.geteuid() == 0 else None
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self.base / f"m{i}") for i in range(size)
        ]
        #: Seconds from the first process started to a healthy cluster (see start()).
        self.start_seconds: float | None = None
        #: With tls: the CA, server and client files (make_tls), else empty.
        self.tls_files: dict[str, Path] = {}
        self.context: ssl.SSLContext | None = None
        if tls:
            self.tls_files = make_tls(self.base / "tls")
            self.context = ssl.create_default_context(cafile=self.tls_files["patroni_cafile"])
            self.context.load_cert_chain(
                self.tls_files["patroni_certfile"], self.tls_files["patroni_keyfile"]
            )
            for member in self.members:
                member.context = self.context

    def tls_settings(self) -> dict[str, str]:
        """The environment that gives a pglock fence this cluster's TLS files."""
        return {
            f"PGLOCK_{name.upper()}": str(self.tls_files[name])
            for name in ("patroni_cafile", "patroni_certfile", "patroni_keyfile")
            if name in self.tls_files
        }

    # -- start and stop -------------------------------------------------------------

    def _own(self, path: Path) -> None:
        if self.account is not None:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)

    def _spawn(self, args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        prefix: list[str] = []
        if self.account is not None:
            # setpriv execs: the pid we get is the program's own (su would stay in
            # between, and stops itself when its child is paused).
            prefix = ["setpriv", f"--reuid={self.account.pw_uid}",
                      f"--regid={self.account.pw_gid}", "--init-groups"]  # fmt: skip
        env = {
            "PATH": f"{PG_BINDIR}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.base),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
        }
        with log.open("ab") as out:
            return subprocess.Popen(
                [*prefix, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.base, env=env, start_new_session=True,
            )  # fmt: skip

    def _config(self, member: Member) -> dict[str, Any]:
        hba = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host replication all 127.0.0.1/32 trust",
        ]
        return {
            "scope": self.scope,
            "name": member.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{member.api_port}",
                "connect_address": f"127.0.0.1:{member.api_port}",
                **self._restapi_tls(),
            },
            # Its own calls to the other members' REST APIs (POST /failsafe, the leader
            # race's GET /patroni) show the same certificate.
            **({"ctl": self._ctl_tls()} if self.tls_files else {}),
            "etcd3": self._etcd(member),
            "bootstrap": {
                "dcs": self.dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"username": "postgres"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{member.pg_port}",
                "connect_address": f"127.0.0.1:{member.pg_port}",
                "data_dir": str(member.data),
                "bin_dir": str(PG_BINDIR),
                "pgpass": str(member.base / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "parameters": {
                    "unix_socket_directories": str(member.base),
                    "fsync": "off",
                },
                "pg_hba": hba,
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }

    def _restapi_tls(self) -> dict[str, str]:
        if not self.tls_files:
            return {}
        return {
            "certfile": str(self.tls_files["server_certfile"]),
            "keyfile": str(self.tls_files["server_keyfile"]),
            "cafile": str(self.tls_files["patroni_cafile"]),
            "verify_client": "required",
        }

    def _ctl_tls(self) -> dict[str, str]:
        return {
            "cacert": str(self.tls_files["patroni_cafile"]),
            "certfile": str(self.tls_files["server_certfile"]),
            "keyfile": str(self.tls_files["server_keyfile"]),
        }

    def _etcd(self, member: Member) -> dict[str, Any]:
        relay = self.relays.get(member.name)
        if relay is None:
            return {"hosts": [f"127.0.0.1:{self.etcd_port}"]}
        # use_proxies: Patroni keeps to the relay, never looks up etcd's own addresses.
        return {"hosts": [f"127.0.0.1:{relay.port}"], "use_proxies": True}

    def cut_from_etcd(self, member: Member) -> Callable[[], None]:
        """Partition ``member``'s Patroni from etcd (its REST API and Postgres still
        answer everyone else); returns what heals it."""
        relay = self.relays[member.name]
        relay.cut()
        return relay.heal

    def promote_by_hand(self, member: Member) -> None:
        """``pg_ctl promote`` on ``member``'s Postgres, behind its Patroni's back (pause
        its Patroni first, or it demotes the server again at its next loop)."""
        done = self._spawn(
            [str(PG_BINDIR / "pg_ctl"), "promote", "-w", "-t", "30", "-D", str(member.data)],
            member.base / "promote.log",
        ).wait(60)
        assert done == 0, self.tail(member.base / "promote.log")

    def start(self, timeout: float = 90.0) -> None:
        """Start etcd and every member at once; return when the cluster is healthy."""
        ensure_tools()
        self.base.chmod(0o755)
        self._own(self.base)
        if self.tls_files:  # Patroni's account reads its key
            self._own(self.base / "tls")
            for path in (self.base / "tls").iterdir():
                self._own(path)
        started = time.monotonic()
        etcd_dir = self.base / "etcd"
        etcd_dir.mkdir()
        self._own(etcd_dir)
        self.start_etcd()
        if self.etcd_relays:
            self.relays = {member.name: Relay(self.etcd_port) for member in self.members}
        # json is YAML: Patroni reads it as its configuration file.
        for member in self.members:
            member.base.mkdir()
            self._own(member.base)
            config = member.base / "patroni.yml"
            config.write_text(json.dumps(self._config(member), indent=1))
            self._own(config)
        for member in self.members:
            member.process = self._spawn(
                [str(PATRONI_VENV / "bin" / "patroni"), str(member.base / "patroni.yml")],
                member.log,
            )
        self.wait_healthy(timeout)
        self.start_seconds = time.monotonic() - started

    def start_etcd(self) -> None:
        """Start etcd (again: its data dir keeps the leader key and its lease) and wait
        until it answers."""
        etcd_dir = self.base / "etcd"
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self.etcd = self._spawn(
            [ETCD, "--name", "etcd0", "--data-dir", str(etcd_dir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"etcd0={peer}", "--initial-cluster-state", "new",
             "--enable-v2=false", "--unsafe-no-fsync", "--log-level", "warn"],
            etcd_dir / "etcd.log",
        )  # fmt: skip
        wait_until(lambda: get_json(client + "/health", 1.0)[0] == 200 or self._died(), 30, "etcd")
        self._check_alive()

    def kill_etcd(self) -> None:
        """SIGKILL etcd by its pid (a DCS outage for every member) and reap it."""
        assert self.etcd is not None
        _signal(self.etcd.pid, signal.SIGKILL)
        self.etcd.wait(10)

    def _died(self) -> bool:
        procs = [self.etcd, *(m.process for m in self.members)]
        return any(p is not None and p.poll() is not None for p in procs)

    def _check_alive(self) -> None:
        if self.etcd is not None and self.etcd.poll() is not None:
            raise RuntimeError(f"etcd exited: {self.tail(self.base / 'etcd' / 'etcd.log')}")

    def tail(self, path: Path, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def wait_healthy(self, timeout: float = 90.0, exclude: Sequence[Member] = ()) -> Member:
        """Wait until a member leads, the others (but ``exclude``) stream, a sync standby is set."""

        def healthy() -> Member | None:
            for member in self.members:
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(f"{member.name}'s Patroni exited:\n{self.tail(member.log)}")
            leader = self.leader()
            if leader is None:
                return None
            status, cluster = leader.status("/cluster")
            if status != 200 or not cluster:
                return None
            members = {m["name"]: m for m in cluster.get("members", [])}
            wanted = [m for m in self.members if m not in exclude]
            if any(members.get(m.name, {}).get("state") not in ("running", "streaming")
                   for m in wanted):  # fmt: skip
                return None
            if not any(m.get("role") == "sync_standby" for m in members.values()):
                return None
            return leader

        try:
            return wait_until(healthy, timeout, "a healthy Patroni cluster", interval=0.1)
        except AssertionError as exc:
            logs = "\n".join(f"--- {m.name}\n{self.tail(m.log)}" for m in self.members)
            raise AssertionError(f"{exc}\n{logs}") from None

    def stop(self) -> None:
        """End every process this cluster started, by pid; remove its files."""
        pids: list[int] = []
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                pids.append(member.process.pid)
        postmasters = [pid for m in self.members if (pid := m.postmaster_pid()) is not None]
        # Patroni first, so that it restarts nothing; then the postmasters (SIGQUIT ends
        # their children at once); etcd last.
        for pid in pids:
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)
        for member in self.members:
            if member.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    member.process.wait(10)
        children: list[psutil.Process] = []
        for pid in postmasters:
            with contextlib.suppress(psutil.Error):
                children += psutil.Process(pid).children(recursive=True)
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGQUIT)
        for child in children:
            _signal(child.pid, signal.SIGCONT)
        _gone, alive = psutil.wait_procs(
            [p for pid in postmasters if (p := _process(pid)) is not None] + children, timeout=10
        )
        for proc in alive:
            _signal(proc.pid, signal.SIGKILL)
        for relay in self.relays.values():
            relay.close()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(10)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)

    # -- what the tests look at -----------------------------------------------------

    def leader(self, timeout: float = 2.0) -> Member | None:
        """The member whose REST API says it holds the leader key, if exactly one does."""
        with concurrent.futures.ThreadPoolExecutor(len(self.members)) as pool:
            answers = list(pool.map(lambda m: m.is_leader(timeout), self.members))
        leaders = [m for m, yes in zip(self.members, answers, strict=True) if yes]
        return leaders[0] if len(leaders) == 1 else None

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    @property
    def urls(self) -> str:
        """The value of pglock_patroni_url for this cluster."""
        return ",".join(m.api_url for m in self.members)

    def dsn(
        self, order: Sequence[int] | None = None, dbname: str = "postgres", host: str = "127.0.0.1"
    ) -> str:
        """A multi-host DSN listing the members in ``order``, read-write target; each by
        ``host`` (``localhost``: by name, where Patroni reports 127.0.0.1)."""
        order = range(len(self.members)) if order is None else order
        hosts = ",".join(host for _ in order)
        ports = ",".join(str(self.members[i].pg_port) for i in order)
        return (
            f"host={hosts} port={ports} user=postgres dbname={dbname} "
            "target_session_attrs=read-write connect_timeout=2"
        )

    def config(self) -> dict[str, Any]:
        for member in self.members:
            status, body = member.status("/config")
            if status == 200 and body:
                return dict(body)
        raise RuntimeError("no member answered GET /config")

    def patch_config(self, changes: dict[str, Any]) -> None:
        for member in self.members:
            request = urllib.request.Request(
                member.api_url + "/config", data=json.dumps(changes).encode(), method="PATCH",
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(request, timeout=10, context=self.context),
            ):
                return
        raise RuntimeError("no member accepted PATCH /config")

    def switchover(self, candidate: Member | None = None) -> tuple[Member, Member]:
        """Ask the leader to hand over (to ``candidate`` or the sync standby); (old, new)."""
        old = self.leader()
        if old is None:
            raise RuntimeError("no leader to switch over from")
        if candidate is None:
            _, cluster = old.status("/cluster")
            sync = [m["name"] for m in cluster["members"] if m.get("role") == "sync_standby"]
            candidate = self.member(sync[0])
        status, text = post_json(
            old.api_url + "/switchover",
            {"leader": old.name, "candidate": candidate.name},
            context=self.context,
        )
        if status != 200:
            raise RuntimeError(f"switchover refused: {status} {text}")
        return old, candidate

    def processes(self) -> list[psutil.Process]:
        """etcd, each Patroni, each postmaster and its children."""
        procs: list[psutil.Process] = []
        pids = [self.etcd.pid if self.etcd else None]
        pids += [m.patroni_pid for m in self.members]
        pids += [m.postmaster_pid() for m in self.members]
        for pid in pids:
            proc = _process(pid) if pid is not None else None
            if proc is None:
                continue
            procs.append(proc)
            if pid in [m.postmaster_pid() for m in self.members]:
                with contextlib.suppress(psutil.Error):
                    procs += proc.children(recursive=True)
        return procs

    def memory(self) -> dict[str, int]:
        """Bytes: the sum of resident set sizes, and of proportional ones (shared pages split)."""
        rss = pss = 0
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
        return {"rss": rss, "pss": pss}


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def writable(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
    except psycopg.Error:
        return False
    return bool(row and row[0])


@contextlib.contextmanager
def patroni_cluster(size: int = 3) -> Iterator[PatroniCluster]:
    """Start a cluster, yield it, stop it (also when starting fails half-way)."""
    cluster = PatroniCluster(size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _main(argv: Sequence[str]) -> int:
    if "--install" in argv:
        ensure_tools()
        print(f"Patroni {PATRONI_VERSION} in {PATRONI_VENV}, etcd at {ETCD}: ready")
    if "--measure" in argv:
        with patroni_cluster() as cluster:
            memory = cluster.memory()
            print(
                f"started in {cluster.start_seconds:.1f} s; {len(cluster.processes())} processes; "
                f"RSS {memory['rss'] / 2**20:.0f} MiB, PSS {memory['pss'] / 2**20:.0f} MiB"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
