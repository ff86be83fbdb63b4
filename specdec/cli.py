"""The ``specdec`` command line.

Every command's bad input ends in one line on stderr and exit status 2, never a traceback.
Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import sys

import click

from specdec import __version__
from specdec.errors import SpecDecError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdec")
def cli() -> None:
    """Exact speculative decoding: plan it, export models to a bundle, run them on ONNX Runtime."""


@cli.command("plan")
@click.option("--alpha", type=float, required=True, help="Acceptance rate α in (0, 1).")
@click.option("--cost", type=float, required=True, help="c: draft call time / target call time (>= 0).")
@click.option("--cost-ops", type=float, default=None, help="ĉ: draft / target arithmetic per token [default: --cost].")
@click.option("--gamma", type=int, default=None, help="Draft tokens per target call (>= 1) [default: the optimal γ].")
@click.option("--max-gamma", type=int, default=32, show_default=True, help="Largest γ the search considers.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan_cmd(alpha: float, cost: float, cost_ops: float | None, gamma: int | None, max_gamma: int, as_json: bool) -> None:
    """Expected tokens, speedup and operations for γ (paper §3), choosing γ when not given."""
    from specdec.runtime.analysis import plan

    chosen = plan(alpha, cost, cost_ops, gamma, max_gamma)
    if as_json:
        click.echo(json.dumps(chosen._asdict()))
        return
    c_hat = cost if cost_ops is None else cost_ops
    click.echo(f"alpha={alpha:g}  c={cost:g}  c_hat={c_hat:g}")
    click.echo(f"{'gamma':>5}  {'E[tokens]':>9}  {'speedup':>7}  {'operations':>10}")
    shown = sorted({1, 2, 3, 4, 5, 6, 7, 8, max(chosen.gamma, 1)})
    for g in shown:
        row = plan(alpha, cost, cost_ops, g)
        mark = "  <- chosen" if g == chosen.gamma else ""
        click.echo(f"{g:>5}  {row.expected_tokens:>9.3f}  {row.speedup:>6.3f}x  {row.operations:>9.3f}x{mark}")
    if chosen.gamma == 0:
        click.echo(f"no gamma pays: alpha={alpha:g} <= c={cost:g} (Corollary 3.9); decode without a draft")
    elif gamma is None and chosen.gamma == max_gamma:
        click.echo(f"gamma is capped at --max-gamma={max_gamma}; larger gamma would still gain a little")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group and turn user errors into one line and exit 2."""
    try:
        cli.main(args=argv, prog_name="specdec", standalone_mode=False)
    except SpecDecError as e:
        click.echo(f"specdec: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as e:  # bare `specdec`: help on stdout, like --help
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.ClickException as e:
        click.echo(f"specdec: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("specdec: aborted", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
