"""CI runs the README's test command verbatim: a dependency added to one and not the other would let CI pass
with tests skipped for a missing package (or a user's run fail where CI's passed)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3\.11 -m venv .*pytest.*$", readme, flags=re.M)
    assert len(commands) == 1, commands  # the Quickstart's one test command
    assert commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()
