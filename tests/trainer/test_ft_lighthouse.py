"""The lighthouse listens only where ``fault_tolerance.lighthouse_bind`` says (default
loopback), and ``ft-local``'s only on loopback: real ``python -m trainer lighthouse``
processes, probed on two loopback addresses (127.0.0.1 and 127.0.0.2, both this host, one
listened on and one not)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e._jobs import ROOT, TINY, base_env, free_port
from trainer.config import ConfigError, load_config
from trainer.ft.lighthouse import probe

pytestmark = pytest.mark.ft
if not os.environ.get("CI"):
    pytest.importorskip("torchft")  # the 'ft' extra; CI installs it, so there it must run
from trainer.ft.local import LocalReplicaGroups  # noqa: E402

LISTENED, OTHER = "127.0.0.1", "127.0.0.2"


def _wait_up(url: str, proc: subprocess.Popen, log: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe(url, timeout=1.0)[0]:
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"no lighthouse answers at {url} (exit {proc.poll()})\n{log}"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=20)


@pytest.mark.parametrize("url_host, bind_args, listened, other, warns", [
    # The documented multi-host URL without a bind address: loopback only, and a warning
    # that the groups named by the URL will not reach it.
    ("lighthouse-host", [], LISTENED, OTHER, True),
    # One named address: that one only.
    (OTHER, [f"--fault_tolerance.lighthouse_bind={OTHER}"], OTHER, LISTENED, False),
])
def test_the_lighthouse_listens_on_its_bind_address_only(tmp_path, url_host, bind_args,
                                                         listened, other, warns):
    port = free_port()
    log = tmp_path / "lighthouse.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "lighthouse", "--config", str(TINY),
             f"--fault_tolerance.lighthouse=http://{url_host}:{port}", *bind_args],
            cwd=ROOT, env=base_env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_up(f"http://{listened}:{port}", proc, log.read_text())
        up, _, why = probe(f"http://{other}:{port}", timeout=2.0)
        assert not up, f"the lighthouse also answers on {other}:{port}"
        assert "refused" in why.lower(), why
    finally:
        code = _stop(proc)
    text = log.read_text()
    assert code == 0, text
    assert f"lighthouse listening on {listened}:{port}" in text, text
    assert ("--fault_tolerance.lighthouse_bind" in text) == warns, text


def test_ft_local_lighthouse_listens_on_loopback_only(tmp_path):
    """Whatever the arguments say: ft-local's groups reach it at 127.0.0.1."""
    port = free_port()
    job = LocalReplicaGroups(["--config", str(TINY), "--fault_tolerance.lighthouse_bind=0.0.0.0"],
                             groups=1, out=tmp_path, port=port, env=base_env())
    try:
        job.start_lighthouse()
        assert probe(f"http://{LISTENED}:{port}", timeout=2.0)[0]
        up, _, why = probe(f"http://{OTHER}:{port}", timeout=2.0)
        assert not up, f"ft-local's lighthouse answers on {OTHER}:{port}"
        assert "refused" in why.lower(), why
    finally:
        job.stop()


@pytest.mark.parametrize("value", ["127.0.0.1:29510", "[::1]", "http://10.0.0.5", "", "a b"])
def test_a_bad_bind_address_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), [f"--fault_tolerance.lighthouse_bind={value}"])
    assert err.value.key == "fault_tolerance.lighthouse_bind", str(err.value)
    assert "e.g. 127.0.0.1" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value, listen", [("127.0.0.1", "127.0.0.1:29510"),
                                           ("::1", "[::1]:29510"), ("0.0.0.0", "0.0.0.0:29510"),
                                           ("lighthouse-host", "lighthouse-host:29510")])
def test_the_listen_address_is_the_bind_address_at_the_url_port(value, listen):
    ft = load_config(str(TINY), [f"--fault_tolerance.lighthouse_bind={value}"]).fault_tolerance
    assert ft.lighthouse_listen == listen
