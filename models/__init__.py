"""Models: where their weights come from, and the named configs trained from scratch.

- `models/language.py`: causal language models and their tokenizer. `--model_name_or_path`
  loads any `AutoModelForCausalLM` (a Hub id or a local directory); `--model_config NAME`
  trains a named config from scratch with the tokenizer shipped in `models/tokenizer/`
  (the default job).
- `models/configs.py`: the named configs. It imports nothing heavy, so that
  `train.py --help` can list them at once.

Adding your own model: register its config in `models/configs.py` (any `transformers`
config class works), or save it as a directory with `save_pretrained` and pass it as
`--model_name_or_path`. Sharded strategies wrap the classes listed in the model's
`_no_split_modules`, which every `transformers` decoder defines.
"""
