"""Models: `language.py` loads causal LMs and their tokenizer; `configs.py` names the configs trained from scratch. Add
yours there, or pass a `save_pretrained` directory as --model_name_or_path; sharded strategies wrap the classes in its
`_no_split_modules`, which every `transformers` decoder defines."""
