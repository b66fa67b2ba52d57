"""Shared fixtures: repository paths, a helper that runs the CLI in-process, and a guard that
keeps every test in this process off the network (only loopback and unix sockets)."""

from __future__ import annotations

import errno
import ipaddress
import os
import pathlib
import socket

import pytest

# `make test` runs the files on two workers (pytest-xdist): each worker, and the runs it starts,
# keeps to one intra-op thread, so two workers share two cores instead of four spinning threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]

# The files with the longest runs go first, so the two workers end together (each file runs on
# one worker, with its module fixtures built once).
FIRST = ("test_ray.py", "test_torchrun.py", "test_fsdp.py", "test_off_policy.py",
         "test_export.py", "test_resume_algorithms.py", "test_resume_grpo.py",
         "test_qwen3_vl_runs.py", "test_reference_examples.py", "test_train_e2e.py",
         "test_accumulation.py", "test_pinned_steps.py")
RECIPES = sorted((REPO / "recipes").glob("*.toml")) + sorted((REPO / "examples").glob("*.toml"))

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def pytest_collection_modifyitems(config, items):
    """The longest files first; tests marked ``extended`` run only when selected (-m
    extended); GPU-marked tests need a CUDA device: elsewhere they are skipped, saying so."""
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: file order kept
    if "extended" not in (config.getoption("markexpr") or ""):
        later = pytest.mark.skip(reason="left out of make test for its time (run with -m extended)")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(later)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (run benchmarks/gpu_check.sh on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _is_local(host: object) -> bool:
    if not isinstance(host, str):
        host = host.decode() if isinstance(host, bytes) else str(host)
    if host in _LOCAL_NAMES or host == "":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """A TCP connection or a name lookup that would leave the machine raises OSError at once.

    UDP ``connect`` sends nothing and is allowed (libraries use it to find their own address);
    subprocesses are not covered: the helpers that start them set the hub libraries offline.
    """
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def refuse(address: object) -> OSError:
        return OSError(errno.ENETUNREACH, f"tests may not reach the network (tried {address!r})")

    def leaves(sock: socket.socket, address: object) -> bool:
        return (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                and isinstance(address, tuple) and not _is_local(address[0]))

    def connect(self, address):
        if leaves(self, address):
            raise refuse(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        if leaves(self, address):
            return errno.ENETUNREACH
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not _is_local(host):
            raise socket.gaierror(socket.EAI_NONAME, f"tests may not look up {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run posttrain-run in this process from the repository root; returns (rc, stdout, stderr)."""
    from runner.cli import main

    def _run(*argv: str) -> tuple[int, str, str]:
        monkeypatch.chdir(REPO)
        rc = main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return _run
