"""The ``autopar`` command line: compile, show, codegen, verify, estimate, calibrate."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import textwrap
import warnings

from autopar.cost_models.optimizer import OPTIMIZER_STATES
from autopar.errors import AutoparError


def _compile(args) -> int:
    from autopar.compiler import compile as compile_plan
    from autopar.outputs import check_dir, check_file, is_plan
    from autopar.runtime import load_factory
    from autopar.report import show

    check_file(args.output, "compile -o", is_plan)  # before the solve, which may take minutes
    if args.cache:
        check_dir(args.cache, "--cache", force=True)
    dynamic, dims = _dynamic(args)
    model, inputs, loss_fn = load_factory(args.source)
    memory = _parse_bytes(args.memory) if args.memory else None
    plan = compile_plan(model, inputs, mesh=args.mesh, cluster=args.cluster, loss_fn=loss_fn, memory=memory,
                        optimizer=args.optimizer, precision=args.precision, recompute=args.recompute,
                        opt_level=args.opt_level, time_limit_s=args.time_limit, relative_gap=args.gap,
                        solver=args.solver, source=args.source, deterministic=args.deterministic,
                        pipeline_stages=_stages(args.pp), microbatches=args.microbatches, schedule=args.schedule,
                        cache=args.cache, offload=not args.no_offload,
                        **({"dynamic": dynamic, "dims": dims, "tolerance": args.tolerance} if dynamic else {}))
    plan.save(args.output)
    if args.coverage:
        if plan.fallbacks:
            print(f"{len(plan.fallbacks)} op(s) fell back to replication:")
            for f in plan.fallbacks:
                why = f"  ({f['reason']})" if f.get("reason") else ""
                print(f"  {f['op']:40s} node {f['node']:24s} at {f['location']}{why}")
        else:
            print("coverage: every op has a sharding rule (no replication fallback)")
    if not args.quiet:
        show(plan)
    if args.verbose and "timings" in plan.solver:
        print("timing: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in plan.solver["timings"].items()))
        print("recompute candidates: " + "; ".join(
            f"{c['recompute']}: {c['status']}" + (f" {c['objective'] * 1e3:.3f} ms" if "objective" in c else "")
            for c in plan.recompute.get("candidates", [])))
    print(f"plan written to {args.output}")
    return 0


def _dynamic(args) -> tuple:
    """``--dynamic batch=4..32`` (repeatable) and ``--dims seq=0.1,1.1`` as compile's dynamic and dims."""
    from autopar.dynamic.symbols import parse_dims, parse_range
    dynamic = dict(parse_range(t) for t in args.dynamic or [])
    dims = dict(parse_dims(t) for t in args.dims or []) or None
    if dims and not dynamic:
        raise AutoparError("--dims names the input dims of --dynamic symbols: give --dynamic NAME=LOW..HIGH too")
    return dynamic or None, dims


def _stages(text):
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise AutoparError(f"--pp {text!r}: give a number of pipeline stages or 'auto'") from None


def _show(args) -> int:
    from autopar.plan import Plan
    from autopar.report import show

    show(Plan.load(args.plan), all_nodes=args.all)
    return 0


def _codegen(args) -> int:
    from autopar.capture import capture
    from autopar.codegen import write_program
    from autopar.outputs import check_dir
    from autopar.plan import Plan
    from autopar.runtime import load_factory

    plan = Plan.load(args.plan)
    source = plan.model.get("source")
    if not source:
        raise AutoparError(f"{args.plan} does not name its model (compile it with `autopar compile FILE.py:FACTORY`)")
    check_dir(args.output, "codegen -o", force=args.force)
    model, inputs, loss_fn = load_factory(source)
    stages = pieces = None
    if plan.pipeline:
        from autopar.pipeline_runtime import stage_sources
        stages = stage_sources(model, plan, loss_fn)
    if plan.dynamic:
        from autopar.dynamic.runtime import piece_sources
        pieces = piece_sources(model, inputs, loss_fn, plan)
    entry = write_program(plan, capture(model, inputs, loss_fn), args.output, stages, pieces)
    programs = "stage_<chunk>.py" if plan.pipeline else "piece_<i>.py" if plan.dynamic else "rank_program.py"
    print(f"wrote {entry}, {os.path.join(args.output, programs)} and plan.json")
    print(f"run it with: torchrun --nproc-per-node {plan.mesh.size} {entry} --check")
    return 0


def _verify(args) -> int:
    """Launch torchrun on this machine to check a plan against single-device training."""
    from autopar.mesh import parse_mesh
    from autopar.pipeline import Schedule
    from autopar.verify import RECOMPUTE

    n = parse_mesh(args.mesh).size
    if args.plan:
        from autopar.plan import Plan
        from autopar.verify import mesh_problem
        problem = mesh_problem(Plan.load(args.plan), args.mesh)
        if problem:
            raise SystemExit(f"autopar verify: {problem}")
    for flag, valid in (("recompute", RECOMPUTE), ("schedule", [s.value for s in Schedule])):
        given = getattr(args, flag)
        for value in given.split(",") if given else []:
            if value not in valid:  # before launching n processes that would each refuse it
                raise SystemExit(f"autopar verify: --{flag} {value!r} is not one of {', '.join(valid)} "
                                 "(comma-separated to check several)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m", "autopar.verify",
           args.source, "--mesh", args.mesh, "--cluster", args.cluster, "--steps", str(args.steps),
           "--random-plans", str(args.random_plans)]
    if args.plan:
        cmd += ["--plan", args.plan]
    if args.tol is not None:
        cmd += ["--tol", str(args.tol)]
    if args.precision != "auto":
        cmd += ["--precision", args.precision]
    for flag in ("microbatches", "schedule", "recompute"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    print("$", " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun"), flush=True)
    return subprocess.call(cmd)


def _parse_bytes(text: str) -> float:
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        return float(num) * units[unit]
    except (ValueError, KeyError):
        raise AutoparError(f"memory {text!r} is not a size; write e.g. 80GB, 40GiB or 1e9") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization compiler for PyTorch")
    p.add_argument("-v", "--verbose", action="store_true", help="print phases and a timing breakdown")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="plan a model: FILE.py:FACTORY -> plan.json")
    c.add_argument("source", help="FILE.py:FACTORY returning (model, example_inputs[, loss_fn])")
    c.add_argument("--mesh", required=True, help="e.g. 4, 2x2 or dp=2,tp=2")
    c.add_argument("--cluster", required=True, help="a preset (dgx-a100, dgx-h100, h200, p3.16xlarge, cpu) or a JSON file")
    c.add_argument("--memory", help="per-device memory budget, e.g. 80GB (default: the device's)")
    c.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype priced (bf16/fp16: mixed precision with fp32 master weights)")
    c.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES),
                   help="optimizer whose state is counted in memory and whose step is priced: torch.optim's "
                        "default (a pass per op), or '-fused' for a one-kernel update (torch's fused=True, apex, "
                        "Transformer Engine)")
    c.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"],
                   help="activation recomputation: selective = the memory-heavy pieces of each layer "
                        "(an attention core), full = whole layers, auto = the fastest that fits")
    c.add_argument("-O", dest="opt_level", type=int, default=1, choices=[1, 2],
                   help="-O1: cluster repeated layers (seconds); -O2: wider search")
    c.add_argument("--pp", help="pipeline stages (a number), or 'auto' to let the planner decide; default: auto "
                                "where the mesh spans more than one node of the cluster; 1 never pipelines")
    c.add_argument("--microbatches", type=int,
                   help="microbatches per step: a pipeline's, or, without one, gradient accumulation "
                        "(default: chosen by the planner for a pipeline, 1 without)")
    c.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], help="pipeline schedule")
    c.add_argument("--no-offload", action="store_true",
                   help="keep every parameter's optimizer state in device memory (by default the planner may keep "
                        "some in host memory, updated there, where device memory binds and the cluster has a host)")
    c.add_argument("--dynamic", action="append", metavar="NAME=LOW..HIGH[:STEP]",
                   help="plan one compile for a range of sizes (repeatable), e.g. batch=4..32 or seq=128..4096:128; "
                        "batch names dim 0 and seq dim 1 of every input, other names need --dims")
    c.add_argument("--dims", action="append", metavar="NAME=INPUT.DIM,...",
                   help="which input dims a --dynamic symbol names, e.g. seq=0.1,1.1 (dim 1 of inputs 0 and 1)")
    c.add_argument("--tolerance", type=float, default=0.01,
                   help="with --dynamic: how much slower than each size's optimum a piece's plan may be "
                        "(default 0.01: 1%%; 0 keeps a piece for every change of the optimal plan)")
    c.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds")
    c.add_argument("--gap", type=float, default=1e-4, help="relative MIP gap at which the solver stops")
    c.add_argument("--deterministic", action="store_true",
                   help="leave wall-clock times out of plan.json (byte-identical for equal inputs)")
    c.add_argument("--solver", default="HIGHS", choices=["HIGHS", "SCIP", "CBC", "CP_SAT"])
    c.add_argument("--coverage", action="store_true", help="list ops that fell back to replication")
    c.add_argument("--cache", metavar="DIR",
                   help="reuse plans solved before for the same model, mesh, cluster and options, and a pipeline "
                        "search's solved layer classes (stored in DIR)")
    c.add_argument("-q", "--quiet", action="store_true", help="do not print the plan summary")
    c.add_argument("-o", "--output", default="plan.json")
    c.set_defaults(fn=_compile)

    s = sub.add_parser("show", help="summarise a plan.json")
    s.add_argument("plan")
    s.add_argument("--all", action="store_true", help="list every node")
    s.set_defaults(fn=_show)

    g = sub.add_parser("codegen", help="write the per-rank program for a plan")
    g.add_argument("plan")
    g.add_argument("-o", "--output", required=True, help="output directory (new or empty, unless --force)")
    g.add_argument("--force", action="store_true",
                   help="write into a non-empty output directory, replacing train.py, plan.json and the programs")
    g.set_defaults(fn=_codegen)

    v = sub.add_parser("verify", help="run a plan on local gloo ranks and compare with one device")
    v.add_argument("source")
    v.add_argument("--mesh", required=True)
    v.add_argument("--cluster", default="cpu")
    v.add_argument("--plan", help="check this plan.json instead of compiling")
    v.add_argument("--steps", type=int, default=2)
    v.add_argument("--random-plans", type=int, default=0)
    v.add_argument("--precision", default="auto", choices=["auto", "float64", "model"],
                   help="auto (default): check a model that computes in float32 in float64, where rounding cannot "
                   "hide a wrong result; float64: cast any model to float64; model: its own dtypes")
    v.add_argument("--tol", type=float, help="relative tolerance (default: 1e-7 in float64, 1e-5 in float32, or "
                   "for a model computing in bfloat16 or float16, torch.testing.assert_close's default for that dtype)")
    v.add_argument("--microbatches", type=int, help="microbatches of a pipelined plan (a mesh with a pp axis)")
    v.add_argument("--schedule", help="pipeline schedule(s), comma-separated: gpipe, 1f1b, interleaved-1f1b")
    v.add_argument("--recompute", help="none, selective, full or auto; comma-separated to check several")
    v.set_defaults(fn=_verify)
    o = sub.add_parser("ops", help="list the ops with a sharding rule, and what each rule splits")
    o.add_argument("query", nargs="?", help="only ops whose name contains this (e.g. lstm, softmax)")
    o.add_argument("--markdown", action="store_true", help="the full table as Markdown (docs/ops.md)")
    o.set_defaults(fn=_ops)
    for name, (_, _, text) in OWN_PARSERS.items():
        sub.add_parser(name, help=text, add_help=False)  # listed in --help; parsed by its own module
    return p


def _ops(args) -> int:
    from autopar.passes.rules import rule_table
    table = rule_table()
    if args.markdown:
        print(ops_markdown(table), end="")
        return 0
    query = (args.query or "").lower()
    shown = 0
    for module, fn, ops in table:
        ops = [op for op in ops if query in op.lower()]
        if not ops:
            continue
        shown += len(ops)
        print(f"{module}.{fn.__name__}: {', '.join(ops)}")
        print(textwrap.indent(textwrap.fill(" ".join(fn.__doc__.split()), 96), "    "))
    if not shown:
        print(f"no op matching {args.query!r} has a sharding rule: it runs replicated on every device, "
              "and `autopar compile` warns about it")
        return 1
    return 0


def ops_markdown(table) -> str:
    """docs/ops.md: every rule, its ops and what it splits (``autopar ops --markdown``)."""
    n_ops = sum(len(ops) for _, _, ops in table)
    lines = [
        "# Ops with a sharding rule",
        "",
        f"{n_ops} ATen ops in {len(table)} rules (`passes/rules/`), as `autopar ops --markdown` prints them. An op "
        "that is not here runs replicated on every device, and `autopar compile` warns about it (`--coverage` "
        "lists them); a rule may also decline for some arguments, saying why. Names are as plans print them "
        "(`aten.` and `.default` left out). `autopar ops QUERY` searches from the command line.",
        "",
        "| rule | what splits | ops |",
        "|---|---|---|",
    ]
    for module, fn, ops in table:
        doc = " ".join(fn.__doc__.split()).replace("|", "\\|")
        lines.append(f"| `{module}.{fn.__name__}` | {doc} | {', '.join(f'`{op}`' for op in ops)} |")
    return "\n".join(lines) + "\n"


# Commands that parse their own arguments: name -> (module, function, help).
OWN_PARSERS = {
    "estimate": ("autopar.cost_models.estimate_cli", "estimate_main",
                 "price a hand-written GPT/Llama plan (tp, pp, dp, ...) with the cost model"),
    "calibrate": ("autopar.cost_models.estimate_cli", "calibrate_main",
                  "measure this machine and write a cluster profile"),
    "viz": ("autopar.viz", "viz_main", "write a self-contained HTML view of one or two plans"),
    "diff": ("autopar.plandiff", "diff_main", "compare two plans: placements and where the cost moves"),
    "explain": ("autopar.explain", "explain_main", "why a node or parameter got its strategy"),
}


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """autopar's own warnings as one line ("autopar: warning: ..."), without
    the source location Python adds; others as Python formats them."""
    text = str(message)
    if text.startswith("autopar: "):
        return f"autopar: warning: {text[len('autopar: '):]}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_PARSERS:
        import importlib
        module, fn, _ = OWN_PARSERS[argv[0]]
        return getattr(importlib.import_module(module), fn)(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    warnings.formatwarning = _format_warning
    try:
        return args.fn(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
