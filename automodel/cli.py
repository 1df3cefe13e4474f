"""The ``automodel`` console command: launch a recipe's ranks through torch's elastic launcher, or plan.

    automodel finetune --config configs/cp.yaml --nproc-per-node 2 [key=value ...]
    automodel plan --config configs/llama3_1_8b_tp2_cp4.yaml --gpus 8 --gpu-type h100 [key=value ...]
    automodel finetune --config my.yaml --nnodes 2 --nproc-per-node 8 \\
        --rdzv-endpoint node0:29400 --rdzv-id run1 [key=value ...]

The launcher options are torchrun's (``--nnodes``, ``--nproc-per-node``, ``--rdzv-backend``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--max-restarts``, ...), parsed by ``torch.distributed.run``'s own parser and run
by ``torch.distributed.launcher.api.elastic_launch`` (the library torchrun is built on); everything
else (``--config PATH``, Hydra overrides) goes to ``recipes/finetune.py``. On one node without
rendezvous options the rendezvous is torchrun's ``--standalone`` one (a free local port).

What reaches the terminal is what the ranks print, and nothing of the launcher's own:

- The config is validated here, for the world size the launch will have, before any rank starts: a
  mistake is one ``error:`` line and exit 2, in about the time of one Hydra compose.
- A mistake the ranks find (a data file, a tokenizer, a model path) is one ``error:`` line from rank
  0 (:mod:`automodel.training.user_errors`) and exit 2; the launcher's traceback and failure table
  are not printed.
- A non-finite loss, gradient or weight (``recipe.on_nonfinite``, :mod:`automodel.training.nonfinite`)
  is one ``error:`` line from rank 0 naming the step and the quantity, and exit 3.
- SIGTERM (or SIGINT, Ctrl-C) stops the ranks with SIGTERM: they checkpoint as under torchrun
  (``checkpoint.save_on_sigterm``) and this command exits 143 (130 for SIGINT). The ranks have
  ``--shutdown-timeout`` seconds (torch's default 30, or ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) to do so.
- A rank lost during training (killed by SIGKILL, the OOM killer, a crash by signal): the others stop
  on the lost connection without a traceback (:mod:`automodel.training.peer_loss`) and this command
  prints one line naming the lost rank and exits 4; ``checkpoint.resume=auto`` continues the run from
  the newest good checkpoint.
- A node lost in a multi-node run: the surviving nodes print the same one line (or, when the lost node
  hosted the rendezvous store and this command noticed it first, one line saying so) and exit 4, without
  c10d's C++ stack traces of the failed store calls (``TORCH_CPP_LOG_LEVEL=ERROR`` unless set).
- A bug (any other failure of a rank) keeps the rank's traceback, followed by one line naming the
  failed ranks and their exit codes; this command exits 1.

``AUTOMODEL_LAUNCHER_LOG=1`` lets the launcher's own log messages through (for debugging a
rendezvous). The recipe can still be launched by hand: ``torchrun ... recipes/finetune.py ...``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

__all__ = ["COMMANDS", "EXIT_USER_ERROR", "FINETUNE_USAGE", "PLAN_USAGE", "USAGE", "main", "recipe_script", "split_argv"]

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3  # automodel.training.nonfinite.EXIT_NONFINITE
EXIT_LOST_RANK = 4  # = automodel.training.peer_loss.EXIT_LOST_RANK (the ranks' code; tests check they agree)
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

_REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"finetune": "recipes/finetune.py"}

# torchrun options this command passes on (both spellings are accepted, as torchrun does); the others
# (--module, --no-python, --run-path, ...) choose the program, which is the recipe here
_LAUNCHER_OPTIONS = (
    "--nnodes",
    "--nproc-per-node",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--standalone",
    "--max-restarts",
    "--monitor-interval",
    "--start-method",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--local-addr",
    "--log-dir",
    "--redirects",
    "--tee",
    "--local-ranks-filter",
    "--shutdown-timeout",
)

FINETUNE_USAGE = """\
usage: automodel finetune [--config PATH] [LAUNCHER OPTIONS] [OVERRIDE ...]

  --config PATH          a recipe YAML (default: configs/cp.yaml); relative paths are also looked up
                         in the repository and its configs/ directory
  OVERRIDE               Hydra overrides: key=value, +key=value, ~key (every key: docs/recipe.md)
  --nproc-per-node N     ranks on this node (default 1)
  --nnodes N | MIN:MAX   nodes (default 1); with more than one, give the rendezvous:
  --rdzv-endpoint H:P --rdzv-id ID [--rdzv-backend c10d]   (every node runs the same command), or
  --node-rank R --master-addr H --master-port P            (the static rendezvous)
  other torchrun options: --max-restarts, --monitor-interval, --rdzv-conf, --local-addr, --log-dir,
  --redirects, --tee, --local-ranks-filter, --shutdown-timeout, --start-method
Exit codes: 0 done, 2 a mistake in the input (one error: line), 3 a non-finite loss, gradient or
weight (one error: line; recipe.on_nonfinite), 4 a rank was lost (resume with checkpoint.resume=auto),
143 / 130 stopped by SIGTERM / SIGINT after a checkpoint, 1 anything else.
"""

PLAN_USAGE = """\
usage: automodel plan --config PATH --gpus N --gpu-type a100|h100|h200|l40s [--gpus-per-node M]
                      [--gpu-memory-gib G] [--host-memory-gib H] [--show-overrides] [OVERRIDE ...]

  the longest row that fits per layout (dp x cp x tp, each exact CP method) and memory technique, searched
  over the memory planner on the meta device (no GPU, no weights); the table, an ablation, the longest row's
  config keys and a last line `longest: <tokens> tokens per row (...)`. Rows past the model's positions
  (max_position_embeddings) are marked * with the RoPE scaling they need.
  --gpus-per-node M      GPUs per node (default 8; the launch's --nproc-per-node)
  --gpu-memory-gib G     the GPU's memory instead of its data sheet's (more than the 1 GiB reserve)
  --host-memory-gib H    host memory per node (default 256 GiB per GPU of the node)
  --show-overrides       under every row, the config keys that reproduce it
Exit codes: 0 planned, 2 a mistake in the input or nothing fits (one error: line). docs/long_context.md
"""

USAGE = FINETUNE_USAGE + "\n" + PLAN_USAGE

_PLAN_OPTIONS = {"--gpus": int, "--gpu-type": str, "--gpu-memory-gib": float, "--host-memory-gib": float,
                 "--gpus-per-node": int}  # fmt: skip
_PLAN_FLAGS = ("--show-overrides",)


class _UsageError(Exception):
    pass


def recipe_script(command: str) -> Path:
    """The recipe file a command launches (``finetune`` -> ``recipes/finetune.py``)."""
    path = _REPO / COMMANDS[command]
    if not path.is_file():
        raise _UsageError(
            f"{path} not found: the automodel command launches the recipes of its source checkout; "
            "install it with `pip install -e .` from the repository"
        )
    return path


def split_argv(argv: Sequence[str], option_takes_value: dict[str, bool]) -> tuple[list[str], list[str]]:
    """Split a command line into ``(launcher arguments, recipe arguments)``.

    ``option_takes_value`` maps each launcher option string (``--nnodes``, ``--nproc_per_node``, ...)
    to whether it takes a value. ``--opt=value`` and ``--opt value`` are both accepted. Any other
    ``--flag`` except ``--config``/``-c``/``--help`` is a usage error (:class:`_UsageError`).
    """
    launcher: list[str] = []
    recipe: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in option_takes_value:
            launcher.append(arg)
            if option_takes_value[name] and "=" not in arg:
                if i + 1 >= len(args):
                    raise _UsageError(f"{arg} needs a value (see automodel finetune --help)")
                launcher.append(args[i + 1])
                i += 1
        elif name in ("--config", "-c", "--config-file"):
            recipe.append(arg)
            if "=" not in arg and i + 1 < len(args):
                recipe.append(args[i + 1])
                i += 1
        elif arg.startswith("-") and arg not in ("-h", "--help"):
            raise _UsageError(
                f"unknown option {arg!r}; automodel finetune takes --config PATH, torchrun's launcher "
                "options (--nproc-per-node, --nnodes, --rdzv-*, ...) and key=value overrides (see --help)"
            )
        else:
            recipe.append(arg)
        i += 1
    return launcher, recipe


def _launcher_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:  # argparse would print its usage and exit 2: one line instead
        raise _UsageError(f"{message} (see automodel finetune --help)")

    parser.error = error  # type: ignore[method-assign]
    takes: dict[str, bool] = {}
    for action in parser._actions:  # the option strings of the options passed on, both spellings
        strings = list(action.option_strings)
        if any(s in _LAUNCHER_OPTIONS or s.replace("_", "-") in _LAUNCHER_OPTIONS for s in strings):
            for s in strings:
                takes[s] = action.nargs != 0
    return parser, takes


def _launcher_log() -> bool:
    return os.environ.get("AUTOMODEL_LAUNCHER_LOG", "") not in ("", "0")


def _quiet_cpp_log() -> None:
    """Keep c10d's C++ warnings off the terminal: when a node goes down, the launcher's (and the ranks')
    TCPStore clients print each failed store call as a warning with a C++ stack trace of about 25 lines,
    before the one line this command prints. ``TORCH_CPP_LOG_LEVEL`` is read when torch loads, so this runs
    before anything imports it (the ranks inherit it); a value the user set is kept, and
    ``AUTOMODEL_LAUNCHER_LOG=1`` lets the warnings through."""
    if not _launcher_log():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _quiet_launcher() -> None:
    """Keep torch elastic's log messages (warnings included) off the terminal."""
    if _launcher_log():
        return
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.NullHandler())  # no "last resort" printing of warnings to stderr
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    logging.getLogger("torch").setLevel(logging.CRITICAL + 1)


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _precheck(recipe_argv: list[str], world_size: int | None) -> tuple[int | None, bool]:
    """Validate the config before any rank starts: ``(exit code or None to go on, is a dry run)``."""
    import torch

    from automodel.config import RecipeConfig, validate_config
    from automodel.config.compose import compose_config, parse_argv, resolve_config_path
    from automodel.config.typecheck import ConfigError, to_dataclass

    try:
        config, overrides, _ = parse_argv(recipe_argv)
        raw = compose_config(resolve_config_path(config), overrides)
        problems: list[str] = []
        cfg = to_dataclass(RecipeConfig, raw, problems)
        if problems:
            raise ConfigError(problems)
        if cfg.recipe.dry_run:
            return None, True
        if world_size is not None:
            validate_config(raw, world_size=world_size, cuda_available=torch.cuda.is_available())
    except ConfigError as e:
        _error(str(e))
        return EXIT_USER_ERROR, False
    return None, False


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _lost_rank_line(codes: dict[int, int]) -> str | None:
    """The one line for a rank lost during training (killed by a signal other than SIGTERM, while the
    others stopped on the lost connection, :mod:`automodel.training.peer_loss`), else None."""
    stopped = (EXIT_LOST_RANK, EXIT_SIGTERM, -signal.SIGTERM)
    lost = {r: c for r, c in codes.items() if c not in stopped}
    if not any(c == EXIT_LOST_RANK for c in codes.values()) and not lost:
        return None
    if any(c >= 0 for c in lost.values()):
        return None  # a rank failed on its own (a bug, with its traceback): the usual line
    resume = "resume with checkpoint.resume=auto (it continues from the newest good checkpoint)"
    if not lost:
        ranks = ", ".join(str(r) for r in sorted(codes))
        return (
            f"rank(s) {ranks} lost contact with a rank of another node during training and stopped (that "
            f"node's output names it); {resume}"
        )
    names = ", ".join(f"rank {r} ({_how(c)})" for r, c in sorted(lost.items()))
    return f"{names} died during training; the other ranks stopped; {resume}"


def _exit_code_of_failures(failures: dict) -> tuple[int, str | None]:
    """The command's exit code for the ranks' failures, and a line to print (None: nothing)."""
    codes = {rank: f.exitcode for rank, f in failures.items()}
    if any(c == EXIT_USER_ERROR for c in codes.values()):
        return EXIT_USER_ERROR, None  # rank 0 printed the agreed error line
    if any(c == EXIT_NONFINITE for c in codes.values()):
        return EXIT_NONFINITE, None  # every rank agreed on the step; rank 0 printed the line
    if codes and all(c in (EXIT_SIGTERM, -signal.SIGTERM) for c in codes.values()):
        return EXIT_SIGTERM, None
    lost = _lost_rank_line(codes)
    if lost is not None:
        return EXIT_LOST_RANK, lost
    described = ", ".join(f"rank {r}: {_how(c)}" for r, c in sorted(codes.items()))
    return 1, f"{len(codes)} rank(s) failed ({described}); the traceback is above and in the run's logs/"


def _launch(launcher_argv: list[str], script: Path, recipe_argv: list[str]) -> int:
    parser, _ = _launcher_parser()
    args = parser.parse_args([*launcher_argv, str(script), *recipe_argv])
    given = {a.split("=", 1)[0].replace("_", "-") for a in launcher_argv if a.startswith("--")}
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.standalone or (
        max_nodes == 1 and not given & {"--rdzv-endpoint", "--rdzv-backend", "--master-port", "--master-addr"}
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks, silently
    os.environ["AUTOMODEL_LAUNCHER"] = "cli"  # peer_loss.LAUNCHER_ENV: survivors of a lost rank stay quiet, we name it

    from torch.distributed.run import config_from_args

    try:
        nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else None
        if nproc is None:
            from torch.distributed.run import determine_local_world_size

            nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise _UsageError(f"--nproc-per-node {args.nproc_per_node}: {e}") from None
    code, dry_run = _precheck(recipe_argv, nproc * min_nodes if min_nodes == max_nodes else None)
    if code is not None:
        return code
    if dry_run:  # a plan, not a run: one process (its world size comes from the config or --nproc-per-node)
        env = dict(os.environ)
        if "--nproc-per-node" in given or "--nnodes" in given:
            env["WORLD_SIZE"] = str(nproc * max_nodes)
        if "--nproc-per-node" in given and not any(a.lstrip("+").startswith("recipe.plan_nproc_per_node=")
                                                   for a in recipe_argv):  # fmt: skip
            recipe_argv = [*recipe_argv, f"recipe.plan_nproc_per_node={nproc}"]  # the plan's GPUs per node
        return subprocess.call([sys.executable, str(script), *recipe_argv], env=env)

    args.signals_to_handle = "SIGTERM,SIGHUP,SIGQUIT"  # SIGINT: below, turned into SIGTERM for the ranks
    config, cmd, cmd_args = config_from_args(args)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import elastic_launch

    interrupted: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        if interrupted:  # a second Ctrl-C while the ranks checkpoint: ignored (they are stopping)
            return
        interrupted.append(signum)
        raise SignalException("SIGINT: stopping the ranks with SIGTERM", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGINT, on_sigint)
    _quiet_cpp_log()  # for the ranks (this process: main() did it before torch loaded)
    _quiet_launcher()
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        code, line = _exit_code_of_failures(e.failures)
        if interrupted:
            return EXIT_SIGINT
        if line is not None:
            _error(line)
        return code
    except SignalException as e:
        if interrupted:
            return EXIT_SIGINT
        return 128 + int(e.sigval)
    except RendezvousConnectionError:  # the node that hosts the rendezvous store went down (before a rank saw it)
        if interrupted:
            return EXIT_SIGINT
        _error(
            f"lost the connection to the rendezvous store at {args.rdzv_endpoint or args.master_addr}: the node "
            "that hosts it went down or its launcher stopped, and this node's ranks were stopped; if a run was "
            "under way, resume it with checkpoint.resume=auto (it continues from the newest good checkpoint)"
        )
        return EXIT_LOST_RANK
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_SIGINT if interrupted else 0


def _plan_args(argv: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """``automodel plan``'s options and the rest (``--config PATH`` and overrides). Raises :class:`_UsageError`."""
    opts: dict[str, object] = {}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg in _PLAN_FLAGS:
            opts[arg] = True
        elif name in _PLAN_OPTIONS:
            if not eq:
                if i + 1 >= len(args):
                    raise _UsageError(f"{arg} needs a value (see automodel plan --help)")
                value, i = args[i + 1], i + 1
            try:
                opts[name] = _PLAN_OPTIONS[name](value)
            except ValueError:
                raise _UsageError(f"{name}={value!r} is not a {_PLAN_OPTIONS[name].__name__}") from None
        elif name in ("--config", "-c", "--config-file"):
            rest.append(arg)
            if not eq and i + 1 < len(args):
                rest.append(args[i + 1])
                i += 1
        elif arg.startswith("-"):
            raise _UsageError(f"unknown option {arg!r}; automodel plan takes --config PATH, "
                              f"{', '.join([*_PLAN_OPTIONS, *_PLAN_FLAGS])} and key=value overrides (see --help)")  # fmt: skip
        else:
            rest.append(arg)
        i += 1
    return opts, rest


def _plan(argv: Sequence[str]) -> int:
    """``automodel plan``: print the longest-row table of :mod:`automodel.training.plan_search`."""
    if "-h" in argv or "--help" in argv:
        print(PLAN_USAGE, end="")
        return 0
    try:
        opts, rest = _plan_args(argv)
        from automodel.config.compose import parse_argv
        from automodel.config.typecheck import ConfigError
        from automodel.training.plan_search import DEVICE_MEMORY_MIB, check_plan_gpu

        gpus, gpu_type = opts.get("--gpus"), str(opts.get("--gpu-type", "")).lower()
        if not isinstance(gpus, int) or gpus < 1:
            raise _UsageError("automodel plan needs --gpus N (N >= 1): the GPUs to plan for")
        if not gpu_type:
            raise _UsageError(f"automodel plan needs --gpu-type, one of {', '.join(sorted(DEVICE_MEMORY_MIB))}")
        for key in ("--gpu-memory-gib", "--host-memory-gib", "--gpus-per-node"):
            if key in opts and not float(opts[key]) > 0:  # type: ignore[arg-type]
                raise _UsageError(f"{key}={opts[key]} must be > 0")
        try:
            check_plan_gpu(gpu_type, opts.get("--gpu-memory-gib"))  # type: ignore[arg-type]
        except ValueError as e:
            raise _UsageError(str(e)) from None
        try:
            config, overrides, _ = parse_argv(rest)
        except ConfigError as e:
            raise _UsageError(str(e)) from None
        if config is None:
            raise _UsageError("automodel plan needs --config PATH (the model and dtypes to plan for)")
    except _UsageError as e:
        _error(str(e))
        return EXIT_USER_ERROR
    from automodel.training.plan_search import plan_report

    try:
        lines = plan_report(config, overrides, gpus, gpu_type, opts.get("--gpu-memory-gib"),  # type: ignore[arg-type]
                            opts.get("--host-memory-gib"), show_overrides=bool(opts.get("--show-overrides")),  # type: ignore[arg-type]
                            gpus_per_node=opts.get("--gpus-per-node"))  # type: ignore[arg-type]  # fmt: skip
    except (ConfigError, ValueError) as e:
        _error(str(e))
        return EXIT_USER_ERROR
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``automodel`` command (console script). Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else EXIT_USER_ERROR
    command, rest = argv[0], argv[1:]
    _quiet_cpp_log()  # before torch loads
    if command == "plan":
        return _plan(rest)
    try:
        if command not in COMMANDS:
            raise _UsageError(f"unknown command {command!r}; the commands are: {', '.join(COMMANDS)}")
        if "-h" in rest or "--help" in rest:
            print(FINETUNE_USAGE, end="")
            return 0
        _quiet_launcher()
        _, takes = _launcher_parser()
        launcher_argv, recipe_argv = split_argv(rest, takes)
        return _launch(launcher_argv, recipe_script(command), recipe_argv)
    except _UsageError as e:
        _error(str(e))
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C before the ranks started (e.g. while the config is checked)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
