"""The client needs Python 3.11 or newer (``typing.Self``, ``datetime.UTC``...): its distribution
says so to pip, and its README says so beside the install line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "python"


def test_the_distribution_requires_python_3_11() -> None:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"


def test_the_readme_says_so_near_the_install_line() -> None:
    readme = (CLIENT / "README.md").read_text()
    install = readme.index("pip install ./clients/python")
    before = readme[max(0, install - 400) : install + 200]
    assert re.search(r"Python (3\.11 or newer|≥ 3\.11)", before)
