"""kiln.local without a cluster: up/down bookkeeping, the pod network's `ip` calls and the
runtime's sync loop, against fakes (no root, no bridge, no network namespaces)."""
from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from kubernetes.client import V1Container, V1ObjectMeta, V1Pod, V1PodList, V1PodSpec, V1PodStatus

from kiln.local import build, cluster, demo, images, network, processes, runtime
from kiln.local.network import PodNetwork
from kiln.local.pod_spec import Probe
from kiln.local.testing import eventually

pytestmark = pytest.mark.timeout(60)
SUBNET = ipaddress.IPv4Network("10.213.0.0/24")


@pytest.fixture(autouse=True)
def no_host_changes(tmp_path, monkeypatch):
    """Locks and caches under tmp_path; podman never runs (a test that wants it fakes it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(images, "remove_containers", lambda label: None)


@pytest.fixture
def sleeper():
    """A process to stand for a test session or a pod's process."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


class FakeIp:
    """network.ip: records the calls; answers `ip netns list`, `ip netns pids` and `ip link show`."""

    def __init__(self, namespaces: dict[str, list[int]] | None = None, links: set[str] | None = None,
                 routes: list[dict] | None = None) -> None:
        self.namespaces = namespaces or {}  # name -> pids inside
        self.links = links if links is not None else set()
        self.routes = routes or []
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        self.calls.append(args)
        out, rc = "", 0
        if args[:2] == ("netns", "list"):
            out = "".join(f"{n} (id: 0)\n" for n in self.namespaces)
        elif args[:2] == ("netns", "pids"):
            out = "".join(f"{pid}\n" for pid in self.namespaces.get(args[2], []))
        elif args[:2] == ("netns", "del"):
            self.namespaces.pop(args[2])
        elif args[:2] == ("link", "show"):
            rc = 0 if args[3] in self.links else 1
        elif args[:3] == ("link", "add", "name"):
            if args[3] in self.links:
                raise RuntimeError(f"ip {' '.join(args)}: RTNETLINK answers: File exists")
            self.links.add(args[3])
        elif args[:2] == ("link", "del"):
            self.links.discard(args[2])
        elif args[:4] == ("-j", "-4", "route", "show"):
            out = json.dumps(self.routes)
        return subprocess.CompletedProcess(["ip", *args], rc, out, "")


def write_state(directory: Path, **extra: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state.json").write_text(json.dumps({"bridge": "kiln0", "subnet": str(SUBNET), "ports": {"apiserver": 1},
                                                      "processes": {}, **extra}))


def register_user(directory: Path, pid: int) -> None:
    (directory / "users").mkdir(exist_ok=True)
    (directory / "users" / str(pid)).write_text(str(processes.start_ticks(pid)))


def test_down_removes_nothing_from_a_directory_without_state(tmp_path):
    project = tmp_path / "project"
    for entry in ("logs", "certs", "pki", "src"):
        (project / entry).mkdir(parents=True)
        (project / entry / "important.txt").write_text("keep me")
    assert cluster.down(project) is False
    assert sorted(p.name for p in project.iterdir()) == ["certs", "logs", "pki", "src"]
    assert all((project / e / "important.txt").exists() for e in ("logs", "certs", "pki", "src"))


def test_up_refuses_a_directory_with_a_users_entries_and_leaves_them(tmp_path, monkeypatch):
    """The refusal ran inside the clean-up of a failed start, which deleted the very folders it
    had refused to touch."""
    monkeypatch.setattr(build, "ensure_built", lambda **_: pytest.fail("up went on to build"))
    project = tmp_path / "project"
    for entry in ("logs", "certs", "src"):
        (project / entry).mkdir(parents=True)
        (project / entry / "important.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match=r"holds \['logs', 'certs'\] from something else"):
        cluster.up(project)
    assert all((project / e / "important.txt").read_text() == "keep me" for e in ("logs", "certs", "src"))


def test_a_dir_that_is_a_file_is_one_line_not_a_traceback(tmp_path, capsys):
    from kiln.cli import main
    afile = tmp_path / "afile.txt"
    afile.write_text("")
    assert main(["local", "down", "--dir", str(afile)]) == 1
    assert capsys.readouterr().err.startswith(f"kiln local down: [Errno 17] File exists: '{afile}'")


def pod(name: str, uid: str, ip: str, deleting: bool = False) -> V1Pod:
    return V1Pod(metadata=V1ObjectMeta(namespace="ns", name=name, uid=uid,
                                       annotations={"kiln.dev/readiness": "runtime"},
                                       deletion_timestamp=datetime.datetime.now() if deleting else None),
                 spec=V1PodSpec(node_name="kiln-gpu-0", automount_service_account_token=False,
                                containers=[V1Container(name="engine", image="x", command=["kiln", "serve"])]),
                 status=V1PodStatus(pod_ip=ip))


def test_a_pod_that_fails_to_start_does_not_stall_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(network, "ip", FakeIp())
    deleted, launched = [], []

    class Core:
        def list_pod_for_all_namespaces(self, **_):
            return V1PodList(items=[pod("broken", "aaaaaaaa-1", "10.213.0.70"),
                                    pod("deleted", "bbbbbbbb-2", "10.213.0.71", deleting=True),
                                    pod("new", "cccccccc-3", "10.213.0.72")])

        def delete_namespaced_pod(self, name, namespace, body):
            deleted.append(name)

    def launch(run):
        launched.append(run.name)
        if run.name == "broken":
            raise FileNotFoundError("[Errno 2] No such file or directory: 'podman'")

    rt = object.__new__(runtime.Runtime)
    rt.core, rt.pods, rt.refused, rt.not_yet = Core(), {}, set(), {}
    rt.net = PodNetwork("kiln0", SUBNET, tmp_path)
    rt.cluster = cluster.Cluster(tmp_path)
    rt.launch = launch
    monkeypatch.setattr(rt, "check", lambda run: None)
    rt.sync()
    assert deleted == ["deleted"] and launched == ["broken", "new"]
    assert list(rt.pods) == ["cccccccc-3"]
    # the failed start left no namespace behind (its pod may be deleted before a retry)
    assert sorted(p.name for p in rt.net.records().iterdir()) == ["pcccccccc"]
    rt.sync()  # the broken one is tried again
    assert launched == ["broken", "new", "broken"]


def test_the_runtime_forgets_pods_that_are_gone(tmp_path, monkeypatch):
    """Refused and waiting pods are remembered only while they are listed: a long-lived runtime
    must not grow with every pod ever deleted. One still listed keeps its entry (no retry storm)."""
    monkeypatch.setattr(network, "ip", FakeIp())
    listed = [pod("refused", "aaaaaaaa-1", "10.213.0.70"), pod("waiting", "bbbbbbbb-2", "10.213.0.71")]
    patched = []

    class Core:
        def list_pod_for_all_namespaces(self, **_):
            return V1PodList(items=list(listed))

        def patch_namespaced_pod_status(self, name, namespace, body, **_):
            patched.append((name, body["status"]["containerStatuses"][0]["state"]["waiting"]["reason"]))

    def plan(p):
        if p.metadata.name == "refused":
            raise ValueError("hostPath volumes are not supported")
        raise runtime.NotYet("CreateContainerConfigError", 'secret "token" not found')

    rt = object.__new__(runtime.Runtime)
    rt.core, rt.pods, rt.refused, rt.not_yet = Core(), {}, set(), {}
    rt.net = PodNetwork("kiln0", SUBNET, tmp_path)
    rt.plan = plan
    rt.sync()
    assert patched == [("refused", "CreateContainerError"), ("waiting", "CreateContainerConfigError")]
    assert rt.refused == {"aaaaaaaa-1"} and set(rt.not_yet) == {"aaaaaaaa-1", "bbbbbbbb-2"}
    rt.sync()  # both still listed: remembered, and nothing said twice
    assert rt.refused == {"aaaaaaaa-1"} and set(rt.not_yet) == {"aaaaaaaa-1", "bbbbbbbb-2"}
    assert len(patched) == 2
    listed.clear()
    rt.sync()
    assert rt.refused == set() and rt.not_yet == {}


def test_a_stale_namespace_of_the_same_name_is_replaced(tmp_path, monkeypatch, sleeper):
    """A runtime that crashed left the namespace (its pod's process still inside): the new
    runtime's create kills that process and makes the namespace anew."""
    fake = FakeIp({"kiln0-paaaaaaaa": [sleeper.pid]})
    monkeypatch.setattr(network, "ip", fake)
    PodNetwork("kiln0", SUBNET, tmp_path).create_namespace("paaaaaaaa", "10.213.0.70")
    assert sleeper.wait(timeout=5) == -9
    netns_calls = [c for c in fake.calls if c[:2] in (("netns", "pids"), ("netns", "del"), ("netns", "add"))]
    assert netns_calls == [("netns", "pids", "kiln0-paaaaaaaa"), ("netns", "del", "kiln0-paaaaaaaa"),
                           ("netns", "add", "kiln0-paaaaaaaa")]


def test_teardown_kills_what_still_runs_in_a_namespace(tmp_path, monkeypatch, sleeper):
    """After a runtime crash its pods' processes survive it: `down` must not leave them running."""
    fake = FakeIp({"kiln0-a": [sleeper.pid]})
    monkeypatch.setattr(network, "ip", fake)
    write_state(tmp_path / "cl", bridge="kiln0", subnet=str(SUBNET))
    (tmp_path / "cl" / "netns").mkdir()
    (tmp_path / "cl" / "netns" / "a").write_text("kiln0-a 10.213.0.70\n")
    cluster.teardown(cluster.Cluster(tmp_path / "cl"))
    assert sleeper.wait(timeout=5) == -9
    assert fake.calls.index(("netns", "pids", "kiln0-a")) < fake.calls.index(("netns", "del", "kiln0-a"))
    assert not (tmp_path / "cl" / "netns").exists()


def test_a_users_up_takes_a_test_started_cluster_over(tmp_path, monkeypatch, sleeper):
    """A cluster that test sessions started, then `kiln local up`/`make up`: the last session to
    leave must not take the user's cluster down."""
    monkeypatch.setattr(cluster.Cluster, "is_up", lambda self: True)
    monkeypatch.setattr(cluster, "ensure_runtime", lambda c, log: None)
    directory = tmp_path / "cl"
    write_state(directory, owner="tests")
    register_user(directory, sleeper.pid)
    c, started = cluster.up(directory, "kiln0", str(SUBNET))
    assert not started and "owner" not in c.state()
    assert cluster.leave(c, sleeper.pid) is False
    assert c.state_file.exists()


def test_runtime_readiness_ignores_the_log_of_an_earlier_launch(tmp_path, monkeypatch):
    """runtime.log is appended to: "pod runtime up" from a runtime before must not make one that
    exits right away (its log says nothing new) count as up."""
    directory = tmp_path / "cl"
    write_state(directory)
    (directory / "logs").mkdir()
    (directory / "logs" / "runtime.log").write_text("05:00:00 INFO pod runtime up; API relay at 10.213.0.1:40000\n")
    launch, launched = processes.launch, []

    def exits_soon(argv: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
        launched.append(launch([sys.executable, "-c", "import time; time.sleep(1.5)"], log, env))
        return launched[-1]
    monkeypatch.setattr(processes, "launch", exits_soon)
    with pytest.raises(RuntimeError, match="runtime: process exited"):
        cluster.ensure_runtime(cluster.Cluster(directory), sys.stderr)
    # and reaped: a zombie left in this (test) process would trip whatever lists its children.
    # Its own child only: another test's child, reaped as this looked, raised NoSuchProcess.
    assert launched and not [r["pid"] for r in launched if zombie(r["pid"])]


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_exit_stop_collected_on_another_thread_is_still_reported(tmp_path):
    """A liveness kill stops the process on its own thread, which reaps it: the sync loop then
    found nothing to collect and reported exitCode -1, not the kubelet's 143 for SIGTERM."""
    record = processes.launch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "p.log")
    stopping = threading.Thread(target=processes.stop, args=(record, 5.0))
    stopping.start()
    stopping.join()
    assert processes.reap(record["pid"]) is None  # collected already
    assert processes.exit_code(record) == -signal.SIGTERM


def test_a_process_that_dies_just_after_a_collect_is_still_collected_by_stop(tmp_path, monkeypatch):
    """Under load (a CI run) the process died between stop()'s collect and its alive() check: a
    zombie is not alive, so stop() returned with the exit uncollected and unrecorded. The collect
    here waits for that death, as the load made it happen."""
    record = processes.launch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "p.log")
    collect = processes._collect

    def then_it_dies(rec: dict) -> None:
        collect(rec)
        if "exit" not in rec and rec.get("signalled"):
            eventually(lambda: processes.start_ticks(rec["pid"]) is None, "the child a zombie", timeout=30)
    kill = os.kill

    def signalled(pid: int, sig: int) -> None:
        record["signalled"] = True
        kill(pid, sig)
    monkeypatch.setattr(processes, "_collect", then_it_dies)
    monkeypatch.setattr(processes.os, "kill", signalled)
    processes.stop(record, 5.0)
    assert record.get("exit") == -signal.SIGTERM and processes.reap(record["pid"]) is None


@pytest.fixture
def http_server():
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_probes_and_health_checks_do_not_go_through_a_proxy(tmp_path, monkeypatch, http_server):
    with socket.socket() as s:  # a proxy that is not there: reaching it fails at once
        s.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(var, proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert Probe(f"http://127.0.0.1:{http_server}/ready", 2.0, 3).check()
    checks = cluster.health_checks(cluster.Cluster(tmp_path), {"ports": {"etcd": http_server, "kwok": http_server}})
    assert checks["etcd"]() and checks["kwok"]()


def test_check_free_reads_routes_of_every_type(tmp_path, monkeypatch):
    """`ip route` lines may start with a route type or a nexthop, not a destination."""
    routes = [{"dst": "default", "nexthops": [{"gateway": "192.168.1.1", "dev": "eth0"}]},
              {"type": "blackhole", "dst": "10.244.1.0/24", "flags": []},
              {"dst": "172.17.0.1", "dev": "eth0"}]
    fake = FakeIp(routes=routes)
    text = ("default proto static metric 100\n\tnexthop via 192.168.1.1 dev eth0 weight 1\n"
            "blackhole 10.244.1.0/24 proto bird\n172.17.0.1 dev eth0\n")
    monkeypatch.setattr(network, "ip", lambda *a, check=True: (
        subprocess.CompletedProcess(["ip", *a], 0, text, "") if a == ("-4", "route", "show") else fake(*a)))
    PodNetwork("kiln0", SUBNET, tmp_path).check_free()
    with pytest.raises(RuntimeError, match="overlaps the host route to 10.244.1.0/24"):
        PodNetwork("kiln0", ipaddress.IPv4Network("10.244.0.0/16"), tmp_path).check_free()


@pytest.mark.parametrize("bridge, subnet, problem", [("kiln0", "8.8.8.0/24", "private"),
                                                     ("a-very-long-bridge", "10.213.0.0/24", "--bridge")])
def test_up_refuses_a_bad_bridge_or_subnet_from_any_caller(tmp_path, monkeypatch, bridge, subnet, problem):
    """`make up` takes them from $KILN_LOCAL_BRIDGE/$KILN_LOCAL_SUBNET, without the CLI's check."""
    def reached(**_):
        raise AssertionError("up went on to build and start")
    monkeypatch.setattr(build, "ensure_built", reached)
    with pytest.raises(RuntimeError, match=problem):
        cluster.up(tmp_path / "cl", bridge, subnet)
    assert not (tmp_path / "cl").exists()


def test_a_failed_bridge_add_leaves_the_bridge_alone(tmp_path, monkeypatch):
    """A bridge of the name appears between check_free and the add (another cluster's `up`):
    cleaning up the failed `up` must not delete that cluster's bridge."""
    fake = FakeIp()
    monkeypatch.setattr(network, "ip", fake)
    monkeypatch.setattr(build, "ensure_built", lambda **_: {})
    check_free = PodNetwork.check_free

    def then_another_cluster_makes_it(self):
        check_free(self)
        fake.links.add(self.bridge)
    monkeypatch.setattr(PodNetwork, "check_free", then_another_cluster_makes_it)
    with pytest.raises(RuntimeError, match="File exists"):
        cluster.up(tmp_path / "cl", "kiln0", str(SUBNET))
    assert "kiln0" in fake.links
    assert not [c for c in fake.calls if c[:2] == ("link", "del")]


def test_a_half_made_bridge_is_removed(tmp_path, monkeypatch):
    fake = FakeIp()

    def addr_fails(*args, check=True):
        if args[:2] == ("addr", "add"):
            raise RuntimeError("ip addr add: RTNETLINK answers: Permission denied")
        return fake(*args, check=check)
    monkeypatch.setattr(network, "ip", addr_fails)
    with pytest.raises(RuntimeError, match="Permission denied"):
        PodNetwork("kiln0", SUBNET, tmp_path).create_bridge()
    assert ("link", "del", "kiln0") in fake.calls and not fake.links


def test_a_base_image_whose_tar_failed_is_not_kept(tmp_path, monkeypatch):
    """podman import tags what it read before tar's exit status is known: a cut-short root
    filesystem labelled as the recipe's would be taken for a good base from then on."""
    fakes, imported = tmp_path / "bin", tmp_path / "imported"
    fakes.mkdir()
    scripts = {
        "debootstrap": 'mkdir -p "$3/etc/dpkg/dpkg.cfg.d" "$3/etc/apt/apt.conf.d"',
        "tar": 'echo "tar: ./usr/lib/libc.so.6: Cannot open: Input/output error" >&2; exit 2',
        "podman": f'case "$1 $2" in\n'
                  f'  "image exists") [ -f {imported} ] ;;\n'
                  f'  "image inspect") echo {images.BASE_RECIPE} ;;\n'
                  f'  "import "*) cat >/dev/null; touch {imported} ;;\n'
                  f'  "rmi "*) rm -f {imported} ;;\n'
                  f'esac',
    }
    for name, body in scripts.items():
        (fakes / name).write_text(f"#!/bin/sh\n{body}\n")
        (fakes / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakes}:/usr/bin:/bin")
    with pytest.raises(RuntimeError, match="tar of the debootstrap root failed"):
        images.ensure_base()
    assert not images.exists(images.BASE)


def test_make_down_can_force(tmp_path, monkeypatch, sleeper, capsys):
    directory = tmp_path / "cl"
    monkeypatch.setenv("KILN_LOCAL_DIR", str(directory))
    write_state(directory, owner="tests")
    register_user(directory, sleeper.pid)
    assert demo.main(["down"]) == 1
    assert "make down FORCE=1" in capsys.readouterr().err
    assert (directory / "state.json").exists()
    assert demo.main(["down", "--force"]) == 0
    assert not (directory / "state.json").exists()


@pytest.mark.parametrize("raised,code,said", [(KeyboardInterrupt(), 130, "make up: interrupted"),
                                              (FileNotFoundError(2, "No such file or directory", "ip"), 1,
                                               "make up: [Errno 2] No such file or directory: 'ip'")])
def test_make_up_fails_in_one_line(monkeypatch, capsys, raised, code, said):
    """Ctrl-C in the long wait, or a missing tool, was a traceback."""
    def up(*_, **__):
        raise raised
    monkeypatch.setattr(cluster, "up", up)
    assert demo.main(["up"]) == code
    assert capsys.readouterr().err.strip() == said


@pytest.mark.parametrize("force,forced", [("1", True), ("yes", True), ("0", False), ("no", False), ("", False)])
def test_make_down_forces_only_when_asked(force, forced):
    """FORCE=0 forced the teardown under running test sessions (make's $(if) takes any non-empty word)."""
    plan = subprocess.run(["make", "-n", "-C", str(Path(__file__).parents[1]), "down", f"FORCE={force}"],
                          capture_output=True, text=True, check=True).stdout
    assert ("--force" in plan) == forced, plan


def test_a_go_build_from_other_inputs_is_not_current(tmp_path, monkeypatch):
    """The cache was keyed by version alone: a go.mod bump (etcd 3.7.0 -> 3.7.1) was never built."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "GOBUILD", tmp_path / "gobuild")
    (tmp_path / "gobuild" / "tool").mkdir(parents=True)
    (tmp_path / "gobuild" / "tool" / "go.mod").write_text("require example.com/x v1.0.0\n")
    target = build.Target("tool", "v1", ("example.com/x/cmd/tool",))
    assert not build.is_current(target)
    build.bin_dir(target).mkdir(parents=True)
    assert build.is_current(target)  # built before digests were kept: taken as is, and recorded
    (tmp_path / "gobuild" / "tool" / "go.mod").write_text("require example.com/x v1.0.1\n")
    assert not build.is_current(target)


def test_stop_takes_a_process_that_exits_as_it_is_signalled(monkeypatch, sleeper):
    """Gone between alive() and the signal: ProcessLookupError stopped `kiln local down` half-way."""
    record = {"pid": sleeper.pid, "start": processes.start_ticks(sleeper.pid)}

    sent = []

    def gone(pid, sig):
        sent.append((pid, sig))
        raise ProcessLookupError(3, "No such process")
    monkeypatch.setattr(processes.os, "kill", gone)
    processes.stop(record, grace=0.1)  # returns, rather than raise or wait out the grace to SIGKILL
    monkeypatch.undo()  # before the sleeper's own kill
    assert sent == [(sleeper.pid, signal.SIGTERM)]


def test_a_cluster_started_without_its_runtime_is_removed(tmp_path, monkeypatch):
    """ensure_runtime failed after this `up` started the cluster: it was neither removed nor marked
    the tests', so no one would ever take it down."""
    monkeypatch.setattr(build, "ensure_built", lambda **_: {})
    monkeypatch.setattr(network, "ip", FakeIp())

    def start(c, bridge, subnet, dir_created, log, timeout):
        c.save({"bridge": bridge, "subnet": str(subnet), "ports": {"apiserver": 1}, "processes": {},
                "dir_created": dir_created})

    def no_runtime(c, log):
        raise RuntimeError("runtime: process exited")
    monkeypatch.setattr(cluster, "start", start)
    monkeypatch.setattr(cluster, "ensure_runtime", no_runtime)
    with pytest.raises(RuntimeError, match="runtime: process exited"):
        cluster.up(tmp_path / "cl", "kiln0", str(SUBNET), user=os.getpid())
    assert not (tmp_path / "cl").exists()


def test_a_garbled_users_entry_does_not_stop_down(tmp_path, sleeper):
    """A session killed between creating its users/<pid> file and writing it left an empty one:
    `kiln local down` and the fixtures' leave() failed on it with a ValueError traceback."""
    directory = tmp_path / "cl"
    write_state(directory, owner="tests")
    (directory / "users").mkdir()
    (directory / "users" / str(sleeper.pid)).write_text("")
    (directory / "users" / f"{sleeper.pid}.tmp").write_text("12")
    assert cluster.down(directory) is True
    write_state(directory)
    c = cluster.Cluster(directory)
    c.add_user(sleeper.pid)
    assert c.users() == [sleeper.pid]
    assert [p.name for p in (directory / "users").iterdir()] == [str(sleeper.pid)]  # no temp file left


def test_a_second_runtime_for_a_cluster_is_refused(tmp_path, monkeypatch, capsys):
    """A second runtime took the first one's pod namespaces for stale ones and deleted them."""
    from kiln.cli import main
    directory = tmp_path / "cl"
    write_state(directory)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # run() must not take this process's signals

    class Runtime:
        def __init__(self, c):
            self.stopping = threading.Event()

        def serve(self):  # the runtime holds the lock itself (`up` only launches it)
            with pytest.raises(RuntimeError, match=f"already runs for this cluster \\(pid {os.getpid()}\\)"):
                runtime.hold_lock(cluster.Cluster(directory))
    monkeypatch.setattr(runtime, "Runtime", Runtime)
    assert runtime.run(directory) == 0
    with runtime.hold_lock(cluster.Cluster(directory)):  # released when the runtime ended
        monkeypatch.setattr(runtime, "Runtime", lambda c: pytest.fail("a second runtime started"))
        assert main(["local", "runtime", "--dir", str(directory)]) == 1
    assert capsys.readouterr().err.strip() == (f"kiln local runtime: a pod runtime already runs for this cluster "
                                               f"(pid {os.getpid()})")


def test_the_revision_without_git_is_unknown(tmp_path, monkeypatch):
    """A machine without git failed `make images` with FileNotFoundError."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert images.revision() == "unknown"


def test_containers_conf_is_replaced_not_rewritten():
    """podman calls of other processes read it: rewritten in place, one could read it half-written."""
    conf = build.cache_root() / "containers.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("# an older recipe\n")
    with conf.open() as reader:  # a podman that opened it before the update
        assert images.podman_env()["CONTAINERS_CONF"] == str(conf)
        assert reader.read() == "# an older recipe\n"
    assert conf.read_text() == images.CONTAINERS_CONF
    assert [p.name for p in conf.parent.iterdir()] == ["containers.conf"]


@pytest.mark.parametrize("argv, refused", [(["down", "--bridge", "x"], "--bridge"), (["up", "--rebuild"], "--rebuild"),
                                           (["build", "--dir", "d"], "--dir"),
                                           (["status", "--jobs", "8", "--force"], "--force, --jobs")])
def test_an_option_the_action_ignores_is_refused(monkeypatch, capsys, argv, refused):
    """One parser serves every action: `down --bridge X` ignored --bridge without a word."""
    from kiln.cli import main
    for name in ("up", "down"):
        monkeypatch.setattr(cluster, name, lambda *_, **__: pytest.fail("the action ran"))
    monkeypatch.setattr(build, "ensure_built", lambda **_: pytest.fail("the action ran"))
    assert main(["local", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"kiln local {argv[0]} takes no {refused}"


def test_up_builds_with_the_jobs_asked(tmp_path, monkeypatch):
    from kiln.cli import main
    asked = []

    def ensure_built(jobs=2, log=None):
        asked.append(jobs)
        raise RuntimeError("stop here")
    monkeypatch.setattr(build, "ensure_built", ensure_built)
    assert main(["local", "up", "--dir", str(tmp_path / "cl"), "--jobs", "8"]) == 1
    assert asked == [8]


def test_service_account_tokens_outlive_a_day(tmp_path, monkeypatch):
    """Minted once, never refreshed: a day's tokens left `make up`'s operator and pods on 401s."""
    asked = []

    def kubeconfig(admin, namespace, account, path, expiration_s, **_):
        asked.append(expiration_s)
        return path
    monkeypatch.setattr(demo, "service_account_kubeconfig", kubeconfig)
    monkeypatch.setattr(demo, "api_client", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(runtime, "service_account_kubeconfig", kubeconfig)
    demo.operator_kubeconfig(cluster.Cluster(tmp_path))
    rt = object.__new__(runtime.Runtime)
    rt.admin, rt.workdir, rt.relay = None, tmp_path, SimpleNamespace(address=("10.213.0.1", 1))
    rt.service_account_kubeconfig(pod("p", "aaaaaaaa-1", "10.213.0.70"))
    assert len(asked) == 2 and all(s >= 365 * 24 * 3600 for s in asked)
    # granted whole: no maximum on the apiserver that would shorten them
    ports = dict.fromkeys(("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok"), 1)
    argv = cluster.commands(cluster.Cluster(tmp_path), {"bridge": "kiln0", "subnet": str(SUBNET), "ports": ports})
    assert not [a for a in argv["kube-apiserver"] if a.startswith("--service-account-max-token-expiration")]


def test_a_failed_venv_is_not_left_half_made(tmp_path):
    """Without ensurepip (python3-venv), `python3 -m venv` fails after making bin/python, and the
    next `make` took that venv without pip for a made one."""
    venv = tmp_path / "venv"
    plan = subprocess.run(["make", "-n", "-C", str(Path(__file__).parents[1]), f"VENV={venv}", f"{venv}/bin/python"],
                          capture_output=True, text=True, check=True).stdout
    recipe = next(line for line in plan.splitlines() if " -m venv " in line)
    fakes = tmp_path / "bin"
    fakes.mkdir()
    (fakes / "python3").write_text('#!/bin/sh\nmkdir -p "$3/bin" && touch "$3/bin/python"\nexit 1\n')
    (fakes / "python3").chmod(0o755)
    assert subprocess.run(["sh", "-c", recipe], env={"PATH": f"{fakes}:/usr/bin:/bin"}).returncode == 1
    assert not venv.exists()


def test_keys_and_kubeconfigs_are_never_readable_by_others(tmp_path):
    """openssl wrote each key with the umask's mode, and kubeconfigs (client keys inlined) were
    written and then chmod-ed: readable by every user in between, or for good after a crash."""
    import stat

    from kiln.local import pki
    old = os.umask(0o022)
    try:
        pki.make_pki(tmp_path / "pki", ["127.0.0.1"])
        config = tmp_path / "admin.kubeconfig"
        config.write_text("stale")
        config.chmod(0o644)
        pki.write_kubeconfig(config, tmp_path / "pki", "admin", "https://127.0.0.1:6443")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "pki").stat().st_mode) == 0o700
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and "client-key-data" in config.read_text()
