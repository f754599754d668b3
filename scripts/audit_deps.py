"""Audit the project's installed dependencies for known vulnerabilities with pip-audit; print the result.

Usage: .venv/bin/python scripts/audit_deps.py [--pip-audit PATH] [--ignore-vuln ID ...]

Every package in this interpreter's environment (the project itself excepted) is checked, first against OSV, then
against PyPI's advisory data. Exit status 1 when a known vulnerability is found (and not ignored); 0 when none is,
and also when neither source can be reached from this machine, which is then printed plainly as NOT AUDITED
rather than passed off as clean.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SERVICES = ("osv", "pypi")


def frozen_requirements() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line and not line.startswith(("-e", "#"))]


def run_service(pip_audit: str, requirements: Path, service: str, ignored: list[str]) -> dict | None:
    """pip-audit's JSON report from one service, or None when the service could not be reached."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [pip_audit, "-r", str(requirements), "--no-deps", "--disable-pip", "-s", service]
        cmd += ["--progress-spinner", "off", "-f", "json", "-o", str(report)]
        for vuln in ignored:
            cmd += ["--ignore-vuln", vuln]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if not report.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"  {service}: unreachable ({last.split(':')[0]})")
            return None
        data = json.loads(report.read_text())
    deps = data.get("dependencies", [])
    audited = [d for d in deps if "skip_reason" not in d]
    if not audited:
        print(f"  {service}: answered for none of the {len(deps)} packages (it does not know them)")
        return None
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pip-audit", default=shutil.which("pip-audit") or "pip-audit", help="pip-audit executable"
    )
    ap.add_argument(
        "--ignore-vuln", action="append", default=[], metavar="ID", help="a known, accepted advisory"
    )
    args = ap.parse_args()

    reqs = frozen_requirements()
    print(f"dependency audit: {len(reqs)} installed packages ({sys.executable})")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(reqs) + "\n")
    requirements = Path(f.name)
    try:
        for service in SERVICES:
            data = run_service(args.pip_audit, requirements, service, args.ignore_vuln)
            if data is not None:
                break
        else:
            print("dependency audit: NOT AUDITED - no vulnerability source reachable from this machine")
            return
    finally:
        requirements.unlink()
    deps = data["dependencies"]
    skipped = [d["name"] for d in deps if "skip_reason" in d]
    found = [(d["name"], d["version"], v) for d in deps for v in d.get("vulns", [])]
    print(f"  source: {service}; audited {len(deps) - len(skipped)}, not known to it {len(skipped)}")
    for name, version, vuln in found:
        fixes = ", ".join(vuln.get("fix_versions", [])) or "none yet"
        print(f"  VULNERABLE {name} {version}: {vuln['id']} (fixed in: {fixes})")
    print(
        f"dependency audit: {len(found)} known vulnerabilities"
        + (f"; ignored: {args.ignore_vuln}" if args.ignore_vuln else "")
    )
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
