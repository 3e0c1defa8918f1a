"""The shipped recipes: every recipe loads and validates as fine-tuning settings, the accelerate configs parse with
accelerate's own loader, the commands in each recipe's header parse against the real CLI, and the recipes are found
by name in a source checkout and in a non-editable install."""

from __future__ import annotations

import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mla_convert import finetune
from mla_convert.cli import app
from mla_convert.errors import UserError

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
SHIPPED = sorted(p.stem for p in RECIPES.glob("*.yaml"))
ACCELERATE = ["ddp", "fsdp"]


def _header_commands(path: Path) -> list[list[str]]:
    """The `mla-convert ...` command lines of a recipe's header comment, as argument lists without the program."""
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break  # the header ends at the first YAML line
        text = line.lstrip("#").strip()
        if text.startswith("mla-convert "):
            commands.append(shlex.split(text)[1:])
    return commands


def _parse(args: list[str]):
    """Parse a command line with the real click command (types converted, nothing run); returns the context."""
    group = typer.main.get_command(app)
    sub = group.commands[args[0]]
    return sub.make_context(args[0], list(args[1:]), parent=group.make_context("mla-convert", list(args)))


def test_every_recipe_is_shipped_and_validates():
    assert {"smollm2-135m", "llama-3-8b", "qwen2.5-7b"} <= set(SHIPPED)
    for name in SHIPPED:
        assert finetune.resolve_recipe_path(name) == RECIPES / f"{name}.yaml"
        cfg = finetune.load_config(name)
        assert cfg.kd_weight > 0 and cfg.teacher == "auto"  # all recipes distil from the source they were made from
        assert not Path(cfg.data).name.startswith("wiki.test")  # never train on the evaluated text
        assert cfg.output.startswith("runs/") and cfg.model.startswith("out/")  # both gitignored: no weights committed
    with pytest.raises(UserError, match="not found"):
        finetune.resolve_recipe_path("no-such-recipe")


def test_accelerate_configs_parse_and_fsdp_wraps_the_decoder_layer():
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    from mla_convert.modeling import modeling_mla

    configs = {name: load_config_from_file(str(finetune.resolve_accelerate_config(name))) for name in ACCELERATE}
    assert all(isinstance(c, ClusterConfig) for c in configs.values())
    assert configs["ddp"].distributed_type == DistributedType.MULTI_GPU
    fsdp = configs["fsdp"]
    assert fsdp.distributed_type == DistributedType.FSDP
    wrapped = fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"].split(",")
    assert wrapped == modeling_mla.MLAPreTrainedModel._no_split_modules  # the native model's decoder layer
    assert all(hasattr(modeling_mla, name) for name in wrapped)
    assert fsdp.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # the loop saves gathered state dicts
    with pytest.raises(UserError, match="accelerate config"):
        finetune.resolve_accelerate_config("zero3")


@pytest.mark.parametrize("name", SHIPPED)
def test_header_commands_parse_against_the_cli(name):
    path = RECIPES / f"{name}.yaml"
    cfg = finetune.load_config(path)
    commands = _header_commands(path)
    subs = [c[0] for c in commands]
    assert subs.count("finetune") == 1 and subs[0] in ("llama", "qwen", "convert") and "eval" in subs
    runner = CliRunner()
    for args in commands:
        help_text = runner.invoke(app, [args[0], "--help"], terminal_width=200)
        assert help_text.exit_code == 0, help_text.output
        for opt in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
            assert opt in help_text.output, f"{name}: `mla-convert {args[0]}` has no option {opt}"
        ctx = _parse(args)  # raises click's UsageError / BadParameter on an unknown option or a bad value
        params = ctx.params
        if args[0] in ("llama", "qwen", "convert"):
            assert str(params["output"]) == cfg.model  # the converted folder is the recipe's student
            assert not any("test" in Path(spec).name for spec in params["calib_data"] or ["self"])
        elif args[0] == "finetune":
            assert Path(params["config"]) == Path("recipes", path.name)
            finetune.load_config(path, ctx.args)  # extra key=value overrides in the header must be valid
            if params["accelerate_config"] is not None:
                assert finetune.resolve_accelerate_config(REPO / params["accelerate_config"]).is_file()
        elif args[0] == "eval":
            assert Path(params["data"]).name == "wiki.test.raw"
    evaluated = [Path(c[1]) for c in commands if c[0] == "eval" and not c[1].startswith("-")]
    assert Path(cfg.output, finetune.FINAL_DIR) in evaluated  # the fine-tuned model is the one evaluated


def test_recipes_found_in_an_installed_layout(tmp_path):
    # a wheel installs mla_convert into site-packages and recipes/ as data under the prefix
    prefix = tmp_path / "venv"
    package = prefix / "lib" / "python3.12" / "site-packages" / "mla_convert"
    installed = prefix / finetune.INSTALLED_RECIPES
    (installed / "accelerate").mkdir(parents=True)
    package.mkdir(parents=True)
    for p in [*RECIPES.glob("*.yaml"), *RECIPES.glob("accelerate/*.yaml")]:
        (installed / p.relative_to(RECIPES)).write_text(p.read_text())
    assert finetune.shipped_recipes_dir(package) == installed
    # and the build puts them there: pyproject's data-files cover every shipped file, each at its relative place
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data_files = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    covered = set()
    for target, globs in data_files.items():
        for pattern in globs:
            assert Path(target) == Path("share/mla-convert") / Path(pattern).parent
            covered |= {p.relative_to(REPO) for p in REPO.glob(pattern)}
    shipped = {p.relative_to(REPO) for p in [*RECIPES.glob("*.yaml"), *RECIPES.glob("accelerate/*.yaml")]}
    assert covered == shipped


def test_wheel_carries_the_recipes(tmp_path):
    """Build a wheel from a copy of the package sources (no network) and look for the recipes in it."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "mla_convert", src / "mla_convert", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(RECIPES, src / "recipes")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("mla_convert-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for p in [*RECIPES.glob("*.yaml"), *RECIPES.glob("accelerate/*.yaml")]:
        rel = p.relative_to(RECIPES).as_posix()
        assert any(n.endswith(f".data/data/share/mla-convert/recipes/{rel}") for n in names), rel
