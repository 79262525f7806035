"""Certificates and kubeconfigs for the local control plane, made with the openssl CLI.

One cluster CA signs the apiserver's serving certificate and every client certificate;
a second CA signs the front-proxy client (the aggregation layer insists they differ).
The service-account key pair signs and verifies ServiceAccount tokens.
"""
from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import yaml

DAYS = "3650"
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

# name -> (subject, extended key usage); all signed by the cluster CA
CLIENTS = {
    "admin": ("/O=system:masters/CN=kiln-admin", "clientAuth"),
    "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth"),
    "scheduler": ("/CN=system:kube-scheduler", "clientAuth"),
}


def openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def make_ca(pki: Path, name: str, cn: str) -> None:
    openssl("req", "-x509", *KEY, "-keyout", str(pki / f"{name}.key"), "-out", str(pki / f"{name}.crt"),
            "-days", DAYS, "-subj", f"/CN={cn}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")


def sign(pki: Path, name: str, ca: str, subject: str, usage: str, sans: list[str] | None = None) -> None:
    ext = ["-addext", "basicConstraints=critical,CA:FALSE",
           "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
           "-addext", f"extendedKeyUsage={usage}"]
    if sans:
        ext += ["-addext", "subjectAltName=" + ",".join(sans)]
    openssl("req", "-x509", *KEY, "-keyout", str(pki / f"{name}.key"), "-out", str(pki / f"{name}.crt"),
            "-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key"),
            "-days", DAYS, "-subj", subject, *ext)


def make_pki(pki: Path, apiserver_ips: list[str]) -> None:
    """Create every key and certificate the control plane needs under `pki`."""
    # Private to this user from the start: openssl writes each key with the umask's mode (0644
    # often) before the chmod below.
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    pki.chmod(0o700)
    make_ca(pki, "ca", "kiln-local-ca")
    make_ca(pki, "front-proxy-ca", "kiln-local-front-proxy-ca")
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"]
    sans = [f"DNS:{n}" for n in names] + [f"IP:{ip}" for ip in apiserver_ips]
    sign(pki, "apiserver", "ca", "/CN=kube-apiserver", "serverAuth", sans)
    for name, (subject, usage) in CLIENTS.items():
        sign(pki, name, "ca", subject, usage)
    sign(pki, "front-proxy-client", "front-proxy-ca", "/CN=front-proxy-client", "clientAuth")
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-out", str(pki / "sa.key"))
    openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, pki: Path, client: str, server: str) -> None:
    """A self-contained kubeconfig (certificates inlined) for one client identity."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kiln-local",
        "clusters": [{"name": "kiln-local", "cluster": {
            "server": server, "certificate-authority-data": b64(pki / "ca.crt")}}],
        "users": [{"name": client, "user": {
            "client-certificate-data": b64(pki / f"{client}.crt"),
            "client-key-data": b64(pki / f"{client}.key")}}],
        "contexts": [{"name": "kiln-local", "context": {"cluster": "kiln-local", "user": client}}],
    }
    write_private(path, yaml.safe_dump(config, sort_keys=False))


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, from its first byte (a chmod after the write left
    a moment, or with a crash for good, where a key in it was readable by all)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file already there keeps its mode through open: changed before a byte
    with os.fdopen(fd, "w") as f:
        f.write(text)
