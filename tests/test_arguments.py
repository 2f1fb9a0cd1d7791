"""Flags, recipes and their precedence."""

from __future__ import annotations

import pytest

from training.arguments import ArgumentError, parse_args


def test_defaults_then_recipe_then_command_line(tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.01\nmax_steps: 7\nmodel_config: llama-tiny\n")
    model_args, _, train_args = parse_args(["--config", str(recipe), "--max_steps", "9", "--output_dir", str(tmp_path)])
    assert (train_args.learning_rate, train_args.max_steps, model_args.model_config) == (0.01, 9, "llama-tiny")
    assert train_args.per_device_train_batch_size == 8  # untouched default


@pytest.mark.parametrize(
    ("recipe_text", "argv", "message"),
    [
        ("learnin_rate: 0.01\n", [], "unknown key 'learnin_rate' in recipe .*did you mean 'learning_rate'"),
        ("max_steps: [1\n", [], "is not valid YAML"),
        (None, ["--max_stepz", "3"], "unknown key 'max_stepz' in the command line; did you mean 'max_steps'"),
        (None, ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be at least 1"),
        (None, ["--max_steps", "0"], "nothing to train"),
        (None, ["--validation_file", "v.txt"], "--validation_file needs --train_file"),
        ("model_config: gpt-9\n", [], "unknown model_config 'gpt-9'"),
    ],
)
def test_bad_arguments_are_named(tmp_path, recipe_text, argv, message) -> None:
    if recipe_text is not None:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(recipe_text)
        argv = ["--config", str(recipe), *argv]
    with pytest.raises(ArgumentError, match=message):
        parse_args([*argv, "--output_dir", str(tmp_path / "out")])
