"""A throw-away SLURM cluster (munged + slurmctld + one slurmd per node) for tests, run as root.

Everything lives in one temporary directory: munge key and socket, slurm.conf, state,
spool and logs; the ports are free ones picked at start, so it never touches a system
SLURM. Needs Debian's packages (`.ci/run` installs them):

    apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge

Use as a context manager; the daemons it started are stopped by pid on exit:

    with SlurmCluster(tmp_dpath) as cluster:
        job_id = cluster.sbatch(["--array=0-1", "slurm/extract.sh", "vit_tiny"], env)
        states = cluster.wait(job_id)

With `nodes=2` (or more) each node is a test host of its own (tests/node_network.py): slurmd
runs in its own network namespace with its own address on a bridge, its own hostname (n1, n2,
...) and an /etc/hosts naming the nodes, and the machine's cores are split between the nodes.
slurmctld and munged stay on the machine (the bridge's address); the file system is shared, as
a cluster's shared disk is. Needs iproute2 as well.

Or by hand: `python tests/slurm_cluster.py DIR [NODES]` starts it, prints `export SLURM_CONF=...`
and waits for Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

INSTALL_HINT = (
    "apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge "
    "(as root; .ci/run does it)"
)
EXECUTABLES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
MULTINODE_EXECUTABLES = (*EXECUTABLES, "ip", "nsenter", "unshare")
MULTINODE_INSTALL_HINT = INSTALL_HINT.replace("munge ", "munge iproute2 ")


def missing_executables(names: tuple[str, ...] = EXECUTABLES) -> list[str]:
    """Names of the SLURM/munge programs not on PATH (also looked up in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [name for name in names if shutil.which(name, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return max(total_kb // 1024 - 1024, 512)


class SlurmCluster:
    """Start munged, slurmctld and slurmd under `root_dpath`; stop them by pid."""

    def __init__(self, root_dpath: Path, cpus: int | None = None, nodes: int = 1) -> None:
        """`cpus`: per node (default: the machine's cores split between the `nodes`)."""
        self.root = Path(root_dpath)
        self.hostname = socket.gethostname().split(".")[0]
        self.nodes = nodes
        self.cpus = cpus or max((os.cpu_count() or 1) // nodes, 1)
        self.node_names = [self.hostname] if nodes == 1 else [f"n{i + 1}" for i in range(nodes)]
        self.network = None  # a NodeNetwork when nodes > 1
        self.conf = self.root / "slurm.conf"
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin",
        }
        self.pids: list[int] = []
        self.daemons: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmCluster:
        if missing := missing_executables(EXECUTABLES if self.nodes == 1 else MULTINODE_EXECUTABLES):
            hint = INSTALL_HINT if self.nodes == 1 else MULTINODE_INSTALL_HINT
            raise RuntimeError(f"SLURM is not installed (missing {', '.join(missing)}); run: {hint}")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        munge_dpath, log_dpath = self.root / "munge", self.root / "log"
        for dpath in (munge_dpath, log_dpath, self.root / "state", self.root / "spool"):
            dpath.mkdir(parents=True, exist_ok=True)
            dpath.chmod(0o755)
        self.root.chmod(0o755)
        key_fpath, socket_fpath = munge_dpath / "munge.key", munge_dpath / "munge.sock"
        subprocess.run(
            ["mungekey", "--create", f"--keyfile={key_fpath}", "--force"], env=self.env, check=True, capture_output=True
        )
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={socket_fpath}",
                f"--key-file={key_fpath}",
                f"--pid-file={munge_dpath / 'munged.pid'}",
                f"--log-file={munge_dpath / 'munged.log'}",
                f"--seed-file={munge_dpath / 'munged.seed'}",
            ],
            env=self.env,
            check=True,
            capture_output=True,
        )
        self.pids.append(int((munge_dpath / "munged.pid").read_text().split()[0]))  # it forks: pid from its file
        r = self.root
        memory_mb = _memory_mb() // self.nodes
        controller, nodes = self.hostname, [f"NodeName={self.hostname}"]
        spool, slurmd_pid, slurmd_log = f"{r}/spool", f"{r}/slurmd.pid", f"{log_dpath}/slurmd.log"
        if self.nodes > 1:
            from node_network import NodeNetwork

            self.network = NodeNetwork(self.node_names).__enter__()
            controller = f"{self.hostname}({self.network.gateway})"
            nodes = [
                f"NodeName={name} NodeAddr={self.network.addresses[name]} NodeHostname={name}"
                for name in self.node_names
            ]
            (r / "hosts").write_text(self.network.hosts_file(self.hostname))
            for name in self.node_names:
                (r / "spool" / name).mkdir(exist_ok=True)
            spool, slurmd_pid, slurmd_log = f"{r}/spool/%n", f"{r}/slurmd-%n.pid", f"{log_dpath}/slurmd-%n.log"
        nodes_text = "\n".join(f"{node} CPUs={self.cpus} RealMemory={memory_mb} State=UNKNOWN" for node in nodes)
        self.conf.write_text(f"""\
ClusterName=extracttest
SlurmctldHost={controller}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_fpath}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={slurmd_pid}
SlurmctldLogFile={log_dpath}/slurmctld.log
SlurmdLogFile={slurmd_log}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=600
SlurmdParameters=config_overrides
{nodes_text}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")
        commands = [(["slurmctld", "-D", "-i"], "slurmctld")]
        if self.network is None:
            commands.append((["slurmd", "-D"], "slurmd"))
        else:  # each slurmd inside its own test host, named explicitly (-N) as in slurm.conf
            commands += [
                (self.network.wrap(name, ["slurmd", "-D", "-N", name], r / "hosts"), f"slurmd-{name}")
                for name in self.node_names
            ]
        for command, name in commands:
            out = open(log_dpath / f"{name}.out", "wb")
            self.daemons.append(subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT))
            out.close()
        deadline = time.time() + 60
        while time.time() < deadline:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if result.returncode == 0 and result.stdout.split() == ["idle"] * self.nodes:
                return
            if any(d.poll() is not None for d in self.daemons):
                break
            time.sleep(0.5)
        logs = "".join((log_dpath / f"{name}.out").read_text(errors="replace")[-1500:] for _, name in commands)
        raise RuntimeError(f"the test SLURM nodes did not become idle in {self.root}; daemon output:\n{logs}")

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit a job; returns its id (`sbatch --parsable`)."""
        result = subprocess.run(
            ["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        """Poll until the job (all array tasks) left the queue; returns {job: 'STATE exit'} (no sacct needed)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            queued = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%i %T"], env=self.env, capture_output=True, text=True
            ).stdout.strip()
            if not queued:
                break
            time.sleep(1)
        else:
            raise TimeoutError(f"SLURM job {job_id} still queued after {timeout} s")
        shown = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True, text=True
        ).stdout
        states = {}
        for line in shown.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            name = fields.get("JobId", "?") + ("_" + fields["ArrayTaskId"] if "ArrayTaskId" in fields else "")
            states[name] = f"{fields.get('JobState')} {fields.get('ExitCode')}"
        return states

    def stop(self) -> None:
        """Stop the daemons this object started, by pid."""
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.daemons = []
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.pids = []
        if self.network is not None:
            self.network.stop()
            self.network = None


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` cleans up as Ctrl-C does
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("slurm-test")
    with SlurmCluster(root, nodes=int(sys.argv[2]) if len(sys.argv) > 2 else 1) as cluster:
        print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
