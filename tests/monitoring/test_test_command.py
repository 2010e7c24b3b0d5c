"""The README's test command (scripts/test.sh) and the real-Prometheus tests: as root with
apt-get it installs Debian's ``prometheus`` when missing; otherwise its first line says which
tests skip and the command that fixes it.

The script runs for real in a copy of the repository's ``scripts/`` with the project's own
steps after the check replaced (``scripts/setup.sh`` a no-op, ``.venv/bin/python`` a script
that prints its arguments), on a PATH of its own: a folder holding the few programs it runs,
and where the test says so an ``apt-get`` that records its arguments and puts
``prometheus`` and ``promtool`` on that PATH, and an ``id`` that says which user runs it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPING = ("tests/monitoring/test_rules.py", "test_prometheus.py", "test_alerts_e2e.py")


def _tree(tmp_path: Path, *, uid: int, apt: bool) -> tuple[Path, Path]:
    """A copy of scripts/test.sh with stubbed project steps, and the PATH folder it runs on;
    returns (the script, the apt-get log)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    bash = shutil.which("bash")
    (venv / "python").write_text(f"#!{bash}\necho \"pytest ran: $*\"\n")
    (venv / "python").chmod(0o755)
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text(f"#!{bash}\necho {uid}\n")
    if apt:
        (bin_dir / "apt-get").write_text(
            f"#!{bash}\necho \"$*\" >> {log}\n"
            "for p in \"$@\"; do if [ \"$p\" = prometheus ]; then\n"
            f"  for t in prometheus promtool; do printf '#!{bash}\\n' > {bin_dir}/$t;"
            f" {shutil.which('chmod')} +x {bin_dir}/$t; done\n"
            "fi; done\n")
    for stub in bin_dir.iterdir():
        if not stub.is_symlink():
            stub.chmod(0o755)
    return tmp_path / "scripts" / "test.sh", log


def _run(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(script), "-x"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path)})


def test_without_root_the_first_line_says_which_tests_skip_and_the_fix(tmp_path):
    script, log = _tree(tmp_path, uid=1000, apt=True)
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert "prometheus is not installed" in first and "sudo apt-get install prometheus" in first
    assert all(name in first for name in SKIPPING), first
    assert not log.exists(), "apt-get ran without root"
    assert "pytest ran: -m pytest -n 3" in proc.stdout and proc.stdout.rstrip().endswith("-x")


def test_as_root_with_apt_it_installs_prometheus_and_says_nothing(tmp_path):
    script, log = _tree(tmp_path, uid=0, apt=True)
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "install -y -qq prometheus" in log.read_text().splitlines()[0]
    assert "not installed" not in proc.stderr, proc.stderr
    assert (tmp_path / "bin" / "promtool").exists()
    assert "pytest ran:" in proc.stdout


@pytest.mark.parametrize("uid", [0, 1000])
def test_without_apt_get_it_says_so_as_root_too(tmp_path, uid):
    script, _ = _tree(tmp_path, uid=uid, apt=False)
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "sudo apt-get install prometheus" in proc.stderr.splitlines()[0], proc.stderr
