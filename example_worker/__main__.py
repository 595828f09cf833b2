"""``python -m example_worker`` (also the ``seckill`` command).

Modes:

(default)         start an embedded Redis unless ``REDIS_URL`` is set, start
                  ``--workers`` worker processes, run the batch, print the
                  report, stop everything; exit 1 if an invariant failed.
``--no-lock``     the same batch on a plain task, to show the oversell.
``--enqueue-only`` run the batch on workers already running against ``REDIS_URL``
                  (the compose ``seckill`` service).
``--worker``      run one worker in the foreground (the compose ``worker`` service).

Counts default to the ``SECKILL_*`` environment variables, then 10 tickets,
50 buyers, 4 workers, every 5th buyer double-clicking.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from celery_redislock import ServerNotFoundError
from celery_redislock.client import url_shown
from celery_redislock.server import RedisServer
from example_worker import interrupt


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"seckill: {name}={raw!r} is not a whole number") from None


def _env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"seckill: {name}={raw!r} is not a number") from None


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The command line; defaults come from ``environ``."""
    parser = argparse.ArgumentParser(
        prog="seckill",
        description=(
            "The celery_redislock seckill demo: buyers race for a few tickets; "
            "with the lock exactly as many are sold as exist."
        ),
        epilog=(
            "Environment: REDIS_URL (broker, results and locks; unset: an embedded "
            "Redis is started), BROKER_URL / RESULT_BACKEND / REDISLOCK_URL "
            "(overrides), SECKILL_TICKETS, SECKILL_BUYERS, SECKILL_WORKERS, "
            "SECKILL_DOUBLE_CLICK_EVERY, SECKILL_TIMEOUT, SECKILL_QUEUE."
        ),
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--enqueue-only",
        action="store_true",
        help="use workers already running against REDIS_URL: enqueue, wait, report",
    )
    mode.add_argument("--worker", action="store_true", help="run one worker in the foreground")
    parser.add_argument(
        "--no-lock",
        action="store_true",
        help="run the batch on a plain task (no lock, no dedup) to show the race",
    )
    parser.add_argument(
        "--tickets",
        type=_count(0),
        default=_env_int(environ, "SECKILL_TICKETS", 10),
        help="tickets on sale (default %(default)s)",
    )
    parser.add_argument(
        "--buyers",
        type=_count(1),
        default=_env_int(environ, "SECKILL_BUYERS", 50),
        help="distinct buyers (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=_count(0),
        default=_env_int(environ, "SECKILL_WORKERS", -1),
        help="worker processes to start (default 4); with --enqueue-only, how many "
        "running workers to wait for (default: whoever answers)",
    )
    parser.add_argument(
        "--double-click-every",
        type=_count(0),
        default=_env_int(environ, "SECKILL_DOUBLE_CLICK_EVERY", 5),
        metavar="N",
        help="every N-th buyer clicks twice (0: nobody; default %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=_env_float(environ, "SECKILL_TIMEOUT", 120.0),
        help="seconds to wait for the batch (default %(default)s)",
    )
    parser.add_argument(
        "--think",
        type=float,
        default=None,
        help="seconds between a buyer's stock check and the decrement (default 0.01)",
    )
    parser.add_argument(
        "--queue",
        default=environ.get("SECKILL_QUEUE") or "seckill",
        help="the queue idle workers consume (default %(default)s)",
    )
    parser.add_argument("--name", help="--worker: the worker's node name")
    parser.add_argument(
        "--loglevel", default="INFO", help="--worker: log level (default %(default)s)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m example_worker`` and ``seckill``."""
    args = build_parser(os.environ).parse_args(argv)
    if args.worker:
        from example_worker.run import run_worker

        return run_worker(queue=args.queue, name=args.name, loglevel=args.loglevel)

    # SIGTERM (docker stop, kill) ends the run like Ctrl-C: everything started is stopped.
    interrupt.install()
    server: RedisServer | None = None
    try:
        if not os.environ.get("REDIS_URL"):
            if args.enqueue_only:
                print(
                    "seckill: --enqueue-only needs REDIS_URL (the workers' Redis)", file=sys.stderr
                )
                return 2
            server = RedisServer().start()
            os.environ["REDIS_URL"] = server.url
            print(
                f"[seckill] REDIS_URL not set: started an embedded {server.version()} "
                f"at {server.url}",
                file=sys.stderr,
            )
        import redis

        from example_worker import run
        from example_worker.tasks import THINK_SECONDS

        workers = args.workers
        if workers < 0:
            workers = 0 if args.enqueue_only else 4
        if not args.enqueue_only and workers < 1:
            print("seckill: --workers must be at least 1", file=sys.stderr)
            return 2
        options = run.Options(
            tickets=args.tickets,
            buyers=args.buyers,
            workers=workers,
            double_click_every=args.double_click_every,
            locked=not args.no_lock,
            timeout=args.timeout,
            think=THINK_SECONDS if args.think is None else args.think,
            queue=args.queue,
            json_path=args.json,
        )
        try:
            return run.run_batch(options, start_workers=not args.enqueue_only)
        except run.RunError as exc:
            print(f"seckill: {exc}", file=sys.stderr)
            return 1
        except redis.ConnectionError as exc:
            print(
                f"seckill: cannot reach Redis at {url_shown(os.environ['REDIS_URL'])}: {exc}",
                file=sys.stderr,
            )
            return 1
    except ServerNotFoundError as exc:
        print(f"seckill: REDIS_URL is not set and {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[seckill] interrupted: stopping what this run started", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            # The task results still in reference cycles, collected while their
            # backend is up: Celery before 5.7 reconnects to it as each is collected,
            # retrying for 20 s each once the server has stopped.
            gc.collect()
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
