"""Static checks of Dockerfile and .dockerignore; tests/image/ builds the image and runs it."""

from __future__ import annotations

import json
import re
import tomllib

from testing.manifests.objects import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-image.sh"
# qemu-utils carries qemu-storage-daemon in Debian 13 (qemu-system-common did in 12).
PACKAGES = {"qemu-utils", "fuse3", "python3", "python3-venv", "e2fsprogs", "xfsprogs", "util-linux", "mount"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends in a continuation"
    return result


def global_args() -> dict[str, str | None]:
    """ARGs before the first FROM: the only ones a FROM line may use."""
    result: dict[str, str | None] = {}
    for keyword, args in instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, eq, default = args.partition("=")
            result[name] = default if eq else None
    return result


def stages() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(image it starts from, stage name or "", its instructions) for each FROM."""
    result: list[tuple[str, str, list[tuple[str, str]]]] = []
    for keyword, args in instructions():
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            result.append((words[0], name, []))
        elif result:
            result[-1][2].append((keyword, args))
    assert result, "no FROM"
    return result


def lineage(stage: int) -> list[str]:
    """The stage's FROM, then its parent stage's, down to an image that is no stage."""
    named = {name: (base, name, steps) for base, name, steps in stages() if name}
    chain = [stages()[stage][0]]
    while chain[-1] in named:
        chain.append(named[chain[-1]][0])
    return chain


def test_base_image_is_debian_trixie() -> None:
    """Debian 13: its QEMU has the FUSE export fix (10.0.8) the fast data path needs."""
    root = lineage(-1)[-1]
    match = re.fullmatch(r"\$\{?(\w+)\}?", root)
    assert match, f"the final stage must come from the BASE_IMAGE argument, not {root}"
    default = global_args().get(match.group(1))
    assert default is not None and re.fullmatch(r"(docker\.io/(library/)?)?debian:trixie(-slim)?", default), default
    for index in range(len(stages())):
        assert lineage(index)[-1] == root, f"stage {index} does not start from the same Debian base"


def test_build_script_passes_the_base_argument() -> None:
    """scripts/build-image.sh names the same ARG, or its local base would be ignored."""
    name = next(iter(global_args()))
    assert re.search(rf"--build-arg \"{name}=\$BASE\"", BUILD_SCRIPT.read_text(encoding="utf-8"))
    assert "--isolation chroot" in BUILD_SCRIPT.read_text(encoding="utf-8")


def test_installs_the_tools() -> None:
    runs = " ".join(args for keyword, args in instructions() if keyword == "RUN")
    installs = re.findall(r"apt-get install ([^&;]*)", runs)
    assert installs
    packages = {word for words in installs for word in words.split() if not word.startswith("-")}
    missing = PACKAGES - packages
    assert not missing, f"not installed: {missing}"
    assert "--no-install-recommends" in runs
    assert "rm -rf /var/lib/apt/lists" in runs


def test_the_image_has_no_mtab() -> None:
    """libfuse forks QSD to run `mount -f` for every FUSE export while /etc/mtab exists: the image removes it."""
    runs = [args for keyword, args in instructions() if keyword == "RUN"]
    assert any("rm -f /etc/mtab" in args for args in runs)


def test_installs_the_package_into_a_venv() -> None:
    """The source is built in a stage of its own; the final image gets the venv only."""
    *builders, (_, _, final) = stages()
    venvs = [
        (match.group(1), steps)
        for _, _, steps in builders
        for keyword, args in steps
        if keyword == "RUN" and (match := re.search(r"python3 -m venv (/\S+)", args))
    ]
    assert len(venvs) == 1, "one build stage makes the venv"
    venv, steps = venvs[0]
    assert any(keyword == "COPY" and args.split()[0] == "." for keyword, args in steps), "the context is copied"
    assert any(
        keyword == "RUN" and re.search(rf"{re.escape(venv)}/bin/pip install (--\S+ )*/src\b", args)
        for keyword, args in steps
    )
    assert not any(keyword == "COPY" and args.split()[0] == "." for keyword, args in final), "source in the image"
    assert ("COPY", f"--from=build {venv} {venv}") in final
    (path,) = [args for keyword, args in final if keyword == "ENV" and args.startswith("PATH=")]
    assert path.removeprefix("PATH=").split(":")[0] == f"{venv}/bin", "csi-qsd must come from the venv"


def test_entry_point() -> None:
    (entrypoint,) = [args for keyword, args in instructions() if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["csi-qsd"]
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "csi-qsd" in scripts


def test_pip_certificate_argument_has_no_default() -> None:
    """PIP_CERT is for builds behind a TLS-inspecting proxy only; elsewhere pip keeps its own trust."""
    args = [args for _, _, steps in stages() for keyword, args in steps if keyword == "ARG"]
    assert "PIP_CERT" in args
    assert not any(keyword == "ARG" and args.startswith("PIP_CERT") for keyword, args in stages()[-1][2])


def ignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (`**` spans directories, `*` and `?` do not)."""
    out = ""
    index = 0
    pattern = pattern.strip("/")
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out += "(?:.*/)?"
            index += 3
        elif pattern.startswith("**", index):
            out += ".*"
            index += 2
        elif pattern[index] == "*":
            out += "[^/]*"
            index += 1
        elif pattern[index] == "?":
            out += "[^/]"
            index += 1
        elif pattern[index] == "[":
            close = pattern.index("]", index)
            out += pattern[index : close + 1]
            index = close + 1
        else:
            out += re.escape(pattern[index])
            index += 1
    return re.compile(out)


def ignored(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context (a matched directory drops its contents)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in ignore_patterns():
        negate = pattern.startswith("!")
        regex = pattern_regex(pattern.lstrip("!"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = not negate
    return result


def test_dockerignore_excludes_local_state() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "csi_qsd/__pycache__/cli.cpython-311.pyc",
                 ".pytest_cache/v", ".mypy_cache/3.11", ".runtime/qemu/usr/bin/qemu-img", ".demo/state/csi.sock"):
        assert ignored(path), f"{path} would be sent to the builder"


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "csi_qsd/__init__.py", "csi_qsd/cli/__init__.py"]
    readme = pyproject["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for path in needed:
        assert not ignored(path), f"{path} is needed by `pip install .` but ignored"
