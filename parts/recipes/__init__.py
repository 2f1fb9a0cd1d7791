"""The worked examples of your own model, data, loss and metric (recipes/: one file of plain PyTorch each, run with
`--task module:Class`), with their page and tests. No hooks: a recipe is a `Task`, which the core runs as any other.
See docs/recipes.md."""

from training.parts import Part


class Recipes(Part):
    name = "recipes"
    description = "worked examples: your own nn.Module, .npy tokens, a CSV task, a loss, a metric (recipes/)"
    files = ("recipes/", "tests/test_custom_model.py")


PART = Recipes()
