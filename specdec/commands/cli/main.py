"""The ``specdec`` command line: the group, its commands, and the one place where errors become
exit statuses.

Every command's bad input ends in one line on stderr and exit status 2, never a traceback.
Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import sys

import click

from specdec import __version__
from specdec.commands.bench.peers.cli import bench_peers_cmd
from specdec.commands.bench.serve import bench_serve_cmd
from specdec.commands.cli import bench, bundle, check, demo, generate, plan, serve, train
from specdec.errors import SpecDecError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdec")
def cli() -> None:
    """Exact speculative decoding: plan it, export models to a bundle, run them on ONNX Runtime."""


for command in (plan.plan_cmd, bundle.export_cmd, bundle.inspect_cmd, bundle.push_cmd, train.train_drafter_cmd, train.distill_cmd, train.distill_merge_cmd,
                check.check_cmd, generate.generate_cmd, bench.bench_cmd, bench.bench_batch_cmd, bench_serve_cmd, bench_peers_cmd,
                serve.serve_cmd, demo.demo_cmd):  # fmt: skip
    cli.add_command(command)


def run(command: click.Command, argv: list[str] | None, prog_name: str) -> None:
    """Run a click command; user errors become one line on stderr and exit status 2."""
    try:
        command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except SpecDecError as e:
        click.echo(f"{prog_name}: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as e:  # bare `specdec`: help on stdout, like --help
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.ClickException as e:
        click.echo(f"{prog_name}: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo(f"{prog_name}: aborted", err=True)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """The ``specdec`` console script."""
    run(cli, argv, "specdec")


def export_main(argv: list[str] | None = None) -> None:
    """The ``specdec-export`` console script: the same command as ``specdec export``."""
    run(bundle.export_cmd, argv, "specdec-export")


if __name__ == "__main__":
    main()
