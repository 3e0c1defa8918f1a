"""The option schema (mla_convert/schema.py): the declared classes ConvertOptions and CommandLine, and what is made
from them: the convert commands' options, their checks and docs/options.md."""

import ast
import dataclasses
from pathlib import Path

import pytest
import typer

from mla_convert.cli import app
from mla_convert import schema
from mla_convert.convert import ConvertOptions
from mla_convert.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("convert", "llama", "qwen", "phi3", "gemma", "olmo2")


def test_docs_options_is_current():
    """docs/options.md is generated: regenerate it with `python -m mla_convert.schema --markdown`."""
    assert (ROOT / "docs" / "options.md").read_text() == schema.markdown(), (
        "docs/options.md is stale: python -m mla_convert.schema --markdown > docs/options.md")


def test_convert_options_are_the_schema():
    fields = dataclasses.fields(ConvertOptions)
    assert [f.name for f in fields] == [o.name for o in schema.OPTIONS if not o.cli_only]
    assert {f.name: f.default for f in fields} == schema.DEFAULTS
    # the order and defaults provenance.json and the resume fingerprint record (dataclasses.asdict)
    assert list(dataclasses.asdict(ConvertOptions())) == list(schema.DEFAULTS)


def test_choices_are_the_librarys():
    from mla_convert import lowrank, rope
    from mla_convert.conversion import model_stage, refine_layer
    from mla_convert.dtypes import DTYPES

    assert schema.choices("rope_strategy") == rope.STRATEGIES
    assert schema.choices("method") == lowrank.METHODS and schema.choices("objective") == lowrank.OBJECTIVES
    assert schema.choices("dtype") == tuple(DTYPES)
    assert (refine_layer.SCOPES, model_stage.MODEL_SCOPES, refine_layer.PRECISIONS) == (
        schema.choices("refine_scope"), schema.choices("refine_model_scope"), schema.choices("refine_precision"))


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_take_every_schema_option(name):
    command = typer.main.get_command(app).commands[name]
    params = {p.name: p for p in command.params}
    assert list(params) == ["model", *(o.name for o in schema.OPTIONS), "verbose", "quiet"]
    for option in schema.OPTIONS:
        param = params[option.name]
        assert param.help == option.help and param.default == option.flag_default, option.name
        spelled = [*param.opts, *param.secondary_opts]
        assert spelled == [s for flag in option.flags for s in flag.split("/")], option.name


@pytest.mark.parametrize("name", COMMANDS)
def test_options_classes_are_what_the_commands_offer(name):
    """Every ConvertOptions field is a flag of the command, spelled as its metadata declares, or is marked
    library-only; every flag of the command (beside the source and -v/-q) is a field of ConvertOptions or of
    CommandLine, the command line's own."""
    command = typer.main.get_command(app).commands[name]
    offered = {p.name: [*p.opts, *p.secondary_opts] for p in command.params}
    assert [offered.pop(own) for own in ("model", "verbose", "quiet")]
    for cls in (schema.ConvertOptions, schema.CommandLine):
        for f in dataclasses.fields(cls):
            declared = [s for flag in f.metadata["flags"] for s in flag.split("/")]
            if f.metadata["library_only"]:
                assert f.name not in offered and not declared, f.name
            else:
                assert offered.pop(f.name) == declared and declared, f.name
    assert not offered, f"flags of {name} that no options class declares: {sorted(offered)}"


def test_an_option_declares_its_flags_or_library_only():
    """A field without `option(...)` metadata, or an option with neither flags nor library_only, is refused; a
    library-only option has no flag and is not a command's option."""
    @dataclasses.dataclass
    class Plain:
        width: int = 3

    with pytest.raises(TypeError, match="Plain.width"):
        schema.options_of(Plain)
    with pytest.raises(TypeError):
        schema.option(3, help="no flags")
    with pytest.raises(TypeError):
        schema.option(3, "--width", help="both", library_only=True)

    @dataclasses.dataclass
    class Declared:
        width: int | None = schema.option(None, help="Library only.", library_only=True)
        depth: int = schema.option(2, "--depth", help="Offered.", check=lambda o, v: None if v > 0 else "bad")

    width, depth = schema.options_of(Declared)
    assert (width.flags, width.flag, width.nullable, width.type, width.default) == ((), "width", True, int, None)
    assert (depth.flag, depth.nullable, depth.type, depth.default) == ("--depth", False, int, 2)
    assert depth.error(0) == "bad" and width.error(None) is None


@pytest.mark.parametrize("changes, line", [
    (dict(factorization="both"), "--factorization must be one of joint, split, got both"),
    (dict(kv_budget=-1.0), "--kv-budget must be a positive number (elements, or a fraction <= 1), got -1.0"),
    (dict(kv_balance=float("inf")), "--kv-balance must be a positive number, got inf"),
    (dict(kv_balance=0.0), "--kv-balance must be positive, got 0.0"),
    (dict(calib_seq_len=1), "--calib-seq-len must be at least 2"),
    (dict(refine_mlp_lr_scale=float("nan")), "--refine-mlp-lr-scale must be 0 or more, got nan"),
    (dict(dtype="int8"), "--dtype must be one of float32, bfloat16, float16, got int8"),
    (dict(rank=8), "give one of --rank (latent dims), --kv-budget (cache per token per layer) or --kv-bytes"),
    (dict(kv_bytes=0.125), "give one of --rank (latent dims), --kv-budget (cache per token per layer) or --kv-bytes"),
    (dict(kv_budget=None), "give --rank (latent dims), --kv-budget (elements per token per layer, or a fraction) or --kv-bytes"),
    (dict(calib_data=None, objective="scores"), "--objective scores needs calibration text"),
    (dict(refine_model_steps=4, calib_propagate="converted"), "--calib-propagate converted does not carry"),
])
def test_check_options_names_the_flag(changes, line):
    options = dataclasses.replace(ConvertOptions(kv_budget=0.5), **changes)
    with pytest.raises(UserError) as e:
        schema.check_options(options)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_good_options_pass():
    schema.check_options(ConvertOptions(kv_budget=0.5))
    schema.check_options(ConvertOptions(rank=32, calib_data=None, refine_steps=0, refine_model_steps=0))


def test_schema_imports_no_torch():
    """The CLI builds its options from the schema: it imports nothing heavy (the standard library, errors and the
    defaults by the cache kept, which import nothing)."""
    def imports(name: str) -> set[str]:
        tree = ast.parse((ROOT / "mla_convert" / name).read_text())
        found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "mla_convert"}
        return found | {f"mla_convert.{a.name}" for n in ast.walk(tree)
                        if isinstance(n, ast.ImportFrom) and n.module == "mla_convert" for a in n.names}

    stdlib = {"__future__", "dataclasses", "math", "sys", "pathlib", "typing"}
    assert imports("schema.py") <= stdlib | {"mla_convert.errors", "mla_convert.policy"}, imports("schema.py")
    assert imports("policy.py") <= {"__future__"} and imports("errors.py") <= stdlib | {"errno", "re"}, imports("errors.py")


def test_kv_balance_none_reaches_the_conversion(sources, calib_text, tmp_path):
    """`--kv-balance none`: the joint factorization of the unscaled key and value blocks (ConvertOptions(kv_balance=
    None)), recorded as such; a word that is neither a number nor none is one clear line."""
    import json

    from conftest import assert_user_error
    from typer.testing import CliRunner

    option = schema.BY_NAME["kv_balance"]
    assert (option.from_flag(None), option.from_flag("none"), option.from_flag("0.5")) == (1.0, None, 0.5)
    args = ["llama", str(sources["llama-gqa"]), "--rank", "16", "--rope-dims", "8", "--calib-data", str(calib_text),
            "--calib-samples", "2", "--calib-seq-len", "16", "--refine-steps", "0", "--refine-model-steps", "0"]
    bad = CliRunner().invoke(app, [*args, "--kv-balance", "some", "--dry-run"])
    assert_user_error(bad.exit_code, bad.output, "--kv-balance must be a number or none, got 'some'")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [*args, "--kv-balance", "none", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "provenance.json").read_text())
    assert record["options"]["kv_balance"] is None
    assert "balanced" not in json.dumps(record)  # describe_method names a balance only where there is one
