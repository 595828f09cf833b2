"""The ``celery redislock`` command: inspect and repair locks from a shell.

Installed as a plug-in of Celery's own command line (``celery.commands`` entry
point), so it runs against the app's configuration::

    celery -A proj redislock ping
    celery -A proj redislock list 'proj.tasks.purchase:*' --state running
    celery -A proj redislock show 6c1d9a0e-…            # a lock name or a holder's task id
    celery -A proj redislock name proj.tasks.purchase 42 --kwargs '{"user": 7}'
    celery -A proj redislock release --holder 6c1d9a0e-…
    celery -A proj redislock purge --node celery@dead-host --yes
    celery -A proj redislock stats --json

The commands work on every place the app's locks live (its lock store under
``redislock_prefix``, plus any task's own ``lock_url``/``lock_prefix``). The
logic is in :mod:`celery_redislock.admin`; this module parses, asks and prints.
Every failure is one line on stderr and a non-zero exit status. A lock store that
cannot be reached, or a task whose options are invalid, is such a failure too,
reported once the command has done what it could with the other stores.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any, TypeVar, cast

import click
from celery import _state

from celery_redislock.admin import (
    HOLDER_STATES,
    ForceReleased,
    HolderState,
    LockInfo,
    ResultReads,
    Store,
    WaiterInfo,
    WorkerActivity,
    app_stores,
    check_pattern,
    find_locks,
    find_waiting,
    force_release,
    holder_status,
    is_glob,
    list_locks,
    lock_stats,
    read_lock,
    read_waiters,
    server_facts,
    short_reason,
    worker_activity,
)
from celery_redislock.errors import LockBackendError, LockError
from celery_redislock.store import describe_store, store_url

#: Seconds ``show``, ``release`` and ``purge`` wait for live workers to answer.
DEFAULT_INSPECT_TIMEOUT = 1.0

#: Seconds the workers are given to answer at the least, however little is left of
#: ``show``'s deadline once the locks are read (``--timeout``'s own least value).
_LEAST_WAIT = 0.05

#: Exit status of ``release`` and ``purge`` when a listed lock changed hands
#: before its release and was left to its new holder (1 is a failure, 2 a usage
#: error): what was freed is done, the rest wants a second look.
CHANGED_HANDS_EXIT = 3

#: Exit status of ``release --pattern``/``--task`` and ``purge`` when a listed lock
#: was left to its holder, which a live worker is running (``--force`` frees those
#: too): the others are released.
LEFT_RUNNING_EXIT = 4

#: Where ``ctx.meta`` keeps what a command could not do (a lock store unreachable, a
#: task's invalid options), one message each, reported once the command has done
#: what it could with the rest.
_PROBLEMS = "celery_redislock.problems"
#: Where ``ctx.meta`` keeps the lock store a command is talking to, for its messages.
_CURRENT_STORE = "celery_redislock.store"
#: Where ``ctx.meta`` keeps the tasks whose options are invalid: name -> message.
_BAD_TASKS = "celery_redislock.bad_tasks"
#: Where ``ctx.meta`` keeps the app's lock stores, once looked up.
_STORES = "celery_redislock.stores"

#: A Celery task id as Celery makes them (a UUID), in any case.
_TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


class Failure(click.ClickException):
    """A failure reported as one line on stderr (``Error: …``), with an exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _no_app(app: Any) -> bool:
    """Whether ``app`` is Celery's fallback app with no lock store configured (no ``-A``)."""
    fallback: Any = getattr(_state, "default_app", None)
    if app is not fallback:
        return False
    if app.conf.get("redislock_client") is not None:
        return False
    try:
        store_url(app)
    except (ValueError, TypeError):
        return True
    return False


def _stores(ctx: click.Context) -> list[Store]:
    """The places the app's locks live; one-line failures for a missing app or config.

    A task whose options are invalid is reported as such (a problem of that
    task's configuration, not of a lock store) and left out: the command works
    on the stores of the other tasks, and exits non-zero once done.
    """
    app = ctx.obj.app
    if _no_app(app):
        raise Failure(
            "no Celery app: pass -A proj (the module of your Celery app), as in "
            "`celery -A proj redislock list`"
        )
    bad_tasks: list[tuple[str, Exception]] = []
    try:
        stores = app_stores(app, bad_tasks=bad_tasks)
    except (ValueError, TypeError) as exc:
        _report_bad_tasks(ctx, bad_tasks)
        raise Failure(f"lock store: {exc}") from None
    except LockBackendError as exc:
        # Its redislock_client callable could not reach it to make the client.
        raise Failure(f"lock store {describe_store(app)}: {short_reason(exc)}") from None
    _report_bad_tasks(ctx, bad_tasks)
    return stores


def _report_bad_tasks(ctx: click.Context, bad_tasks: list[tuple[str, Exception]]) -> None:
    """Note each task whose options are invalid (its locks are not looked at)."""
    reported: dict[str, str] = ctx.meta.setdefault(_BAD_TASKS, {})
    for task_name, exc in bad_tasks:
        said = str(exc)
        whose = "" if task_name in said else f"task {task_name!r}: "
        message = reported[task_name] = (
            f"task configuration: {whose}{said} (fix the task's options; its locks "
            "were not looked at)"
        )
        _problem(ctx, message)


def _problem(ctx: click.Context, message: str) -> None:
    """Note something the command could not do; it goes on with the rest, and
    reports each such problem (once) on stderr and exits non-zero when done."""
    problems: dict[str, None] = ctx.meta.setdefault(_PROBLEMS, {})
    problems[message] = None


def _problem_list(ctx: click.Context) -> list[str]:
    """The problems noted so far (they stay noted), for ``--json``'s ``errors``."""
    problems: dict[str, None] = ctx.meta.get(_PROBLEMS, {})
    return list(problems)


def _partly(ctx: click.Context) -> str:
    """What a count printed leaves out: the stores or tasks that could not be read."""
    return " (in what could be read: see the errors below)" if _problem_list(ctx) else ""


def _take_problems(ctx: click.Context) -> list[str]:
    """The problems noted so far, forgotten once taken."""
    problems: dict[str, None] = ctx.meta.pop(_PROBLEMS, {})
    return list(problems)


def _echo_problems(problems: Sequence[str]) -> None:
    for message in problems:
        click.echo(f"Error: {message}", err=True)


def _problems_failure(ctx: click.Context) -> Failure | None:
    """The failure that ends a command with problems noted: each but the last is
    printed now, the last is the failure's own line."""
    problems = _take_problems(ctx)
    if not problems:
        return None
    _echo_problems(problems[:-1])
    return Failure(problems[-1])


def one_line_errors(command: _F) -> _F:
    """Turn what a command can fail with into a one-line message and exit status 1
    (store unreachable, bad configuration, bad input), never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            result = command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            _echo_problems(_take_problems(ctx))
            raise
        except LockBackendError as exc:
            _echo_problems(_take_problems(ctx))
            raise Failure(f"lock store {_where(ctx)}: {short_reason(exc)}") from None
        except (ValueError, TypeError, LockError) as exc:
            _echo_problems(_take_problems(ctx))
            raise Failure(str(exc)) from None
        failure = _problems_failure(ctx)
        if failure is not None:
            raise failure
        return result

    return cast(_F, wrapper)


def _where(ctx: click.Context) -> str:
    """The lock store a failed command was talking to, for its message."""
    store: Store | None = ctx.meta.get(_CURRENT_STORE)
    return store.description if store is not None else "?"


def _stores_of(ctx: click.Context) -> list[Store]:
    """The app's lock stores (looked up once per command)."""
    stores: list[Store] | None = ctx.meta.get(_STORES)
    if stores is None:
        stores = ctx.meta[_STORES] = _stores(ctx)
    return stores


def _each_store(
    ctx: click.Context, read: Callable[[Store], Iterable[_T]]
) -> list[tuple[Store, _T]]:
    """What ``read`` finds in each of the app's lock stores, with the store it is in.

    A store that cannot be reached is noted as a problem (named alone, with why)
    and the others are read all the same; the command then exits non-zero once
    it has done what it could. When none can be read, that is the failure.
    """
    stores = _stores_of(ctx)
    found: list[tuple[Store, _T]] = []
    failed = 0
    for store in stores:
        items = _in_store(ctx, store, lambda store: list(read(store)))
        if items is None:
            failed += 1
        else:
            found.extend((store, item) for item in items)
    if failed == len(stores):
        failure = _problems_failure(ctx)
        if failure is not None:
            raise failure
    return found


def _in_store(ctx: click.Context, store: Store, read: Callable[[Store], _T]) -> _T | None:
    """``read(store)``, or ``None`` if the store cannot be reached: noted as a
    problem, named alone, with why (see :func:`_each_store`)."""
    ctx.meta[_CURRENT_STORE] = store
    try:
        return read(store)
    except LockBackendError as exc:
        _problem(ctx, f"lock store {store.description}: {short_reason(exc)}")
        return None
    finally:
        ctx.meta.pop(_CURRENT_STORE, None)


def _app_given(ctx: click.Context) -> str:
    """The app as given with ``-A``, for commands the messages suggest."""
    given = ctx.find_root().params.get("app")
    return given if isinstance(given, str) and given else "proj"


def _list_hint(ctx: click.Context) -> str:
    """Where to find the held locks' names and holders, for messages about a lock not found."""
    return f"`celery -A {_app_given(ctx)} redislock list` shows the held locks and their holders"


def _duration(seconds: float | None) -> str:
    """``seconds`` for a person: ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _ttl(info: LockInfo) -> str:
    return "none" if info.ttl_ms < 0 else _duration(info.ttl_ms / 1000)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as lines of left-aligned columns (the last one unpadded)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


_HEADER = ("NAME", "TASK", "HOLDER", "STATE", "NODE", "PID", "AGE", "TTL", "FENCE", "HOLDS")


def _row(info: LockInfo, now: float) -> tuple[str, ...]:
    return (
        info.name,
        info.task or "-",
        info.holder or "-",
        info.state or "-",
        info.node or "-",
        str(info.pid) if info.pid is not None else "-",
        _duration(info.age(now)),
        _ttl(info),
        str(info.fence),
        str(info.count),
        str(info.waiters),
    )


def _whose(info: LockInfo) -> str:
    """Who held ``info``, in a few words: task, holder id and where it ran."""
    parts = [f"task {info.task}"] if info.task else []
    parts.append(f"holder {info.holder or '-'}")
    if info.state == "running":
        parts.append(f"running on {info.node or '?'}" + (f" pid {info.pid}" if info.pid else ""))
    elif info.state == "queued":
        parts.append("queued")
    return ", ".join(parts)


def _emit_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, sort_keys=False))


@click.group()
@click.pass_context
def redislock(ctx: click.Context) -> None:
    """Inspect and repair celery_redislock locks (of the app given with -A)."""


@redislock.command()
@click.pass_context
@one_line_errors
def ping(ctx: click.Context) -> None:
    """Check that the lock store answers, and show its server version.

    Warns (on stderr) about a server whose memory limit is enforced by evicting
    keys: a held lock evicted is a lock lost.
    """
    for store, facts in _each_store(ctx, lambda store: [server_facts(store.client)]):
        versions = sorted({fact.version for fact in facts})
        primaries = f"{len(facts)} primaries, " if len(facts) > 1 else ""
        click.echo(f"lock store {store.description}: ok ({primaries}server {', '.join(versions)})")
        for policy in sorted({fact.policy for fact in facts if fact.evicts_locks}):
            click.echo(
                f"warning: lock store {store.description}: maxmemory-policy {policy} evicts keys "
                "when the memory limit is reached, held locks included (a lock evicted is "
                "lost); set maxmemory-policy noeviction on the lock store",
                err=True,
            )


def _collect(
    ctx: click.Context,
    pattern: str = "*",
    task: str | None = None,
    holder: str | None = None,
    state: HolderState | None = None,
) -> list[tuple[Store, LockInfo]]:
    return _each_store(
        ctx,
        lambda store: list_locks(
            store.client, pattern, store.prefix, task=task, holder=holder, state=state
        ),
    )


@redislock.command(name="list")
@click.argument("pattern", default="*")
@click.option("--task", "task", metavar="NAME", help="Only locks held for this task name.")
@click.option("--holder", metavar="TASK_ID", help="Only the lock held by this task id.")
@click.option("--state", type=click.Choice(HOLDER_STATES), help="Only queued or running holders.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON (schema: celery_redislock.admin.LIST_SCHEMA).",
)
@click.pass_context
@one_line_errors
def list_(
    ctx: click.Context,
    pattern: str,
    task: str | None,
    holder: str | None,
    state: HolderState | None,
    as_json: bool,
) -> None:
    """List held locks whose name matches PATTERN (a glob, default every lock).

    One row per lock: name, task, holder task id, state (queued: taken when the
    message was sent; running), worker node and pid, age, TTL left, fencing
    token, hold count and queued waiters.
    """
    check_pattern(pattern)
    found = _collect(ctx, pattern, task, holder, state)
    if not found:
        _check_task_known(ctx, f"of task {task}", task)
    now = time.time()
    if as_json:
        _emit_json(
            {
                "locks": [info.to_json(now) for _, info in found],
                "count": len(found),
                "errors": _problem_list(ctx),
            }
        )
        return
    if found:
        for line in _table([(*_HEADER, "WAITERS"), *(_row(info, now) for _, info in found)]):
            click.echo(line)
    click.echo(f"{len(found)} lock(s) held{_partly(ctx)}")


@redislock.command()
@click.argument("name_or_id", metavar="NAME|TASK_ID")
@click.option(
    "--timeout",
    type=click.FloatRange(0.05, 60),
    default=DEFAULT_INSPECT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for the workers' and the result backend's answers.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON (schema: celery_redislock.admin.SHOW_SCHEMA).",
)
@click.pass_context
@one_line_errors
def show(ctx: click.Context, name_or_id: str, timeout: float, as_json: bool) -> None:
    """Show one lock in full (by name, or by its holder's task id), and what is
    known of the holder: its result state and whether a live worker has it.

    --timeout is one deadline for the whole command: the result backend is read
    while the workers are asked, and what did not answer by then is said to
    have timed out.
    """
    deadline = time.monotonic() + timeout
    found = _each_store(ctx, lambda store: find_locks(store.client, name_or_id, store.prefix))
    if not found:
        found = _waited_for(ctx, name_or_id, as_json)
    if not found:
        raise Failure(
            f"no lock named {name_or_id!r} is held, and no lock is held by that task id, "
            "nor waited for; " + _list_hint(ctx)
        )
    app = ctx.obj.app
    holders = [info.holder for _, info in found if info.holder]
    results = ResultReads(app, holders)
    left = max(deadline - time.monotonic(), _LEAST_WAIT)
    activity = worker_activity(app, left) if holders else WorkerActivity()
    now = time.time()
    entries = []
    for store, info in found:
        status = (
            holder_status(app, info.holder, timeout, activity, results=results, deadline=deadline)
            if info.holder
            else None
        )
        queued = _waiters_of(ctx, store, info) if info.waiters else []
        entries.append((info, status, queued))
    if as_json:
        _emit_json(
            {
                "locks": [
                    {
                        "lock": info.to_json(now),
                        "holder_status": s.to_json() if s else None,
                        "waiting": [waiter.to_json() for waiter in queued],
                    }
                    for info, s, queued in entries
                ],
                "errors": _problem_list(ctx),
            }
        )
        return
    for number, (info, status, queued) in enumerate(entries):
        if number:
            click.echo("")
        since = _when(info.since)
        lines = [
            ("name", info.name),
            ("prefix", info.prefix),
            ("task", info.task or "-"),
            ("holder", info.holder or "-"),
            ("state", info.state or "-"),
            ("node", info.node or "-"),
            ("pid", str(info.pid) if info.pid is not None else "-"),
            ("since", f"{since} ({_duration(info.age(now))} ago)"),
            ("ttl", _ttl(info)),
            ("fence", str(info.fence)),
            ("holds", str(info.count)),
            ("waiters", str(info.waiters)),
            *(("waiting", _waiter_line(waiter, now)) for waiter in queued),
        ]
        if status is not None:
            lines.append(
                ("result", status.result_state or f"unknown ({status.result_error or 'not read'})")
            )
            if status.worker is not None:
                worker = f"{status.worker} reports it {status.worker_state}"
            elif activity.error is not None:
                worker = activity.error
            else:
                worker = (
                    f"no live worker reports it ({status.workers_answered} worker(s) "
                    f"answered within {timeout:g} s)"
                )
            lines.append(("worker", worker))
        for line in _table(lines):
            click.echo(line)


def _when(since: float | None) -> str:
    """A time in Unix seconds as an ISO 8601 UTC time, to the second (``-``: unknown)."""
    if since is None:
        return "-"
    return datetime.fromtimestamp(since, timezone.utc).isoformat(timespec="seconds")


def _waiter_line(waiter: WaiterInfo, now: float) -> str:
    """A queued waiter in a line: its task id, task, where it runs and since when."""
    where = f"on {waiter.node or '?'}" + (f" pid {waiter.pid}" if waiter.pid is not None else "")
    task = f" ({waiter.task})" if waiter.task else ""
    return (
        f"{waiter.task_id or '-'}{task} {where}, waiting since {_when(waiter.since)} "
        f"({_duration(waiter.age(now))} ago)"
    )


def _waited_for(ctx: click.Context, task_id: str, quiet: bool) -> list[tuple[Store, LockInfo]]:
    """The held locks task id ``task_id`` is queued for, saying so (unless ``quiet``:
    ``--json`` shows it among each lock's waiters)."""
    found = []
    for store, waiting in _each_store(
        ctx, lambda store: find_waiting(store.client, task_id, store.prefix)
    ):
        held = _held(ctx, store, waiting.name)
        if not quiet:
            state = "" if held else " (not held at this moment: being handed over)"
            click.echo(
                f"{task_id} is waiting for {waiting.name}{state}, number {waiting.position} "
                "in its queue"
            )
        if held is not None:
            found.append((store, held))
    if found and not quiet:
        click.echo("")
    return found


def _waiters_of(ctx: click.Context, store: Store, info: LockInfo) -> list[WaiterInfo]:
    """The waiters queued for ``info`` in ``store`` (none if it cannot be reached)."""
    waiters = _in_store(
        ctx, store, lambda store: read_waiters(store.client, info.name, store.prefix)
    )
    return waiters or []


def _held(ctx: click.Context, store: Store, name: str) -> LockInfo | None:
    """Lock ``name`` in ``store`` if it is held (``None`` too if it cannot be reached)."""
    return _in_store(ctx, store, lambda store: read_lock(store.client, name, store.prefix))


def _parse_value(text: str) -> Any:
    """A command-line argument as a JSON value, or as the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


#: A negative JSON number: an argument of a call, not an option, though it starts with '-'.
_NEGATIVE_NUMBER = re.compile(r"-(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


class _CallCommand(click.Command):
    """A command whose trailing arguments are those of a task call.

    An unknown option is an error naming it and the options there are, as for any
    command, rather than a string argument of the call: a mistyped ``--kwargs``
    would otherwise name another call's lock. A negative number is an argument;
    any other argument that starts with ``-`` goes after ``--``, which ends the
    options (everything after it is an argument).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Refuse unknown options, then parse as click does (which lets negative
        numbers through as arguments)."""
        takes_value: dict[str, bool] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                for opt in (*param.opts, *param.secondary_opts):
                    takes_value[opt] = not param.is_flag and not param.count
        rest = iter(args)
        for arg in rest:
            if arg == "--":
                break
            option, equals, _ = arg.partition("=") if arg.startswith("--") else (arg, "", "")
            if option in takes_value:
                if takes_value[option] and not equals:
                    next(rest, None)  # its value, whatever it looks like
                continue
            if arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.fullmatch(arg):
                raise self._no_such_option(ctx, option, sorted(takes_value))
        return super().parse_args(ctx, args)

    def _no_such_option(
        self, ctx: click.Context, option: str, options: list[str]
    ) -> click.NoSuchOption:
        close = difflib.get_close_matches(option, options, n=1)
        guess = f" Did you mean {close[0]!r}?" if close else ""
        return click.NoSuchOption(
            option,
            f"No such option {option!r}.{guess} The options of {self.name!r} are "
            f"{', '.join(options)}; an argument of the call that starts with '-' "
            f"goes after '--', as in: {self.name} TASK -- {option}",
            ctx=ctx,
        )


@redislock.command(cls=_CallCommand, context_settings={"ignore_unknown_options": True})
@click.argument("task_name", metavar="TASK")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="Keyword arguments, a JSON object.")
@click.pass_context
@one_line_errors
def name(
    ctx: click.Context, task_name: str, args: tuple[str, ...], kwargs_json: str | None
) -> None:
    """Print the lock name a call of TASK with ARGS would use.

    Each ARG is read as a JSON value (42, -1, "42", [1, 2], null), else taken as
    a string: `name proj.tasks.rebuild_report 42 --kwargs '{"full": true}'`.
    An unknown option is an error; an ARG that starts with '-' (other than a
    negative number) goes after '--', which ends the options:
    `name proj.tasks.tag 7 -- -draft`.
    """
    from celery_redislock.task import SingletonTask

    _stores_of(ctx)  # the same "no app" check as every command
    # Another task's invalid options do not change this one's lock names.
    mine = ctx.meta.get(_BAD_TASKS, {}).get(task_name)
    _take_problems(ctx)
    if mine is not None:
        _problem(ctx, mine)
    app = ctx.obj.app
    task = app.tasks.get(task_name)
    if task is None or not isinstance(task, SingletonTask):
        what = "no task" if task is None else "not a SingletonTask:"
        raise Failure(f"{what} {task_name!r} in app {app.main!r}; {_singleton_tasks(app)}")
    kwargs: Any = {}
    if kwargs_json is not None:
        try:
            kwargs = json.loads(kwargs_json)
        except ValueError as exc:
            raise Failure(f"--kwargs is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise Failure("--kwargs must be a JSON object, e.g. '{\"full\": true}'")
    click.echo(task.lock_name([_parse_value(arg) for arg in args], kwargs))


_TIMEOUT_OPTION = click.option(
    "--timeout",
    type=click.FloatRange(0.05, 60),
    default=DEFAULT_INSPECT_TIMEOUT,
    show_default=True,
    help="Seconds to wait for live workers to say what they run.",
)
_YES_OPTION = click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
_FORCE_OPTION = click.option(
    "--force", is_flag=True, help="Also release locks whose holder a live worker is running."
)


def _release_all(
    ctx: click.Context,
    found: list[tuple[Store, LockInfo]],
    what: str,
    yes: bool,
    force: bool,
    timeout: float,
    *,
    one_lock: bool = False,
) -> None:
    """Release ``found`` after the safety checks: live holders, then confirmation.

    Without ``force``, a lock whose holder a live worker is running is left to
    it: for ``one_lock`` (a lock named, or the lock of a task id) that is a
    refusal; for a selection (a pattern, a task, a node, the app), the others are
    released and the command then exits with :data:`LEFT_RUNNING_EXIT`. Only the
    holds listed are released; a lock that changed hands meanwhile is reported
    and left, and the command then exits with :data:`CHANGED_HANDS_EXIT`.
    """
    left: list[tuple[LockInfo, str]] = []
    if not force and any(info.holder for _, info in found):
        found, left = _leave_running(ctx, found, timeout, one_lock)
    for info, node in left:
        click.echo(
            f"left: {info.name} ({_whose(info)}): a live worker, {node}, is running its "
            "holder; --force frees it too"
        )
    if not found:
        raise Failure(
            f"released nothing: the {len(left)} lock(s) {what} are held by tasks a live "
            "worker is running; pass --force to free those too (the tasks keep running, "
            "without their locks)",
            LEFT_RUNNING_EXIT,
        )
    for _, info in found:
        click.echo(f"to release: {info.name} ({_whose(info)})")
    if not yes:
        click.confirm(f"Release {len(found)} lock(s) {what}?", abort=True, err=True)
    moved = _release_listed(ctx, found, force)
    if moved:
        raise Failure(
            f"{moved} lock(s) changed hands since they were listed and were not released; "
            "run the command again to review their new holders"
            + (f" ({len(left)} more left to their running holders)" if left else ""),
            CHANGED_HANDS_EXIT,
        )
    if left:
        raise Failure(
            f"{len(left)} lock(s) {what} left to their holders, which a live worker is "
            "running (listed above); pass --force to free those too (the tasks keep "
            "running, without their locks)",
            LEFT_RUNNING_EXIT,
        )


def _leave_running(
    ctx: click.Context, found: list[tuple[Store, LockInfo]], timeout: float, one_lock: bool
) -> tuple[list[tuple[Store, LockInfo]], list[tuple[LockInfo, str]]]:
    """``found`` split into the locks to release and those whose holder a live
    worker is running (with its node), after asking the workers; warns of a
    holder whose node did not answer. Refuses (raises) when the workers cannot
    be asked, and, for ``one_lock``, when its holder runs."""
    activity = worker_activity(ctx.obj.app, timeout, kinds=("active",))
    if activity.error is not None:
        raise Failure(
            f"cannot tell whether the holders still run ({activity.error}); "
            "pass --force to release anyway"
        )
    free: list[tuple[Store, LockInfo]] = []
    left: list[tuple[LockInfo, str]] = []
    for store, info in found:
        node = activity.running(info.holder)
        if node is None:
            free.append((store, info))
        else:
            left.append((info, node))
    if left and one_lock:
        info, node = left[0]
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise Failure(
            f"refusing to release {info.name}: its holder {info.holder} is running on "
            f"{node}{more}; pass --force to release it anyway (the task keeps running, "
            "unprotected)"
        )
    for _, info in free:
        if info.state == "running" and info.node and info.node not in activity.answered:
            # Gone (a crash: the usual reason to release), or alive but unable
            # to answer (a solo pool busy with this very task).
            click.echo(
                f"warning: {info.name}: its holder's node {info.node} did not answer "
                f"within {timeout:g} s: gone, or busy (a solo pool cannot answer while "
                "it runs a task)",
                err=True,
            )
    return free, left


def _release_listed(ctx: click.Context, found: list[tuple[Store, LockInfo]], force: bool) -> int:
    """Release each hold listed in ``found``; return how many changed hands instead.

    Each release names the hold that was listed and checked (by its fencing
    token): a lock handed to someone else meanwhile (its holder ended and a
    waiter got it, a new task took it) was never shown nor checked, so it stays.
    A lock store that fails is noted as a problem, and the rest are released.
    """
    moved = 0
    for store, info in found:
        ctx.meta[_CURRENT_STORE] = store
        try:
            outcome = force_release(store.client, info.name, store.prefix, info.fence)
            now = (
                read_lock(store.client, info.name, store.prefix)
                if outcome is ForceReleased.CHANGED_HANDS
                else None
            )
        except LockBackendError as exc:
            _problem(ctx, f"lock store {store.description}: {short_reason(exc)}")
            continue
        if outcome is ForceReleased.FREED:
            click.echo(f"released {info.name}: evicted {_whose(info)}")
            if force and info.state == "running":
                click.echo(
                    f"warning: {info.name}: its holder {info.holder or '-'} was not stopped: "
                    "if it still runs, it keeps running without its lock (it finds the lock "
                    "lost at its next renewal)",
                    err=True,
                )
        elif outcome is ForceReleased.CHANGED_HANDS:
            moved += 1
            holder = f"now {_whose(now)}" if now is not None else "since freed"
            click.echo(
                f"not released {info.name}: it changed hands since it was listed "
                f"({holder}; listed: {_whose(info)}, fence {info.fence})"
            )
        else:
            click.echo(f"{info.name} was no longer held")
    ctx.meta.pop(_CURRENT_STORE, None)
    return moved


@redislock.command()
@click.argument("lock_name", metavar="[NAME]", required=False)
@click.option("--pattern", metavar="GLOB", help="Every held lock whose name matches GLOB.")
@click.option("--holder", metavar="TASK_ID", help="The lock held by this task id.")
@click.option("--task", "task", metavar="NAME", help="Every lock held for this task name.")
@_YES_OPTION
@_FORCE_OPTION
@_TIMEOUT_OPTION
@click.pass_context
@one_line_errors
def release(
    ctx: click.Context,
    lock_name: str | None,
    pattern: str | None,
    holder: str | None,
    task: str | None,
    yes: bool,
    force: bool,
    timeout: float,
) -> None:
    """Force-release locks, whoever holds them, and hand each to its next waiter.

    Give exactly one of NAME, --pattern, --holder or --task. Asks first unless
    --yes. A lock whose holder a live worker is running is left to it unless
    --force: NAME and --holder refuse; --pattern and --task release the others,
    list those left, and exit with status 4. The holder is not stopped: it finds
    its lock lost at its next renewal. Only the holds listed are released: a lock
    that changed hands since is left to its new holder, and the command exits
    with status 3.
    """
    chosen = [x for x in (lock_name, pattern, holder, task) if x is not None]
    if len(chosen) != 1:
        raise Failure("give exactly one of NAME, --pattern GLOB, --holder TASK_ID, --task NAME", 2)
    if lock_name is not None:
        found = _named(ctx, lock_name)
        if not found:
            raise Failure(_no_lock_named(ctx, lock_name))
        what = f"named {lock_name}"
    elif pattern is not None:
        found = _collect(ctx, check_pattern(pattern))
        what = f"matching {pattern}"
        if not found:
            click.echo(f"no lock {what} is held")
            return
    elif holder is not None:
        found = _collect(ctx, holder=holder)
        what = f"held by {holder}"
        if not found:
            hint = (
                f"; {holder!r} is a lock's name: release it with `release {holder}`"
                if holder and _named(ctx, holder)
                else f"; {_list_hint(ctx)}"
            )
            raise Failure(f"no lock is held by task id {holder!r}{hint}")
    else:
        found = _collect(ctx, task=task)
        what = f"of task {task}"
        if not found:
            _nothing_of_task(ctx, what, task)
            return
    _release_all(
        ctx, found, what, yes, force, timeout, one_lock=lock_name is not None or holder is not None
    )


def _named(ctx: click.Context, lock_name: str) -> list[tuple[Store, LockInfo]]:
    """The held lock called ``lock_name``, in each of the app's lock stores."""
    return _each_store(
        ctx,
        lambda store: [
            info for info in [read_lock(store.client, lock_name, store.prefix)] if info is not None
        ],
    )


def _no_lock_named(ctx: click.Context, lock_name: str) -> str:
    """Why ``release NAME`` found nothing to release, and what to give it instead:
    the NAME may be a pattern, or the task id of a holder (``--holder``)."""
    said = f"no lock named {lock_name!r} is held"
    if is_glob(lock_name):
        return f"{said}; it looks like a pattern: use --pattern {lock_name!r}"
    held = _collect(ctx, holder=lock_name)
    if held:
        names = ", ".join(info.name for _, info in held)
        return f"{said}; {lock_name} is the task id holding {names}: use --holder {lock_name}"
    if _TASK_ID.fullmatch(lock_name):
        return (
            f"{said}, and no lock is held by task id {lock_name} either (--holder TASK_ID "
            f"releases by task id); {_list_hint(ctx)}"
        )
    return f"{said}; {_list_hint(ctx)}"


def _nothing_of_task(ctx: click.Context, what: str, task: str | None) -> None:
    """Say that no lock ``what`` is held: a message, or a failure if ``task`` names
    a task the app does not have (see :func:`_check_task_known`)."""
    _check_task_known(ctx, what, task)
    click.echo(f"no lock {what} is held")


def _check_task_known(ctx: click.Context, what: str, task: str | None) -> None:
    """Fail when ``--task`` matched no held lock and names a task the app does not
    have: a mistyped name must not look like success. (Locks held for a task the
    app no longer has are still found, and worked on, by its name.)"""
    app = ctx.obj.app
    if task is not None and task not in app.tasks:
        raise Failure(
            f"no lock {what} is held (app {app.main!r} has no task {task!r}; "
            f"{_singleton_tasks(app)})"
        )


def _singleton_tasks(app: Any) -> str:
    """The app's SingletonTasks, for a message about a task name it does not know."""
    from celery_redislock.task import SingletonTask

    known = sorted(n for n, t in app.tasks.items() if isinstance(t, SingletonTask))
    return "its SingletonTasks: " + (", ".join(known) or "none")


@redislock.command()
@click.option("--task", "task", metavar="NAME", help="Every lock held for this task name.")
@click.option(
    "--node", metavar="NODENAME", help="Every lock held by tasks running on this node (NAME@HOST)."
)
@click.option("--all", "everything", is_flag=True, help="Every lock of the app.")
@_YES_OPTION
@_FORCE_OPTION
@_TIMEOUT_OPTION
@click.pass_context
@one_line_errors
def purge(
    ctx: click.Context,
    task: str | None,
    node: str | None,
    everything: bool,
    yes: bool,
    force: bool,
    timeout: float,
) -> None:
    """Release every lock of a task, of a worker node, or of the app.

    The same checks as `release --task`: asks first unless --yes; a lock whose
    holder a live worker is running is left to it unless --force (the others are
    released, those left are listed, and the command exits with status 4). From
    Python: celery_redislock.admin.purge_locks(app, task=..., node=..., all=...).
    """
    if task is None and node is None and not everything:
        raise Failure("say what to purge: --task NAME, --node NODENAME or --all", 2)
    if node is not None and "@" not in node:
        raise Failure(
            f"--node takes a worker node name, NAME@HOST (as locks list it), not {node!r}", 2
        )
    found = [(store, info) for store, info in _collect(ctx, task=task) if node in (None, info.node)]
    what = " and ".join(
        part
        for part in (
            f"of task {task}" if task else "",
            f"on node {node}" if node else "",
            "of the app" if everything and not (task or node) else "",
        )
        if part
    )
    if not found:
        _nothing_of_task(ctx, what, task)
        return
    _release_all(ctx, found, what, yes, force, timeout)


@redislock.command()
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON (schema: celery_redislock.admin.STATS_SCHEMA).",
)
@click.pass_context
@one_line_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Held locks by task and state, queued waiters, and the oldest hold."""
    now = time.time()
    summary = lock_stats((info for _, info in _collect(ctx)), now)
    if as_json:
        _emit_json({**summary, "errors": _problem_list(ctx)})
        return
    click.echo(
        f"{summary['held']} lock(s) held, {summary['waiters']} waiter(s) queued{_partly(ctx)}"
    )
    if summary["by_task"]:
        rows = [("TASK", "RUNNING", "QUEUED", "OTHER", "WAITERS")]
        for task_name, counts in summary["by_task"].items():
            rows.append(
                (
                    task_name or "(no task)",
                    str(counts["running"]),
                    str(counts["queued"]),
                    str(counts["unknown"]),
                    str(counts["waiters"]),
                )
            )
        for line in _table(rows):
            click.echo(line)
    oldest = summary["oldest"]
    if oldest is not None:
        click.echo(
            f"oldest: {oldest['name']} ({_duration(oldest['age'])}, "
            f"holder {oldest['holder'] or '-'}, {oldest['state'] or 'no state'})"
        )
