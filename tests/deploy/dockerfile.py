"""The Dockerfile as the deploy tests read it: its instructions (continuation lines joined, comments dropped), its
stages, the environment a stage's ENV lines give a process, and the directories its `install -d` lines make."""

from __future__ import annotations

import shlex
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what the runtime gives a process
DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


STEPS = instructions(DOCKERFILE.read_text())
_FROMS = [i for i, (kw, _) in enumerate(STEPS) if kw == "FROM"]
BUILD = STEPS[_FROMS[0]:_FROMS[1]]  # the build stage
FINAL = STEPS[_FROMS[-1]:]  # the runtime stage


def commands(run: str) -> list[list[str]]:
    """The words of each `&&`-joined command of a RUN line."""
    return [shlex.split(part) for part in run.split("&&")]


def image_env(stage, path: str = DEFAULT_PATH) -> dict[str, str]:
    """The environment the ENV lines of `stage` give a process, `$PATH` expanded from `path`."""
    env: dict[str, str] = {"PATH": path}
    for keyword, rest in stage:
        if keyword == "ENV":
            for token in shlex.split(rest):
                name, _, value = token.partition("=")
                env[name] = value.replace("$PATH", env["PATH"])
    return env


def install_dirs(stage) -> list[tuple[str, int, int, int]]:
    """(path, uid, gid, mode) of every directory an `install -d` in a RUN of `stage` makes."""
    dirs = []
    for keyword, rest in stage:
        if keyword != "RUN":
            continue
        for words in commands(rest):
            if words[:2] != ["install", "-d"]:
                continue
            opts, paths, args = {"-o": "0", "-g": "0", "-m": "0755"}, [], iter(words[2:])
            for word in args:
                if word in opts:
                    opts[word] = next(args)
                else:
                    paths.append(word)
            dirs += [(p, int(opts["-o"]), int(opts["-g"]), int(opts["-m"], 8)) for p in paths]
    return dirs
