"""Run every benchmark and summarise the project's performance targets in one table.

Usage::

    python bench/run_all.py [--quick] [--rounds R] [--markdown FILE] [--chart FILE] [--url URL]

Runs ``bench_lock.py --profile`` (the engine: goals 1, 4, 5, 6, 7) and then
``bench_task.py`` (Celery workers: goals 1, 2, 3), each in a process of its own
so neither inherits the other's connections, threads or locks. Their output is
shown as it comes; at the end every figure that has a target is listed with
``MET`` or ``NOT MET``. With ``--markdown FILE`` the same goes into a Markdown
report: machine, versions, date, the targets table and both scripts' output.

``--rounds R`` is passed to ``bench_task.py`` (rounds of its throughput section:
more of them narrow the spread on a noisy machine).

A default run takes about 5 minutes on a 2-core machine (two of them counting
instructions under valgrind, when it is installed), ``--quick`` about one.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Finding, describe_machine, load_findings

HERE = Path(__file__).resolve().parent

#: The scripts run, with the arguments each always gets.
SCRIPTS: list[tuple[str, list[str]]] = [
    ("bench_lock.py", ["--profile"]),
    ("bench_task.py", ["--profile"]),
]


def run_script(script: str, arguments: list[str], findings: Path) -> tuple[str, int, float]:
    """Run one benchmark script, echoing its output; return (output, exit status, seconds)."""
    command = [sys.executable, str(HERE / script), *arguments, "--json", str(findings)]
    print(f"$ python bench/{script} {' '.join(arguments)}".rstrip(), flush=True)
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    status = process.wait()
    return "".join(lines), status, time.monotonic() - started


def targets_table(findings: list[Finding], markdown: bool) -> list[str]:
    """The findings as a table: goal, figure, value, target, verdict."""
    if markdown:
        lines = ["| goal | figure | value | target | verdict |", "|---|---|---|---|---|"]
        for f in findings:
            verdict = f"**{f.verdict}**" if f.met is False else f.verdict
            lines.append(f"| {f.goal} | {f.what} | {f.value} | {f.target or '-'} | {verdict} |")
        return lines
    width = max((len(f.what) for f in findings), default=10)
    lines = [f"  {'goal':<4}  {'figure':<{width}}  {'value':>18}  {'target':<26}  verdict"]
    for f in findings:
        lines.append(
            f"  {f.goal:<4}  {f.what:<{width}}  {f.value:>18}  {f.target or '-':<26}  {f.verdict}"
        )
    return lines


#: A throughput finding: "<kind>/plain throughput, <work>, <pool> pool".
_RATIO = re.compile(r"^(?P<kind>.+)/plain throughput, (?P<work>[^,]+), (?P<pool>\w+) pool$")
#: A value "median (min-max)", or a bare median.
_SPREAD = re.compile(r"^(?P<median>[\d.]+)(?: \((?P<low>[\d.]+)-(?P<high>[\d.]+)\))?")


def draw_chart(findings: list[Finding], path: Path, caption: str) -> None:
    """Draw the throughput ratios to a plain task (median, with min-max whiskers),
    one group of bars per pool and kind of task, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, tuple[float, float, float]]] = {}
    for finding in findings:
        ratio, spread = _RATIO.match(finding.what), _SPREAD.match(finding.value)
        if ratio is None or spread is None:
            continue
        median = float(spread["median"])
        low = float(spread["low"] or median)
        high = float(spread["high"] or median)
        column = f"{ratio['pool']}, {ratio['work']}"
        series.setdefault(ratio["kind"], {})[column] = (median, low, high)
    columns = sorted({column for values in series.values() for column in values})
    if not columns:
        print("no throughput figures to chart")
        return
    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=100)
    width = 0.8 / max(1, len(series))
    for index, (kind, values) in enumerate(sorted(series.items())):
        xs = [position + index * width for position in range(len(columns))]
        medians = [values.get(column, (0.0, 0.0, 0.0))[0] for column in columns]
        below = [m - values.get(c, (m, m, m))[1] for m, c in zip(medians, columns, strict=True)]
        above = [values.get(c, (m, m, m))[2] - m for m, c in zip(medians, columns, strict=True)]
        axes.bar(xs, medians, width, yerr=[below, above], capsize=3, label=kind)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xticks([p + width * (len(series) - 1) / 2 for p in range(len(columns))])
    # Pool and measure on two lines: with six or more columns, one line each overlaps.
    axes.set_xticklabels([column.replace(", ", "\n", 1) for column in columns], fontsize=8)
    axes.set_ylabel("throughput / plain task (median, min-max)")
    axes.set_title(f"Task throughput relative to a plain task\n{caption}", fontsize=9)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run both scripts, print the targets table, and write the Markdown report if asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (about a minute)")
    parser.add_argument("--markdown", help="also write a Markdown report to this file")
    parser.add_argument("--url", help="a Redis URL for every script (default: private servers)")
    parser.add_argument("--rounds", type=int, help="rounds of bench_task.py's throughput section")
    parser.add_argument(
        "--chart", help="also draw the throughput ratios as a PNG chart (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    common = (["--quick"] if args.quick else []) + (["--url", args.url] if args.url else [])

    started = datetime.datetime.now(datetime.timezone.utc)
    machine = describe_machine()
    outputs: list[tuple[str, str, int, float]] = []
    findings: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        for script, extra in SCRIPTS:
            path = Path(scratch) / f"{script}.json"
            own = (
                ["--rounds", str(args.rounds)] if args.rounds and script == "bench_task.py" else []
            )
            output, status, seconds = run_script(script, [*extra, *common, *own], path)
            outputs.append((script, output, status, seconds))
            findings.extend(load_findings(path))
            print(flush=True)
    findings.sort(key=lambda f: f.goal)
    # The server the scripts ran against, as the first one reported it.
    machine += [
        line
        for line in outputs[0][1].splitlines()
        if line.startswith("server  :") or line.startswith("url     :")
    ][:2]
    total = sum(seconds for *_, seconds in outputs)

    print(f"Targets ({total:.0f} s in all):")
    for line in targets_table([f for f in findings if f.met is not None], markdown=False):
        print(line)
    print("Other figures (no target):")
    for line in targets_table([f for f in findings if f.met is None], markdown=False):
        print(line)
    failed = [script for script, _, status, _ in outputs if status]
    for script in failed:
        print(f"  {script} exited with an error: its figures are incomplete")

    if args.chart:
        where = machine[0].split(":", 1)[-1].strip()
        draw_chart(findings, Path(args.chart), f"{started:%Y-%m-%d}, {where}")
        print(f"chart written to {args.chart}")

    if args.markdown:
        report = [
            "# Benchmark report",
            "",
            f"- date: {started:%Y-%m-%d %H:%M} UTC",
            f"- command: `{' '.join(['python bench/run_all.py', *(argv or sys.argv[1:])])}`",
            *(f"- {line}" for line in machine),
            f"- time taken: {total:.0f} s",
            "",
            "## Targets",
            "",
            *targets_table([f for f in findings if f.met is not None], markdown=True),
            "",
            "## Other figures",
            "",
            *targets_table([f for f in findings if f.met is None], markdown=True),
            "",
        ]
        for script, output, status, seconds in outputs:
            report += [
                f"## {script} ({seconds:.0f} s{', exited with an error' if status else ''})",
                "",
                "```text",
                output.rstrip(),
                "```",
                "",
            ]
        Path(args.markdown).write_text("\n".join(report))
        print(f"\nMarkdown report written to {args.markdown}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
