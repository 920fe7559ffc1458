"""`orca-calibrate`: the offline job, one subcommand per stage; every stage reads and writes files.

Bad input ends with one line on stderr and exit code 2, never a traceback: a bad option or
value too (the parser is orca-serve's one-line parser, `orca_serve.checks.argtypes.OneLineParser`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orca_calibrate.collect import Collector, CollectSettings, read_prompts
from orca_calibrate.group_options import GroupOptions
from orca_calibrate.job import JobError, collect_shard, load_job, run_job
from orca_calibrate.job_options import DEFAULT_DELTAS, DEFAULT_WINDOW, GateOptions, LttOptions
from orca_calibrate.judge import JudgeError, JudgeSettings
from orca_calibrate.plan import DEFAULT_PILOT
from orca_calibrate.probe_variants import PROBES
from orca_calibrate.synth import disk_room, generate
from orca_calibrate.train_defaults import DEFAULT_D_H, DEFAULT_PROBE, DEFAULTS, EPOCH_SELECT
from orca_method.answer_probes import CONSISTENT, SUPERVISED
from orca_method.covariate_shift import DEFAULT_RATIO_RANK
from orca_method.ltt import DEFAULT_EPSILON
from orca_method.normalizations import DEFAULT_NORMALIZATION, NORMALIZATIONS
from orca_method.outcomes import PVALUE_CHOICES, PValue
from orca_method.shift_gate import (
    DEFAULT_GATE_ALPHA,
    DEFAULT_GATE_GIVE_UP_ALPHA,
    DEFAULT_GATE_RANK,
    DEFAULT_GATE_STEPS,
)
from orca_method.trajectories import (
    ALL,
    DTYPES,
    SPLITS,
    STORED_DTYPE,
    Split,
    TrajectoryError,
    TrajectorySet,
    import_pickle,
)
from orca_serve.checks.argtypes import (
    OneLineParser,
    OptionError,
    fraction,
    integer,
    out_dir,
    out_file,
)
from orca_serve.checks.errors import Stopped, exit_on_sigterm
from orca_serve.live_audit.options import EPSILON_SPLITS, EpsilonSplit

if TYPE_CHECKING:
    from orca_method.bundle import Bundle

# the shard a pod of a Kubernetes indexed Job collects: its completion index, set by Kubernetes
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"


class UsageError(Exception):
    """Bad input the user can fix; printed as one line."""


def training_options(a: argparse.Namespace) -> dict:
    """The `meta_train` settings given on the command line (None = the default)."""
    return {"epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr, "warmup": a.warmup,
            "epoch_select": a.epoch_select}


def _open(path: str, pickle_labels: str = "pessimistic"):
    return TrajectorySet.open(path, pickle_labels=pickle_labels)


def cmd_synth(a: argparse.Namespace) -> None:
    need, free = disk_room(a.out, a.problems, a.dim, a.steps, a.dtype)
    if need > free:  # it wrote until killed (10^11 problems: 11.5 GB before the kill)
        raise UsageError(f"the set needs about {need / 2**30:,.1f} GiB of step embeddings "
                         f"({a.problems:,} problems x {a.steps} steps x {a.dim} x {a.dtype}), "
                         f"more than the {free / 2**30:,.1f} GiB free where --out is; lower "
                         "--problems, --steps or --dim")
    out = generate(a.out, n_problems=a.problems, dim=a.dim, shift=a.shift, seed=a.seed,
                   mean_steps=a.steps, dtype=a.dtype)
    print(f"wrote {a.problems} synthetic {'shifted' if a.shift else 'in-dist'} trajectories to {out}")


def _label_mode(ts, requested: str | None) -> str:
    modes = ts.label_modes
    mode = requested or (SUPERVISED if SUPERVISED in modes else (modes[0] if modes else None))
    if mode is None or mode not in modes:
        raise UsageError(f"label mode {mode!r} is not in {ts.path} (it has {list(modes) or 'none'})")
    return mode


def cmd_train(a: argparse.Namespace) -> None:
    from orca_calibrate.train import save_probe, train_probe  # deferred: torch (not needed by --help)
    ts = _open(a.data, a.pickle_labels)
    mode = _label_mode(ts, a.label_mode)
    if not ts.split(Split.TRAIN):
        raise UsageError(f"{a.data} has no problem in the train split")
    out = Path(a.out)
    ckpt = Path(a.checkpoints) if a.checkpoints else out.with_suffix(".ckpt")
    probe, facts = train_probe(ts, a.probe, mode, d_h=a.d_h, seed=a.seed, checkpoints=ckpt,
                               **training_options(a))
    meta = {"label_mode": mode, "seed": a.seed, "data": str(ts.path), **facts}
    meta["history"] = json.dumps(facts.get("history", []))
    save_probe(probe, out, meta)
    sel = f", selected epoch {facts['selected_epoch']} of {facts['epochs']}" if "epochs" in facts else ""
    print(f"wrote {probe.spec.name} probe to {out} (label mode {mode}{sel})")


def cmd_calibrate(a: argparse.Namespace) -> None:
    from orca_calibrate.calibrate import calibrate_bundle  # deferred: torch (not needed by --help)
    from orca_calibrate.train import load_probe  # deferred: torch (not needed by --help)
    ltt = LttOptions(tuple(a.delta), a.epsilon, a.window)  # a delta listed twice: one line
    ts = _open(a.data, a.pickle_labels)
    probe, meta = load_probe(Path(a.probe))
    mode = _label_mode(ts, a.label_mode or meta.get("label_mode"))
    bundle = calibrate_bundle(
        probe, ts, Path(a.out), mode=mode, deltas=ltt.deltas, epsilon=ltt.epsilon,
        pvalue=a.pvalue, window=ltt.window, default_delta=a.default_delta,
        dump_scores=Path(a.dump_scores) if a.dump_scores else None,
        provenance={"probe_file": a.probe, "train_seed": meta.get("seed"),
                    "selected_epoch": meta.get("selected_epoch")})
    print(f"wrote {a.out}: n_cal={bundle.ltt.n_cal}, epsilon={bundle.ltt.epsilon}")
    for r in bundle.ltt.rows:
        lam = "never" if r.lam is None else f"{r.lam:.4f}"
        print(f"  delta={r.delta:<5g} lambda*={lam:<8} risk={r.risk:.3f} "
              f"savings_total_steps={r.savings:.3f} p={r.pvalue:.3g}")  # the bundle keeps one


def check_on_data(a: argparse.Namespace, bundle: Bundle, ts: TrajectorySet) -> None:
    """Check --bundle against the data it is replayed on as orca-serve checks it against the
    model it serves (orca_method.bundle_checks.check_bundle): what the server would refuse, the
    offline tools refuse (`--force-model` as orca-serve's --orca-force-model)."""
    from orca_method.bundle_checks import check_bundle, data_target  # deferred: torch
    note = check_bundle(bundle, data_target(ts.info, ts.dim), force=a.force_model)
    if note:
        print(f"orca-calibrate {a.cmd}: warning: --force-model: using the bundle anyway "
              f"although {note}", file=sys.stderr)


def cmd_evaluate(a: argparse.Namespace) -> None:
    from orca_calibrate.evaluate import evaluate_bundle, markdown_table, plot_report  # deferred: torch
    from orca_method.bundle import load_bundle  # deferred: torch (not needed by --help)
    bundle = load_bundle(a.bundle)
    ts = _open(a.data, a.pickle_labels)
    check_on_data(a, bundle, ts)
    split = a.split
    if split is None:  # the test split; a set without splits (e.g. a job's shifted set): all
        split = Split.TEST if ts.split(Split.TEST) else ALL
        if split == ALL:
            print(f"{a.data} has no test split: evaluating all {len(ts)} problems",
                  file=sys.stderr)
    elif split != ALL and not ts.split(split):
        raise UsageError(f"{a.data} has no problem in the {split} split; pass --split all to "
                         "evaluate every problem")
    report, scored = evaluate_bundle(bundle, ts, split)
    print(markdown_table([(report["probe"], report)]))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.plots:
        for p in plot_report(bundle, scored, report, Path(a.plots)):
            print(f"plot: {p}")


def cmd_compare(a: argparse.Namespace) -> None:
    """The paper's comparison rows: each probe x label mode, trained, calibrated, evaluated."""
    from orca_calibrate.calibrate import calibrate_bundle  # deferred: torch (not needed by --help)
    from orca_calibrate.evaluate import evaluate_bundle, markdown_table  # deferred: torch
    from orca_calibrate.train import train_probe  # deferred: torch (not needed by --help)
    ts = _open(a.data)
    shifted = _open(a.shifted) if a.shifted else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tables: dict[str, list] = {"in-distribution (test split)": [], "shifted (all problems)": []}
    for mode in a.label_modes:
        for name in a.probes:
            probe, _ = train_probe(ts, name, mode, d_h=a.d_h, seed=a.seed, checkpoints=None,
                                   progress=False, **training_options(a))
            bundle = calibrate_bundle(probe, ts, out / f"{name}-{mode}.json", mode=mode,
                                      window=a.window)
            label = f"{name} ({mode})"
            tables["in-distribution (test split)"].append((label, evaluate_bundle(bundle, ts)[0]))
            if shifted is not None:
                tables["shifted (all problems)"].append(
                    (label, evaluate_bundle(bundle, shifted, ALL)[0]))
            print(f"done: {label}", file=sys.stderr)
    text = "\n\n".join(f"### {k}\n\n{markdown_table(v)}" for k, v in tables.items() if v)
    (out / "compare.md").write_text(text + "\n")
    print(text)


def cmd_collect(a: argparse.Namespace) -> None:
    if a.config:
        _collect_shard(a)
        return
    missing = [f"--{k}" for k in ("model", "prompts", "out") if getattr(a, k) is None]
    if missing:
        raise UsageError(f"give {', '.join(missing)} (or --config JOB.yaml --shard I: one shard "
                         "of a job)")
    if a.shard is not None or a.of is not None:
        raise UsageError("--shard and --of collect a shard of a job: give --config JOB.yaml")
    if bool(a.judge_url) != bool(a.judge_model):
        raise UsageError("--judge-url and --judge-model go together")
    judge = JudgeSettings(base_url=a.judge_url, model=a.judge_model,
                          api_key_env=a.judge_api_key_env) if a.judge_url else None
    prompts = read_prompts(Path(a.prompts))
    settings = CollectSettings(samples=a.samples, temperature=a.temperature, top_p=a.top_p,
                               top_k=a.top_k, min_p=a.min_p, max_tokens=a.max_tokens,
                               seed=a.seed, label_every=a.label_every, suffix=a.suffix,
                               answer_tokens=a.answer_tokens, dtype=a.dtype, batch=a.batch,
                               judge=judge)
    with Collector(a.model, settings) as collector:  # vLLM's shutdown lines before the stats
        stats = collector.run(prompts, Path(a.out))
    print(json.dumps(stats.as_dict()))


def _collect_shard(a: argparse.Namespace) -> None:
    """One shard of a job (`collect --config JOB --shard I`), the shard from the option or, as a
    Kubernetes indexed Job gives each pod its index, from $JOB_COMPLETION_INDEX."""
    given = [f"--{k}" for k in ("model", "prompts", "out") if getattr(a, k) is not None]
    if given:
        raise UsageError(f"--config takes the model, prompts and out from the job file: drop "
                         f"{', '.join(given)}")
    shard = a.shard if a.shard is not None else os.environ.get(COMPLETION_INDEX)
    if shard is None:
        raise UsageError(f"collect --config runs one shard of the job: give --shard I (or set "
                         f"{COMPLETION_INDEX}, as a Kubernetes indexed Job does)")
    try:
        shard = int(shard)
    except ValueError:
        raise UsageError(f"{COMPLETION_INDEX}={shard!r:.20} is not a shard number") from None
    stats = collect_shard(Path(a.config), shard, a.of)
    if stats is None:
        print(f"{a.config}: collected and merged already; shard {shard} has nothing to do")
    else:
        print(json.dumps({"shard": shard, **stats.as_dict()}))


def cmd_gate(a: argparse.Namespace) -> None:
    from orca_calibrate.gate import add_gate, first_step_features, gate_collector
    from orca_method.bundle import load_bundle

    try:  # before an engine starts; argparse checked each flag, this the give-up level's order
        opts = GateOptions(steps=a.steps, alpha=a.alpha, give_up_alpha=a.give_up_alpha,
                           rank=a.rank)
    except ValueError as e:
        raise UsageError(f"--give-up-alpha: {e}") from None
    bundle = load_bundle(a.bundle)
    prompts = read_prompts(Path(a.prompts))
    with gate_collector(a.model, bundle, max_tokens=a.max_tokens, temperature=a.temperature,
                        seed=a.seed, engine=dict(a.engine or {})) as collector:
        feats = first_step_features(collector, prompts, opts.steps)
    sealed = add_gate(Path(a.bundle), Path(a.out), feats, opts, fit_fraction=a.fit_fraction,
                      seed=a.seed)
    g = sealed.shift_gate
    print(f"wrote {a.out}: shift gate on {g.steps} step(s), fitted on {g.n_fit} prompts, "
          f"scored on {len(g.scores)}, alpha {g.alpha} (give-up side {g.give_up_alpha}); "
          f"checksum {sealed.checksum}")


def cmd_groups(a: argparse.Namespace) -> None:
    from orca_calibrate.calibrate import add_groups  # deferred: torch
    from orca_method.bundle import load_bundle  # deferred: torch (not needed by --help)

    bundle, sets = load_bundle(a.bundle), [_open(d) for d in a.data]
    for ts in sets:
        check_on_data(a, bundle, ts)
    sealed = add_groups(bundle, sets, GroupOptions(a.field, a.min_n), Path(a.out))
    print(f"wrote {a.out}: checksum {sealed.checksum}; the main tables as they were")
    for name, g in sorted((sealed.groups or {}).items()):
        lams = ", ".join("never" if r.lam is None else f"{r.lam:.4f}" for r in g.ltt.rows)
        mus = "" if g.give_up is None else ", mu* " + ", ".join(
            "never" if r.mu is None else f"{r.mu:.4f}" for r in g.give_up.rows)
        print(f"  group {name}: n_cal {g.ltt.n_cal}, lambda* {lams} at deltas "
              f"{', '.join(f'{r.delta:g}' for r in g.ltt.rows)}{mus}")


def cmd_reweight(a: argparse.Namespace) -> None:
    # deferred: torch (not needed by --help)
    from orca_calibrate.reweight import gate_steps, read_traffic_features, reweight_bundle
    from orca_method.bundle import load_bundle

    job = Path(a.job)
    parent = load_bundle(job / "bundle.json")
    given = [x for x in (a.traffic_features, a.traffic_prompts, a.traffic_audits) if x]
    if len(given) != 1:
        raise UsageError("give the traffic as --traffic-features FILE.npy, --traffic-prompts "
                         "FILE.jsonl (with --model) or --traffic-audits DIR, one of the three")
    source = given[0]
    if a.traffic_features is not None:
        traffic = read_traffic_features(Path(a.traffic_features), parent.model.hidden_size)
    elif a.traffic_audits is not None:
        from orca_calibrate.audit_report import open_audits
        from orca_calibrate.reweight import features_of
        audits = open_audits(a.traffic_audits, parent)
        traffic = features_of(audits, range(len(audits)), gate_steps(parent))[1]
    else:
        from orca_calibrate.gate import first_step_features, gate_collector
        if not a.model:
            raise UsageError("--traffic-prompts runs the prompts to the gate's step: give "
                             "--model (the bundle's model)")
        with gate_collector(a.model, parent, max_tokens=a.max_tokens, temperature=a.temperature,
                            seed=a.seed, engine=dict(a.engine or {})) as collector:
            traffic = first_step_features(collector, read_prompts(Path(a.traffic_prompts)),
                                          gate_steps(parent))
    new, rs = reweight_bundle(job, traffic, Path(a.out), source=source, seed=a.seed,
                              rank=a.rank, clip=a.clip)
    print(f"wrote {a.out}: {len(traffic)} traffic requests; kept {int(rs.kept.sum())} of "
          f"{rs.kept.size} calibration traces (B {rs.bound:.3g}, mean weight "
          f"{rs.weights.mean():.3g}, n_eff {rs.n_eff:.1f}, clipped {rs.clipped}); "
          f"n_cal={new.ltt.n_cal}")
    _show_recalibrated(parent, new)


def _show_recalibrated(parent: Bundle, new: Bundle) -> None:
    """lambda* per delta against the parent's, and what became of its groups and consensus."""
    for r, old in zip(new.ltt.rows, parent.ltt.rows):
        lam, was = ("never" if x.lam is None else f"{x.lam:.4f}" for x in (r, old))
        print(f"  delta={r.delta:<5g} lambda*={lam:<8} (was {was}) risk={r.risk:.3f} "
              f"savings={r.savings:.3f} p={r.pvalue:.3g}")
    if parent.groups is not None:
        print(f"  groups {', '.join(sorted(parent.groups))}: {new.provenance['groups']}")
    if parent.consensus is not None:
        print("  consensus: dropped (its rows stop samples at the parent's lambda*; certify it "
              "anew with the job's calibrate.consensus)")


def cmd_audit_report(a: argparse.Namespace) -> None:
    from orca_calibrate.audit_report import (  # deferred: torch (not needed by --help)
        audit_label_mode,
        audit_report,
        format_report,
        open_audits,
        plot_report,
    )
    from orca_method.bundle import load_bundle  # deferred: torch (not needed by --help)
    bundle = load_bundle(a.bundle)
    ts = open_audits(a.audit, bundle)
    check_on_data(a, bundle, ts)
    report = audit_report(bundle, ts, mode=audit_label_mode(bundle, ts, a.label_mode),
                          alpha=a.alpha, drift_window=a.drift_window,
                          epsilon_split=a.epsilon_split)
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.plots:
        print(f"plot: {plot_report(report, Path(a.plots))}")


def cmd_recalibrate(a: argparse.Namespace) -> None:
    # deferred: torch (not needed by --help)
    from orca_calibrate.audit_report import audit_label_mode, open_audits, recalibrate
    from orca_method.bundle import load_bundle
    bundle = load_bundle(a.bundle)
    ts = open_audits(a.audit, bundle)
    check_on_data(a, bundle, ts)
    new = recalibrate(bundle, ts, Path(a.out), mode=audit_label_mode(bundle, ts, a.label_mode),
                      last=a.last, retrain=a.retrain, seed=a.seed,
                      train_options=training_options(a), bundle_path=a.bundle,
                      force=a.force, drop_give_up=a.drop_give_up)
    if bundle.give_up is not None and a.drop_give_up:
        print(f"orca-calibrate recalibrate: warning: --drop-give-up: {a.out} is one-sided; a "
              "server running it refuses every request that asks to give up", file=sys.stderr)
    elif a.drop_give_up:
        print(f"orca-calibrate recalibrate: note: --drop-give-up: {a.bundle} has no give-up "
              "block to drop", file=sys.stderr)
    print(f"wrote {a.out}: n_cal={new.ltt.n_cal} audits, label mode {new.label_mode}")
    if new.give_up is not None:
        print(f"  give-up: kept the parent's block as calibrated (mu* per give-up delta "
              f"{', '.join(f'{d:g}' for d in new.give_up_deltas())}: valid with any lambda*; "
              "live audits cannot re-certify it)")
    _show_recalibrated(bundle, new)


def cmd_run(a: argparse.Namespace) -> None:
    """Run the job, then show what it produced."""
    run_job(Path(a.config))
    _show(a.config)


def cmd_merge(a: argparse.Namespace) -> None:
    """Merge the shards a cluster's workers collected, then run the rest of the job."""
    run_job(Path(a.config), merge=True)
    _show(a.config)


def _show(config: str) -> None:
    """What a job produced: the evaluation table and the bundle (paths normalised: the job's
    are joined to the config's folder, `jobs/../runs/x`)."""
    from orca_method.bundle import load_bundle  # deferred: torch (not needed by --help)

    out = Path(os.path.normpath(load_job(Path(config))["out"]))
    table = out / "evaluation.md"
    if table.exists():
        print(f"\nresults ({table}):\n{table.read_text().rstrip()}")
    print(f"bundle: {out / 'bundle.json'}")
    ltt = load_bundle(out / "bundle.json").ltt
    never = [r.delta for r in ltt.rows if r.lam is None]
    if never:  # LTT rejected nothing for them: such requests run to their end, silently
        print(f"note: no lambda* certified for delta {', '.join(f'{d:g}' for d in never)} "
              f"(n_cal {ltt.n_cal} at epsilon {ltt.epsilon:g}): requests at "
              f"{'that delta' if len(never) == 1 else 'those deltas'} never stop early; more "
              "calibration prompts (or a larger delta) certify one")


def cmd_plan(a: argparse.Namespace) -> None:
    """A pilot of the job, then its estimated cost (orca_calibrate/plan.py)."""
    from orca_calibrate.plan import plan_job  # deferred: torch, vllm (not needed by --help)
    plan = plan_job(Path(a.config), pilot=a.pilot, seed=a.seed,
                    scratch=Path(a.scratch) if a.scratch else None)
    print("\n".join(plan.lines()))


def cmd_import_pickle(a: argparse.Namespace) -> None:
    import_pickle(a.pickle, a.out, dtype=a.dtype, pickle_labels=a.pickle_labels)
    print(f"wrote {a.out}")


def cmd_import_probe(a: argparse.Namespace) -> None:
    """The authors' released probe.pt + lambdas.json -> a bundle with their serving settings."""
    from orca_calibrate.import_probe import import_probe  # deferred: torch (not needed by --help)
    b = import_probe(a.probe, a.lambdas, a.model, a.out, tokenizer=a.tokenizer,
                     config=a.config, window=a.window,
                     label_mode=a.label_mode, epsilon=a.epsilon, default_delta=a.default_delta,
                     max_step_tokens=a.max_step_tokens or None, normalization=a.normalization,
                     probe_out=a.probe_out)
    print(f"wrote {a.out}: probe {b.spec().name} (dim {b.model.hidden_size}), window {b.window}, "
          f"deltas {', '.join(f'{d:g}' for d in b.deltas())}; lambda* {b.lambdas_from}")
    if b.model.tokenizer_fingerprint is None:
        print(f"note: {a.out} names no tokenizer (--model {a.model} is not a local folder): "
              "orca-serve refuses it unless --orca-force-model; pass --tokenizer DIR (a local "
              "copy of the model's tokenizer) to record its fingerprint", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="orca-calibrate", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def data_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", required=True, help="trajectory directory or research pickle")
        p.add_argument("--pickle-labels", choices=["pessimistic", "research"],
                       default="pessimistic", help="how block labels of a pickle become steps")

    def training_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--epochs", type=integer(1),
                       help="default 20 for no-QK, 10 for QK (the paper)")
        p.add_argument("--batch-size", type=integer(1), help="trajectories per optimizer step "
                       f"(default {DEFAULTS['batch_size']}; the paper: 1)")
        p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3 x batch^(2/3): "
                       "the paper's 1e-3 at batch 1, ~0.01 at batch 32)")
        p.add_argument("--warmup", type=float, help="share of the optimizer steps over which the "
                       f"learning rate ramps up from 0 (default {DEFAULTS['warmup']:g})")
        p.add_argument("--epoch-select", choices=EPOCH_SELECT, help="keep the last epoch (the "
                       "paper) or the one with the best savings on a 10%% validation part of the "
                       f"training split (default {DEFAULTS['epoch_select']})")

    def force_model_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--force-model", action="store_true", help="use the bundle although "
                       "it names another model than the data (name or config fingerprint), as "
                       "orca-serve's --orca-force-model; a bad table, probe, tokenizer or step "
                       "delimiter is refused always")

    def embeddings_dtype_arg(p: argparse.ArgumentParser, default: str) -> None:
        # the stored embeddings' dtype, not the model's (`--dtype`, vLLM's name, kept as an alias)
        p.add_argument("--embeddings-dtype", "--dtype", dest="dtype", choices=sorted(DTYPES),
                       default=default, help="dtype the embeddings are stored in (not the "
                       f"model's; default {default})")

    def audits_args(p: argparse.ArgumentParser) -> None:
        """What audit-report and recalibrate read: the server's audits, the labels of them."""
        p.add_argument("--audit", required=True, help="the server's audit directory (its "
                       "audit-NNNNNN parts, oldest first) or one trajectory directory")
        p.add_argument("--label-mode", help="default: the bundle's if the audits have it, "
                       "else consistent")

    def window_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--window", type=integer(1), default=DEFAULT_WINDOW,
                      help="smoothing window k")

    p = sub.add_parser("synth", help="write a synthetic trajectory set")
    p.add_argument("--out", type=out_dir, required=True)
    p.add_argument("--problems", type=integer(1), default=600)
    p.add_argument("--dim", type=integer(1), default=64)
    p.add_argument("--steps", type=integer(1), default=100, help="mean steps per problem")
    p.add_argument("--shift", action="store_true", help="the shifted family")
    p.add_argument("--seed", type=integer(0), default=0)
    embeddings_dtype_arg(p, STORED_DTYPE)
    p.set_defaults(fn=cmd_synth)

    p = sub.add_parser("train", help="meta-train a probe (or fit the static baseline)")
    data_arg(p)
    p.add_argument("--probe", choices=sorted(PROBES), default=DEFAULT_PROBE)
    p.add_argument("--out", type=out_file, required=True, help="probe file (.safetensors)")
    p.add_argument("--d-h", type=integer(1), default=DEFAULT_D_H, help="QK projection size")
    p.add_argument("--label-mode", help="supervised (default), consistent, judge")
    training_args(p)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--checkpoints", help="per-epoch checkpoints (default PROBE.ckpt/)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("calibrate", help="LTT on the calibration split; writes bundle.json")
    data_arg(p)
    p.add_argument("--probe", required=True)
    p.add_argument("--out", type=out_file, required=True)
    p.add_argument("--delta", type=fraction(open_interval=True), nargs="+",
                   default=list(DEFAULT_DELTAS))
    p.add_argument("--epsilon", type=fraction(open_interval=True), default=DEFAULT_EPSILON)
    p.add_argument("--pvalue", choices=PVALUE_CHOICES, default=str(PValue.BINOMIAL))
    window_arg(p)
    p.add_argument("--default-delta", type=float)
    p.add_argument("--label-mode", help="default: the mode the probe was trained with")
    p.add_argument("--dump-scores", help="JSON lines: id, smoothed scores, labels per problem")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("evaluate", help="replay a bundle on held-out trajectories")
    data_arg(p)
    p.add_argument("--bundle", required=True)
    p.add_argument("--split", choices=[*SPLITS, ALL], default=None,
                   help="problems to replay (default: the test split, or all problems when the "
                   "data has no test split)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plots", help="write PNG plots to this directory")
    force_model_arg(p)
    p.set_defaults(fn=cmd_evaluate)

    p = sub.add_parser("compare", help="static vs TTT probes, supervised and consistent")
    p.add_argument("--data", required=True)
    p.add_argument("--shifted", help="a shifted trajectory set, evaluated whole")
    p.add_argument("--out", type=out_dir, required=True)
    p.add_argument("--probes", nargs="+", default=["static", "ttt-noqk", "ttt-qk"],
                   choices=sorted(PROBES))
    p.add_argument("--label-modes", nargs="+", default=[SUPERVISED, CONSISTENT])
    p.add_argument("--d-h", type=integer(1), default=DEFAULT_D_H)
    window_arg(p)
    training_args(p)
    p.add_argument("--seed", type=integer(0), default=0)
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("collect", help="run the model with the plugin in record mode (or one "
                       "shard of a job's collection)")
    p.add_argument("--model", help="model path or hub name")
    p.add_argument("--prompts", help="JSON lines: id, messages|prompt, answer")
    p.add_argument("--out", type=out_dir, help="trajectory directory (resumed if it exists)")
    p.add_argument("--config", metavar="JOB.yaml", help="instead of --model/--prompts/--out: "
                   "collect one shard of this job into its out (the job's collect block "
                   "decides; the options below are not read), for `merge` to join "
                   "(docs/CALIBRATE.md, \"Beyond one node\")")
    p.add_argument("--shard", type=integer(0), help=f"with --config: the shard, 0 to N-1 "
                   f"(default ${COMPLETION_INDEX}, which a Kubernetes indexed Job sets)")
    p.add_argument("--of", type=integer(1), help="with --config: the number of shards N, "
                   "which must be the job's collect.engines (default: that)")
    p.add_argument("--samples", type=integer(1), default=1, help="trajectories per prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=integer(0), default=CollectSettings.top_k,
                   help="sample from the k likeliest tokens (0: all), as the model's authors "
                   "advise (its generation_config.json: what the server samples with)")
    p.add_argument("--min-p", type=fraction(open_interval=False), default=CollectSettings.min_p,
                   help="drop tokens less likely than this share of the likeliest (0: none)")
    p.add_argument("--max-tokens", type=integer(1), default=1024)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--label-every", type=integer(1), default=1, help="answer-probe every k-th step")
    p.add_argument("--suffix", default=CollectSettings.suffix, help="answer-forcing suffix "
                   "(the bundle records it: the live audit labels with it)")
    p.add_argument("--answer-tokens", type=integer(1), default=CollectSettings.answer_tokens,
                   help="greedy tokens per answer probe (recorded as --suffix)")
    embeddings_dtype_arg(p, CollectSettings.dtype)
    p.add_argument("--batch", type=integer(1), default=64, help="prompts per generation batch")
    p.add_argument("--judge-url", help="OpenAI-compatible endpoint (…/v1) whose model grades "
                   "every step answer: adds the `judge` label mode")
    p.add_argument("--judge-model", help="the judge's model name at --judge-url")
    p.add_argument("--judge-api-key-env", help="environment variable holding the judge's API key")
    p.set_defaults(fn=cmd_collect)

    p = sub.add_parser("gate", help="add a shift gate to a bundle from in-distribution prompts")
    p.add_argument("--model", required=True, help="the bundle's model (path or hub name)")
    p.add_argument("--bundle", required=True, help="the bundle to add the gate to")
    p.add_argument("--prompts", required=True, help="JSON lines of in-distribution prompts "
                   "(id, messages|prompt), none of them used to train or calibrate the probe")
    p.add_argument("--out", type=out_file, required=True,
                   help="the gated bundle (may be --bundle itself)")
    p.add_argument("--steps", type=integer(1), default=DEFAULT_GATE_STEPS,
                   help="step embeddings the gate reads (it decides at this step)")
    p.add_argument("--alpha", type=fraction(open_interval=True), default=DEFAULT_GATE_ALPHA,
                   help="default level: share of in-distribution requests flagged, at most")
    p.add_argument("--give-up-alpha", type=fraction(open_interval=True), default=None,
                   help="the give-up side's default level, at least --alpha: share of "
                   "in-distribution requests denied their give-up, at most (default: "
                   f"{DEFAULT_GATE_GIVE_UP_ALPHA:g}, or --alpha where that is higher)")
    p.add_argument("--rank", type=integer(1), default=DEFAULT_GATE_RANK,
                   help="principal directions of the nonconformity score")
    p.add_argument("--fit-fraction", type=fraction(open_interval=True), default=0.5,
                   help="share of the prompts the score is fitted on (the rest are scored)")
    p.add_argument("--max-tokens", type=integer(1), default=256,
                   help="tokens per prompt: enough for --steps + 1 reasoning steps")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--engine", type=json.loads, default=None,
                   help="extra vLLM LLM(...) arguments as JSON, e.g. '{\"max_model_len\": 5120}'")
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("groups", help="add per-group lambda* (and mu*) to a bundle, each "
                       "certified on its own group's calibration-only traces")
    p.add_argument("--bundle", required=True, help="the bundle to add the groups to (its "
                   "probes, main tables, gate and drift reference stay as they are)")
    p.add_argument("--data", required=True, nargs="+", help="trajectory directories collected "
                   "apart from the bundle's job (no split: none of them trained or chose "
                   "anything), each problem tagged with its group; a group's traces in one")
    p.add_argument("--out", type=out_file, required=True,
                   help="the bundle with groups (may be --bundle itself)")
    p.add_argument("--field", default=GroupOptions.field, help="the problems' tag that names "
                   "their group (a trajectory field or a key of its extra)")
    p.add_argument("--min-n", type=integer(1), default=GroupOptions.min_n,
                   help="solvable traces a group needs for a table of its own")
    force_model_arg(p)
    p.set_defaults(fn=cmd_groups)

    p = sub.add_parser("reweight", help="recertify a job's lambda* for traffic whose gate "
                       "features you have, without labels (covariate shift)")
    p.add_argument("--job", required=True, help="the bundle's job directory (bundle.json and "
                   "trajectories/ with its train and calibration splits)")
    p.add_argument("--traffic-features", help="the traffic's gate features: a .npy array "
                   "[N, d] (docs/CALIBRATE.md says how to get them)")
    p.add_argument("--traffic-prompts", help="or the traffic's prompts (JSON lines), run to "
                   "the gate's step with --model in record mode")
    p.add_argument("--traffic-audits", help="or a server's audit directory (--orca-audit-dir): "
                   "the audited requests' recorded step embeddings (their labels are not read)")
    p.add_argument("--model", help="the bundle's model (with --traffic-prompts)")
    p.add_argument("--out", type=out_file, required=True, help="the recertified bundle")
    p.add_argument("--rank", type=integer(1), default=DEFAULT_RATIO_RANK,
                   help="principal directions the density-ratio classifier reads")
    p.add_argument("--clip", type=float, help="cap on the weights (default: the largest "
                   "fitted weight); traces above it are clipped and the statement weakens")
    p.add_argument("--max-tokens", type=integer(1), default=256,
                   help="tokens per traffic prompt (with --traffic-prompts)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=integer(0), default=0, help="the classifier's folds and the "
                   "rejection sampling")
    p.add_argument("--engine", type=json.loads, default=None,
                   help="extra vLLM LLM(...) arguments as JSON (with --traffic-prompts)")
    p.set_defaults(fn=cmd_reweight)

    p = sub.add_parser("audit-report", help="realized risk of a bundle on live audits")
    audits_args(p)
    p.add_argument("--bundle", required=True, help="the bundle the server ran")
    p.add_argument("--alpha", type=float, help="confidence sequence level (default: epsilon)")
    p.add_argument("--drift-window", type=integer(1), default=500, help="requests per drift test")
    p.add_argument("--epsilon-split", choices=EPSILON_SPLITS,
                   default=str(EpsilonSplit.PER_DELTA),
                   help="as the server's --orca-audit-epsilon-split: joint splits the level "
                   "across the deltas (docs/AUDIT.md, \"Several deltas\")")
    p.add_argument("--json", help="write the report (with the bounds' history) here")
    p.add_argument("--plots", help="write audit_risk.png to this directory")
    force_model_arg(p)
    p.set_defaults(fn=cmd_audit_report)

    p = sub.add_parser("recalibrate", help="LTT on live audits; writes a new bundle")
    p.add_argument("--bundle", required=True)
    audits_args(p)
    p.add_argument("--out", type=out_file, required=True)
    p.add_argument("--last", type=integer(1), help="only the last N audits (sliding window)")
    p.add_argument("--retrain", action="store_true", help="retrain the probe on half the "
                   "window (split by prompt) and calibrate on the other half")
    training_args(p)  # the retraining's settings, as in train
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--force", action="store_true", help="accept a window that reaches back to "
                   "or before the first alarm in the audits (refused by default: those audits "
                   "are not the traffic after the change)")
    p.add_argument("--drop-give-up", action="store_true", help="write a one-sided bundle from "
                   "a two-sided one (default: keep its give-up block as calibrated; live audits "
                   "cannot re-certify it)")
    force_model_arg(p)
    p.set_defaults(fn=cmd_recalibrate)

    p = sub.add_parser("run", help="the whole job from a YAML file (resumable)")
    p.add_argument("--config", required=True, metavar="JOB.yaml", help="the job file "
                   "(YAML: model, prompts, out and each stage's settings, as in "
                   "orca_calibrate/jobs/toy.yaml); paths in it are relative to its folder")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("merge", help="merge the shards of a job that `collect --config "
                       "--shard` collected (all must be complete), then run the rest of it")
    p.add_argument("--config", required=True, metavar="JOB.yaml", help="the job file, as for run")
    p.set_defaults(fn=cmd_merge)

    p = sub.add_parser("plan", help="a short pilot of a job, then its estimated hours, wall "
                       "time and disk")
    p.add_argument("--config", required=True, metavar="JOB.yaml", help="the job file, as for run")
    p.add_argument("--pilot", type=integer(1), default=DEFAULT_PILOT,
                   help="prompts the pilot collects (drawn at random from the job's)")
    p.add_argument("--seed", type=integer(0), default=0, help="which prompts the pilot draws")
    p.add_argument("--scratch", help="the pilot's folder (default: the job's out/plan; emptied "
                   "first)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("import-pickle", help="convert a research-code pickle to our format")
    p.add_argument("pickle")
    p.add_argument("--out", type=out_dir, required=True)
    embeddings_dtype_arg(p, STORED_DTYPE)
    p.add_argument("--pickle-labels", choices=["pessimistic", "research"], default="pessimistic")
    p.set_defaults(fn=cmd_import_pickle)

    p = sub.add_parser("import-probe", help="bundle from the authors' released probe.pt")
    p.add_argument("probe", help="their probe.pt (a TTT probe state dict)")
    p.add_argument("--lambdas", required=True, help="their lambdas.json (delta -> lambda*)")
    p.add_argument("--model", required=True, help="the model the probe was trained on (its "
                   "name or local folder; orca-serve serves the bundle on this model only)")
    p.add_argument("--tokenizer", help="a local folder with that model's tokenizer, whose "
                   "fingerprint the bundle records (default: --model when it is a folder)")
    p.add_argument("--out", type=out_file, required=True, help="bundle.json to write")
    p.add_argument("--config", help="their run's config.json (default: beside the probe)")
    p.add_argument("--window", type=integer(1),
                   help="smoothing window (default: the config's, else 10)")
    p.add_argument("--label-mode", help="recorded in the bundle (default: the config's)")
    p.add_argument("--epsilon", type=fraction(open_interval=True), default=DEFAULT_EPSILON,
                   help="their LTT epsilon (scripts: 0.05)")
    p.add_argument("--default-delta", type=float)
    p.add_argument("--max-step-tokens", type=integer(0), default=500,
                   help="cut steps at this many tokens (theirs: 500; 0: never)")
    p.add_argument("--normalization", choices=NORMALIZATIONS, default=DEFAULT_NORMALIZATION,
                   help="pooling the probe was trained on (theirs: token-l2, vLLM's default)")
    p.add_argument("--probe-out", help="also write the probe for `calibrate --probe` "
                   "(to recalibrate it on your own trajectories)")
    p.set_defaults(fn=cmd_import_probe)
    return ap


# Python's resource tracker (a process of its own, started with the interpreter's -W options)
# warns at exit about the shared memory and semaphores of vLLM workers that vLLM force-killed
# after its 5 s grace period (a loaded machine) and unlinks them: freed either way, but printed
# after the job's table. `collect`, `run`, `merge` and `plan` close the engine first
# (Collector.close); this keeps the tracker's leftover report out of the output.
QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except OptionError as e:
        print(f"{e.prog}: error: {e}", file=sys.stderr)  # as the stages' errors below
        return 2
    if args.cmd in ("collect", "run", "merge", "plan") and QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)  # before vLLM starts the tracker
    from orca_method.bundle import BundleError  # deferred: torch (not needed by --help)
    # SIGTERM (a scheduler's stop) unwinds as Ctrl-C does: the engines a stage started are shut
    # down on the way out, and what was written stays for the rerun to resume from. Only as the
    # command (argv None), not when a caller runs main() inside its own process
    if argv is None:
        exit_on_sigterm()
    try:
        args.fn(args)
    except (UsageError, TrajectoryError, BundleError, JobError, JudgeError, ValueError,
            OSError, KeyError) as e:  # OSError: an output path that is a file, a folder, ...
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"orca-calibrate {args.cmd}: error: {msg}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped):
        print(f"orca-calibrate {args.cmd}: interrupted; what it finished is kept (run and collect "
              "resume from it)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
