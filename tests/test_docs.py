"""The documentation site against the code: every sample runs, every command exists,
and the reference tables list exactly what the code has.

How the samples run (the conventions the pages follow):

* ``python`` blocks run, page by page, in a fresh interpreter per page: the blocks of
  one page share one namespace, in order, as ``__main__``. A block whose fence
  title says ``not run`` (with the reason after it) is skipped; its title shows the
  reason on the site.
* Host names in the samples are stand-ins for real servers started here:
  ``redis://localhost:6379`` is the session server, ``redis.internal``,
  ``sentinel-1``/``sentinel-2`` and ``redis-cluster`` are the deployments of
  :data:`STAND_INS`. A sample that names a host no stand-in covers fails.
* A block titled with a file name (``title="tasks.py"``) is also written to the
  page's working directory, so later blocks can import it; when a page writes
  ``test_*.py`` files, pytest runs them there.
* A ``text`` block titled ``Output`` right after a ``python`` block must match what
  that block printed (``...`` matches anything within a line).
* ``<!-- docs-test: then=NAME -->`` before a block runs the check ``then_NAME`` of
  this module on the namespace after the block.
* ``console`` blocks do not run, but each ``$`` command must exist: programs,
  sub-commands, options and extras are looked up in the code.

The README is held to the same rules (its console lines are commands without the
``$``), and stays the short front door: its links resolve and map the site, its test
command is what CI runs, and its benchmark figures are those of the Benchmarks page.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import LONGEST_FIRST

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"
#: Everything whose samples and commands are checked: the README and the site's pages.
SOURCES = [README, *PAGES]

#: Loopback stand-ins: the text a sample shows, and the deployment that replaces it.
STAND_INS: dict[str, str] = {
    "redis://localhost:6379": "server",
    "redis://:PASSWORD@redis.internal:6379": "password_server",
    "redis://locker:PASSWORD@redis.internal:6379": "acl_server",
    "rediss://redis.internal:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem": "tls",
    # A TLS broker without query parameters, and the CA file its broker_use_ssl names
    # (after the URL above, which names the same file).
    "rediss://redis.internal:6380/0": "tls_bare",
    "/etc/ssl/ca.pem": "tls_ca",
    "sentinel://sentinel-1:26379;sentinel://sentinel-2:26379": "sentinel",
    'host="redis-cluster", port=6379': "cluster",
}

#: Host names a runnable sample may not keep after the stand-ins are replaced.
_FOREIGN_HOST = re.compile(
    r"(?:rediss?|sentinel|unix)://[^\"'\s]*?(?:localhost|redis\.internal|sentinel-\d|redis-cluster)"
    r"|host=\"(?!127\.0\.0\.1)"
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`]*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the block's first line of code
    lang: str
    title: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skipped(self) -> bool:
        return "not run" in self.title.lower()


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, with their titles and docs-test directives."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, ticks, info = opening["indent"], opening["ticks"], opening["info"].strip()
        body: list[str] = []
        end = index + 1
        while end < len(lines) and lines[end].strip() != ticks:
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end])
            end += 1
        lang = info.split()[0] if info else ""
        title = _TITLE.search(info)
        directives: dict[str, str] = {}
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        directive = _DIRECTIVE.match(lines[before]) if before >= 0 else None
        if directive is not None:
            for item in directive["body"].split():
                key, _, value = item.partition("=")
                directives[key] = value
        found.append(
            Block(
                page, index + 2, lang, title["title"] if title else "", "\n".join(body), directives
            )
        )
        index = end + 1
    return found


def prose(page: Path) -> str:
    """``page`` without its fenced blocks."""
    kept: list[str] = []
    closing: str | None = None
    for line in page.read_text().splitlines():
        fence = _FENCE.match(line)
        if closing is None and fence is not None:
            closing = fence["ticks"]
        elif closing is not None and line.strip() == closing:
            closing = None
        elif closing is None:
            kept.append(line)
    return "\n".join(kept)


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS if page.is_relative_to(DOCS) else ROOT))


# -- Running a page's samples -------------------------------------------------------


def _output_matches(expected: str, printed: str) -> bool:
    """Whether ``printed`` matches ``expected``, where ``...`` stands for any text."""
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("..."))
    return re.fullmatch(pattern, printed.strip(), flags=re.DOTALL) is not None


def run_page(spec: dict[str, Any]) -> None:
    """Run one page's samples (in a child interpreter; see :func:`test_samples_run`)."""
    from celery_redislock import task

    # A misspelt setting in a sample would be ignored with a warning: fail instead.
    warnings.simplefilter("error", getattr(task, "UnknownSettingWarning", UserWarning))
    os.chdir(spec["workdir"])
    sys.path.insert(0, spec["workdir"])
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for sample in spec["samples"]:
        if sample["file"]:
            Path(sample["file"]).write_text(sample["code"] + "\n")
        padded = "\n" * (sample["line"] - 1) + sample["code"]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(padded, sample["page"], "exec"), namespace)
                if sample["then"]:
                    globals()[f"then_{sample['then']}"](namespace)
        except BaseException:
            sys.stdout.write(printed.getvalue())
            traceback.print_exc()
            raise SystemExit(f"{sample['page']}:{sample['line']}: the sample failed") from None
        expected = sample["output"]
        if expected is not None and not _output_matches(expected, printed.getvalue()):
            raise SystemExit(
                f"{sample['page']}:{sample['line']}: printed\n{printed.getvalue()}"
                f"but the page shows\n{expected}"
            )
    for value in list(namespace.values()):
        if type(value).__name__ == "Celery" and hasattr(value, "close"):
            value.close()


def then_task_locks(namespace: dict[str, Any]) -> None:
    """The sample's ``app`` locks where it was configured to: a task run with it holds
    its lock, with a fencing token, in the app's lock store."""
    from redis.exceptions import NoPermissionError

    from celery_redislock import SingletonTask
    from celery_redislock.scripts import OWNER_FIELD
    from tests.support import field

    app = namespace["app"]
    name = f"docs-check-{uuid.uuid4().hex[:8]}"

    @app.task(base=SingletonTask, bind=True, name=name, shared=False)
    def check(self: Any) -> tuple[int, bool]:
        key = f"{self.lock_options.prefix}:{{{self.lock.key}}}"
        return self.lock.fence, bool(field(self.lock_client, key, OWNER_FIELD))

    token, held = check.apply().get()
    assert isinstance(token, int), token
    assert held, f"{name}: no lock in the store the sample configured"
    # Shared deployments must be left as found: drop the freed lock's key too.
    key = f"{check.lock_options.prefix}:{{{check.lock_name((), {})}}}"
    with contextlib.suppress(NoPermissionError):  # the minimal ACL has no DEL
        check.lock_client.delete(key)


class Deployments:
    """The servers behind :data:`STAND_INS`, started on first use."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self._urls: dict[str, str] = {}

    def url(self, kind: str) -> str:
        if kind not in self._urls:
            self._urls[kind] = getattr(self, f"_start_{kind}")()
        return self._urls[kind]

    def _fixture(self, name: str) -> Any:
        return self.request.getfixturevalue(name)

    def _start_server(self) -> str:
        # Each page starts from an empty server, and leaves it empty for the tests after.
        client = self._fixture("redislock_server").client()
        client.flushall()
        self.request.addfinalizer(client.close)
        self.request.addfinalizer(client.flushall)
        url: str = self._fixture("redislock_url")
        return url.rsplit("/", 1)[0]

    def _start_password_server(self) -> str:
        server = self._fixture("redislock_server_factory")()
        server.client().config_set("requirepass", "docs-password")
        return f"redis://:docs-password@{server.host}:{server.port}"

    def _start_acl_server(self) -> str:
        rules = acl_rules_on_page()
        server = self._fixture("redislock_server_factory")()
        server.client().execute_command("ACL", "SETUSER", "locker", "on", ">docs-password", *rules)
        return f"redis://locker:docs-password@{server.host}:{server.port}"

    def _start_tls(self) -> str:
        url: str = self._fixture("redislock_tls_server").url
        return url

    def _start_tls_bare(self) -> str:
        server = self._fixture("redislock_tls_server")
        return f"rediss://{server.host}:{server.port}/0"

    def _start_tls_ca(self) -> str:
        path: str = self._fixture("redislock_tls_server").ca_path
        return path

    def _start_sentinel(self) -> str:
        url: str = self._fixture("redislock_sentinel").sentinel_url
        return url

    def _start_cluster(self) -> str:
        node = self._fixture("redislock_cluster").nodes[0]
        return f'host="{node.host}", port={node.port}'


def substituted(code: str, deployments: Deployments) -> str:
    """``code`` with every stand-in replaced by its loopback deployment."""
    for shown, kind in STAND_INS.items():
        if shown in code:
            code = code.replace(shown, deployments.url(kind))
    return code


def page_spec(page: Path, deployments: Deployments, workdir: Path) -> dict[str, Any]:
    """What the child interpreter runs for ``page``."""
    found = blocks(page)
    samples = []
    for position, block in enumerate(found):
        if block.lang != "python" or block.skipped:
            continue
        code = substituted(block.code, deployments)
        foreign = _FOREIGN_HOST.search(code)
        assert foreign is None, f"{block.where}: no stand-in for {foreign[0]!r}"
        following = found[position + 1] if position + 1 < len(found) else None
        output = (
            following.code
            if following is not None and following.lang == "text" and following.title == "Output"
            else None
        )
        file = block.title if block.title.endswith(".py") else ""
        samples.append(
            {
                "page": str(page.relative_to(ROOT)),
                "line": block.line,
                "code": code,
                "file": file,
                "then": block.directives.get("then", ""),
                "output": output,
            }
        )
    return {"workdir": str(workdir), "samples": samples}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


RUNNABLE = [page for page in SOURCES if any(b.lang == "python" for b in blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_samples_run(page: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every Python sample of the page runs and prints what the page shows."""
    deployments = Deployments(request)
    spec = page_spec(page, deployments, tmp_path)
    assert spec["samples"], f"{page_id(page)}: no runnable sample"
    code = "import json, sys; from tests.test_docs import run_page; run_page(json.load(sys.stdin))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_child_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if any(path.name.startswith("test_") for path in tmp_path.glob("*.py")):
        tested = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=_child_env(),
            timeout=120,
        )
        assert tested.returncode == 0, tested.stdout + tested.stderr
        assert " passed" in tested.stdout


def test_every_python_sample_is_run_or_says_why_not() -> None:
    """A sample that is not run says why in its visible title."""
    for page in SOURCES:
        for block in blocks(page):
            if block.lang == "python" and block.skipped:
                reason = block.title.lower().split("not run", 1)[1].strip(" :—-()")
                assert reason, f"{block.where}: say why the sample is not run"


def test_code_blocks_have_a_known_language() -> None:
    """Every fenced block says what it is, so none escapes the checks by accident."""
    known = {"python", "console", "text", "mermaid", "toml"}
    for page in SOURCES:
        for block in blocks(page):
            assert block.lang in known, f"{block.where}: fence language {block.lang!r}"


_TYPED_TASKS = """
from celery import Celery

from celery_redislock import LockHandle, RedisLock, SingletonTask

app = Celery("shop")


@app.task(base=SingletonTask, bind=True, lock_on=("account_id",))
def rebuild_report(self: SingletonTask, account_id: int) -> int:
    self.lock.check()
    handle: LockHandle = self.lock
    return handle.fence + account_id


def invoice(url: str) -> int | None:
    with RedisLock(url, "invoice:42", ttl=30) as lock:
        return lock.token
"""


def test_typing_configuration_checks_a_project(tmp_path: Path) -> None:
    """The mypy configuration Getting started gives lets mypy --strict accept a
    project that uses SingletonTask, self.lock and RedisLock."""
    (config,) = [
        block.code
        for block in blocks(DOCS / "getting-started.md")
        if block.lang == "toml" and block.title == "pyproject.toml"
    ]
    assert tomllib.loads(config)["tool"]["mypy"]["strict"] is True
    (tmp_path / "pyproject.toml").write_text(config)
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    (tmp_path / "shop" / "tasks.py").write_text(_TYPED_TASKS)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "shop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- Console commands -------------------------------------------------------------


def console_commands() -> Iterator[tuple[Block, list[str]]]:
    """Every ``$`` command of every console block (every line of the README's), split
    like a shell would."""
    for page in SOURCES:
        for block in blocks(page):
            if block.lang != "console":
                continue
            for line in block.code.splitlines():
                if line.startswith("$ "):
                    yield block, shlex.split(line[2:], comments=True)
                elif page == README and line.strip():
                    yield block, shlex.split(line, comments=True)


def _options(words: list[str]) -> list[str]:
    """The options among a command's ``words``: up to ``--``, after which all are arguments."""
    given = words[: words.index("--")] if "--" in words else words
    return [word.split("=", 1)[0] for word in given if word.startswith("-") and word != "-"]


@cache
def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


@cache
def _example_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "example_worker", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _check_pip(words: list[str]) -> None:
    assert words[:2] == ["pip", "install"], words
    extras = _pyproject()["project"]["optional-dependencies"]
    for word in words[2:]:
        if word.startswith("-"):
            continue
        target = re.fullmatch(r"\.(?:\[(?P<extras>[\w,-]+)\])?", word)
        assert target is not None, f"pip install {word}: only this checkout is installed"
        for extra in (target["extras"] or "").split(","):
            assert not extra or extra in extras, f"no extra {extra!r} in pyproject.toml"


def _check_python(words: list[str]) -> None:
    if words[1:3] == ["-m", "example_worker"]:
        for option in _options(words[3:]):
            assert re.search(rf"(?<![\w-]){re.escape(option)}\b", _example_help()), option
        return
    script = ROOT / words[1]
    assert script.is_file(), f"no {words[1]}"
    # The script's options, or those of a module beside it that it shares them from.
    text = "".join(path.read_text() for path in script.parent.glob("*.py"))
    for option in _options(words[2:]):
        assert f'"{option}"' in text, f"{words[1]} has no {option}"


def _check_celery(words: list[str]) -> None:
    from celery.bin.celery import celery as celery_command

    from celery_redislock.cli import redislock

    rest = list(words[1:])
    if rest[:1] == ["-A"]:
        rest = rest[2:]
    command, *arguments = rest
    if command == "redislock":
        sub, *arguments = arguments
        assert sub in redislock.commands, f"celery redislock has no {sub!r}"
        params = redislock.commands[sub].params
    else:
        assert command in celery_command.commands, f"celery has no {command!r}"
        params = celery_command.commands[command].params
    known = {opt for param in params for opt in [*param.opts, *param.secondary_opts]}
    for option in _options(arguments):
        assert option in known, f"celery {command}: no option {option}"


def _check_pytest(words: list[str]) -> None:
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    arguments = iter(words[1:])
    for word in arguments:
        if word == "-p":
            plugin = next(arguments)
            assert plugin.startswith("no:") or __import__(plugin)
        elif word.startswith("--"):
            assert f'"{word}"' in conftest, f"pytest: no option {word}"


def _check_mkdocs(words: list[str]) -> None:
    assert words[1] in {"build", "serve"}, words
    assert (ROOT / "mkdocs.yml").is_file()


def _check_docker(words: list[str]) -> None:
    assert words[1] == "compose", words
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in ("worker", "seckill"):
        if service in words:
            assert service in compose["services"], service


def _check_redis_cli(words: list[str]) -> None:
    assert words[1:3] == ["ACL", "SETUSER"], "redis-cli: only the ACL of the Deployments page"


CHECKS: dict[str, Callable[[list[str]], None]] = {
    "pip": _check_pip,
    "python": _check_python,
    "celery": _check_celery,
    "pytest": _check_pytest,
    "mkdocs": _check_mkdocs,
    "docker": _check_docker,
    "redis-cli": _check_redis_cli,
}


def test_console_commands_exist() -> None:
    """Every command a console block shows exists, with the options it uses."""
    seen = 0
    for block, words in console_commands():
        assert words[0] in CHECKS, f"{block.where}: unknown program {words[0]!r}"
        try:
            CHECKS[words[0]](words)
        except AssertionError as exc:
            raise AssertionError(f"{block.where}: {shlex.join(words)}: {exc}") from None
        seen += 1
    assert seen > 10


def test_demo_report_on_the_page_uses_the_demo_labels() -> None:
    """The seckill report the Getting started page quotes checks what the demo checks."""
    sources = "".join(path.read_text() for path in (ROOT / "example_worker").glob("*.py"))
    quoted = [
        label
        for block in blocks(DOCS / "getting-started.md")
        if block.lang == "text" and "invariants:" in block.code
        for label in re.findall(r"\[ok  \] ([^:]+):", block.code)
    ]
    assert len(quoted) == 5
    for label in quoted:
        assert f'"{label}' in sources, label


def acl_rules_on_page() -> list[str]:
    """The ACL rules the Deployments page gives (after the user name, ``on`` and password)."""
    for _block, words in console_commands():
        if words[0] == "redis-cli":
            return words[6:]
    raise AssertionError("no ACL on the Deployments page")


def test_acl_on_the_page_is_the_tested_minimal_acl() -> None:
    """The ACL the page gives is the one the engine's ACL tests prove enough and needed."""
    from tests.test_deployments_engine import MINIMAL_ACL

    for _block, words in console_commands():
        if words[0] == "redis-cli":
            assert words[3:6] == ["locker", "on", ">PASSWORD"]
    assert acl_rules_on_page() == list(MINIMAL_ACL)


# -- Reference tables against the code ----------------------------------------------


def tables(page: Path) -> list[list[dict[str, str]]]:
    """The Markdown tables of ``page``, as rows keyed by their header cells."""
    found: list[list[dict[str, str]]] = []
    lines = page.read_text().splitlines()
    index = 0
    while index + 1 < len(lines):
        if lines[index].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[index + 1]):
            header = _cells(lines[index])
            rows = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[index]), strict=True)))
                index += 1
            found.append(rows)
        else:
            index += 1
    return found


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [part.strip().replace("\\|", "|") for part in parts]


def _code(cell: str) -> str | None:
    """The single ``code`` in a cell, or ``None`` for a dash."""
    if cell in {"—", "-"}:
        return None
    found = re.fullmatch(r"`([^`]+)`", cell)
    assert found is not None, f"expected one `name` in {cell!r}"
    return found[1]


def _settings_read_in(source: str) -> set[str]:
    return set(re.findall(r"conf\.get\(\s*[\"'](redislock_\w+)[\"']", source))


def test_configuration_page_lists_every_option_and_setting() -> None:
    """The Configuration table has a row for every task option and app.conf setting the
    code has, and none it does not; defaults and pairings match the code."""
    from celery_redislock import task
    from celery_redislock.task import OPTIONS, SingletonTask

    rows = [row for table in tables(DOCS / "configuration.md") for row in table]
    rows = [row for row in rows if "task option" in row]
    page = {(_code(row["task option"]), _code(row["`app.conf` setting"])): row for row in rows}

    attributes = {o.attribute for o in OPTIONS} | {"lock_on", "lock_key", "lock_url"}
    declared = {
        name
        for name, value in vars(SingletonTask).items()
        if type(value).__name__ == "_ResolvedOption" or name in {"lock_on", "lock_key", "lock_url"}
    }
    assert declared == attributes
    settings = {o.setting for o in OPTIONS} | {
        "redislock_url",
        "redislock_client",
        "redislock_transport_options",
    }
    settings |= set(getattr(task, "KNOWN_SETTINGS", ()))
    for module in (ROOT / "src" / "celery_redislock").glob("*.py"):
        settings |= _settings_read_in(module.read_text())

    assert {a for a, _ in page if a} == attributes
    assert {s for _, s in page if s} == settings
    for option in OPTIONS:
        row = page[option.attribute, option.setting]
        assert ast.literal_eval(_code(row["default"]) or "None") == option.default, option
    assert ("lock_url", "redislock_url") in page


def test_configuration_page_names_every_redislock_argument() -> None:
    """The Configuration page names every argument RedisLock takes, and no other."""
    import inspect

    from celery_redislock import RedisLock

    text = (DOCS / "configuration.md").read_text().split("## The lock engine's arguments")[1]
    section = re.split(r"\bSee\b", text.split("\n## ")[0])[0]
    parameters = inspect.signature(RedisLock).parameters
    expected = {name for name in parameters if not name.startswith("_")}
    named = set(re.findall(r"`(\w+)`", section)) | {"client_or_url", "name", "ttl"}
    assert named == expected


def test_signals_table_matches_the_signals() -> None:
    """The Operations page lists every signal with exactly the arguments it provides."""
    from celery_redislock import signals

    rows = [row for table in tables(DOCS / "operations.md") for row in table if "signal" in row]
    listed = {_code(row["signal"]): row["arguments"] for row in rows}
    assert set(listed) == set(signals.__all__)
    for name, cell in listed.items():
        assert name is not None
        arguments = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cell)))
        if "name" in arguments:
            # Sent again as `key`, its older spelling, which the page explains once.
            arguments.add("key")
        assert arguments == set(getattr(signals, name).providing_args), name
    assert "also send it\nas `key`" in (DOCS / "operations.md").read_text()


def test_cli_table_matches_the_commands() -> None:
    """The Operations page's command table lists exactly the `celery redislock` commands."""
    from celery_redislock.cli import redislock

    rows = [row for table in tables(DOCS / "operations.md") for row in table if "command" in row]
    assert {_code(row["command"]) for row in rows} == set(redislock.commands)


def test_json_field_tables_match_the_schemas() -> None:
    """The Operations page's LOCK and HOLDER field tables list exactly the fields of the
    JSON Schemas that `list --json` and `show --json` follow."""
    from celery_redislock.admin import LIST_SCHEMA, SHOW_SCHEMA

    lock = LIST_SCHEMA["properties"]["locks"]["items"]["properties"]
    holder = SHOW_SCHEMA["properties"]["locks"]["items"]["properties"]["holder_status"]
    holder_fields = next(
        option["properties"]
        for option in holder.get("anyOf", holder.get("oneOf", [holder]))
        if "properties" in option
    )
    found = {}
    for table in tables(DOCS / "operations.md"):
        for column in ("`LOCK` field", "`HOLDER` field"):
            if table and column in table[0]:
                found[column] = {_code(row[column]) for row in table}
    assert found["`LOCK` field"] == set(lock)
    assert found["`HOLDER` field"] == set(holder_fields)


def _testing_module() -> ast.Module:
    return ast.parse((ROOT / "src" / "celery_redislock" / "testing.py").read_text())


def test_testing_page_lists_every_fixture_and_helper() -> None:
    """The Testing page lists exactly the test kit's fixtures and public helpers."""
    import celery_redislock.testing as kit

    fixtures = set()
    for node in _testing_module().body:
        if isinstance(node, ast.FunctionDef) and any(
            "fixture" in ast.unparse(decorator) for decorator in node.decorator_list
        ):
            fixtures.add(node.name)
    rows = [row for table in tables(DOCS / "testing.md") for row in table]
    assert {_code(row["fixture"]) for row in rows if "fixture" in row} == fixtures
    helpers = {(_code(row["helper"]) or "").split("(")[0] for row in rows if "helper" in row}
    assert helpers == set(kit.__all__)


def _test_names() -> dict[str, set[str]]:
    """Test function names per test file, from the sources."""
    names: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        names[path.name] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test_")
        }
    return names


def test_every_test_named_in_the_docs_exists() -> None:
    """Every test the pages name as proof (``test_x`` or ``file.py::test_x``) exists."""
    names = _test_names()
    everywhere = set().union(*names.values())
    cited = 0
    for page in SOURCES:
        text = prose(page)  # a sample's own tests are not cited as proof
        for file, name in re.findall(r"(?:(test_\w+\.py)::)?\b(test_\w+)\b(?!\.py)", text):
            if file:
                assert name in names.get(file, set()), f"{page_id(page)}: no {file}::{name}"
            else:
                assert name in everywhere, f"{page_id(page)}: no test {name}"
            cited += 1
        for path in re.findall(r"`((?:tests|example_worker|bench)/[\w./]+)`", text):
            assert (ROOT / path).exists(), f"{page_id(page)}: no {path}"
    assert cited > 50


def test_guarantees_table_names_a_test_on_every_row() -> None:
    """Every row of the guarantees table names at least one test."""
    rows = [row for table in tables(DOCS / "guarantees.md") for row in table]
    assert len(rows) > 15
    for row in rows:
        assert re.search(r"`test_\w+`", row["proved in"]), row


# -- The site ------------------------------------------------------------------------


def _nav_pages(entries: Any) -> Iterator[str]:
    for entry in entries:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from _nav_pages([value] if isinstance(value, str) else value)


class _Loader(yaml.SafeLoader):
    """mkdocs.yml with its ``!!python/name:`` tags read as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def test_navigation_lists_every_page() -> None:
    """mkdocs.yml's navigation has every page under docs/ once, and no other."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    listed = list(_nav_pages(config["nav"]))
    assert len(listed) == len(set(listed))
    assert set(listed) == {page_id(page) for page in PAGES}


def test_api_reference_covers_the_public_modules() -> None:
    """The API reference renders every module the package's docstring calls public."""
    text = "\n".join(page.read_text() for page in (DOCS / "reference").glob("*.md"))
    documented = set(re.findall(r"^::: (celery_redislock(?:\.\w+)?)\s*$", text, flags=re.M))
    for module in (
        "celery_redislock",
        "celery_redislock.task",
        "celery_redislock.lock",
        "celery_redislock.errors",
        "celery_redislock.signals",
        "celery_redislock.store",
        "celery_redislock.server",
        "celery_redislock.deployments",
    ):
        assert module in documented, module


def test_dev_extra_installs_the_docs_tools() -> None:
    """``pip install -e ".[dev]"`` brings the site's build tools (the docs extra)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(requirement.startswith("mkdocs-material") for requirement in extras["docs"])
    assert any(requirement.startswith("mkdocstrings[python]") for requirement in extras["docs"])
    assert "celery_redislock[docs]" in extras["dev"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci


def test_tests_run_in_one_process_per_core_taking_whole_files() -> None:
    """As the testing page says: ``pytest`` runs one process per core (pytest-xdist,
    which the dev extra installs), each taking whole test files, so a module's
    fixtures start once, the longest modules first."""
    options = shlex.split(_pyproject()["tool"]["pytest"]["ini_options"]["addopts"])
    assert options[options.index("-n") + 1] == "auto"
    assert options[options.index("--dist") + 1] == "loadfile"
    # The order tests/conftest.py gives the modules, kept.
    assert "--no-loadscope-reorder" in options
    assert any(
        r.startswith("pytest-xdist")
        for r in _pyproject()["project"]["optional-dependencies"]["dev"]
    )
    page = (ROOT / "docs" / "testing.md").read_text()
    assert "one process per core" in page
    assert "whole test files" in page
    assert "`LONGEST_FIRST`" in page
    assert all((ROOT / "tests" / name).is_file() for name in LONGEST_FIRST)


# -- The README ----------------------------------------------------------------------


def _readme_section(title: str) -> str:
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_the_short_front_door() -> None:
    """The README stays short: the pitch, the quick start and a map of the site."""
    assert len(README.read_text().splitlines()) <= 150


def test_readme_links_resolve_and_map_the_site() -> None:
    """Every relative link of the README reaches a file, and it links every page of the
    site but the API reference's own (whose index it links)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", prose(README))
    local = {target.split("#", 1)[0] for target in targets if "://" not in target}
    for target in local:
        assert (ROOT / target).is_file(), f"README.md: no {target}"
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    site = {
        f"docs/{page}"
        for page in _nav_pages(config["nav"])
        if not page.startswith("reference/") or page == "reference/index.md"
    }
    assert site - local == set()


def test_readme_test_command_is_what_ci_runs() -> None:
    """The README's test command is the one .ci/run ends with."""
    readme = [words for block, words in console_commands() if block.page == README]
    tests = [words for words in readme if words[0] == "pytest"]
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert tests == [shlex.split(ci[-1])]


_FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)*")


def test_readme_benchmark_figures_are_on_the_benchmarks_page() -> None:
    """Every figure of the README's benchmark headline is one the Benchmarks page shows."""
    headline = re.sub(r"\]\([^)]*\)", "]", _readme_section("Benchmarks"))
    page = set(_FIGURE.findall((DOCS / "benchmarks.md").read_text()))
    figures = _FIGURE.findall(headline)
    assert len(figures) > 5
    assert set(figures) - page == set()
