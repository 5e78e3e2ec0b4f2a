"""The README and docs/ cannot rot: every relative link resolves (file and anchor),
every command in the README's code blocks runs as written, the docs pages' commands
name modules, flags and config fields that exist, and design.md's package table names
exactly the packages under rpk/.

"Runs as written", without starting a training run: an `rpk.run` command's arguments
are parsed by `rpk.config.from_argv` (a wrong flag or value fails), and once the config
has `run.dry_run` the command itself runs with `--run.dry_run true` appended (config,
layout and memory plan resolved, nothing started). Any other `python -m X` must answer
`--help` and know every flag the command gives it; `torchrun` must know its flags; a
script must exist and be executable; the test command must be what `.ci/run` runs.
Placeholders (`HOST`, `/path/to/hf-model`, ...) are replaced by the values of
`_substitutions`, real files where a dry run would read them; a placeholder missing
from that table fails the test instead of being skipped.

Dry runs and `--help` run in this process, through each module's `main` (a process
each would pay torch's import again); `test_the_entry_points_answer_as_processes` runs
one of each kind as the shell would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpk import config
from rpk import run as rpk_run

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PYTHONS = {"python", "python3", ".venv/bin/python"}


# -- markdown -------------------------------------------------------------------------

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _shell_blocks(text: str) -> list[str]:
    """Bodies of the fenced blocks with no info string or a shell one (not ```text)."""
    blocks, body, info = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, info = [], line[3:].strip()
            else:
                if info in ("", "sh", "bash", "shell"):
                    blocks.append("\n".join(body) + "\n")
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def _without_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    targets = _LINK.findall(_without_code(path.read_text()))
    return [t for t in targets if "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README)}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_readme_fits_on_a_few_screens() -> None:
    size = len(README.read_text())
    assert size <= 15_000, f"README.md has {size} characters, more than 15,000: move detail to docs/"


# -- commands -------------------------------------------------------------------------


def _commands(text: str) -> list[list[str]]:
    """A page's shell commands: code-block lines (continuations joined, comments
    dropped, `&&` chains split), each as argv with leading VAR=value assignments.
    Blocks fenced as ```text (pictures, output) hold no commands."""
    found = []
    for block in _shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                found.append(words[:cut])
                words = words[cut + 1 :]
    return [argv for argv in found if argv]


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """(what runs, its arguments): `-m MODULE` for python, else the executable."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        argv = argv[1:]
    exe, rest = argv[0], argv[1:]
    if exe in PYTHONS:
        assert rest[:1] == ["-m"], f"python without -m in the docs: {argv}"
        return f"-m {rest[1]}", rest[2:]
    return exe, rest


@pytest.fixture(scope="module")
def substitutions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _substitutions(tmp_path_factory.mktemp("readme"))


def _substitutions(tmp: Path) -> dict[str, str]:
    """Placeholder -> value. Files a dry run may read are real: a model directory with
    a Qwen2-7B config.json, veRL-layout rows, a reward module, a config file."""
    model = tmp / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }))
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "data_source": "openai/gsm8k",
           "reward_model": {"ground_truth": "5"}, "extra_info": {}}
    for name in ("train.jsonl", "val.jsonl"):
        (tmp / name).write_text(json.dumps(row) + "\n")
    (tmp / "my_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    (tmp / "my.yaml").write_text("train:\n  lr: 2.0e-5\nrun:\n  steps: 3\n")
    return {
        "/path/to/hf-model": str(model),
        "train.jsonl": str(tmp / "train.jsonl"),
        "val.jsonl": str(tmp / "val.jsonl"),
        "my.yaml": str(tmp / "my.yaml"),
        "/shared/runs": str(tmp / "runs"),
        "HOST": "127.0.0.1",
        "M": "2",
        "N": "1",
        "i": "0",
        "RUN": "rpk-docs",
        "__pythonpath__": str(tmp),  # where my_rewards lives
    }


def _substitute(args: list[str], subs: dict[str, str]) -> list[str]:
    out = []
    for word in args:
        if word in subs:
            word = subs[word]
        else:
            assert not re.fullmatch(r"[A-Z]+|/path/.*|/shared/.*", word), (
                f"placeholder {word!r} in a docs command has no entry in _substitutions"
            )
        out.append(word)
    return out


def _is_module(name: str) -> bool:
    """Whether the repository has this module or package, without importing its parents."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _run(cmd: list[str], subs: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), subs["__pythonpath__"]])}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _as_a_command(subs: dict[str, str], argv: list[str]) -> Iterator[io.StringIO]:
    """What `_run` gives a process, in this one: the substitutions' directory on the
    import path, the repository as the working directory, `argv` as sys.argv; what is
    printed to stdout is collected."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.syspath_prepend(subs["__pythonpath__"])
        patch.chdir(ROOT)
        patch.setattr(sys, "argv", argv)
        yield out


def _module_help(module: str, subs: dict[str, str]) -> str:
    if module not in _HELP:
        _HELP[module] = _fresh_help(module, subs)
    return _HELP[module]


_HELP: dict[str, str] = {}


def _fresh_help(module: str, subs: dict[str, str]) -> str:
    """`python -m MODULE --help`, through the module's `main` in this process."""
    target = importlib.import_module(module)
    if not hasattr(target, "main"):  # a package run by its __main__
        target = importlib.import_module(f"{module}.__main__")
    with _as_a_command(subs, [module, "--help"]) as out:
        try:
            code = target.main()
        except SystemExit as e:  # argparse's --help; torchrun's `main` catches it itself
            code = e.code
    assert code in (0, None), f"python -m {module} --help exited {code}"
    text = out.getvalue()
    assert "usage:" in text.lower(), f"python -m {module} --help printed no usage: {text[:300]!r}"
    return text


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and a not in ("-", "--")]


def _unknown(flags: list[str], helptext: str) -> list[str]:
    return [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", helptext)]


def _has_dry_run() -> bool:
    return "dry_run" in {f.name for f in dataclasses.fields(config.RunConfig)}


def _check_rpk_run(args: list[str], subs: dict[str, str], dry_run: bool) -> None:
    if "--help" in args:
        with pytest.raises(SystemExit) as stop:
            config.from_argv(args)
        assert stop.value.code == 0
        return
    config.from_argv(args)
    if dry_run and _has_dry_run():
        _dry_run(args, subs)


def _dry_run(args: list[str], subs: dict[str, str]) -> dict:
    """`python -m rpk.run ARGS --run.dry_run true`, through `rpk.run.main` in this process:
    what it would start, as JSON."""
    argv = [*args, "--run.dry_run", "true"]
    with _as_a_command(subs, ["rpk.run", *argv]) as out:
        code = rpk_run.main(argv)
    assert code == 0, f"python -m rpk.run {shlex.join(argv)} exited {code}"
    return json.loads(out.getvalue())


def _check(argv: list[str], subs: dict[str, str], dry_run: bool = True) -> None:
    program, args = _program(argv)
    args = _substitute(args, subs)
    if program == "-m rpk.run":
        _check_rpk_run(args, subs, dry_run)
    elif program == "-m pytest":
        ci = (ROOT / ".ci" / "run").read_text()
        assert shlex.join(argv) in ci, f".ci/run does not run the README's test command {shlex.join(argv)!r}"
    elif program.startswith("-m "):
        cut = args.index("--") if "--" in args else len(args)
        own, overrides = args[:cut], args[cut + 1 :]  # after `--`: rpk.run overrides
        helptext = _module_help(program[3:], subs)
        unknown = _unknown(_flags(own), helptext)
        assert not unknown, f"python {program} does not know {unknown}"
        if overrides:
            config.from_argv(overrides)
    elif program == "torchrun":
        cut = args.index("-m")
        helptext = _module_help("torch.distributed.run", subs)
        unknown = _unknown(_flags(args[:cut]), helptext)
        assert not unknown, f"torchrun does not know {unknown}"
        _check(["python", *args[cut:]], subs, dry_run)
    else:
        script = ROOT / program
        assert script.is_file() and os.access(script, os.X_OK), f"{program} is not an executable file"


def _readme_commands() -> list[list[str]]:
    commands = _commands(README.read_text())
    assert commands, "no commands found in README.md's code blocks"
    return commands


@pytest.mark.parametrize("argv", _readme_commands(), ids=lambda a: shlex.join(a)[:80])
def test_readme_command_runs_as_written(argv: list[str], substitutions: dict[str, str]) -> None:
    _check(argv, substitutions)


@pytest.mark.parametrize("page", [p for p in PAGES[1:] if p.name != "design.md"], ids=lambda p: p.name)
def test_docs_commands_parse(page: Path, substitutions: dict[str, str]) -> None:
    """The docs pages' commands (benchmarks included) name modules and flags that exist
    and configs that parse; they are not dry-run (many need a GPU, nodes or minutes).
    design.md holds pictures, not commands."""
    commands = _commands(page.read_text())
    programs = [_program(argv)[0] for argv in commands]
    modules = {p[3:] for p in programs if p.startswith("-m ")} | {
        a[a.index("-m") + 1] for a in commands if a[0] == "torchrun"
    }
    for module in sorted(modules - {"", "rpk.run", "pytest"}):
        _module_help(module, substitutions)
    for argv in commands:
        _check(argv, substitutions, dry_run=False)


def test_quick_start_comes_first() -> None:
    text = README.read_text()
    headings = re.findall(r"^## (.+)", _FENCE.sub("", text), re.M)
    assert headings[:1] == ["Quick start"], f"the README's first section is {headings[:1]}"
    first = _shell_blocks(text.split("\n## Quick start\n", 1)[1])[0].splitlines()
    assert first[:2] == [
        "./scripts/setup.sh && .venv/bin/python -m rpk.run",
        "./scripts/setup.sh && .venv/bin/python -m pytest -m 'not slow'",
    ], f"the README's first commands are {first[:2]}"


def test_the_entry_points_answer_as_processes(substitutions: dict[str, str]) -> None:
    """One real process of each kind the tests above run in process: `python -m rpk.run`'s
    dry run (the README's first command; it prints what `main` prints here) and a
    module's `--help`."""
    args = _program(next(a for a in _readme_commands() if _program(a)[0] == "-m rpk.run"))[1]
    argv = [*_substitute(args, substitutions), "--run.dry_run", "true"]
    done = _run([sys.executable, "-m", "rpk.run", *argv], substitutions, timeout=300)
    assert done.returncode == 0, f"python -m rpk.run {shlex.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
    assert json.loads(done.stdout) == _dry_run(argv[:-2], substitutions)
    done = _run([sys.executable, "-m", "rpk.obs.plot", "--help"], substitutions)
    assert done.returncode == 0 and "usage:" in done.stdout.lower(), done.stderr[-2000:]
    assert not _unknown(["--out"], done.stdout)


def test_inline_python_m_modules_answer_help(substitutions: dict[str, str]) -> None:
    """`python -m X` in the README's prose names a module that exists and has a CLI."""
    modules = set(re.findall(r"`python -m ([\w.]+)", _FENCE.sub("", README.read_text())))
    for module in sorted(modules - {"rpk.run", "pytest"}):
        _module_help(module, substitutions)


def _config_name_exists(name: str) -> bool:
    """`rollout.tp_sizes`, `model.tiny.sft_alpha`, `reward.sandbox.*`: a field of Config."""
    cls: type = config.Config
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part == "*" and i == len(parts) - 1:
            return True
        found = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if found is None:
            return False
        if i < len(parts) - 1:
            cls = getattr(config, found.type, None) if isinstance(found.type, str) else found.type
            if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
                return False
    return True


_CONFIG_NAME = re.compile(r"(?<![\w/.-])(?:--)?((?:model|data|rollout|reward|train|run|dist)\.[a-z_][\w.*]*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_config_names_exist(page: Path) -> None:
    """Every `--section.field` (or `section.field`) a page names is a config field; a
    module path (`reward.stack.RewardStack`) or a file name (`reward.png`) is not one."""
    unknown = set()
    for m in _CONFIG_NAME.finditer(page.read_text()):
        name = m.group(1).rstrip(".")
        if re.search(r"\.(py|md|json|jsonl|yaml|png|pt|safetensors)$", name):
            continue
        if _is_module("rpk." + ".".join(name.split(".")[:2])):
            continue
        if not _config_name_exists(name):
            unknown.add(name)
    assert not unknown, f"{page.name} names config fields that do not exist: {sorted(unknown)}"


# -- design.md --------------------------------------------------------------------------


def _package_table(text: str) -> list[str]:
    """First-column names of design.md's table whose header's first cell is 'package'."""
    lines = text.splitlines()
    tables = [i for i, line in enumerate(lines) if re.match(r"\|\s*`?package`?\s*\|", line, re.I)]
    assert len(tables) == 1, f"design.md has {len(tables)} tables headed 'package', want one"
    names = []
    for line in lines[tables[0] + 2 :]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        m = re.search(r"rpk/(\w+)/?", cell)
        assert m, f"design.md package table row names no rpk/ directory: {line!r}"
        names.append(m.group(1))
    return names


def test_design_package_table_matches_tree() -> None:
    listed = _package_table((ROOT / "docs" / "design.md").read_text())
    tree = sorted(p.parent.name for p in (ROOT / "rpk").glob("*/__init__.py"))
    assert sorted(listed) == tree, (
        f"design.md's package table lists {sorted(set(listed) - set(tree))} that are not "
        f"packages under rpk/, and misses {sorted(set(tree) - set(listed))}"
    )
    assert len(listed) == len(set(listed)), f"design.md's package table repeats a package: {listed}"


def test_design_module_map_names_every_module() -> None:
    """The map under "Layers" names each module of rpk/ by its file name, and no file that
    is gone (a `name.py` that is nowhere in rpk/, bench/, tests/ or scripts/)."""
    design = (ROOT / "docs" / "design.md").read_text()
    modules = {p.name for p in (ROOT / "rpk").rglob("*.py") if p.stem not in ("__init__", "__main__")}
    named = set(re.findall(r"\b(\w+\.py)\b", design))
    assert not modules - named, f"docs/design.md does not name {sorted(modules - named)}"
    files = {p.name for d in ("rpk", "bench", "tests", "scripts") for p in (ROOT / d).rglob("*.py")}
    assert not named - files, f"docs/design.md names {sorted(named - files)}, which are not in the tree"


def test_ci_lints_before_the_tests() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    lint = ci.find(".venv/bin/ruff check rpk bench tests")
    assert lint != -1, ".ci/run does not run ruff over rpk, bench and tests"
    assert lint < ci.find("-m pytest"), ".ci/run lints after the tests"
