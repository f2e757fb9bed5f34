"""The command line before Hydra composes it, and the composed config after.

Before composing, `prepare_overrides` checks config-group options, so a typo like
`attention=sliding_windw` is one line with a suggestion instead of Hydra's multi-line error, and
quotes numeric option names (`block_size=64`) that Hydra would otherwise parse as integers.
Hydra's own flags (`--cfg job`, `-cd DIR`, `-sc install=bash`, ...) pass through untouched, with
their arguments: Hydra's argument parser says which flags take one.

What Hydra receives is not always what the user typed (`++attention.window_size=128`,
`block_size='64'`); `as_typed` maps an override back, and everything a person reads (run names,
W&B run names, the overrides column of every table) and every record a resumed sweep compares
(metrics.json, grid.json) holds the typed form.

After composing, the resolvers of the YAML files (`${div:...}`, `${split:...}`, `${run_id:}`) and
`to_plain`, the composed config as the plain dict attngym.runner.config reads (nothing below this
module sees OmegaConf). OmegaConf is imported inside the functions that need it.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from attngym.errors import ConfigError, closest

# The repository's conf/, installed as this package (an editable install maps it to conf/ itself).
# Hydra composes from it and the option checks below list it: one place for both.
CONF_PACKAGE = "attngym.conf"
CONF_DIR = Path(str(files(CONF_PACKAGE)))  # a regular package, so a real folder on disk

# Keys whose sub-keys are open: a variant's parameters differ per variant, kernel options are
# flex_attention's, a topology's options its spec's, a scheme factory's arguments its own.
# Overrides of them are forced (`++`), so a misspelt key reaches attngym's own check (one line
# with a suggestion) rather than Hydra's struct-mode error; so is topology.scheme, which only
# topology=custom's file holds and a sweep sets for every topology.
OPEN_KEYS = ("attention", "kernel_options", "topology.options", "topology.scheme_args")
FORCED_KEYS = ("topology.scheme",)
_OPEN = "|".join(map(re.escape, OPEN_KEYS))
_FORCED = rf"(?:(?:{_OPEN})\.[\w.]+|{'|'.join(map(re.escape, FORCED_KEYS))})="
_OPEN_ARG = re.compile(rf"^{_FORCED}")
_FORCED_OPEN_ARG = re.compile(rf"^\+\+(?={_FORCED})")

_GROUP_ARG = re.compile(
    r"^(?P<prefix>[+~]{0,2})(?P<group>[A-Za-z_][\w/]*)(?P<pkg>@[\w.]*)?=(?P<value>.*)$"
)
_VALUE_ARG = re.compile(r"^(?P<prefix>\+{0,2})(?P<key>[A-Za-z_][\w.]*)=")
_QUOTED_NUMBER = re.compile(r"(?<![^,])'(\d+)'(?![^,])")  # an item '64' of `a,'64',b`

# Flags whose "overrides" are Hydra's completion commands (`install=bash`, `query=bash`).
SHELL_COMPLETION = ("-sc", "--shell-completion")


# --------------------------------------------------------------------------------------------
# Resolvers and the composed config


def register_resolvers() -> None:
    """Register the OmegaConf resolvers the YAML files use (idempotent; call before composing).

    - `${div:a,b}`: integer division, e.g. `prefix_length: ${div:${shape.seq_len},4}`.
    - `${split:total,[fractions]}`: integer lengths proportional to the fractions that sum to
      `total` exactly (the last one takes the rounding), e.g. document lengths.
    - `${run_id:}`: the name of a default run or sweep folder (`run_id`), cached with the config
      like Hydra's `${now:}`, so a sweep's jobs (submitit copies the cache to them) and the
      ranks of a SLURM step agree on it.
    - `${study:${attention},${shape},${device.name},${dtype}}`: the tuner's Optuna study name
      (`study_name`).
    - `${cache:}`: attngym's cache folder (attngym.compile_cache.root).
    - `${signal_delay:${.timeout_min}}`: the SLURM launcher's signal delay from the job's limit
      (`signal_delay`).
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("div"):
        OmegaConf.register_new_resolver("div", _div)
    if not OmegaConf.has_resolver("split"):
        OmegaConf.register_new_resolver("split", _split)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("attention_options"):
        OmegaConf.register_new_resolver("attention_options", attention_options)
    if not OmegaConf.has_resolver("config_groups"):
        OmegaConf.register_new_resolver("config_groups", config_groups)
    if not OmegaConf.has_resolver("study"):
        OmegaConf.register_new_resolver("study", study_name)
    if not OmegaConf.has_resolver("cache"):
        OmegaConf.register_new_resolver("cache", cache_folder)
    if not OmegaConf.has_resolver("signal_delay"):
        OmegaConf.register_new_resolver("signal_delay", signal_delay)


def expect_launcher_schema() -> None:
    """Silence Hydra's deprecation warning for conf/hydra/launcher/submitit_slurm.yaml: it is
    checked against hydra-submitit-launcher's schema of the same name on purpose (its keys are
    the plugin's, attngym's launcher fills some in), which Hydra calls automatic schema matching."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"\s*'hydra/launcher/submitit_slurm' is validated against ConfigStore"
    )


def run_id() -> str:
    """A default run or sweep folder's name: the time to the microsecond and the process id, so
    two runs started together get folders of their own; in a SLURM job step of several tasks
    (each task a rank of one run: attngym.distributed.ranks.launch.join_slurm_step), `slurm-<job
    id>.<step id>`, the same in every task."""
    import datetime

    from attngym.distributed.ranks.launch import slurm_step_tasks

    if slurm_step_tasks() > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    return f"{datetime.datetime.now():%H-%M-%S-%f}-{os.getpid()}"


# The width a line attngym prints keeps to (--help, a refused option, a sweep's launch lines).
LINE_WIDTH = 100


def wrapped(head: str, items: Iterable[str], indent: int, sep: str = ", ") -> str:
    """`head` then `items` joined by `sep`, wrapped at LINE_WIDTH, later lines indented by
    `indent`; an item longer than a line is kept whole."""
    import textwrap

    return textwrap.fill(
        sep.join(items),
        width=LINE_WIDTH,
        initial_indent=head,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def config_groups() -> str:
    """--help's config groups and their options, wrapped at LINE_WIDTH (Hydra's
    $APP_CONFIG_GROUPS puts each on one line: attention's is 700 characters): the groups of
    attngym's config folder and of the command line's `-cd DIR` and `hydra.searchpath`."""
    flag_args, at = split_flags(typed_command_line)
    dirs = _conf_dirs(flag_args) or [CONF_DIR]
    dirs += _search_path([typed_command_line[i] for i in at])
    lines = [
        wrapped(f"{group}: ", group_options(group, dirs), indent=4)
        for group in sorted(_group_dirs(dirs))
    ]
    return "\n".join(lines).replace("$", "$$")  # string.Template's escape (attention_options)


def attention_options() -> str:
    """`--help`'s list of attention options, each with its parameters and their defaults as its
    conf/attention/<name>.yaml states them (`${attention_options:}` in the help template),
    wrapped at LINE_WIDTH."""
    import yaml

    lines = []
    for path in sorted((CONF_DIR / "attention").glob("*.yaml")):
        entry = yaml.safe_load(path.read_text()) or {}
        if "compose" in entry:
            parts = [p.get("name", "?") for p in entry["compose"]]
            params = [
                f"{' + '.join(parts)}: "
                + "; ".join(
                    ", ".join(f"{k}={v}" for k, v in p.items() if k != "name") or p.get("name", "")
                    for p in entry["compose"]
                )
            ]
        else:
            params = [f"{k}={'null' if v is None else v}" for k, v in entry.items() if k != "name"]
        lines.append(wrapped(f"  {path.stem:<30} ", params or ["(no parameters)"], indent=33))
    # Hydra fills the help template with string.Template: a default such as ${shape.seq_len}
    # is shown as written, its `$` doubled.
    return "\n".join(lines).replace("$", "$$")


def _div(a: Any, b: Any) -> int:
    if not isinstance(a, int) or not isinstance(b, int) or b == 0:
        raise ValueError(f"div needs two integers and a non-zero divisor, got {a!r}, {b!r}")
    return a // b


def _split(total: Any, fractions: Any) -> list[int]:
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"split needs a positive integer total, got {total!r}")
    fractions = list(fractions)
    if not fractions or any(not isinstance(f, int | float) or f <= 0 for f in fractions):
        raise ValueError(f"split needs positive fractions, got {fractions!r}")
    norm = sum(fractions)
    lengths = [max(1, int(total * f / norm)) for f in fractions[:-1]]
    return [*lengths, total - sum(lengths)]


def to_plain(cfg: Any) -> dict[str, Any]:
    """The composed config (a DictConfig) as a plain, resolved dict without the `hydra` node:
    what attngym.runner.config reads.

    Raises:
        ConfigError: an interpolation cannot be resolved; the key names where.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(str(key), str(err).split("\n")[0]) from None
    data.pop("hydra", None)  # type: ignore[union-attr]
    return data  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Config groups and their options


def _group_dirs(conf_dirs: Iterable[Path] = (CONF_DIR,)) -> set[str]:
    """Config groups a user picks options of: the config folders' folders, less hydra/ and
    __pycache__/."""
    return {
        p.name
        for conf_dir in conf_dirs
        if conf_dir.is_dir()
        for p in conf_dir.iterdir()
        if p.is_dir() and p.name != "hydra" and not p.name.startswith(("_", "."))
    }


def group_options(group: str, conf_dirs: Iterable[Path] = (CONF_DIR,)) -> list[str]:
    return sorted({p.stem for d in conf_dirs for p in (d / group).glob("*.yaml")})


# --------------------------------------------------------------------------------------------
# Hydra's flags


@functools.cache
def hydra_flags() -> dict[str, tuple[Any, tuple[str, ...] | None]]:
    """Hydra's command-line flags, from Hydra's own argument parser: {flag: (nargs, choices)}.

    nargs 0: a switch (`--resolve`); None: one argument (`--cfg job`, `-cd DIR`); "?": an
    optional one, taken when it is one of the choices (`--info defaults`).
    """
    from hydra._internal.utils import get_args_parser

    return {
        option: (action.nargs, tuple(action.choices) if action.choices else None)
        for action in get_args_parser()._actions
        for option in action.option_strings
    }


def split_flags(argv: Sequence[str]) -> tuple[list[tuple[int, str]], list[int]]:
    """Which arguments are Hydra's flags (with their arguments) and which are overrides.

    Returns:
        ([(index, flag or flag argument)], [indices of the overrides]).
    """
    flags = hydra_flags()
    flag_args: list[tuple[int, str]] = []
    overrides: list[int] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            overrides.append(i)
            i += 1
            continue
        flag_args.append((i, arg))
        name, eq, _ = arg.partition("=")
        nargs, choices = flags.get(name, (0, None))
        takes_next = i + 1 < len(argv) and not eq
        if takes_next and (nargs is None or (nargs == "?" and argv[i + 1] in (choices or ()))):
            flag_args.append((i + 1, argv[i + 1]))
            i += 1
        i += 1
    return flag_args, overrides


def _flag_value(flag_args: list[tuple[int, str]], names: Sequence[str]) -> str | None:
    """The argument of the last of `names` among the flags (`-cd DIR` or `--config-dir=DIR`)."""
    value = None
    for n, (_, arg) in enumerate(flag_args):
        name, eq, attached = arg.partition("=")
        if name in names:
            value = attached if eq else (flag_args[n + 1][1] if n + 1 < len(flag_args) else None)
    return value


def _conf_dirs(flag_args: list[tuple[int, str]]) -> list[Path] | None:
    """The folders Hydra reads config groups from: attngym's conf (or `-cp DIR`) and `-cd DIR`;
    None when `-cp` names a folder this check cannot read (Hydra then checks the options)."""
    primary = _flag_value(flag_args, ("-cp", "--config-path"))
    dirs = [CONF_DIR]
    if primary is not None:
        if not Path(primary).is_absolute() or not Path(primary).is_dir():
            return None
        dirs = [Path(primary)]
    extra = _flag_value(flag_args, ("-cd", "--config-dir"))
    return [*dirs, Path(extra)] if extra else dirs


def _search_path(overrides: Sequence[str]) -> list[Path]:
    """The folders of `hydra.searchpath=[file://DIR, ...]`: a config folder of your own, whose
    `<group>/<name>.yaml` files are options too (Hydra reads them; this check lists them)."""
    dirs: list[Path] = []
    for arg in overrides:
        key, _, value = arg.lstrip("+").partition("=")
        if key != "hydra.searchpath":
            continue
        for item in value.strip().strip("[]").split(","):
            item = item.strip().strip("'\"")
            if item.startswith("file://"):
                dirs.append(Path(item.removeprefix("file://")))
    return dirs


# The command line as the user typed it (attngym.runner.cli.entry sets it), for the resume command.
typed_command_line: list[str] = []
# A single run's overrides that Hydra itself would refuse (HydraRefused), as typed, with the
# error: attngym.runner.cli.entry leaves them out of what Hydra composes, and the job refuses the
# run with the error, so the run has a folder and a metrics.json like any config error.
refused: list[tuple[str, ConfigError]] = []


class HydraRefused(ConfigError):
    """An override that Hydra itself would refuse with a traceback or a page of text: one its
    grammar cannot read, an option of one of Hydra's own groups it does not have."""


def raise_refused() -> None:
    """Raise the error of the first override left out for Hydra (`refused`), if any."""
    if refused:
        raise refused[0][1]


def resume_command(sweep_dir: str | Path) -> str:
    """The command that resumes (or re-runs) a sweep into `sweep_dir`: the command line as
    typed, with `hydra.sweep.dir` set to it (jobs already ok and complete are skipped)."""
    import shlex
    import sys

    args = [a for a in typed_command_line if a.lstrip("+").partition("=")[0] != "hydra.sweep.dir"]
    args.append(f"hydra.sweep.dir={sweep_dir}")
    if "WORLD_SIZE" in os.environ:  # torchrun's own arguments are not ours to know
        return f"the same torchrun command with these attngym arguments: {shlex.join(args)}"
    program = ["attngym"] if Path(sys.argv[0]).name == "attngym" else ["python", "-m", "attngym"]
    return shlex.join([*program, *args])


# --------------------------------------------------------------------------------------------
# Overrides


def prepare_overrides(
    argv: list[str], left_out: list[tuple[str, ConfigError]] | None = None
) -> list[str]:
    """Check and normalise config-group overrides before Hydra sees them.

    - `group=option` (and sweeps `group=a,b`) must name files in conf/<group>/ (or in the folder
      of `-cd DIR`); an unknown option raises ConfigError listing the options with a suggestion;
    - numeric option names are quoted (`block_size=64` → `block_size='64'`): Hydra would parse them
      as integers and refuse them as group options;
    - any other `key=value` (with or without `+`) must name a config key
      (attngym.runner.config.check_key): `seq_len=512` or `+shape.seqlen=512` raise ConfigError with
      the key meant (`shape.seq_len`);
    - `attention.<key>=v` and `kernel_options.<key>=v` become `++attention.<key>=v` (add or
      override): these keys are checked by attngym (attngym.variants.spec.build_variant, the
      kernel-option checks of attngym.runner.config), which names a misspelt key with a suggestion.
      `kernel_options` is null in conf/config.yaml so that sweeps can set whole mappings
      (`kernel_options={...}`); `++kernel_options.X=v` creates the mapping from null.

    - every override must be one Hydra's grammar reads, and an option of one of Hydra's own
      groups (`hydra/launcher=...`) one it has: else HydraRefused, naming the key, where Hydra
      would print its parser's or its config loader's text; with `left_out` (a single run)
      such an override is left out of the result and recorded there, as typed, with its error.

    Hydra's flags and their arguments pass through unchanged (`split_flags`); with `-sc` the whole
    command line does, its words being completion commands. `as_typed` undoes the rewriting.
    """
    if any(arg.partition("=")[0] in SHELL_COMPLETION for arg in argv):
        return list(argv)
    flag_args, at = split_flags(argv)
    conf_dirs = _conf_dirs(flag_args)
    if conf_dirs is not None:
        conf_dirs += _search_path([argv[i] for i in at])
    groups = _group_dirs(conf_dirs) if conf_dirs is not None else set()
    out: list[str | None] = list(argv)
    for i in at:
        try:
            out[i] = _prepare(argv[i], groups, conf_dirs or [])
            _check_grammar(out[i])
        except HydraRefused as err:
            if left_out is None:
                raise
            left_out.append((argv[i], err))
            out[i] = None
    kept = [a for a in out if a is not None]
    _check_preset_on_this_machine([a for i, a in enumerate(out) if i in at and a], conf_dirs or [])
    return kept


def _check_grammar(arg: str) -> None:
    """HydraRefused naming the key for an override Hydra's grammar cannot read (`[1,2`, `((`, an
    emoji unquoted), where Hydra prints its parser's message about the rewritten override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(arg)
    except HydraException as err:
        typed = as_typed(arg)
        key, _, value = typed.lstrip("+~").partition("=")
        reason = str(err).splitlines()[0].split(" expecting {")[0]
        raise HydraRefused(
            key.split("@")[0] or typed,
            f"Hydra's override grammar cannot read {value!r} ({reason}): close its brackets, "
            f"or quote it ({key}='...')",
        ) from None


def _prepare(arg: str, groups: set[str], conf_dirs: list[Path]) -> str:
    """One override as Hydra should receive it (see prepare_overrides)."""
    if _OPEN_ARG.match(arg):
        return f"++{arg}"
    match = _GROUP_ARG.match(arg)
    if match and match["group"].startswith("hydra/"):  # Hydra's groups: their options are Hydra's
        _check_hydra_option(match["group"], match["value"], conf_dirs)
        return arg
    if not match or match["group"] not in groups:
        _check_value_key(arg)
        _check_output_dir(arg)
        return arg
    value = match["value"]
    if match["prefix"].startswith("~") and not value:
        return arg
    if "(" in value or "[" in value or "$" in value:  # choice(...), range(...), globs: Hydra's
        return arg
    items = [v.strip().strip("'\"") for v in value.split(",")]
    options = group_options(match["group"], conf_dirs)
    for item in items:
        if item not in options and item != "null":
            raise ConfigError(match["group"], unknown_option(match["group"], item, options))
    quoted = ",".join(f"'{v}'" if v.isdigit() else v for v in items)
    return f"{match['prefix']}{match['group']}{match['pkg'] or ''}={quoted}"


# Where Hydra writes before any attngym code runs: refused here with one line, not Hydra's
# traceback from its mkdir or its .hydra writes.
OUTPUT_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")


def _check_output_dir(arg: str) -> None:
    """ConfigError (hydra.run.dir / hydra.sweep.dir) for a folder Hydra cannot or must not write:
    one inside attngym's config folder (its `.hydra` would become a config group, its YAML
    options), a file of that name, a folder (or, for a new one, its nearest existing parent)
    that is not writable, a symlink planted as its `.hydra`. A value with an interpolation is
    left to Hydra."""
    key, _, value = arg.lstrip("+").partition("=")
    if key not in OUTPUT_DIR_KEYS or not value or "${" in value:
        return
    folder = Path(value.strip("'\""))
    if folder.resolve() == CONF_DIR.resolve() or CONF_DIR.resolve() in folder.resolve().parents:
        raise ConfigError(
            key, f"{folder} is inside attngym's config folder {CONF_DIR}; choose another folder"
        )
    if folder.exists() and not folder.is_dir():
        raise ConfigError(key, f"{folder} is a file, not a folder; name a folder for the output")
    if (folder / ".hydra").is_symlink():
        raise ConfigError(key, f"{folder}/.hydra is a symlink; remove it (writes stay inside)")
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            key, f"cannot write in {existing} (read-only or not yours); choose another folder"
        )


# hydra/launcher options whose launcher is another package's Hydra plugin: (module, install).
LAUNCHER_PLUGINS = {
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", 'pip install -e ".[slurm]"'),
}


def unknown_option(group: str, item: str, options: Sequence[str]) -> str:
    """The refusal of a group option the config folders lack: the option meant first, then the
    options, the first OPTIONS_WIDTH characters of them and how many --help lists (the 43
    attention options made one line of 800 characters, the option meant at its end)."""
    hint = closest(item, options)
    head = f"unknown option {item!r}" + (f" (did you mean {hint!r}?)" if hint else "")
    listed = sorted(options)
    more = f"... ({len(listed)} in all: attngym --help)"
    if len(", ".join(listed)) > OPTIONS_WIDTH + len(more):  # cut where cutting is shorter
        fit = [n for n in range(len(listed)) if len(", ".join(listed[: n + 1])) <= OPTIONS_WIDTH]
        listed = [*listed[: len(fit)], more]
    return f"{head}; options: {', '.join(listed)}"


# How much of a refused option's line lists the options (unknown_option).
OPTIONS_WIDTH = 40


def _check_hydra_option(group: str, value: str, conf_dirs: list[Path]) -> None:
    """HydraRefused (the group) for an option of one of Hydra's own groups that neither Hydra, its
    plugins nor the config folders have, where Hydra prints a page; a launcher plugin that is not
    installed is named with how to install it."""
    options = set(group_options(group, conf_dirs))  # the config folders' (the fast look)
    for option in (v.strip().strip("'\"") for v in value.split(",")):
        if option in LAUNCHER_PLUGINS and group == "hydra/launcher":
            _check_plugin(option)
        elif option not in options and "(" not in value and option != "null":
            options |= _hydra_options(group)
            if not options:
                raise HydraRefused(group, f"{group} is no config group of Hydra's")
            if option not in options:
                raise HydraRefused(group, unknown_option(group, option, options))


def _hydra_options(group: str) -> set[str]:
    """The options Hydra and its plugins have for one of Hydra's groups (`basic`, `optuna`):
    its config repository, which scans the plugins (Hydra's own run then reuses the scan)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path

    repository = ConfigRepository(create_config_search_path(f"pkg://{CONF_PACKAGE}"))
    return set(repository.get_group_options(group))


def _check_plugin(option: str) -> None:
    """ConfigError (hydra/launcher) when the option's launcher plugin is not installed, rather
    than Hydra's "Unknown plugin class" traceback."""
    import importlib.util

    module, install = LAUNCHER_PLUGINS[option]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise HydraRefused(
            "hydra/launcher", f"{option} needs hydra-submitit-launcher, not installed: {install}"
        )


def task_overrides(hydra: Any) -> list[str]:
    """The task overrides of a composed config's `hydra` node as Hydra received them, never
    resolved: `shape.seq_len=${nope}` is the user's text, which the job's config check refuses
    naming its key; read resolved, it raised before any job."""
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.to_container(hydra.overrides.task, resolve=False)]


def as_typed(override: str) -> str:
    """An override as the user typed it, from what Hydra received (prepare_overrides, or a sweep
    job's share of it): `++attention.window_size=128` → `attention.window_size=128`,
    `block_size='64'` → `block_size=64`. Idempotent: a typed override maps to itself, so records
    written before this mapping existed compare equal after it."""
    override = _FORCED_OPEN_ARG.sub("", override)
    match = _GROUP_ARG.match(override)
    if match and match["group"] in _group_dirs():
        key, _, value = override.partition("=")
        return f"{key}={_QUOTED_NUMBER.sub(_unquote, value)}"
    return override


def _unquote(match: re.Match[str]) -> str:
    return match[1]


def launch_lines(job_overrides: Sequence[Sequence[str]]) -> tuple[str, list[str]]:
    """What a launcher prints of a sweep's jobs (Hydra's own launch line held every override in
    its ++ form, past 100 characters): the overrides every job shares, once, wrapped on lines of
    their own; each job's others, as typed, cut to fit LINE_WIDTH after `[HYDRA] \t#N : ` (the
    whole is in its metrics.json and the sweep's summary).

    Returns:
        (the shared overrides' lines, "" when the jobs share none; one text per job).
    """
    from attngym.metrics import printable, shortened

    typed = [[printable(as_typed(o)) for o in overrides] for overrides in job_overrides]
    shared = [o for o in typed[0] if all(o in job for job in typed)] if len(typed) > 1 else []
    width = LINE_WIDTH - len("[00:00:00][HYDRA] \t#000 : ")
    lines = [" ".join(o for o in job if o not in shared) or "(the shared ones)" for job in typed]
    return wrapped("    ", shared, indent=4, sep=" ") if shared else "", [
        shortened(line, width) for line in lines
    ]


def run_name(
    overrides: Iterable[str],
    *,
    exclude_keys: Iterable[str] = (),
    item_sep: str = ",",
    kv_sep: str = "=",
) -> str:
    """A run's readable name: its typed overrides, sorted, less `exclude_keys`, joined as Hydra
    joins hydra.job.override_dirname (hydra.job.config.override_dirname says how); "defaults"
    for none."""
    excluded = set(exclude_keys)
    lines = sorted(
        o for o in overrides if o.partition("=")[0].lstrip("+~").split("@")[0] not in excluded
    )
    return item_sep.join(line.replace("=", kv_sep) for line in lines) or "defaults"


def _check_preset_on_this_machine(overrides: list[str], conf_dirs: list[Path]) -> None:
    """A GPU-sized preset on a CPU is refused once, before a sweep's first job (each job checks
    it again with the device its config resolves to: attngym.runner.presets)."""
    presets = [
        m["value"] for a in overrides if (m := _GROUP_ARG.match(a)) and m["group"] == "experiment"
    ]
    if len(presets) != 1 or "," in presets[0] or CONF_DIR not in conf_dirs:
        return
    if attngym_preset(presets[0]) is None:
        return
    from attngym.device import resolve_device
    from attngym.runner.presets import check_fits_machine

    devices = [a.split("=", 1)[1] for a in overrides if a.lstrip("+").startswith("device=")]
    try:
        device = resolve_device(devices[-1] if devices else "auto").type
    except ValueError:
        return  # the job's own check names the device
    check_fits_machine(CONF_DIR, presets[0], device, overrides)


def attngym_preset(name: str | None) -> str | None:
    """`name` when it is one of attngym's presets (conf/experiment/, whose headers say the
    machine each is sized for: attngym.runner.presets), else None (a preset of the user's `-cd`
    folder carries no such header)."""
    if name is None or not (CONF_DIR / "experiment" / f"{name}.yaml").is_file():
        return None
    return name


def _check_value_key(arg: str) -> None:
    """A `key=value` override (also `+key=` and `++key=`) names a config key
    (attngym.runner.config.check_key): a misspelt or group-less key is one line with the key it most
    likely means, never a key Hydra adds and nothing reads. Hydra's own keys pass."""
    from attngym.runner.config import check_key

    match = _VALUE_ARG.match(arg)
    if match and match["key"].split(".")[0] != "hydra":
        check_key(match["key"])


def study_name(attention: Any, shape: Any, device: str, dtype: str) -> str:
    """The tuner's study: one per variant (your own named by its label or import paths), shape,
    device and dtype (`auto` resolved here), so a second tuning command of the same problem
    resumes the same study, as long as the search space (tune_search.SEARCH_SPACE) is the same."""
    from attngym.device import auto_dtype, resolve_device
    from attngym.runner.tune_search import SEARCH_SPACE

    device = resolve_device(device).type
    dtype = auto_dtype(device) if dtype == "auto" else dtype
    parts = [attention.get("name")]
    if attention.get("name") == "custom":
        parts += [attention.get(k) for k in ("label", "mask_mod", "score_mod") if attention.get(k)]
    parts += [f"b{shape.batch}h{shape.heads}s{shape.seq_len}d{shape.head_dim}", device, dtype]
    parts.append(f"space{SEARCH_SPACE}")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(str(p) for p in parts))


# The longest signal_delay_s derived from timeout_min (SIGNAL_DELAY_SHARE of it below that).
SIGNAL_DELAY_S = 120
SIGNAL_DELAY_SHARE = 0.1


def signal_delay(timeout_min: Any) -> int:
    """The SLURM launcher's signal_delay_s derived from the job's limit: SIGNAL_DELAY_SHARE of
    it, at most SIGNAL_DELAY_S (attngym.runner.launchers.slurm says why)."""
    return int(min(SIGNAL_DELAY_S, float(timeout_min) * 60 * SIGNAL_DELAY_SHARE))


def cache_folder() -> str:
    """attngym's cache folder, for a config's paths (the tuner's study database), made if it is
    not there yet (SQLite creates a database file, not its folder)."""
    from attngym import compile_cache

    root = compile_cache.root()
    root.mkdir(parents=True, exist_ok=True)
    return str(root)
