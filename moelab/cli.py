"""``python -m moelab {train,info,data,study,eval}``.

    python -m moelab train --config tiny --set train.max_steps=20 [--resume [CKPT]] [--throughput FILE]
    python -m moelab info  --config k3
    python -m moelab data  --config cpu [--force]
    python -m moelab study 1 [--preset cpu|gpu|research] [--runs ARM:SEED,... | --shard I/N] [--jobs K] [--probe STEPS]
    python -m moelab eval  --ckpt runs/tiny/last.ckpt --task passkey|mqar|loss_by_position [--lengths ...]

``--config`` takes a preset name (``moelab/presets/<name>.yaml``) or a YAML path; ``--set KEY=VALUE``
(repeatable) overrides any field, the value parsed as YAML. Exit codes: 0 done, 1 failed (the
message says why: a NaN, a tracking store that cannot be reached), 2 bad configuration or arguments
(including a damaged checkpoint, a resume that changes the model, a run folder another run owns),
1 also when training finished but MLflow could not record all of it (a database that turned read-only or
locked mid-run: the checkpoint and summary.json are intact, the line says what is missing),
130 stopped by Ctrl-C, 143 stopped by SIGTERM (after either, last.ckpt and summary.json are saved; a
study's next call resumes). A study whose notebook cell raises exits 1 with one line naming the cell.
User errors print one ``error:`` line, never a traceback, and stop before an MLflow run is opened.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence

from moelab.base import ConfigError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="PRESET_OR_PATH",
                   help="preset name (tiny, cpu, gpu-small, fla-shape, k3, ...) or path of a YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set train.lr=1e-3 --set model.kda.gate=softplus")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moelab", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a preset (Lightning + MLflow)")
    _config_args(p)
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CKPT",
                   help="continue from CKPT, or from <ckpt_dir>/last.ckpt when no path is given")
    p.add_argument("--throughput", metavar="FILE",
                   help="also record tokens/s, MFU and peak memory as a row of this JSON file "
                        "(e.g. kernels/results/model_h200.json)")

    p = sub.add_parser("info", help="parameter counts and FLOPs of a config (no model is built)")
    _config_args(p)
    p.add_argument("--seq-len", type=int, default=None, help="context for the FLOPs line (default: model.max_seq_len)")

    p = sub.add_parser("data", help="prepare (download/tokenize/cache) the corpus of a config")
    _config_args(p)
    p.add_argument("--force", action="store_true", help="rebuild the cache even if it verifies")

    p = sub.add_parser("study", help="run study N's notebook with papermill (research, or gpu while no research "
                                     "report is committed: into studies/NN_name/; otherwise into "
                                     "runs/studies/NN_name/); with --runs/--shard, a split call: the study module's "
                                     "train(preset, out_dir), no notebook, no Jupyter, MLflow only if importable")
    p.add_argument("number", type=int, help="study number (1-4)")
    p.add_argument("--preset", choices=("cpu", "gpu", "research"), default=None,
                   help="scale of the study (default: gpu when CUDA is available, else cpu): cpu a smoke run, gpu the "
                        "quick look, research the tier that answers the question (split calls; studies/README.md)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--runs", metavar="ARM:SEED,...", default=None,
                       help="a split call: train only these runs and record them, without the notebook "
                            "(studies/README.md has the recipe)")
    split.add_argument("--shard", metavar="I/N", default=None,
                       help="a split call: train runs I, I+N, ... of each grid and record them")
    p.add_argument("--jobs", type=int, default=1, metavar="K",
                   help="with --runs/--shard: train the runs in K processes at once on the same GPU (a host-bound "
                        "model trains K runs in little more than the time of one; their records keep gpu_share=K)")
    p.add_argument("--probe", type=int, default=None, metavar="STEPS",
                   help="with --runs/--shard: time the runs instead of training them (STEPS steps each, no record): "
                        "one line per run with its step time and what the whole run would take")
    p.add_argument("--from-results", action="store_true",
                   help="train nothing: render the committed report, at the preset that made it, from studies/NN_name/")

    p = sub.add_parser("eval", help="long-context evaluation of a checkpoint (JSON + MLflow eval/<preset>)")
    p.add_argument("--ckpt", required=True, metavar="PATH", help="a moelab checkpoint (.ckpt)")
    p.add_argument("--task", required=True, choices=("passkey", "mqar", "loss_by_position"))
    p.add_argument("--lengths", type=int, nargs="+", default=None, metavar="N",
                   help="context lengths in tokens (default: 1x, 2x, 4x the training window)")
    p.add_argument("--depths", type=float, nargs="+", default=None, metavar="D",
                   help="passkey needle depths in [0, 1] (default: 0 0.25 0.5 0.75 1)")
    p.add_argument("--samples", type=int, default=16, help="samples per length (and depth)")
    p.add_argument("--mqar-pairs", type=int, default=16, help="key-value pairs per MQAR sample")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="tokens per forward piece (default: the training window; 0: one full forward)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", metavar="FILE", help="JSON path (default: <checkpoint folder>/eval/<task>.json)")
    p.add_argument("--tracking-uri", default="", help="MLflow store (default: as for training)")
    p.add_argument("--no-mlflow", action="store_true", help="write the JSON only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from moelab.tracking import StorageError

    args = build_parser().parse_args(argv)
    try:
        return {"train": _train, "info": _info, "data": _data, "study": _study, "eval": _eval}[args.command](args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StorageError as e:  # a tracking store or disk fault: the message is the one line (TrackingError, ...)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)


def _train(args: argparse.Namespace) -> int:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from moelab.config import load_config
    from moelab.train import NonFiniteLossError, fit

    cfg = load_config(args.config, args.overrides)
    try:
        result = fit(cfg, resume=args.resume)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if rank_zero_only.rank != 0:
        return 0
    print(json.dumps(result.summary, indent=2, default=str))
    if result.tracking_incomplete:  # the model is trained and saved; its MLflow record is not complete
        print(f"error: {result.tracking_incomplete}", file=sys.stderr)
        return 1
    if args.throughput:
        from moelab.train.perf import record_throughput

        s = result.summary
        row = {"impl": "moelab_" + cfg.name.replace("-", "_"), "params": s["params_total"], "B": s["B"],
               "T": s["T"], "tok_per_s": s["tok_per_s"], "mfu": s["mfu"], "peak_mem_gb": s["peak_mem_gb"]}
        record_throughput(args.throughput, row)
        print(f"recorded {row['impl']} in {args.throughput}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from moelab.config import load_config
    from moelab.model.accounting import param_counts, summary

    cfg = load_config(args.config, args.overrides)
    print(f"config: {cfg.name}")
    print(summary(cfg.model, args.seq_len) if args.seq_len else summary(cfg.model))
    if cfg.k3_reference:
        counts = param_counts(cfg.model)
        print("reference (k3_reference):")
        for key, ref in cfg.k3_reference.items():
            ours = counts.get(key)
            if isinstance(ref, (int, float)) and isinstance(ours, (int, float)) and ref:
                print(f"  {key:<12} reference {ref:.4g}   accounting {ours:.4g}   ({(ours - ref) / ref:+.1%})")
            else:
                print(f"  {key:<12} {ref}")
    return 0


def _data(args: argparse.Namespace) -> int:
    from moelab.config import load_config
    from moelab.data import prepare

    cfg = load_config(args.config, args.overrides)
    corpus = prepare(cfg.data, force=args.force)
    print(f"cache: {corpus.cache_dir}")
    print(f"tokenizer: {cfg.data.tokenizer}, {corpus.vocab_size} ids; "
          f"train {corpus.n_train_tokens:,} tokens, val {corpus.n_val_tokens:,} tokens")
    return 0


def _study(args: argparse.Namespace) -> int:
    from moelab.base import repo_root
    from moelab.studies.runner import STUDIES, StudyFailed, StudyStopped, committed_preset, run_study

    # Rendering from the committed results re-renders the committed report, so it goes where they are, at the
    # preset that made it: a cpu render would write cpu-scale tables over the gpu report.
    render = {"parameters": {"from_results": True}, "out_root": repo_root() / "studies"} if args.from_results else {}
    preset = args.preset
    if args.from_results:
        made = committed_preset(STUDIES.get(args.number, "")) or "gpu"
        if preset not in (None, made) or args.runs or args.shard:
            print(f"error: --from-results renders the committed report, made at preset {made}; got --preset {preset}"
                  + (" with a split call" if args.runs or args.shard else ""), file=sys.stderr)
            return 2
        preset = made
    try:
        out = run_study(args.number, preset, runs=args.runs, shard=args.shard, jobs=args.jobs, probe=args.probe,
                        **render)
    except StudyStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except StudyFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a bad --runs / --shard
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # the lab's packages for a notebook call, or a study module
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"study {args.number}: results in {out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from moelab.eval.suite import evaluate

    report = evaluate(args.ckpt, args.task, lengths=args.lengths, depths=args.depths, samples=args.samples,
                      mqar_pairs=args.mqar_pairs, chunk_size=args.chunk_size, batch_size=args.batch_size,
                      seed=args.seed, device=args.device, out=args.out, tracking=not args.no_mlflow,
                      tracking_uri=args.tracking_uri)
    keys = {"passkey": ("accuracy_by_length", "effective_context"), "mqar": ("accuracy", "all_correct"),
            "loss_by_position": ()}[args.task]
    lines = {k: report[k] for k in ("task", "step", "lengths", *keys, "state_bytes_per_token", "wall_s", "json")}
    if args.task == "loss_by_position":
        lines["mean_loss"] = [c["mean_loss"] for c in report["curves"]]
    print(json.dumps(lines, indent=2, default=str))
    return 0
