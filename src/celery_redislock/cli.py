"""The ``celery redislock`` command: inspect and repair locks from a shell.

Installed as a plug-in of Celery's own command line (``celery.commands`` entry
point), so it runs against the app's configuration::

    celery -A proj redislock ping
    celery -A proj redislock list 'proj.tasks.purchase:*'
    celery -A proj redislock release 'proj.tasks.purchase:1f0c…'
"""

from __future__ import annotations

from typing import Any

import click

from celery_redislock.admin import force_release, list_locks
from celery_redislock.lock import DEFAULT_PREFIX
from celery_redislock.store import describe_store, lock_store


def _store(ctx: click.Context) -> tuple[Any, str]:
    app = ctx.obj.app
    prefix = app.conf.get("redislock_prefix") or DEFAULT_PREFIX
    return lock_store(app), str(prefix)


@click.group()
@click.pass_context
def redislock(ctx: click.Context) -> None:
    """Inspect and repair celery_redislock locks."""


@redislock.command()
@click.pass_context
def ping(ctx: click.Context) -> None:
    """Check that the lock store answers, and show its version."""
    client, _prefix = _store(ctx)
    info = client.info("server")
    version = info.get("valkey_version") or info.get("redis_version")
    click.echo(f"lock store {describe_store(ctx.obj.app)}: ok (server {version})")


@redislock.command(name="list")
@click.argument("pattern", default="*")
@click.pass_context
def list_(ctx: click.Context, pattern: str) -> None:
    """List held locks whose name matches PATTERN (a glob)."""
    client, prefix = _store(ctx)
    locks = list_locks(client, pattern, prefix)
    for info in locks:
        click.echo(
            f"{info.name}\tholder={info.holder or '-'}\tholds={info.count}"
            f"\tfence={info.fence}\tttl={info.ttl_ms / 1000:.1f}s"
        )
    click.echo(f"{len(locks)} lock(s) held")


@redislock.command()
@click.argument("name")
@click.pass_context
def release(ctx: click.Context, name: str) -> None:
    """Force-release lock NAME whoever holds it (the holder is not stopped)."""
    client, prefix = _store(ctx)
    if force_release(client, name, prefix):
        click.echo(f"released {name}")
    else:
        raise click.ClickException(f"no lock named {name!r} is held")
