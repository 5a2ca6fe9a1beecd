"""Connecting this process to a Ray cluster, or starting a private one on loopback: what the Ray executor
(autotune.drivers.ray), its script shipping and RL training (autotune.rl.train) share. Every failure is one line
(ConfigError) within a bounded time: Ray itself retries an unreachable or foreign server for minutes."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autotune.files import write_atomic
from autotune.values.config import ConfigError, first_line

LOCAL = "local"  # --ray-address local: start a private single-node Ray instance for this run
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch for single-machine clusters (start_local)
ADDRESS_ENV = "RAY_ADDRESS"  # the cluster ray.init joins when given no address
LOOPBACK_IP = "127.0.0.1"
# A file in the session folder of a private instance (start_local): its processes were started by this program,
# not by a user's own cluster (reap_orphaned_agents).
PRIVATE_MARK = "autotune-private"
# The process titles of the agents every raylet starts (the raylet refuses an empty command for either), which
# outlive a private instance killed with SIGKILL by about a minute (reap_orphaned_agents).
AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
RAYLET = "raylet"  # the raylet's process name (/proc/PID/comm)
PROBE_TIMEOUT_S = 5.0  # a cluster's address must accept a connection within this
CONNECT_TIMEOUT_S = 20.0  # and Ray must have joined it within this
CLIENT_PORT = 10001  # Ray Client's default port (ray://HOST)
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 section 3.4
HTTP2_EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # length 0, type SETTINGS, no flags, stream 0
HTTP2_SETTINGS = 4


def connect(address: str, num_cpus: int | None = None) -> None:
    """Connect this process to a Ray cluster (or start a private local one of `num_cpus` CPUs, default every
    core); one line (ConfigError) on failure, within PROBE_TIMEOUT_S + CONNECT_TIMEOUT_S at most."""
    import ray

    if ray.is_initialized():
        return
    if address == LOCAL:
        start_local(ray, num_cpus)
        return
    check_reachable(address)
    token_set = ("RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN_PATH=FILE, RAY_AUTH_TOKEN, or ~/.ray/auth_token) "
                 "set in this environment?")
    refused = _ask_gcs(address, CONNECT_TIMEOUT_S)
    if refused:
        raise ConfigError(f"--ray-address (RayOptions' `address`) {address}: the cluster refused this process ({refused}); are {token_set}")
    err = (TimeoutError(f"no Ray cluster answered within {CONNECT_TIMEOUT_S:g} s") if refused is None
           else _init_within(ray, address, CONNECT_TIMEOUT_S))
    # A cluster that wants a token Ray was not given may also just never answer: the hint names both causes.
    token = f"if it uses token authentication, are {token_set}"
    if isinstance(err, TimeoutError):
        raise ConfigError(f"cannot reach Ray cluster at {address}: {err}; is it a Ray cluster's address "
                          f"(the head's GCS port, or ray://HOST:PORT of its Ray Client server)? And {token}")
    if err is not None:
        raise ConfigError(f"--ray-address (RayOptions' `address`) {address}: cannot connect to Ray: {first_line(err)}; is it running, and "
                          f"{token}") from None


def _ask_gcs(address: str, timeout_s: float) -> str | None:
    """One request to the GCS at `address` (HOST:PORT), as ray.init makes first, in a helper thread waited for at
    most `timeout_s`. Returns why the cluster refused this process's authentication token; "" when it answered
    otherwise (or `address` is auto or a Ray Client's: left to ray.init); None when it did not answer in time
    (ray.init would wait as long). A refusal is answered at once, where ray.init retries it for 20 s, printing
    Ray's warning every second, and then reads as a cluster that never answered. What Ray writes meanwhile to the
    stderr descriptor (its C++ warnings) is passed on only if the cluster answered."""
    if address == "auto" or "://" in address:
        return ""
    from ray.exceptions import AuthenticationError

    host = _ray_host(address, address.rpartition(":")[0])
    verdict: list[str] = []

    def ask() -> None:
        try:
            from ray._raylet import GcsClient  # type: ignore[attr-defined]  # (the stub lacks it; ray.init uses it)

            GcsClient(address=f"{host}:{address.rpartition(':')[2]}")
            verdict.append("")
        except AuthenticationError as err:
            verdict.append(err.message.strip().splitlines()[0] if err.message.strip() else "refused")
        except Exception:  # noqa: BLE001  (anything else is ray.init's to report)
            verdict.append("")

    with _stderr_held() as held:
        thread = threading.Thread(target=ask, name="ray-gcs-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)  # left behind if it did not answer, daemonic: it ends with the process
        answer = verdict[0] if verdict else None
        held.keep = answer == ""
    return answer


class _Held:
    keep = True  # whether what was written meanwhile goes on to stderr


@contextmanager
def _stderr_held() -> Iterator[_Held]:
    """Hold what is written to the stderr file descriptor (a C++ library's log included) in a file, and pass it
    on afterwards unless told not to. Where stderr is no file descriptor (a test's captured stream): nothing."""
    held = _Held()
    try:
        sys.stderr.flush()
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield held
        return
    saved = os.dup(fd)
    try:
        with tempfile.TemporaryFile() as buffer:
            os.dup2(buffer.fileno(), fd)
            try:
                yield held
            finally:
                sys.stderr.flush()
                os.dup2(saved, fd)
                if held.keep:
                    buffer.seek(0)
                    text = buffer.read()
                    while text:
                        text = text[os.write(fd, text):]
    finally:
        os.close(saved)


def _init_within(ray: Any, address: str, timeout_s: float) -> BaseException | None:
    """ray.init(address) in a helper thread, waited for at most `timeout_s`: against a server that accepts
    the connection but is no Ray cluster, Ray retries for many minutes in calls no signal interrupts.
    Returns the error (a TimeoutError if it took too long), or None once connected. Outside the main
    thread Ray installs no SIGTERM handler of its own, so the caller's (SIGTERM as Ctrl-C) stays."""
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except BaseException as err:  # noqa: BLE001  (handed to the waiting thread)
            failure.append(err)

    worker_log = logging.getLogger("ray._private.worker")
    quiet = _DropMessage("is not the main thread")  # Ray's note that it set no SIGTERM handler: as intended
    worker_log.addFilter(quiet)
    try:
        thread = threading.Thread(target=init, name="ray-connect", daemon=True)
        thread.start()
        thread.join(timeout_s)
    finally:
        worker_log.removeFilter(quiet)
    if thread.is_alive():  # left behind, daemonic: it ends with the process
        return TimeoutError(f"no Ray cluster answered within {timeout_s:g} s")
    return failure[0] if failure else None


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def start_local(ray: Any, num_cpus: int | None) -> None:
    """A private Ray instance on this machine that listens on loopback only, whatever the environment says.

    Ray joins the cluster an inherited RAY_ADDRESS names unless told "local"; it binds its servers to
    loopback only when the node's IP is literally 127.0.0.1, and resolves 127.0.0.1 to the routable address
    unless its switch for single-machine clusters (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, read at import into
    ray_constants and again by every process it starts) is off. So the switch is turned off in this process
    and in the environment the instance's processes inherit, and RAY_ADDRESS is left out of that
    environment, for the start only: the caller's os.environ is as it was afterwards. The agents an earlier
    private instance left behind are ended first, and this one's session folder is marked as private
    (reap_orphaned_agents)."""
    from ray._private import ray_constants

    reap_orphaned_agents()
    saved_env = {name: os.environ.get(name) for name in (LOOPBACK_ENV, ADDRESS_ENV)}
    saved_switch = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    os.environ.pop(ADDRESS_ENV, None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=LOCAL, num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK_IP,
                 log_to_driver=False, configure_logging=False)
        mark_private(ray)
    finally:
        if sigterm is not None:  # Ray's own handler exits at once; the caller's (SIGTERM as Ctrl-C) ends trials
            signal.signal(signal.SIGTERM, sigterm)
        ray_constants.ENABLE_RAY_CLUSTER = saved_switch
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mark_private(ray: Any) -> None:
    """Mark the session folder of the private instance this process started (PRIVATE_MARK): its agents, should
    they outlive it, are this program's to end (reap_orphaned_agents). Nothing where Ray does not say its folder."""
    try:
        session = ray._private.worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001  (a private attribute of Ray's: without it, no mark)
        return
    try:
        write_atomic(Path(session) / PRIVATE_MARK, f"{os.getpid()}\n")
    except OSError:
        return


def reap_orphaned_agents(proc: Path = Path("/proc")) -> list[int]:
    """End (SIGKILL) the Ray agents that an earlier private instance of this user left without their raylet; the
    pids ended. Only where /proc is (Linux); elsewhere nothing.

    Every raylet starts a dashboard agent and a runtime-env agent (ray::DashboardAgent, ray::RuntimeEnvAgent; Ray
    2.60 has no option that leaves either out: the raylet refuses an empty command for them, include_dashboard=False
    only makes the dashboard agent minimal). Where the process that started a private instance is killed with
    SIGKILL, the kernel kills its raylet and GCS (Ray's fate sharing, PR_SET_PDEATHSIG), but not the agents,
    which are the raylet's children: each sees its raylet gone within a second, and then, the raylet's log showing
    no SIGTERM, publishes that error through the GCS, which is gone too: a synchronous call with a fixed 60 s
    timeout (ray._private.process_watcher.report_raylet_error_logs) that blocks the agent's event loop, and with it
    the agent's SIGTERM handler, before it exits. No Ray setting shortens it (RAY_gcs_rpc_server_reconnect_timeout_s,
    RAY_gcs_server_request_timeout_seconds, RAY_gcs_rpc_server_connect_timeout_s: no effect).

    Ended here: a process of this user titled as an agent (AGENT_TITLES) whose parent is no longer a raylet (the
    agent's own test of its raylet's death: it was reparented) and which holds a file of a session folder that
    start_local marked (PRIVATE_MARK). Never an agent of a user's own cluster (no mark), nor one of a private
    instance still running (another sweep's: its parent is its raylet)."""
    if not proc.is_dir():
        return []
    uid = os.getuid()
    ended = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].strip().decode(errors="replace")
            if title not in AGENT_TITLES:
                continue
            stat = (entry / "stat").read_text()
            parent = stat[stat.rindex(")") + 2:].split()[1]  # after "pid (comm) state": the parent's pid
            if (proc / parent / "comm").read_text().strip() == RAYLET:
                continue  # its raylet still runs it
            if not _holds_private_session(entry):
                continue
            os.kill(int(entry.name), signal.SIGKILL)  # its event loop may be blocked: a SIGTERM would wait
            ended.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, not readable, or not as expected: left alone
            continue
    return ended


def _holds_private_session(entry: Path) -> bool:
    """Whether the process at /proc/PID `entry` holds a file of a session folder start_local marked (its logs)."""
    for fd in (entry / "fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.is_absolute() and target.parent.name == "logs" and (target.parent.parent / PRIVATE_MARK).is_file():
            return True
    return False


def check_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail in one line, within about `timeout_s`, when nothing accepts a connection at the cluster's
    address: Ray itself retries an unreachable GCS for minutes without a word. "auto" (find the cluster
    started on this machine) is left to Ray; a Ray Client address (ray://host:port) is probed as given."""
    if address == "auto":
        return
    client = "://" in address
    target = address.split("://", 1)[1] if client else address
    if client and not re.search(r":\d*$", target):
        target += f":{CLIENT_PORT}"
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray-address (RayOptions' `address`) {address}: allowed local, auto, HOST:PORT or ray://HOST:PORT")
    if not client:
        host = _ray_host(address, host)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            if _speaks_http2(sock):
                return
            why = f"nothing there answered as a Ray server (gRPC) within {timeout_s:g} s"
    except socket.gaierror as err:
        why = f"cannot resolve {host!r} ({err.strerror})"
    except TimeoutError:
        why = f"no answer within {timeout_s:g} s"
    except OSError as err:
        why = (err.strerror or type(err).__name__).lower()
    raise ConfigError(f"cannot reach Ray cluster at {address}: {why}; is it running, and is its port reachable "
                      "from here?")


def _speaks_http2(sock: socket.socket) -> bool:
    """Whether the server on `sock` answers an HTTP/2 client preface with its SETTINGS frame, as Ray's gRPC
    servers do (a port that accepts connections but is no Ray server, or a proxy that accepts every
    connection, does not). A cluster with TLS (RAY_USE_TLS) expects a TLS handshake first: not checked."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    try:
        sock.sendall(HTTP2_PREFACE + HTTP2_EMPTY_SETTINGS)
        header = b""
        while len(header) < 9:
            chunk = sock.recv(9 - len(header))
            if not chunk:
                return False
            header += chunk
    except OSError:  # a timeout included
        return False
    return header[3] == HTTP2_SETTINGS


def _ray_host(address: str, host: str) -> str:
    """The host Ray itself will connect to for `address` (it replaces a loopback address by this node's
    routable one); the host as given if Ray cannot say."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001  (a private helper: any failure means "as given")
        return host
    return resolved.rpartition(":")[0].strip("[]") if resolved else host


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
