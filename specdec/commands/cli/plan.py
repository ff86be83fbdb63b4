"""``specdec plan``: γ (or a tree's shape) from measured acceptance and cost (paper §3).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from specdec.errors import ConfigError


@click.command("plan")
@click.option("--alpha", type=float, default=None, help="Acceptance rate α in (0, 1) (a chain drafter).")
@click.option("--cost", type=float, required=True, help="c: draft call time / target call time (>= 0).")
@click.option("--cost-ops", type=float, default=None, help="ĉ: draft / target arithmetic per token [default: --cost].")
@click.option("--gamma", type=int, default=None, help="Draft tokens per target call (>= 1) [default: the optimal γ].")
@click.option("--max-gamma", type=int, default=32, show_default=True, help="Largest γ the search considers.")
@click.option("--verify-cost", type=float, default=1.0, show_default=True, help="v: a (γ+1)-token verify call / a 1-token call (`specdec bench` measures it).")
@click.option("--rank-acceptance", default=None, help="A tree drafter's kept share per sibling rank, comma-separated "
              "(`specdec bench --drafters feature-tree` reports them): plan tree shapes instead of γ.")
@click.option("--tree-cost", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="With --rank-acceptance: a tree call's cost against a 1-token call per node count (tools/bench_tree_cost.py's JSON).")
@click.option("--batch", default=None, help="Each row's α in one batched call, comma-separated (e.g. 0.9,0.3,0.3,0.3): the γ all of "
              "them verify at, as --gamma auto chooses it under load (--cost and --verify-cost then in plain steps of that batch).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan_cmd(alpha, cost, cost_ops, gamma, max_gamma, verify_cost, rank_acceptance, tree_cost, batch, as_json) -> None:
    """Expected tokens, speedup and operations for γ (paper §3), choosing γ when not given; with
    --rank-acceptance and --tree-cost, the best tree shape (depth x width) for a measured cost curve;
    with --batch, the γ of a batched call over rows of different acceptance."""
    from specdec.runtime.analysis import plan

    if rank_acceptance is not None:
        return _plan_trees(rank_acceptance, cost, tree_cost, max_gamma, as_json)
    if batch is not None:
        return _plan_batch(batch, cost, verify_cost, min(max_gamma, 16), as_json)
    if alpha is None:
        raise ConfigError("--alpha is missing: expected the acceptance rate in (0, 1), or --rank-acceptance for a tree drafter")
    chosen = plan(alpha, cost, cost_ops, gamma, max_gamma, verify_cost)
    if as_json:
        click.echo(json.dumps(chosen._asdict()))
        return
    c_hat = cost if cost_ops is None else cost_ops
    click.echo(f"alpha={alpha:g}  c={cost:g}  c_hat={c_hat:g}  v={verify_cost:g}")
    click.echo(f"{'gamma':>5}  {'E[tokens]':>9}  {'speedup':>7}  {'operations':>10}")
    shown = sorted({1, 2, 3, 4, 5, 6, 7, 8, max(chosen.gamma, 1)})
    for g in shown:
        row = plan(alpha, cost, cost_ops, g, verify_cost=verify_cost)
        mark = "  <- chosen" if g == chosen.gamma else ""
        click.echo(f"{g:>5}  {row.expected_tokens:>9.3f}  {row.speedup:>6.3f}x  {row.operations:>9.3f}x{mark}")
    if chosen.gamma == 0:
        click.echo(f"no gamma pays: alpha={alpha:g} <= c={cost:g} (Corollary 3.9); decode without a draft")
    elif gamma is None and chosen.gamma == max_gamma:
        click.echo(f"gamma is capped at --max-gamma={max_gamma}; larger gamma would still gain a little")


def _plan_batch(batch: str, cost: float, verify_cost: float, max_gamma: int, as_json: bool) -> None:
    """The batch's speedup over plain decoding per γ, and the γ that maximizes it (0: plain)."""
    from specdec.runtime.analysis import batch_speedup

    try:
        alphas = [float(x) for x in batch.split(",")]
    except ValueError:
        raise ConfigError(f"--batch {batch!r}: expected comma-separated acceptance rates in (0, 1), one per row, e.g. 0.9,0.3,0.3") from None
    speedups = {g: batch_speedup(alphas, g, cost, verify_cost) for g in range(max_gamma + 1)}
    best = max(speedups, key=lambda g: (speedups[g], -g))
    if as_json:
        click.echo(json.dumps({"gamma": best, "speedup": speedups[best], "speedups": speedups, "rows": len(alphas)}))
        return
    click.echo(f"{len(alphas)} rows, alpha {', '.join(f'{a:g}' for a in alphas)}  c={cost:g}  v={verify_cost:g} (in plain steps of this batch)")
    click.echo(f"{'gamma':>5}  {'speedup':>7}")
    for g in sorted(set(range(min(max_gamma, 8) + 1)) | {best}):
        click.echo(f"{g:>5}  {speedups[g]:>6.3f}x{'  <- chosen' if g == best else ''}")
    if best == 0:
        click.echo("no gamma pays for this batch: decode it plainly (--gamma auto does, and probes gamma 1 now and then)")


def _plan_trees(rank_acceptance: str, cost: float, tree_cost: Path | None, max_depth: int, as_json: bool) -> None:
    from specdec.runtime.analysis import best_tree_tokens, plan_trees

    try:
        ranks = [float(x) for x in rank_acceptance.split(",")]
    except ValueError:
        raise ConfigError(f"--rank-acceptance={rank_acceptance!r}: expected comma-separated shares such as 0.6,0.1,0.05") from None
    if tree_cost is None:
        raise ConfigError("--tree-cost is missing: expected tools/bench_tree_cost.py's JSON (a tree call's cost per node count)")
    try:
        curve = {int(r["nodes"]): float(r["vs_one_token"]) for r in json.loads(tree_cost.read_text())["rows"] if r["graph"].startswith("tree")}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--tree-cost={tree_cost}: expected tools/bench_tree_cost.py's JSON with rows of nodes and vs_one_token") from None
    rows = plan_trees(ranks, cost, curve, min(max_depth, 16))
    if as_json:
        click.echo(json.dumps([r._asdict() for r in rows]))
        return
    best = rows[0]
    click.echo(f"kept by rank={','.join(f'{x:g}' for x in ranks)}  c={cost:g}  tree cost curve: {tree_cost}")
    click.echo(f"{'depth':>5}  {'width':>5}  {'nodes':>5}  {'E[tokens]':>9}  {'v':>5}  {'speedup':>7}")
    for r in rows[:8]:
        mark = "  <- chosen" if r is best else ""
        click.echo(f"{r.depth:>5}  {r.width:>5}  {r.nodes:>5}  {r.expected_tokens:>9.3f}  {r.verify_cost:>5.2f}  {r.speedup:>6.3f}x{mark}")
    click.echo(f"export --tree-nodes {best.nodes} and decode with --drafter feature-tree --gamma {best.depth}"
               if best.width > 1 else f"a chain pays most: --drafter feature --gamma {best.depth}")
    click.echo(f"the best static tree of {best.nodes} nodes under the same model: {best_tree_tokens(ranks, best.nodes):.3f} tokens per call "
               "(what a dynamic tree could reach; the feature tree offers siblings along its chain only)")
