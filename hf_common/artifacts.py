"""The Hub-format artifacts shipped with the package, and the check that a path-like artifact argument exists.

`hub_configs/` at the root of the checkout holds each shipped artifact as a Hub repo folder (the source of truth);
the wheel carries the same folders as package data of `hf_common.hub_configs` (see `pyproject.toml`), so they are
found after a plain `pip install` from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# installed wheel first, then the checkout this module sits in (editable install or PYTHONPATH)
SHIPPED_FOLDERS = (_HERE / "hub_configs", _HERE.parent / "hub_configs")
HUB_CONFIGS = "hub_configs"  # how the README and the scripts name the checkout's folder of shipped artifacts
SHIPPED_CALIBRATION = "gaac-SmolLM2-135M-Instruct"  # GAAC calibration of SmolLM2-135M-Instruct
# the same made for format version 2 (even windows): what the caches store as version 2 on Hopper
SHIPPED_CALIBRATION_V2 = "gaac-SmolLM2-135M-Instruct-v2"
SHIPPED_DGAP = "dgap-SmolLM2-135M-Instruct"  # DGAP artifact of SmolLM2-135M-Instruct, every precision


def shipped_artifact(name: str) -> Path:
    """The folder of the shipped artifact `name` (e.g. `gaac-SmolLM2-135M-Instruct`)."""
    for folder in SHIPPED_FOLDERS:
        if (folder / name / "config.json").is_file():
            return folder / name
    raise FileNotFoundError(f"no shipped artifact {name!r} in " + " or ".join(str(f) for f in SHIPPED_FOLDERS)
                            + " (reinstall gaac-hf, or pass a Hub repo id)")


def is_path_like(name_or_path) -> bool:
    """True when `name_or_path` can only mean a local folder, not a Hub repo id (`org/name` or `name`)."""
    if isinstance(name_or_path, os.PathLike):
        return True
    s = str(name_or_path)
    if s.startswith(("/", "./", "../", "~", ".\\", "..\\")) or s in (".", "..") or "\\" in s or s.endswith("/"):
        return True
    if s.count("/") > 1:  # a Hub repo id has at most one "/"
        return True
    # `org/name` is a repo id unless org is the checkout's artifact folder (an org of that name is not worth the
    # tens of seconds a typo of this README path would cost)
    return s.split("/")[0] == HUB_CONFIGS and "/" in s


def check_artifact_path(name_or_path, what: str):
    """`name_or_path` as a string; raise `FileNotFoundError` at once (instead of asking the Hub, which retries for
    tens of seconds offline) when it is path-like and no such folder exists."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        return name_or_path  # not a name: let the loader report it
    s = os.fspath(name_or_path)
    expanded = os.path.expanduser(s)
    if os.path.isdir(expanded):
        return expanded
    if is_path_like(name_or_path):
        where = os.path.abspath(expanded)
        hint = ""
        if _tail(s) and any((f / _tail(s) / "config.json").is_file() for f in SHIPPED_FOLDERS):
            hint = f"; the shipped copy of {_tail(s)!r} is at {shipped_artifact(_tail(s))}"
        raise FileNotFoundError(f"{what} folder {s!r} does not exist (looked for {where}){hint}")
    return s


def _tail(s: str) -> str:
    return s.rstrip("/\\").replace("\\", "/").split("/")[-1]
