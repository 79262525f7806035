"""Operator hand-over on the local cluster: two `kiln operator --leader-elect` replicas (the
manifests' RBAC, a ServiceAccount token each), the leader stopped again and again; how long
until the other holds the Lease, and until a spec change made right after the stop is
reconciled (the engine Deployment of the new revision exists).

Two ways to stop: SIGKILL (a crash: the Lease must expire, design bound 15 s + a 2 s retry) and
SIGTERM (a clean stop releases the Lease: one retry). Engine pods are kwok's (no engine runs):
this measures the operator only. Polling every 50 ms.

    .venv/bin/python bench/operator_handover.py --rounds 5   # bench/results/operator-handover-<date>-<cpu kind>.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from cpu_common import machine, write_result
from kiln.local import cluster, demo
from kiln.local.testing import OperatorProcess, api_client, eventually, kubectl, service_account_kubeconfig
from kiln.operator import leader

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.05


def holder(kubeconfig: Path, lease: str) -> str:
    return kubectl(kubeconfig, "get", "lease", lease, "-n", "kiln-system", "-o", "jsonpath={.spec.holderIdentity}",
                   check=False).stdout


def revisions(kubeconfig: Path, ns: str) -> set[str]:
    out = kubectl(kubeconfig, "get", "deployments", "-n", ns, "-l", "kiln.dev/component=engine", "-o", "name").stdout
    return set(out.split())


def one_round(kubeconfig: Path, procs: list[OperatorProcess], lease: str, ns: str, sig: int, seqs: int) -> dict:
    current = eventually(lambda: holder(kubeconfig, lease), "a leader", timeout=60, interval=POLL_S)
    (chief,) = [p for p in procs if p.proc and current.endswith(f"-{p.proc.pid}")]
    before = revisions(kubeconfig, ns)
    start = time.monotonic()
    chief.proc.send_signal(sig)
    kubectl(kubeconfig, "patch", "isvc/bench", "-n", ns, "--type=merge", "-p",
            json.dumps({"spec": {"engine": {"maxNumSeqs": seqs}}}))
    eventually(lambda: holder(kubeconfig, lease) not in ("", current), "a new leader", timeout=60, interval=POLL_S)
    taken = time.monotonic() - start
    eventually(lambda: revisions(kubeconfig, ns) - before, "the new revision", timeout=60, interval=POLL_S)
    reconciled = time.monotonic() - start
    chief.stop()
    mark = len(chief.text())
    chief.start()  # back as the follower for the next round
    eventually(lambda: "waits for Lease" in chief.text()[mark:], "the restarted follower", timeout=60)
    return {"signal": signal.Signals(sig).name, "lease_taken_s": round(taken, 2), "reconciled_s": round(reconciled, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per signal (default 5)")
    args = parser.parse_args()
    c, _ = cluster.up(cluster.default_dir(), user=os.getpid())
    ns, lease = f"bench-ha-{uuid.uuid4().hex[:6]}", f"bench-{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="kiln-handover-"))
    procs: list[OperatorProcess] = []
    try:
        demo.install(c.kubeconfig)
        kubectl(c.kubeconfig, "create", "namespace", ns)
        with api_client(c.kubeconfig) as admin:
            token = service_account_kubeconfig(admin, "kiln-system", "kiln-operator", work / "kubeconfig")
        flags = ("-n", ns, "--leader-elect", "--lease-name", lease, "--lease-namespace", "kiln-system")
        procs = [OperatorProcess(token, work / f"operator-{i}.log", flags) for i in range(2)]
        for proc in procs:
            proc.start()
        body = yaml.safe_load((REPO / "examples/smollm2.yaml").read_text())
        body["metadata"]["name"], body["spec"]["resources"]["gpus"] = "bench", 0
        kubectl(c.kubeconfig, "apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body))
        eventually(lambda: revisions(c.kubeconfig, ns), "the first revision", timeout=120)
        rounds = [one_round(c.kubeconfig, procs, lease, ns, sig, 40 + i)
                  for i, sig in enumerate([signal.SIGKILL] * args.rounds + [signal.SIGTERM] * args.rounds)]
    finally:
        for proc in procs:
            proc.stop()
        kubectl(c.kubeconfig, "delete", "namespace", ns, "--wait=false", check=False)
        kubectl(c.kubeconfig, "delete", "lease", lease, "-n", "kiln-system", check=False)
        cluster.leave(c, os.getpid())
    summary = {}
    for name in ("SIGKILL", "SIGTERM"):
        mine = [r for r in rounds if r["signal"] == name]
        summary[name] = {key: {"median": statistics.median(r[key] for r in mine), "max": max(r[key] for r in mine)}
                         for key in ("lease_taken_s", "reconciled_s")}
    record = {"benchmark": "operator-handover", "machine": machine(),
              "design": {"lease_s": leader.LEASE_S, "retry_s": leader.RETRY_S,
                         "renew_deadline_s": leader.RENEW_DEADLINE_S},
              "summary": summary, "rounds": rounds}
    print(json.dumps(summary, indent=1))
    print(f"wrote {write_result('operator-handover', record)}")


if __name__ == "__main__":
    main()
